"""A saved validation run read back: ``validate --from FILE`` re-prices and refits it without
timing anything again; several runs of one grid combine into their per-point medians.

    v = read_validation("validation.json")             # priced on the run's own profile
    v = read_validation("validation.json", "a100-80gb")  # or on another one
    v = read_validations(["run1.json", "run2.json", "run3.json"])  # each point's median

Only what was measured is read: the grid, the profile the run priced with, and per point its
family, shape, V, B, T, measured and compile seconds. Every prediction is recomputed by today's
cost model, so a run made once can be priced again after the model or the profile changes.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Sequence
from typing import Any

from vocabjax.errors import UserError
from vocabjax.hardware import DeviceProfile
from vocabjax.profiles import (
    a_list,
    an_object,
    boolean,
    closed,
    integer,
    load_json,
    one_of,
    positive_number,
    require,
    text,
)
from vocabjax.shapes import shape_from_mapping
from vocabjax.timing import TimingSettings, spread_pct
from vocabjax.validation.grid import AXES, FAMILIES, Grid, Point
from vocabjax.validation.prediction import predict
from vocabjax.validation.run import (
    Result,
    Validation,
    device_mismatch,
    load_validation_device,
    profile_kind,
)

KIND = "validation"
_POINT_FIELDS = ("family", "shape", "vocab", "batch", "context", "measured_s", "compile_s")
# written by a combined run (``combine_runs``), by runs that counted page faults, by runs that
# recorded the memory each call maps afresh (or had it added: sims/fresh_bytes.py), and by runs
# that recorded their timed calls' spread
_POINT_OPTIONAL = ("runs_spread_pct", "faults_per_call", "fresh_bytes", "repeat_spread_pct")


def _grid(data: Any, *, where: str) -> Grid:
    g = an_object(data, where=where)
    require(g, ("name", "shapes", "axes", "train_seq", "decode_steps", "max_flops", "timing"),
            where=where)  # fmt: skip
    loops = a_list(g.get("loop_steps", []), where=f"{where}.loop_steps")
    shapes = tuple(
        shape_from_mapping(s, name=f"shape {i}", where=f"{where}.shapes[{i}]")
        for i, s in enumerate(a_list(g["shapes"], where=f"{where}.shapes", nonempty=True))
    )
    axes = an_object(g["axes"], where=f"{where}.axes")
    closed(axes, AXES, where=f"{where}.axes")
    require(axes, AXES, where=f"{where}.axes")
    timing = an_object(g["timing"], where=f"{where}.timing")
    return Grid(
        name=text(g["name"], where=f"{where}.name", empty=False),
        shapes=shapes,
        **{
            axis: tuple(
                integer(x, where=f"{where}.axes.{axis}")
                for x in a_list(axes[axis], where=f"{where}.axes.{axis}")
            )  # fmt: skip
            for axis in AXES
        },
        train_seq=integer(g["train_seq"], where=f"{where}.train_seq"),
        decode_steps=integer(g["decode_steps"], where=f"{where}.decode_steps"),
        loop_steps=tuple(integer(n, where=f"{where}.loop_steps", minimum=1) for n in loops),
        max_flops=positive_number(g["max_flops"], where=f"{where}.max_flops"),
        timing=TimingSettings(
            **{
                k: integer(timing[k], where=f"{where}.timing.{k}")
                for k in ("warmup", "repeats", "min_repeats")
                if k in timing
            }  # fmt: skip
        ),
    )


def _result(data: Any, grid: Grid, device: DeviceProfile, *, where: str) -> Result:
    p = an_object(data, where=where)
    require(p, _POINT_FIELDS, where=where)
    shapes = {s.name: s for s in grid.shapes}
    shape = one_of(p["shape"], tuple(shapes), where=f"{where}.shape")

    def size(key: str) -> int | None:
        return None if p[key] is None else integer(p[key], where=f"{where}.{key}", minimum=1)

    point = Point(
        one_of(p["family"], FAMILIES, where=f"{where}.family"),  # type: ignore[arg-type]
        shapes[shape],
        integer(p["batch"], where=f"{where}.batch", minimum=1),
        size("vocab"),
        size("context"),
        None if p.get("steps") is None else size("steps"),
    )
    optional = {
        key: None
        if p.get(key) is None
        else positive_number(p[key], where=f"{where}.{key}", allow_zero=True)
        for key in _POINT_OPTIONAL
    }
    fresh = optional["fresh_bytes"] or 0.0
    return Result(
        point,
        predict(point, device, decode_steps=grid.decode_steps, fresh_bytes=fresh),
        positive_number(p["measured_s"], where=f"{where}.measured_s"),
        positive_number(p["compile_s"], where=f"{where}.compile_s", allow_zero=True),
        **optional,
    )


def read_validation(
    path: str | os.PathLike, device: DeviceProfile | str | None = None
) -> Validation:
    """The run ``validate --out`` wrote to ``path``, every point priced again on ``device``
    (default: the profile the run priced with)."""
    where = str(path)
    data = load_json(path, KIND)
    require(data, ("date", "host", "device", "grid", "points"), where=where)
    grid = _grid(data["grid"], where=f"{where}: grid")
    recorded = an_object(data["device"], where=f"{where}: device")
    require(recorded, ("profile", "running_on"), where=f"{where}: device")
    if device is None:
        profile = DeviceProfile.from_json(recorded["profile"], where=f"{where}: device.profile")
    else:
        profile = load_validation_device(device)
    running = text(recorded["running_on"], where=f"{where}: device.running_on", empty=False)
    points = a_list(data["points"], where=f"{where}: points", nonempty=True)
    results = tuple(
        _result(p, grid, profile, where=f"{where}: points[{i}]") for i, p in enumerate(points)
    )
    measured = {r.point.label() for r in results}
    if len(measured) != len(results):
        raise UserError(f"{where}: a point is listed twice")
    return Validation(
        device=profile,
        device_kind=profile_kind(profile),
        running_on=running,
        mismatch=device_mismatch(profile, running),
        grid=grid,
        results=results,
        skipped=tuple(p for p in grid.points() if p.label() not in measured),
        date=text(data["date"], where=f"{where}: date"),
        host=text(data["host"], where=f"{where}: host"),
        seconds=0.0,
        load_average=positive_number(
            data.get("load_average", 0.0), where=f"{where}: load_average", allow_zero=True
        ),
        runs=integer(data.get("runs", 1), where=f"{where}: runs", minimum=1),
        by_shape=boolean(data.get("by_shape", False), where=f"{where}: by_shape"),
        warm=boolean(data.get("warm", False), where=f"{where}: warm"),
    )


def measured_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (a validation JSON) with each point cut to what was measured: what
    ``read_validation`` reads, a fraction of the size, for keeping a run as data."""
    keep = ("schema", "kind", "date", "host", "load_average", "command", "seconds", "runs",
            "by_shape", "warm", "device", "grid")  # fmt: skip
    out = {k: doc[k] for k in keep if k in doc}
    out["points"] = [
        {k: p[k] for k in _POINT_FIELDS + _POINT_OPTIONAL + ("steps",) if k in p}
        for p in doc["points"]
    ]
    return out


# how a run was timed (``Validation`` fields), said for each value: runs combine only alike
_TIMED = {
    "by_shape": {True: "by shape", False: "as one set"},
    "warm": {True: "warm (each point's calls back to back)", False: "with the cache evicted"},
}


def combine_runs(runs: Sequence[Validation], names: Sequence[str] | None = None) -> Validation:
    """Runs as one: each point's median time (and compile time) over the runs that timed it, its
    spread (``runs_spread_pct``: max - min over the median), priced as the first run that
    timed it prices it. Runs of one grid must hold the same points; runs of several grids (the
    full grid's and the ``loops`` grid's, say) combine into the union of their points, where
    they loop alike (one ``decode_steps``) and were timed alike (``by_shape``, ``warm``). The result
    keeps the first run's grid.

    A decode loop of a point's own length (``Point.steps``) is measured against its
    configuration's loop at the grid's ``decode_steps``, timed beside it in the same rounds:
    its time is the median of that ratio over its runs times the configuration's median time
    over every run that timed it. Runs made hours apart can run at another speed altogether
    (a loops run of 2026-12-07 timed the 8-step loops the full grid's runs share 1.37x slower,
    median); the ratio, timed side by side, carries over.

    A run's points keep one state for minutes (this 2-core guest measured a 250 ms training
    step at 252 ms in one run and 385 ms in the next, every round of each alike), so more
    rounds in one run do not remove it; runs made apart, in fresh processes, do."""
    if not runs:
        raise UserError("no validation runs to combine")
    names = list(names or (f"run {i + 1}" for i in range(len(runs))))
    first = runs[0]
    if len(runs) == 1:
        return first
    first_of: list[tuple[Grid, str, set[str]]] = []  # each grid, its first run, its points
    # each point's result in every run that timed it, beside the same run's loop of its
    # configuration at the grid's length where the point is a loop of its own length
    seen: dict[str, list[tuple[Result, Result | None]]] = {}
    for name, v in zip(names, runs, strict=True):
        if v.grid.decode_steps != first.grid.decode_steps:
            raise UserError(
                f"{name}: its decode loops run {v.grid.decode_steps} steps a call, "
                f"{names[0]}'s {first.grid.decode_steps}: only runs that loop alike combine"
            )
        for field, said in _TIMED.items():
            if getattr(v, field) != getattr(first, field):
                raise UserError(
                    f"{name}: timed {said[getattr(v, field)]}, {names[0]} "
                    f"{said[getattr(first, field)]}: only runs timed alike combine"
                )
        own = {r.point.label(): r for r in v.results}
        match = next(((n, labels) for g, n, labels in first_of if g == v.grid), None)
        if match is None:
            first_of.append((v.grid, name, set(own)))
        elif own.keys() != match[1]:
            raise UserError(
                f"{name}: {len(own.keys() ^ match[1])} points differ from {match[0]}'s, a run "
                f"of the same grid ({v.grid.name!r}): runs of one grid combine only alike"
            )
        for label, r in own.items():
            beside = None if r.point.steps is None else own.get(r.point.configuration())
            seen.setdefault(label, []).append((r, beside))

    def times(pairs: list[tuple[Result, Result | None]]) -> list[float]:
        """Each run's time of the point; a loop of the point's own length (``Point.steps``)
        anchored on its configuration's loop at the grid's length: its run's ratio to that loop,
        timed beside it, times that loop's median over every run that timed it."""
        ratios = [r.measured_s / b.measured_s for r, b in pairs if b is not None]
        if not ratios:
            return [r.measured_s for r, _ in pairs]
        base = seen[pairs[0][0].point.configuration()]
        anchor = statistics.median(r.measured_s for r, _ in base)
        return [anchor * q for q in ratios]

    def one(pairs: list[tuple[Result, Result | None]]) -> Result:
        each = [r for r, _ in pairs]
        ts = times(pairs)
        median = statistics.median(ts)
        faults = [x.faults_per_call for x in each]
        spreads = [x.repeat_spread_pct for x in each]
        # the compiled calls' own figure: alike in every run that recorded it
        fresh = {x.fresh_bytes for x in each if x.fresh_bytes is not None}
        if len(fresh) > 1:
            raise UserError(
                f"{each[0].point.label()}: the runs record different fresh memory for its call "
                f"({', '.join(str(f) for f in fresh)}): only runs of one build combine"
            )
        return dataclasses.replace(
            each[0],
            measured_s=median,
            compile_s=statistics.median(x.compile_s for x in each),
            runs_spread_pct=spread_pct(ts),
            faults_per_call=None if None in faults else statistics.median(faults),
            fresh_bytes=fresh.pop() if fresh else None,
            repeat_spread_pct=None if None in spreads else statistics.median(spreads),
        )

    hosts = list(dict.fromkeys(v.host for v in runs))
    dates = sorted(v.date for v in runs)  # "YYYY-MM-DD HH:MM UTC": in time order as text
    return dataclasses.replace(
        first,
        results=tuple(one(pairs) for pairs in seen.values()),
        date=f"{dates[0]} .. {dates[-1]}" if dates[-1] != dates[0] else dates[0],
        host="; ".join(hosts),
        seconds=sum(v.seconds for v in runs),
        load_average=max(v.load_average for v in runs),
        runs=sum(v.runs for v in runs),
    )


def read_validations(
    paths: Sequence[str | os.PathLike], device: DeviceProfile | str | None = None
) -> Validation:
    """The runs ``validate --out`` wrote to ``paths`` (one or more), each point's median over
    the runs that timed it (``combine_runs``), priced on ``device`` (default: the first run's
    profile)."""
    if not paths:
        raise UserError("no validation runs to read")
    first = read_validation(paths[0], device)
    rest = [read_validation(p, first.device if device is None else device) for p in paths[1:]]
    return combine_runs([first, *rest], [str(p) for p in paths])
