"""Requests of several sampling settings: one running batch whose rows each pick their own way
(``decode.pick_rows``) against one batch per setting (each compiled for its temperature and top
k, as the live server ran them before), side by side in one process.

    python benchmarks/row_sampling.py [--shape tiny] [--head 4096] [--batch 3,12,24]

The live server used to keep a running batch per (head, temperature, top_k): clients at three
settings meant three batches, three decode calls per turn, each at a third of the rows, and
each setting compiling its own shapes. Now a batch holds every setting, its rows' temperature
and top k on the device, and its decode call is compiled per ``decode.RowPicks`` (whether any
row samples, a bucket of the largest top k). For each total of ``--batch`` requests, spread
evenly over ``--settings``, the script builds the carry of each way after a prefill of
``--prompt`` tokens and times ``--steps`` decode steps (``decode.decode_some``, no row
stopping), ``vocabjax.timing.time_interleaved`` calling them round-robin:

- ``apart``: a batch per setting (rows: the next power of two of its requests), its pick
  ``unembed.sample`` with ``impl="auto"`` at the static setting, the calls one after another;
- ``one batch``: all rows in one carry (the next power of two of the total), each row's
  setting in the carry;
- and, at the same rows, one setting for all: the static pick against the per-row one (what the
  per-row pick costs where nothing is mixed).

It checks that both ways give every request the same tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _report import header  # noqa: E402
from flax import nnx  # noqa: E402

from vocabjax import render  # noqa: E402
from vocabjax.models import GPT, GPTConfig  # noqa: E402
from vocabjax.serving import decode  # noqa: E402
from vocabjax.serving.batching import pow2_rows  # noqa: E402
from vocabjax.serving.engine import attention_window, bucket_length  # noqa: E402
from vocabjax.shapes import load_shape  # noqa: E402
from vocabjax.timing import TimingSettings, time_interleaved  # noqa: E402
from vocabjax.train import Functional  # noqa: E402
from vocabjax.units import parse_size  # noqa: E402

MAX_SEQ = 128


def parse_settings(text: str) -> list[decode.Sampling]:
    """``0.7,0.8,1.0:40``: a temperature each, ``:K`` a top k."""
    out = []
    for item in text.split(","):
        t, _, k = item.partition(":")
        out.append(decode.Sampling(float(t), int(k) if k else None))
    return out


class Carry:
    """A carry of ``rows`` rows after a prefill: requests ``ids`` (their numbers, which fix
    their prompts and keys) at ``settings``, the rest empty rows, picking per ``per_row``; its
    compiled decode call of ``args.steps`` steps."""

    def __init__(self, fn, params, head, ids, settings, rows, args, per_row):
        config = decode.DecodeConfig(fn, MAX_SEQ, head, settings[0], per_row=per_row)
        window = attention_window([args.prompt + args.steps + 1], MAX_SEQ)
        config = dataclasses.replace(config, window=window)
        n, pad = len(ids), rows - len(ids)
        prompts = np.random.default_rng(0).integers(1, head, (max(ids) + 1, args.prompt))
        ids_bt = np.zeros((rows, bucket_length(args.prompt, MAX_SEQ)), np.int32)
        ids_bt[:n, : args.prompt] = prompts[ids]
        ids_bt[n:, 0] = 1
        keys = jnp.stack([jax.random.key(i) for i in ids] + [jax.random.key(0)] * pad)
        temps = jnp.asarray([s.temperature for s in settings] + [0.0] * pad, jnp.float32)
        topks = jnp.asarray([s.top_k or 0 for s in settings] + [0] * pad, jnp.int32)
        lengths = jnp.full((rows,), args.prompt, jnp.int32)
        prefill = jax.jit(functools.partial(decode.prefill, config))
        caches, first, _ = prefill(params, jnp.asarray(ids_bt), lengths, keys, temps, topks)
        limits = jnp.full((rows,), args.steps + 1, jnp.int32)
        real = jnp.asarray(np.arange(rows) < n)
        self.state = decode.start(config, caches, first, lengths, limits, real, temps, topks)
        self.ids, self.keys, self.params, self.steps = list(ids), keys, params, args.steps
        some = jax.jit(functools.partial(decode.decode_some, config))
        self.fn = some.lower(params, self.state, keys, jnp.int32(1), jnp.int32(1)).compile()

    @property
    def rows(self) -> int:
        return int(self.state.n_b.shape[0])

    def __call__(self):
        return self.fn(
            self.params, self.state, self.keys, jnp.int32(self.steps), jnp.int32(1 << 20)
        )

    def tokens(self) -> dict[int, tuple[int, ...]]:
        out = jax.device_get(self())
        return {i: tuple(out.out_bs[r, : out.n_b[r]].tolist()) for r, i in enumerate(self.ids)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="tiny")
    p.add_argument("--head", default="4096", help="the head's ids")
    p.add_argument("--settings", default="0.7,0.8,1.0:40", help="TEMPERATURE[:TOP_K],...")
    p.add_argument("--batch", default="3,12,24", help="requests in all, spread over the settings")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--steps", type=int, default=8, help="decode steps per call")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--format", default="markdown", choices=["table", "markdown", "json", "csv"])
    args = p.parse_args(argv)
    head = parse_size(args.head)
    settings = parse_settings(args.settings)
    header(__file__, argv, f"shape {args.shape}, head {head}, max_seq {MAX_SEQ}, f32, random "
           f"weights, {args.steps} steps per call")  # fmt: skip
    model = GPT(GPTConfig(load_shape(args.shape), max_vocab=head, max_seq=MAX_SEQ),
                rngs=nnx.Rngs(0))  # fmt: skip
    fn, params = Functional.of(model)
    timing = TimingSettings(warmup=3, repeats=args.repeats)
    rows = []
    for total in (int(x) for x in args.batch.split(",")):
        each = [list(range(i, total, len(settings))) for i in range(len(settings))]
        apart = [
            Carry(fn, params, head, ids, [s] * len(ids), pow2_rows(len(ids), total), args, None)
            for ids, s in zip(each, settings, strict=True)
            if ids
        ]
        order = [i for ids in each for i in ids]
        mixed = [settings[i % len(settings)] for i in order]
        rows_all = pow2_rows(total, total)
        one = Carry(fn, params, head, order, mixed, rows_all, args, decode.RowPicks.of(mixed))
        # one setting for every row: the static pick against the per-row one, same rows
        uniform = [settings[0]] * total
        static = Carry(fn, params, head, order, uniform, rows_all, args, None)
        per_row = Carry(fn, params, head, order, uniform, rows_all, args,
                        decode.RowPicks.of(uniform))  # fmt: skip

        def all_apart(apart=apart):
            return [c() for c in apart]

        t_apart, t_one, t_static, t_rows = time_interleaved(
            [all_apart, one, static, per_row], [()], timing
        )
        want = {}
        for c in apart:
            want.update(c.tokens())
        rows.append({
            "requests": total,
            "apart_rows": "+".join(str(c.rows) for c in apart),
            "apart_ms": 1e3 * t_apart,
            "one_batch_rows": one.rows,
            "one_batch_ms": 1e3 * t_one,
            "speedup": t_apart / t_one,
            "same_tokens": one.tokens() == want,
            "uniform_static_ms": 1e3 * t_static,
            "uniform_per_row_ms": 1e3 * t_rows,
            "per_row_cost": t_rows / t_static,
            "uniform_same": per_row.tokens() == static.tokens(),
        })  # fmt: skip
    print(render.rows(rows, args.format))


if __name__ == "__main__":
    main()
