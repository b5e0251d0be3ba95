"""The memory each point's compiled call maps afresh, against the page faults the runs counted.

    python sims/fresh_bytes.py           # seconds: docs/validation_fresh.md from the runs
    python sims/fresh_bytes.py --build   # compiles every point of the full and quick grids
                                         # (times nothing: about 15 minutes on 2 cores), writes
                                         # each point's figure into the runs, then the doc

``validate`` records, for each point, the memory one call of its compiled program maps afresh
(``fresh_bytes``: on a CPU, XLA's temporary buffer when it is 32 MiB or more, which glibc maps
anew on every call, so every page of it faults; ``validation.timing.fresh_bytes``). Runs 6-10
of each grid in sims/data/ were timed before it did. The figure is XLA's buffer assignment of the
compiled call: it depends on the code, the shapes and the jax that compiles them, not on the run.
So ``--build`` builds every point of those runs again with validate's own builds
(``timing.Group.build``: the engine's prefill and decode loop, the training step, each op),
reads the figure, and writes it into each point of each run (atomically), after checking that
this jax is the one the runs name. The doc sets the figure beside the page faults each run
counted (``faults_per_call``, the median of the runs; 4 KiB pages) for every step that maps
memory afresh or faults.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import _common  # noqa: F401  (puts the checkout on sys.path)
import jax
from _common import ROOT, write_doc

from vocabjax import validation
from vocabjax.outputs import atomic_write_json
from vocabjax.validation.timing import Group

DATA = ROOT / "sims" / "data"
RUNS = {
    grid: tuple(f"validation_cpu_{grid}_{i}.json" for i in (6, 7, 8, 9, 10))
    for grid in ("full", "quick")
}
PAGE = 4096
MiB = 2.0**20


def fresh_of(run) -> dict[str, float | None]:
    """Each point's fresh memory, built shape by shape as validate builds it (each shape's
    builds freed before the next)."""
    out: dict[str, float | None] = {}
    points = [r.point for r in run.results]
    for shape in dict.fromkeys(p.shape for p in points):
        mine = [p for p in points if p.shape == shape]
        group = Group(shape, run.grid, mine)
        for i, p in enumerate(mine, 1):
            out[p.label()] = group.build(p).fresh_bytes
            print(f"  {shape.name}: {i}/{len(mine)} {p.label()}", file=sys.stderr, flush=True)
        del group
        gc.collect()
    return out


def build(grid: str, paths) -> None:
    """Compile every point of ``grid``'s runs and write each one's figure into them."""
    if jax.default_backend() != "cpu":
        raise SystemExit("the runs were timed on a CPU: run this on one")
    docs = [json.loads(p.read_text()) for p in paths]
    for path, doc in zip(paths, docs, strict=True):
        if not doc["host"].endswith(f"jax {jax.__version__}"):
            raise SystemExit(f"{path.name} ran on {doc['host']!r}, not jax {jax.__version__}")
    run = validation.read_validation(paths[0])
    print(f"{grid}: building {len(run.results)} points", file=sys.stderr)
    fresh = fresh_of(run)
    for path, doc in zip(paths, docs, strict=True):
        # each point's label as validate reads it, in the order of the file's points
        labels = [r.point.label() for r in validation.read_validation(path).results]
        for p, name in zip(doc["points"], labels, strict=True):
            p["fresh_bytes"] = fresh[name]
        atomic_write_json(path, doc)
        print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)


def table(grid: str, paths) -> list[str]:
    """The steps of ``grid`` that map memory afresh or fault: XLA's figure and the counts (each
    point's median over the runs, as ``combine_runs`` takes it)."""
    combined = validation.read_validations(paths)
    lines = [
        f"## The {grid} grid, runs 6-10",
        "",
        "| step | XLA's temporaries mapped afresh, MiB | page faults counted, MiB | counted / XLA |",
        "|---|---:|---:|---:|",
    ]
    for r in combined.results:
        if r.point.family not in ("decode", "prefill", "train"):
            continue
        if r.fresh_bytes is None:
            raise SystemExit(f"{paths[0].name} has no fresh_bytes: run with --build first")
        faults = r.faults_per_call * PAGE / MiB
        mapped = r.fresh_bytes / MiB
        if mapped or faults > 1.0:
            ratio = f"{faults / mapped:.2f}" if mapped else "-"
            lines.append(f"| {r.point.label()} | {mapped:.1f} | {faults:.1f} | {ratio} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", action="store_true", help="compile and write the figures first")
    args = ap.parse_args()
    body = [
        "XLA's temporary buffer of each step's compiled call where it is 32 MiB or more (the",
        "`fresh_bytes` `validate` records; 0 below that), beside the minor page faults the",
        "runs counted per call (`faults_per_call`, the median of runs 6-10, 4 KiB pages), for",
        "every step that maps memory afresh or faults more than 1 MiB. A decode point's call",
        "runs the engine's 8-step loop. How the fit uses the figure: [validation.md](validation.md).",
        "",
    ]
    for grid, names in RUNS.items():
        paths = [DATA / name for name in names]
        if args.build:
            build(grid, paths)
        body += [*table(grid, paths), ""]
    write_doc("validation_fresh.md", "XLA's fresh temporaries against the page faults counted",
              "\n".join(body))  # fmt: skip


if __name__ == "__main__":
    main()
