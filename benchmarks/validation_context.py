"""Points of a saved validation run timed again in a group of their own, beside the time the
whole grid's run measured for them.

    python benchmarks/validation_context.py --from sims/data/validation_cpu_full_1.json \
        --point "prefill tiny V=1024 B=64 T=512" --point "prefill tiny V=4096 B=64 T=512"

``--from`` repeated takes each point's median over runs of one grid, as ``validate`` does.

Each point is built exactly as ``validate`` built it in that run (``validation.timing.Group``
over the run's grid: its parameters drawn at the grid's largest V and longest sequence, a decode
point sharing its engine with the prefill of its (V, B, T) where the grid has one) and timed by
the same timer (``timing.time_interleaved``, the cache evicted before every call), in
``--rounds`` rounds over the chosen points only. A point that takes much longer inside the grid
than in a group of its own is slowed by what the grid holds around it, not by its own work.

``--warm`` times each point again called back to back, nothing between its calls (as a serving
loop calls its steps), beside the evicted time: what a call saves when its weights, caches and
the runtime's own state are still in the CPU's caches from the call before.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import header  # noqa: E402

from vocabjax import render  # noqa: E402
from vocabjax.timing import (  # noqa: E402
    Tally,
    cache_evictor,
    minor_faults,
    time_call,
    time_interleaved,
)
from vocabjax.validation import read_validations  # noqa: E402
from vocabjax.validation.timing import Group  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--from",
        dest="saved",
        action="append",
        required=True,
        help="a run `validate --out` saved; repeat it for runs of one grid (each point's median)",
    )
    p.add_argument(
        "--point", action="append", required=True, help='a point\'s label, "decode tiny V=..."'
    )
    p.add_argument("--rounds", type=int, default=9, help="timed rounds [9]")
    p.add_argument(
        "--warm", action="store_true", help="also time each point back to back, nothing between"
    )
    p.add_argument("--format", default="markdown", choices=["table", "markdown", "csv", "json"])
    args = p.parse_args(argv)
    run = read_validations(args.saved)
    source = ", ".join(args.saved)
    by_label = {r.point.label(): r for r in run.results}
    unknown = [x for x in args.point if x not in by_label]
    if unknown:
        sys.exit(f"Error: {unknown[0]!r} is not a point of {source}")
    chosen = [by_label[x] for x in args.point]
    header(
        __file__,
        argv,
        f"{len(chosen)} points of {source} ({run.date}, grid {run.grid.name!r}, {run.runs} runs) "
        "timed in "
        f"a group of their own, {args.rounds} rounds, cache evicted before every call",
    )
    grid_points = run.grid.points()
    groups = {
        shape: Group(shape, run.grid, [q for q in grid_points if q.shape == shape])
        for shape in dict.fromkeys(r.point.shape for r in chosen)
    }
    calls = [groups[r.point.shape].build(r.point)[0] for r in chosen]
    settings = dataclasses.replace(run.grid.timing, repeats=args.rounds, min_repeats=args.rounds)
    tally = Tally(minor_faults)
    times = time_interleaved(calls, [()], settings, between=cache_evictor(), tally=tally)
    faults = tally.medians(len(calls))
    # back to back: each point's calls in a row, its own warm-up first (``time_call``)
    warm = [time_call(c, [()], settings) for c in calls] if args.warm else [None] * len(calls)
    rows = []
    for r, t, f, w in zip(chosen, times, faults, warm, strict=True):
        per_call = r.point.per_call(run.grid.decode_steps)
        own = t / per_call
        row = {
            "point": r.point.label(),
            "in_the_grid_ms": r.measured_s * 1e3,
            "runs_spread_pct": r.runs_spread_pct,
            "alone_ms": own * 1e3,
            "grid_over_alone": r.measured_s / own,
            "faults_in_the_grid": r.faults_per_call,
            "faults_alone": f,
        }
        if w is not None:
            row |= {"warm_ms": w / per_call * 1e3, "alone_over_warm": t / w}
        rows.append(row)
    print(render.rows(rows, args.format))


if __name__ == "__main__":
    main()
