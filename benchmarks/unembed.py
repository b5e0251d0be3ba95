"""Unembedding kernels side by side in one process: every implementation, the measured ceilings,
each one's fraction of its roofline floor, and ``impl="auto"`` against ``xla``.

    python benchmarks/unembed.py                      # V in {32k, 131k}, B in {1, 4, 16, 64, 256}
    python benchmarks/unembed.py --dtype bf16 --format markdown
    python benchmarks/unembed.py --ce-extra ""        # no extra cross-entropy token counts
    python benchmarks/unembed.py --profile none --ops greedy,top_k,sample   # auto, no profile

Steps: measure the ceilings (large copy, large matmul, tiny op); time every candidate of
``greedy`` and of ``linear_cross_entropy`` (forward + backward, B read as the token count N) on
the grid, checked against the reference first and timed round-robin (this is ``autotune`` on
the grid); build the measured profile; then time ``impl="auto"`` under that profile
round-robin with ``xla`` twice (xla, auto, xla in every round, 15 rounds), so the ratio is
side by side: auto's median over the mean of the two xla medians, whose gap shows the noise.
``--profile none`` skips the candidates and times what a user gets before running autotune:
auto under the roofline rule alone, against xla.
Where auto lowers to the same program as xla (the StableHLO text compared), that goal is met by
construction and the ratio printed is the noise alone.

Cross-entropy also runs at ``--ce-extra`` token counts (default 2048: several gradient row
tiles, where the batch sizes fit one). Besides the ceilings autotune measures, a read-only
stream (a jitted row-wise max over the copy probe's size) shows how fast this device reads
when it writes nothing, the traffic of a B = 1 decode. Pallas kernels are timed only off CPU
(on a CPU they run through the interpreter, whose speed means nothing);
``--include-interpret`` times them anyway.

Goals checked at the end (printed, never asserted): auto never slower than xla (within the
repeat-to-repeat noise printed beside it); greedy at B = 1 at >= 70% of the measured bandwidth;
fused cross-entropy forward + backward within 1.3x xla's time. The B = 1 rate (W's bytes over
auto's median) is set against the copy ceiling (its fastest repeat, measured first) and against
the copy and read streams timed in the same rounds as the kernel (medians, the same machine
load): on a shared host the ceilings move by 2x within an hour, and only the second comparison
holds the load fixed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _report import header  # noqa: E402

from vocabjax import autotune as at  # noqa: E402
from vocabjax import render, timing, unembed  # noqa: E402
from vocabjax.units import parse_size_list  # noqa: E402


def main(argv=None) -> int:
    """Options, then every (op, shape, implementation) timed side by side in this process against
    its baseline, then the tables; one script read top to bottom, hence its length."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vocab", default="32k,131072", help="vocabulary sizes (default 32k,131072)")
    p.add_argument("--batch", default="1,4,16,64,256", help="batch sizes / CE token counts")
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--ops", default="greedy,linear_cross_entropy")
    p.add_argument("--ce-extra", default="2048", help="more CE token counts (default 2048)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--include-interpret", action="store_true")
    p.add_argument(
        "--profile",
        choices=["measured", "none"],
        default="measured",
        help="auto under the profile this run measures (default), or with no profile at all "
        "(the roofline rule a user gets before running autotune; no candidates are timed)",
    )
    p.add_argument("--format", choices=["table", "markdown"], default="table")
    args = p.parse_args(argv)
    vocabs = parse_size_list(args.vocab, what="vocab")
    batches = parse_size_list(args.batch, what="batch")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    ce_extra = parse_size_list(args.ce_extra, what="ce-extra") if args.ce_extra.strip() else []
    op_batches = {
        op: batches + [n for n in ce_extra if n not in batches]
        if op == "linear_cross_entropy"
        else batches
        for op in ops
    }
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731

    settings = timing.TimingSettings(
        warmup=2,
        repeats=args.repeats,
        min_repeats=3,
        slow_call_s=0.5,
        matmul_n={"f32": 2048, "bf16": 2048},
        chunk_candidates="quick",  # the default tile and 4x either side
    )
    # auto against xla: more rounds (fast points are the noisy ones; slow ones still stop at
    # min_repeats), each xla median against the mean of the two.
    compare = dataclasses.replace(settings, repeats=max(15, args.repeats))
    ceilings = at.measure_ceilings(tuple(dict.fromkeys((args.dtype, *at.DTYPES))), settings, say)
    read_fn, read_bytes = read_probe(settings.copy_bytes)
    read_bw = read_bytes / timing.time_call(read_fn, [()], settings, fastest=True)
    say(f"read-only stream: {read_bw / 1e9:.1f} GB/s")
    runs = (
        []
        if args.profile == "none"
        else [
            at.autotune(
                vocabs,
                op_batches[op],
                args.d_model,
                args.dtype,
                ops=[op],
                settings=settings,
                progress=say,
                include_interpret=args.include_interpret,
                ceilings=ceilings,
            )
            for op in ops
        ]
    )
    profile = (
        dataclasses.replace(
            runs[0].profile,
            kernels=tuple(r for run in runs for r in run.profile.kernels),
            best=tuple(r for run in runs for r in run.profile.best),
        )
        if runs
        else None
    )
    rows, goals = [], []
    with unembed.using_device_profile(profile):
        for op in ops:
            for vocab in vocabs:
                for batch in op_batches[op]:
                    point = [
                        r
                        for r in (profile.kernels if profile else ())
                        if (r.op, r.vocab, r.batch) == (op, vocab, batch)
                    ]
                    # auto and xla again, one right after the other, on the same inputs
                    sets = at._inputs(vocab, batch, args.d_model, args.dtype, 2, seed=vocab + batch)
                    fn_auto = at._op_fn(op, at.Candidate("auto", None))
                    fn_xla = at._op_fn(op, at.Candidate("xla", None))
                    fns = [fn_xla, fn_auto, fn_xla]
                    streams = op == "greedy" and batch == 1
                    if streams:  # the copy and read streams in the same rounds as the kernel
                        copy_fn, copy_bytes = timing.copy_probe(settings.copy_bytes)
                        fns += [copy_fn, read_fn]
                    t_xla, t_auto, t_xla2, *t_streams = timing.time_interleaved(fns, sets, compare)
                    t_xla_mean = (t_xla + t_xla2) / 2
                    noise = abs(t_xla - t_xla2) / t_xla_mean
                    choice = unembed.select(
                        op, vocab=vocab, batch=batch, d_model=args.d_model, dtype=args.dtype
                    )
                    floor = ceilings.floor_s(op, vocab, batch, args.d_model, args.dtype)
                    flops, bytes_ = unembed.unembed_cost(
                        op, vocab=vocab, batch=batch, d_model=args.d_model, dtype=args.dtype
                    )
                    for r in point:
                        rows.append(
                            _row(
                                r.op,
                                vocab,
                                batch,
                                r.impl,
                                r.blocks,
                                r.time_s,
                                floor,
                                flops,
                                bytes_,
                                t_xla_mean,
                            )
                        )
                    rows.append(
                        _row(
                            op,
                            vocab,
                            batch,
                            f"auto->{choice.impl}",
                            choice.blocks,
                            t_auto,
                            floor,
                            flops,
                            bytes_,
                            t_xla_mean,
                        )
                    )
                    # auto resolves at trace time: where it lowers to xla's very program, it
                    # cannot be slower than xla, and the timed ratio is the noise alone.
                    same = _lowered(fn_auto, sets[0]) == _lowered(fn_xla, sets[0])
                    ok = same or t_auto <= t_xla_mean * (1 + max(noise, 0.05))
                    goals.append(
                        {
                            "goal": "auto <= xla",
                            "op": op,
                            "vocab": vocab,
                            "batch": batch,
                            "blocks": f"->{choice.impl}" + (" (same program)" if same else ""),
                            "value": t_auto / t_xla_mean,
                            "target": "<= 1 (+noise)",
                            "noise": noise,
                            "met": ok,
                        }
                    )
                    if streams:
                        rate = vocab * args.d_model * _w(args.dtype) / t_auto
                        t_copy, t_read = t_streams
                        del copy_fn
                        for against, value, target in (
                            ("copy ceiling", rate / ceilings.hbm_bandwidth, ">= 0.70"),
                            ("copy, same rounds", rate * t_copy / copy_bytes, ">= 0.70"),
                            ("read, same rounds", rate * t_read / read_bytes, "(context)"),
                        ):
                            goals.append(
                                {
                                    "goal": "B=1 auto bytes/s / stream",
                                    "op": op,
                                    "vocab": vocab,
                                    "batch": 1,
                                    "blocks": against,
                                    "value": value,
                                    "target": target,
                                    "noise": noise,
                                    "met": value >= 0.70 if target != "(context)" else "-",
                                }
                            )
                    if op == "linear_cross_entropy":
                        fused = [r for r in point if r.impl != "xla"]
                        xla = [r for r in point if r.impl == "xla"]
                        if fused and xla:
                            fastest = min(fused, key=lambda r: r.time_s)
                            ratio = fastest.time_s / xla[0].time_s
                            goals.append(
                                {
                                    "goal": "fused CE fwd+bwd / xla",
                                    "op": op,
                                    "vocab": vocab,
                                    "batch": batch,
                                    "blocks": _blocks(fastest.blocks),
                                    "value": ratio,
                                    "target": "<= 1.3",
                                    "noise": noise,
                                    "met": ratio <= 1.3,
                                }
                            )
    fmt = args.format
    header(__file__, argv, f"d_model={args.d_model}, dtype={args.dtype}")
    read_row = {"ceiling": "read_only_stream", "value": read_bw, "unit": "bytes/s"}
    print(
        f"# auto: {'the profile measured above' if profile else 'no profile (the selector fallback rule)'}"
    )
    print(render.rows([*ceilings.rows(), read_row], fmt))
    print()
    print(render.rows(rows, fmt))
    print()
    print(render.rows(goals, fmt))
    failed = [f for run in runs for f in run.failures]
    for f in failed:
        print(f"failed check: {f}")
    return 0


def _lowered(fn, args) -> str:
    """The StableHLO text ``fn`` lowers to for ``args``."""
    return fn.lower(*args).as_text()


def _w(dtype: str) -> int:
    return 2 if dtype == "bf16" else 4


def read_probe(nbytes: int):
    """(fn, bytes read per call): a jitted row-wise max over one of two f32 (n / 1024, 1024)
    arrays of ``nbytes`` (alternating calls): reads, no writes, no arithmetic to speak of, rows
    split across the cores (a 1-D sum is one reduction, slower to parallelize: 37.6 GB/s where
    this read 50 on the same host). ``fn`` ignores its arguments."""
    n = nbytes // 4
    row_max = jax.jit(lambda x: jnp.max(x, axis=1))
    xs = [jnp.full((n // 1024, 1024), float(i), jnp.float32) for i in range(2)]
    calls = [0]

    def fn(*_):
        calls[0] += 1
        return row_max(xs[calls[0] % 2])

    return fn, n * 4


def _blocks(blocks) -> str:
    return ",".join(f"{k}={v}" for k, v in dict(blocks).items()) or "-"


def _row(op, vocab, batch, impl, blocks, t, floor, flops, bytes_, t_xla):
    return {
        "op": op,
        "vocab": vocab,
        "batch": batch,
        "impl": impl,
        "blocks": _blocks(blocks),
        "time_ms": t * 1e3,
        "GB/s": bytes_ / t / 1e9,
        "GFLOP/s": flops / t / 1e9,
        "roofline_fraction": floor / t,
        "vs_xla": t / t_xla,
    }


if __name__ == "__main__":
    sys.exit(main())
