"""How fast XLA picks the argmax of a row of logits on this machine, against a plain max.

    python benchmarks/xla_cpu_argmax.py          # seconds on two CPU cores

The decode step's greedy pick (``unembed.greedy``'s xla path, what the serving engine runs on a
CPU) reduces the B x V f32 logits to each row's argmax. The cost model prices that pick as one
read of the logits (``costmodel``'s "sampling" op); a reduction that carries an index is not a
plain one on every backend. Per (B, V), side by side in one round-robin: ``max`` (the baseline:
one read, one value per row), ``argmax`` (``jnp.argmax``, an index-carrying reduction),
``two-pass`` (the max, then the lowest index holding it: two plain reductions, the same answer
where the row has no NaN) and ``blocked`` (each block of ``BLOCK`` logits' max, a plain
reduction over all of them, then the argmax of the block maxima and the argmax inside the
chosen block, both over few elements: the same lowest index, NaN included). Each cell is a
median time and its rate in GB/s of logits read; the ratios are against ``max``. docs/validation.md records a run.
"""

from __future__ import annotations

import _report
import jax
import jax.numpy as jnp
import numpy as np

from vocabjax.timing import TimingSettings, time_interleaved

VOCABS = (16384, 65536, 131072)
BATCHES = (1, 4, 64)


def two_pass(x_bv):
    """The lowest index of each row's max: a max, then a min over the indices that hold it."""
    top_b = jnp.max(x_bv, axis=-1, keepdims=True)
    ids_v = jnp.arange(x_bv.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(x_bv == top_b, ids_v, x_bv.shape[-1]), axis=-1)


BLOCK = 256


def blocked(x_bv):
    """The argmax of each row from its blocks' maxima: the first block holding the row's max,
    then the first index holding it inside that block (V a multiple of ``BLOCK``)."""
    b, v = x_bv.shape
    blocks_bnk = x_bv.reshape(b, v // BLOCK, BLOCK)
    block_b = jnp.argmax(jnp.max(blocks_bnk, axis=-1), axis=-1)
    inside_bk = jnp.take_along_axis(blocks_bnk, block_b[:, None, None], axis=1)[:, 0]
    return block_b * BLOCK + jnp.argmax(inside_bk, axis=-1)


PICKS = {
    "max": lambda x: jnp.max(x, axis=-1),
    "argmax": lambda x: jnp.argmax(x, axis=-1),
    "two-pass": two_pass,
    "blocked": blocked,
}


def main() -> None:
    _report.header(__file__, None, "XLA argmax against max over f32 logits")
    rng = np.random.default_rng(0)
    jitted = {name: jax.jit(fn) for name, fn in PICKS.items()}
    calls, cells = [], []
    for v in VOCABS:
        for b in BATCHES:
            x_bv = jnp.asarray(rng.standard_normal((b, v), dtype=np.float32))
            want = np.argmax(np.asarray(x_bv), axis=-1)
            for name, fn in jitted.items():
                if name != "max":  # both index picks give numpy's answer
                    np.testing.assert_array_equal(np.asarray(fn(x_bv)), want)
                calls.append(lambda f=fn, x=x_bv: f(x))
                cells.append((v, b, name))
    times = dict(
        zip(cells, time_interleaved(calls, [()], TimingSettings(warmup=3, repeats=15)), strict=True)
    )
    ratios = [name for name in PICKS if name != "max"]
    print(
        "| V | B | " + " | ".join(PICKS) + " | " + " | ".join(f"{n} / max" for n in ratios) + " |"
    )
    print("|---:|---:|" + "---:|" * (len(PICKS) + len(ratios)))
    for v in VOCABS:
        for b in BATCHES:
            t = {name: times[v, b, name] for name in PICKS}
            text = [f"{1e3 * t[n]:.3g} ms, {4 * b * v / t[n] / 1e9:.1f} GB/s" for n in PICKS]
            over = [f"{t[n] / t['max']:.1f}" for n in ratios]
            print(f"| {v} | {b} | " + " | ".join(text) + " | " + " | ".join(over) + " |")


if __name__ == "__main__":
    main()
