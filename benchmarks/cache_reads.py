"""How much of the KV cache the engine's prefill and decode attend over, against attending over
all of it, side by side in one process.

    python benchmarks/cache_reads.py [--shape tiny] [--max-seq 128,1024] [--head 4096]

The engine's caches hold ``max_seq`` positions per sequence (the run's ``--seq-len``). Two
calls used to attend over every one of them, the positions past a sequence's end masked:

- prefill: prompts written at positions 0..T-1 attended over the whole cache (T x max_seq
  scores); now ``GPT.cached(..., fresh=True)``: nothing precedes a prompt, so it attends among
  its own T tokens (T x T);
- decode: each step's query attended over all max_seq positions; now the steps attend to
  ``DecodeConfig.window`` positions, the power-of-two bucket that holds every row's prompt plus
  its max_new_tokens (``serving.attention_window``), the whole cache when that is no smaller.

Both compute the same scores over the positions the mask keeps. For each ``--max-seq`` the
script builds the model of ``--shape`` with random weights and one head of ``--head`` ids,
and times (``vocabjax.timing.time_interleaved``: the two versions called round-robin, the
median of ``--repeats`` rounds) the engine's compiled prefill with scoring, as ``serve`` calls
it, against the same function attending over the whole cache; and its decode loop (greedy,
``--new`` tokens after a prompt of ``--prompt`` tokens) at each batch of ``--batch``, the
window chosen as ``Engine.generate`` chooses it, against the window of the whole cache. It
checks that both give the same first tokens, caches and generated tokens.
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
from vocabjax.serving.engine import attention_window, bucket_length  # noqa: E402
from vocabjax.shapes import load_shape  # noqa: E402
from vocabjax.timing import TimingSettings, time_interleaved  # noqa: E402
from vocabjax.train import Functional  # noqa: E402
from vocabjax.units import parse_size, parse_size_list  # noqa: E402

SETS = 4  # input sets each version rotates through


def prefill_whole_cache(config, params, ids_bt, lengths_b, rng):
    """``decode.prefill`` as it was: the prompts attend over every cache position (masked)."""
    model = config.fn.model(params)
    rows = ids_bt.shape[0]
    caches = model.init_cache(rows, config.max_seq)
    h_btd, caches = model.cached(ids_bt, caches, jnp.zeros((rows,), jnp.int32))
    h_bd = jnp.take_along_axis(h_btd, (lengths_b - 1)[:, None, None], axis=1)[:, 0]
    nats_b = decode.prompt_nats(config, model, h_btd, ids_bt, lengths_b)
    first_b = decode.pick(
        config, model, h_bd, decode.row_keys(rng, rows), jnp.zeros((rows,), jnp.int32)
    )
    return caches, first_b, nats_b


def inputs(config, rng: np.random.Generator, rows: int, tokens: int, params) -> list[tuple]:
    """``SETS`` (params, ids, lengths, key) of ``rows`` prompts of ``tokens`` tokens, padded as
    the engine pads them."""
    out = []
    for i in range(SETS):
        ids = np.zeros((rows, bucket_length(tokens, config.max_seq)), np.int32)
        ids[:, :tokens] = rng.integers(1, config.head, (rows, tokens))
        lengths = jnp.full((rows,), tokens, jnp.int32)
        out.append((params, jnp.asarray(ids), lengths, jax.random.key(i)))
    return out


def same(a, b) -> bool:
    return all(
        np.allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def prefill_rows(config, sets, settings, rows: int, tokens: int) -> dict:
    """The engine's prefill against ``prefill_whole_cache`` on the same prompts."""
    fresh = jax.jit(functools.partial(decode.prefill, config))
    whole = jax.jit(functools.partial(prefill_whole_cache, config))
    t_fresh, t_whole = time_interleaved([fresh, whole], sets, settings)
    return {
        "call": "prefill",
        "max_seq": config.max_seq,
        "batch": rows,
        "tokens": tokens,
        "window": bucket_length(tokens, config.max_seq),
        "whole_cache_ms": 1e3 * t_whole,
        "engine_ms": 1e3 * t_fresh,
        "speedup": t_whole / t_fresh,
        "same": same(fresh(*sets[0]), whole(*sets[0])),
    }


def decode_rows(config, sets, settings, rows: int, tokens: int, new: int) -> dict:
    """The decode loop at the engine's window against the whole cache, after one prefill."""
    window = attention_window([tokens + new], config.max_seq)
    prefill = jax.jit(functools.partial(decode.prefill, config))
    starts = [prefill(*s) for s in sets]  # (caches, first tokens, nats) per input set
    limits = jnp.full((rows,), new, jnp.int32)
    real = jnp.ones((rows,), bool)

    def loop(cfg):
        run = jax.jit(functools.partial(decode.decode, cfg))
        return run, [(s[0], c, f, s[2], limits, real, s[3]) for s, (c, f, _) in zip(sets, starts)]

    engine, args = loop(dataclasses.replace(config, window=window))
    whole, _ = loop(config)
    t_engine, t_whole = time_interleaved([engine, whole], args, settings)
    a, b = engine(*args[0]), whole(*args[0])
    return {
        "call": "decode",
        "max_seq": config.max_seq,
        "batch": rows,
        "tokens": tokens + new,
        "window": window or config.max_seq,
        "whole_cache_ms": 1e3 * t_whole / (new - 1),
        "engine_ms": 1e3 * t_engine / (new - 1),
        "speedup": t_whole / t_engine,
        "same": bool(np.array_equal(np.asarray(a.out_bs), np.asarray(b.out_bs))),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="tiny")
    p.add_argument("--max-seq", default="128,1024", help="cache positions per sequence")
    p.add_argument("--head", default="4096", help="the head's ids")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--new", type=int, default=64, help="tokens each row generates")
    p.add_argument("--batch", default="1,16", help="decode batches")
    p.add_argument("--prefill", default="1x32,4x64", help="prefills: ROWSxTOKENS")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--format", default="markdown", choices=["table", "markdown", "json", "csv"])
    args = p.parse_args(argv)
    head = parse_size(args.head)
    seqs = [int(x) for x in parse_size_list(args.max_seq)]
    batches = [int(x) for x in parse_size_list(args.batch)]
    prefills = [tuple(int(n) for n in x.split("x")) for x in args.prefill.split(",")]
    header(__file__, argv, f"shape {args.shape}, head {head}, f32, random weights")
    settings = TimingSettings(warmup=3, repeats=args.repeats)
    rng = np.random.default_rng(0)
    rows = []
    for max_seq in seqs:
        model = GPT(GPTConfig(load_shape(args.shape), max_vocab=head, max_seq=max_seq),
                    rngs=nnx.Rngs(0))  # fmt: skip
        fn, params = Functional.of(model)
        config = decode.DecodeConfig(fn, max_seq, head, decode.Sampling(), None, score=True)
        for b, t in prefills:
            rows.append(prefill_rows(config, inputs(config, rng, b, t, params), settings, b, t))
        plain = dataclasses.replace(config, score=False)
        for b in batches:
            sets = inputs(plain, rng, b, args.prompt, params)
            rows.append(decode_rows(plain, sets, settings, b, args.prompt, args.new))
    print(render.rows(rows, args.format))


if __name__ == "__main__":
    main()
