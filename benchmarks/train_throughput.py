"""Training throughput against V, measured: one jitted training step (forward, backward, AdamW
update) of the same backbone with one head of each vocabulary size, side by side in one process.

    python benchmarks/train_throughput.py                          # paper-100m, V = 8k and 262k
    python benchmarks/train_throughput.py --model tiny --vocab 1k,4k,16k --format markdown
    python benchmarks/train_throughput.py --vocab 131k --donation   # donated step vs not

Each V is its own model (an embedding table and an untied head of V rows, as a model trained at
that V has), built from the same seed; the tokens are uniform random ids below V (a step's time
does not depend on which ids it sees). All the models are built first, then their steps are
compiled and timed round-robin on fixed inputs (``timing.time_interleaved``: each round runs
every V once, so all see the same machine load), the median of ``--repeats`` rounds. Printed: tokens/s per V, and the ratio of the first V's tokens/s to
each other V's beside the cost model's FLOP ratio (6 (N_nv + V D) per token, plus attention at
``--seq-len`` in the full mode) and, for 8k -> 262k, the source paper's 2.4x (DESIGN.md's
training-throughput claim). The ratio is this device's: a CPU is compute-bound here as a GPU
would be, but its memory system and kernels are not a GPU's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _report import header  # noqa: E402

from vocabjax import render  # noqa: E402
from vocabjax.costmodel import CostModel  # noqa: E402
from vocabjax.costmodel import Settings as CostSettings  # noqa: E402
from vocabjax.hardware import load_device  # noqa: E402
from vocabjax.outputs import SCHEMA, atomic_write_json  # noqa: E402
from vocabjax.shapes import load_shape  # noqa: E402
from vocabjax.timing import TimingSettings, time_interleaved  # noqa: E402
from vocabjax.train import CorpusSpec, RunConfig  # noqa: E402
from vocabjax.train.steps import init_params, make_train_step, optimizer, stepping  # noqa: E402
from vocabjax.units import parse_size_list  # noqa: E402

PAPER = {(8192, 262144): 2.4}  # the paper's training-throughput ratio, 8k -> 262k at ~100M


def prepared_step(config: RunConfig, *, donate: bool = True) -> tuple[Callable[[], object], int]:
    """(a call of one training step on fixed inputs, parameter count) for ``config``'s head."""
    fn, params = init_params(config)
    tx = optimizer(config)
    opt_state = tx.init(params)
    step = make_train_step(fn, config.heads, tx, config.impl, donate=donate)
    rng = np.random.default_rng(config.seed)
    ids = rng.integers(0, config.max_vocab, size=(1, config.batch, config.seq_len + 1))
    batch_hbt = jnp.asarray(ids, jnp.int32)
    n_params = sum(int(np.prod(v.shape)) for v in params.values())
    return stepping(step, params, opt_state, batch_hbt), n_params


def main(argv=None) -> int:
    """Options, then each measured variant side by side in this process, then the table; one
    script read top to bottom, hence its length."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="paper-100m", help="builtin shape or JSON (paper-100m)")
    p.add_argument("--vocab", default="8k,262k", help="vocabulary sizes (default 8k,262k)")
    p.add_argument("--batch", type=int, default=4, help="windows per step (default 4)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per window (default 256)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--impl", default="auto", choices=["auto", "xla", "chunked"])
    p.add_argument("--compute-dtype", default="f32", choices=["f32", "bf16"])
    p.add_argument("--format", choices=["table", "markdown"], default="table")
    p.add_argument(
        "--donation",
        action="store_true",
        help="also time each V's step without buffer donation (the baseline), round-robin",
    )
    p.add_argument("--out", help="also write the figures as JSON (sims/paper_claims.py reads it)")
    args = p.parse_args(argv)
    shape = load_shape(args.model)
    vocabs = parse_size_list(args.vocab, what="vocab")
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731

    calls, sizes = [], []
    for vocab in vocabs:
        config = RunConfig(
            shape=shape,
            heads=(vocab,),
            tokenizer="-",  # not read: the tokens are random
            corpus=CorpusSpec("builtin"),
            steps=1000,
            seq_len=args.seq_len,
            batch=args.batch,
            impl=args.impl,
            compute_dtype=args.compute_dtype,
        )
        call, n_params = prepared_step(config)
        calls.append(call)
        sizes.append(n_params)
        if args.donation:
            calls.append(prepared_step(config, donate=False)[0])
        say(f"V={vocab}: {n_params / 1e6:.1f}M parameters")
    # Round-robin: every round runs each V's step once, so they all see the same machine load.
    say(f"compiling and timing {len(calls)} steps, {args.repeats} rounds ...")
    settings = TimingSettings(
        warmup=1, repeats=args.repeats, min_repeats=args.repeats, slow_call_s=1e9
    )
    seconds = time_interleaved(calls, [()], settings)
    tokens = args.batch * args.seq_len
    per_v = 2 if args.donation else 1
    rows = []
    for i, (vocab, n_params) in enumerate(zip(vocabs, sizes, strict=True)):
        t = seconds[per_v * i]
        row = {"vocab": vocab, "params_M": n_params / 1e6, "step_s": t, "tokens/s": tokens / t}
        if args.donation:
            row["step_s (no donation)"] = seconds[per_v * i + 1]
            row["no donation / donated"] = seconds[per_v * i + 1] / t
        rows.append(row)

    # The cost model at this benchmark's own context length (full mode counts attention).
    models = {
        mode: CostModel(
            load_device("a100-paper"), shape, CostSettings(mode=mode, train_seq_tokens=args.seq_len)
        )
        for mode in ("weights-only", "full")
    }
    first = rows[0]
    ratios = []
    for row in rows[1:]:
        flops = {
            mode: float(cm.train_flops_per_token(float(row["vocab"])))
            / float(cm.train_flops_per_token(float(first["vocab"])))
            for mode, cm in models.items()
        }
        paper = PAPER.get((first["vocab"], row["vocab"])) if args.model == "paper-100m" else None
        ratios.append(
            {
                "from": first["vocab"],
                "to": row["vocab"],
                "measured tokens/s ratio": first["tokens/s"] / row["tokens/s"],
                "FLOP ratio (weights-only)": flops["weights-only"],
                "FLOP ratio (full)": flops["full"],
                "paper": "-" if paper is None else paper,
            }
        )

    made = header(
        __file__,
        argv,
        f"model {shape.name}, batch {args.batch} x seq {args.seq_len}, impl {args.impl}, "
        f"compute {args.compute_dtype}",
    )
    print(render.rows(rows, args.format))
    if ratios:
        print()
        print(render.rows(ratios, args.format))
    if args.out:
        record = {
            "schema": SCHEMA,
            "kind": "train_throughput",
            **made,
            "model": shape.name,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "impl": args.impl,
            "compute_dtype": args.compute_dtype,
            "rows": rows,
            "ratios": ratios,
        }
        say(f"wrote {atomic_write_json(args.out, record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
