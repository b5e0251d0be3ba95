"""How XLA's matmul speed depends on shape on this machine, at a fixed weight size.

    python benchmarks/xla_cpu_dot.py            # seconds on two CPU cores

The unembedding's matmul ``h_bd @ w_vd.T`` (as ``GPT.logits`` computes it) with W of 32 MiB
f32 in every row of the table: the contraction length D from 128 to 1024 (V = 32 MiB / 4 D)
and the batch B from 1 to 64. A roofline prices all of one row's B = 1 cells alike (the same
bytes, the same FLOPs); any spread across D is what an efficiency by size or arithmetic
intensity cannot describe. Each cell: the median of round-robin calls, as W's bandwidth (GB/s)
and as FLOP rate (GFLOP/s), and the B = 1 bandwidth over a copy of 128 MiB timed in the same
rounds.

A second table sweeps the rows instead: a prefill's first MLP matmul ``x_nd @ w_df`` (F = 4 D)
at N = B x T rows from 64 to 8,192 and D from 128 to 512, each cell's FLOP rate beside its
output's MiB and the minor page faults of one call (``vocabjax.timing.minor_faults``). A step
in rate between neighbouring N at few faults is the GEMM's own (blocking, threads); a drop
where the faults jump is the fresh output buffer (on this machine every page of a 16 MiB or
larger output faults again on each call). docs/validation.md records a run.
"""

from __future__ import annotations

import _report
import jax
import jax.numpy as jnp
import numpy as np

from vocabjax.timing import Tally, TimingSettings, copy_probe, minor_faults, time_interleaved

W_BYTES = 32 << 20
CONTRACTIONS = (128, 256, 512, 1024)
BATCHES = (1, 2, 4, 16, 64)
ROWS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
WIDTHS = (128, 256, 512)


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
    rows_table(rng)


def _mlp_in(x_nd, w_df):
    return jnp.dot(x_nd, w_df, precision=jax.lax.Precision.HIGHEST)


def rows_table(rng) -> None:
    """GFLOP/s of ``x_nd @ w_df`` (F = 4 D) by rows N, with the output's size and faults."""
    mlp_in = jax.jit(_mlp_in)
    calls, cells = [], []
    for d in WIDTHS:
        w_df = jnp.asarray(rng.standard_normal((d, 4 * d), dtype=np.float32))
        for n in ROWS:
            x_nd = jnp.asarray(rng.standard_normal((n, d), dtype=np.float32))
            calls.append(lambda x=x_nd, w=w_df: mlp_in(x, w))
            cells.append((d, n))
    tally = Tally(minor_faults)
    times = time_interleaved(calls, [()], TimingSettings(warmup=3, repeats=15), tally=tally)
    faults = tally.medians(len(calls))
    print()
    print("x_nd @ w_df, F = 4 D: GFLOP/s by rows N (output MiB; minor page faults per call)")
    print("| D | " + " | ".join(f"N = {n}" for n in ROWS) + " |")
    print("|---:|" + "---:|" * len(ROWS))
    for d in WIDTHS:
        text = []
        for (dd, n), t, f in zip(cells, times, faults, strict=True):
            if dd == d:
                fault = "-" if f is None else f"{f:.0f}"
                text.append(
                    f"{2 * n * d * 4 * d / t / 1e9:.0f} ({n * 4 * d * 4 / 2**20:.1f}; {fault})"
                )
        print(f"| {d} | " + " | ".join(text) + " |")


if __name__ == "__main__":
    main()
