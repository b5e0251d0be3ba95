"""How XLA's matmul speed depends on shape on this machine, at a fixed weight size.

    python benchmarks/xla_cpu_dot.py            # seconds on two CPU cores

The unembedding's matmul ``h_bd @ w_vd.T`` (as ``GPT.logits`` computes it) with W of 32 MiB
f32 in every row of the table: the contraction length D from 128 to 1024 (V = 32 MiB / 4 D)
and the batch B from 1 to 64. A roofline prices all of one row's B = 1 cells alike (the same
bytes, the same FLOPs); any spread across D is what an efficiency by size or arithmetic
intensity cannot describe. Each cell: the median of round-robin calls, as W's bandwidth (GB/s)
and as FLOP rate (GFLOP/s), and the B = 1 bandwidth over a copy of 128 MiB timed in the same
rounds. docs/validation.md records a run.
"""

from __future__ import annotations

import _report
import jax
import jax.numpy as jnp
import numpy as np

from vocabjax.timing import TimingSettings, copy_probe, time_interleaved

W_BYTES = 32 << 20
CONTRACTIONS = (128, 256, 512, 1024)
BATCHES = (1, 2, 4, 16, 64)


def _logits(h_bd, w_vd):
    return jnp.einsum("bd,vd->bv", h_bd, w_vd, precision=jax.lax.Precision.HIGHEST)


def main() -> None:
    _report.header(__file__, None, "XLA matmul speed by shape at 32 MiB of f32 weights")
    rng = np.random.default_rng(0)
    logits = jax.jit(_logits)
    calls, cells = [], []
    for d in CONTRACTIONS:
        v = W_BYTES // (4 * d)
        w_vd = jnp.asarray(rng.standard_normal((v, d), dtype=np.float32))
        for b in BATCHES:
            h_bd = jnp.asarray(rng.standard_normal((b, d), dtype=np.float32))
            calls.append(lambda h=h_bd, w=w_vd: logits(h, w))
            cells.append((d, v, b))
    copy, moved = copy_probe(128 << 20)
    times = time_interleaved([*calls, copy], [()], TimingSettings(warmup=3, repeats=15))
    copy_gbs = moved / times[-1] / 1e9
    print(f"copy of 128 MiB: {copy_gbs:.1f} GB/s (bytes read + written)")
    print("| D | V | " + " | ".join(f"B = {b}" for b in BATCHES) + " | B = 1 / copy |")
    print("|---:|---:|" + "---:|" * (len(BATCHES) + 1))
    for d in CONTRACTIONS:
        row = [(t, v, b) for (dd, v, b), t in zip(cells, times, strict=False) if dd == d]
        text = [f"{W_BYTES / t / 1e9:.1f} GB/s, {2 * b * v * d / t / 1e9:.0f} GFLOP/s"
                for t, v, b in row]  # fmt: skip
        ratio = W_BYTES / row[0][0] / 1e9 / copy_gbs
        print(f"| {d} | {row[0][1]} | " + " | ".join(text) + f" | {ratio:.2f} |")


if __name__ == "__main__":
    main()
