"""How fast XLA picks the argmax of a row of logits on this machine, against a plain max, and
what the blocked pick saves in the greedy decode step.

    python benchmarks/xla_cpu_argmax.py          # seconds on two CPU cores

The decode step's greedy pick (``unembed.greedy``'s xla path, what the serving engine runs on a
CPU) reduces the B x V f32 logits to each row's argmax. The cost model prices that pick as its
"sampling" op, one read of the logits at the op's own efficiency.

Table 1, per (B, V), side by side in one round-robin: ``max`` (the baseline: one read, one value
per row), ``argmax`` (``jnp.argmax``, an index-carrying reduction: what the engine ran before
``vocabjax.unembed.argmax``), ``two-pass`` (the max, then the lowest index holding it: two plain
reductions, the same answer where the row has no NaN) and ``blocked``
(``vocabjax.unembed.argmax.blocked_argmax``: each block of up to 256 logits' max, then the
argmax of the block maxima and inside the chosen block; the same index as ``jnp.argmax``, NaN
included; ``jnp.argmax`` itself at V = 50,257, which no power-of-two block divides).
Each cell is a median time and its rate in GB/s of logits read; the ratios are against ``max``.

Table 2, the whole greedy pick from the hidden state (D = 512, f32 W), side by side: ``before``
is ``tile_logits`` then ``jnp.argmax``, ``after`` is ``unembed.greedy(impl="xla")`` as it runs
now; the ratio is before / after.

Table 3, the pick of each row alone under ``vmap`` (as the serving engine samples: each row of
a batch is its own call, for its own noise), side by side: ``jnp.argmax`` against
``vocabjax.unembed.argmax``, whose vmap rule picks over the whole batched array so that its NaN
check stays one branch. docs/validation.md records a run.
"""

from __future__ import annotations

import _report
import jax
import jax.numpy as jnp
import numpy as np

from vocabjax import unembed
from vocabjax.timing import TimingSettings, time_interleaved
from vocabjax.unembed.argmax import argmax, blocked_argmax, plain_argmax
from vocabjax.unembed.chunked import tile_logits

VOCABS = (16384, 50257, 131072)  # 50,257: no block divides it (blocked runs jnp.argmax)
BATCHES = (1, 4, 64)
D_MODEL = 512
SETTINGS = TimingSettings(warmup=3, repeats=15)


def two_pass(x_bv):
    """The lowest index of each row's max: a max, then a min over the indices that hold it."""
    top_b = jnp.max(x_bv, axis=-1, keepdims=True)
    ids_v = jnp.arange(x_bv.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(x_bv == top_b, ids_v, x_bv.shape[-1]), axis=-1)


PICKS = {
    "max": lambda x: jnp.max(x, axis=-1),
    "argmax": plain_argmax,
    "two-pass": two_pass,
    "blocked": blocked_argmax,
}
PER_ROW = {
    "jnp.argmax": jax.vmap(plain_argmax),
    "argmax": jax.vmap(argmax),
}
STEPS = {
    "before": lambda h, w: plain_argmax(tile_logits(h, w)),
    "after": lambda h, w: unembed.greedy(h, w, impl="xla"),
}


def _timed(jitted, make_args, check):
    """Median seconds of each (cell, name) call, all in one round-robin."""
    calls, cells = [], []
    for v in VOCABS:
        for b in BATCHES:
            args = make_args(v, b)
            want = check(*args)  # None: every call gives the first call's ids
            for name, fn in jitted.items():
                got = np.asarray(fn(*args))
                if want is None:
                    want = got
                if got.dtype.kind == "i":  # not ``max``
                    np.testing.assert_array_equal(got, want)
                calls.append(lambda f=fn, a=args: f(*a))
                cells.append((v, b, name))
    return dict(zip(cells, time_interleaved(calls, [()], SETTINGS), strict=True))


def main() -> None:
    _report.header(__file__, None, "XLA argmax against max over f32 logits")
    rng = np.random.default_rng(0)

    def logits(v, b):
        return (jnp.asarray(rng.standard_normal((b, v), dtype=np.float32)),)

    times = _timed(
        {name: jax.jit(fn) for name, fn in PICKS.items()},
        logits,
        lambda x: np.argmax(np.asarray(x), axis=-1),
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

    def step_args(v, b):
        h = jnp.asarray(rng.standard_normal((b, D_MODEL), dtype=np.float32))
        w = jnp.asarray(rng.standard_normal((v, D_MODEL), dtype=np.float32) / D_MODEL**0.5)
        return h, w

    times = _timed({name: jax.jit(fn) for name, fn in STEPS.items()}, step_args, lambda h, w: None)
    _ratio_table(
        times, f"Greedy pick from h (D = {D_MODEL}, f32 W): logits then jnp.argmax, and now"
    )
    times = _timed(
        {name: jax.jit(fn) for name, fn in PER_ROW.items()},
        logits,
        lambda x: np.argmax(np.asarray(x), axis=-1),
    )
    _ratio_table(times, "Each row's pick under vmap (the engine's sampling path)")


def _ratio_table(times, title: str) -> None:
    """A table of two ways' medians per (V, B) and the first over the second."""
    first, second = dict.fromkeys(name for _, _, name in times)
    print(f"\n{title}")
    print(f"| V | B | {first} | {second} | {first} / {second} |")
    print("|---:|---:|---:|---:|---:|")
    for v in VOCABS:
        for b in BATCHES:
            x, y = times[v, b, first], times[v, b, second]
            print(f"| {v} | {b} | {1e3 * x:.3g} ms | {1e3 * y:.3g} ms | {x / y:.2f} |")


if __name__ == "__main__":
    main()
