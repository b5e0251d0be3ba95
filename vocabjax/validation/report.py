"""What ``validate`` reports: per-point rows, the error summary, the JSON document and the
predicted-against-measured figure.

The JSON keeps every point's op rows (FLOPs, bytes, roofline times) and launch count beside its
measured time, enough to re-price the points under other efficiency parameters without timing
them again (what a fit of the profile needs).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from vocabjax import plots
from vocabjax.hardware import OP_KINDS, TABLE_FIELDS
from vocabjax.profiles import SCHEMA
from vocabjax.validation.fit import Calibrated
from vocabjax.validation.grid import AXES, FAMILIES
from vocabjax.validation.prediction import DTYPE, settings_for
from vocabjax.validation.run import Result, Validation

KIND = "validation"
COLUMNS = (
    "family", "shape", "vocab", "batch", "context", "bound", "flops", "bytes", "predicted_s",
    "measured_s", "error_pct", "compile_s",
)  # fmt: skip
BOUNDS = ("compute", "memory", "launch")


def errors_summary(results: Iterable[Result]) -> dict[str, Any]:
    """``n``, ``median_abs_error_pct`` and ``max_abs_error_pct`` of the points' |error|."""
    errors = [abs(r.error_pct) for r in results]
    if not errors:
        return {"n": 0, "median_abs_error_pct": None, "max_abs_error_pct": None}
    return {
        "n": len(errors),
        "median_abs_error_pct": statistics.median(errors),
        "max_abs_error_pct": max(errors),
    }


def summary(results: Sequence[Result]) -> dict[str, Any]:
    """The error over all points, per kind (step or op), per family and per bound (groups with
    no point are left out)."""
    results = list(results)

    def by(key, groups) -> dict[str, Any]:
        return {
            g: errors_summary([r for r in results if key(r) == g])
            for g in groups
            if any(key(r) == g for r in results)
        }

    out = errors_summary(results)
    out["by_kind"] = by(lambda r: r.point.kind, ("step", "op"))
    out["by_family"] = by(lambda r: r.point.family, FAMILIES)
    out["by_bound"] = by(lambda r: r.prediction.bound, BOUNDS)
    return out


def point_json(r: Result) -> dict[str, Any]:
    p, q = r.point, r.prediction
    return {
        "family": p.family,
        "kind": p.kind,
        "shape": p.shape.name,
        "vocab": p.vocab,
        "batch": p.batch,
        "context": p.context,
        **({} if p.steps is None else {"steps": p.steps}),
        "flops": q.flops,
        "bytes": q.bytes,
        "launches": q.launches,
        "launch_s": q.launch_s,
        "calls": q.calls,
        "dispatch_s": q.dispatch_s,
        "predicted_s": q.predicted_s,
        "measured_s": r.measured_s,
        "compile_s": r.compile_s,
        **({} if r.runs_spread_pct is None else {"runs_spread_pct": r.runs_spread_pct}),
        **({} if r.faults_per_call is None else {"faults_per_call": r.faults_per_call}),
        **({} if r.fresh_bytes is None else {"fresh_bytes": r.fresh_bytes}),
        **({} if r.repeat_spread_pct is None else {"repeat_spread_pct": r.repeat_spread_pct}),
        "error_pct": r.error_pct,
        "bound": q.bound,
        "ops": [o.to_json() for o in q.ops],
    }


def device_json(v: Validation) -> dict[str, Any]:
    d = v.device
    return {
        "name": d.name,
        "source": d.source,
        "measured": d.measured,
        "kind": v.device_kind,
        "running_on": v.running_on,
        "mismatch": v.mismatch,
        "peak_flops": d.flops(DTYPE),
        "hbm_bandwidth": d.hbm_bandwidth,
        "ridge_point": d.ridge_point(DTYPE),
        "launch_overhead_s": d.launch_overhead_s,
        "dispatch_overhead_s": d.dispatch_overhead_s,
        "compute_efficiency": d.compute_efficiency,
        "memory_efficiency": d.memory_efficiency,
        "measured_unembedding": bool(d.best_rows("greedy", DTYPE)),
        "profile": d.to_json(),  # the whole profile, so ``read_validation`` prices as this run
    }


def grid_json(v: Validation) -> dict[str, Any]:
    g = v.grid
    s = g.timing
    some_step = next((r.point for r in v.results if r.point.family != "train"), None)
    settings = settings_for(some_step) if some_step is not None else None
    return {
        "name": g.name,
        "shapes": [shape.to_json() for shape in g.shapes],
        "axes": {axis: list(getattr(g, axis)) for axis in AXES},
        "train_seq": g.train_seq,
        "decode_steps": g.decode_steps,
        "loop_steps": list(g.loop_steps),
        "max_flops": g.max_flops,
        "skipped": len(v.skipped),
        "timing": {"warmup": s.warmup, "repeats": s.repeats, "min_repeats": s.min_repeats},
        "cost_model": None
        if settings is None
        else {
            "mode": settings.mode,
            "dtype": DTYPE,
            "launches_per_layer": settings.launches_per_layer,
            "fused_logits": settings.fused_logits,
        },
    }


def document(
    v: Validation, *, command: str | None = None, calibrated: Calibrated | None = None
) -> dict[str, Any]:
    """The JSON of a run: ``{"schema": 1, "kind": "validation", "device", "points",
    "summary": {"before": ...}}`` and how it was made. With ``calibrated`` (``--fit``): each
    point says whether it was held out and its prediction after; ``summary.after`` and
    ``summary.before_held_out`` are on the held-out points only; ``calibration`` is the
    calibrated profile's record."""
    doc = {
        "schema": SCHEMA,
        "kind": KIND,
        "date": v.date,
        "host": v.host,
        "load_average": v.load_average,
        "command": command,
        "seconds": v.seconds,
        "runs": v.runs,
        "by_shape": v.by_shape,
        "warm": v.warm,
        "device": device_json(v),
        "grid": grid_json(v),
        "points": [point_json(r) for r in v.results],
        "summary": {"before": summary(v.results)},
    }
    if calibrated is not None:
        for p, after in zip(doc["points"], calibrated.after, strict=True):
            p["held_out"] = calibrated.is_held_out(after)
            p["predicted_after_s"] = after.prediction.predicted_s
            p["error_after_pct"] = after.error_pct
        doc["summary"]["before_held_out"] = summary(calibrated.held_out(v.results))
        doc["summary"]["after"] = summary(calibrated.held_out(calibrated.after))
        doc["calibration"] = dict(calibrated.fit.profile.calibration or {})
    return doc


def point_rows(v: Validation) -> list[dict[str, Any]]:
    """One row per point, in ``COLUMNS`` (and the runs' spread for combined runs, the page
    faults per call where the run counted them, the memory a call maps afresh and the timed
    calls' spread where known)."""
    columns = COLUMNS + (("runs_spread_pct",) if v.runs > 1 else ())
    for optional in ("faults_per_call", "fresh_bytes", "repeat_spread_pct"):
        if any(getattr(r, optional) is not None for r in v.results):
            columns += (optional,)
    return [{c: point_json(r).get(c) for c in columns} for r in v.results]


def summary_rows(v: Validation, results: Sequence[Result] | None = None) -> list[dict[str, Any]]:
    """Rows of |error| per family, per bound and over all points (of ``results``, by default
    the run's)."""
    s = summary(v.results if results is None else results)
    rows = [{"group": f"family {f}", **x} for f, x in s["by_family"].items()]
    rows += [{"group": f"{k}s", **x} for k, x in s["by_kind"].items()]
    rows += [{"group": f"bound {b}", **x} for b, x in s["by_bound"].items()]
    rows.append({"group": "all", **{k: s[k] for k in ("n", "median_abs_error_pct",
                                                      "max_abs_error_pct")}})  # fmt: skip
    return rows


def profile_rows(profile) -> list[dict[str, str]]:
    """A calibrated profile's fitted parameters, one row each (``parameter``, ``value``): its
    tables, kind scales, overlap, decode-loop cache, fresh memory and overheads."""
    rows = [
        {"parameter": key,
         "value": ", ".join(f"{s:.3g}: {x:.3g}" for s, x in zip(t.sizes, t.values, strict=True))}
        for field, key in TABLE_FIELDS.items()
        if (t := getattr(profile, field)) is not None
    ]  # fmt: skip
    rows += [{"parameter": f"{k} efficiency", "value": f"{profile.kind_efficiency(k):.3g}"}
             for k in OP_KINDS]  # fmt: skip
    cache = "none"
    if profile.cache_bytes > 0:
        cache = (f"{profile.cache_bytes / 2**20:.3g} MiB, read in {profile.cached_time:.3g} of "
                 "the time from memory")  # fmt: skip
    fresh = "not modelled"
    if profile.fresh_bandwidth > 0:
        page = 4096 / profile.fresh_bandwidth * 1e6
        fresh = f"{profile.fresh_bandwidth / 1e9:.3g} GB/s, {page:.3g} us a 4 KiB page"
    rows += [
        {"parameter": "overlap", "value": f"{profile.overlap:.3g}"},
        {"parameter": "cache of a decode loop's steps", "value": cache},
        {"parameter": "fresh memory (a call's page faults)", "value": fresh},
        {"parameter": "launch overhead", "value": f"{profile.launch_overhead_s * 1e6:.3g} us"},
        {"parameter": "dispatch overhead (one host call)",
         "value": f"{profile.dispatch_overhead_s * 1e6:.3g} us"},
    ]  # fmt: skip
    return rows


def headline(v: Validation) -> str:
    d = v.device
    runs = f", each point the median of {v.runs} runs" if v.runs > 1 else ""
    return (
        f"validate on {v.running_on} ({v.host}), grid {v.grid.name!r}, {len(v.results)} points"
        f"{runs} "
        f"({len(v.skipped)} over the FLOP cap left out); predictions from {d.name!r}: "
        f"{d.flops(DTYPE) / 1e9:.4g} GFLOP/s f32, {d.hbm_bandwidth / 1e9:.4g} GB/s, "
        f"launch {d.launch_overhead_s * 1e6:.3g} us, dispatch {d.dispatch_overhead_s * 1e6:.3g} us "
        f"per call ({d.source})"
    )


_MARKERS = {"decode": "o", "prefill": "s", "train": "D", "backbone": "^", "attention": "v",
            "unembedding": "P"}  # fmt: skip
_COLOURS = {"compute": "C3", "memory": "C0", "launch": "C2"}


def _scatter(ax, results: Sequence[Result], *, title: str, xlabel: str, ylabel: str) -> None:
    """One panel: predicted against measured, log-log, y = x; colour the bound, marker the
    family."""
    for family in FAMILIES:
        for bound in BOUNDS:
            pts = [r for r in results if r.point.family == family and r.prediction.bound == bound]
            if pts:
                ax.scatter(
                    [r.measured_s for r in pts],
                    [r.prediction.predicted_s for r in pts],
                    marker=_MARKERS[family],
                    c=_COLOURS[bound],
                    s=28,
                    alpha=0.8,
                    label=f"{family}, {bound}-bound",
                )
    values = [x for r in results for x in (r.measured_s, r.prediction.predicted_s) if x > 0]
    lo, hi = min(values) / 2, max(values) * 2
    ax.plot([lo, hi], [lo, hi], color="0.3", lw=1, ls="--", label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    s = summary(results)
    med = s["median_abs_error_pct"]
    if med is not None and math.isfinite(med):
        steps = s["by_kind"].get("step")
        step_note = f"; steps {steps['median_abs_error_pct']:.0f}%" if steps else ""
        title += f"\nmedian |error| {med:.0f}%, worst {s['max_abs_error_pct']:.0f}%{step_note}"
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")


def plot(
    v: Validation,
    path: str | os.PathLike,
    *,
    caption: str = "",
    calibrated: Calibrated | None = None,
) -> Path:
    """Predicted against measured seconds, log-log, the y = x line; colour: the bound the model
    says holds, marker: the family. With ``calibrated`` a second panel shows the points the fit
    never saw, priced by the calibrated profile."""
    plots.check_plot_path(path)  # matplotlib present, the target writable
    import matplotlib.pyplot as plt

    panels = 1 if calibrated is None else 2
    fig, axes = plt.subplots(1, panels, figsize=(7.5 * panels, 6.5), squeeze=False)
    xlabel = f"measured seconds on {v.running_on}"
    _scatter(
        axes[0][0],
        v.results,
        title=f"{v.device.name}, all {len(v.results)} points",
        xlabel=xlabel,
        ylabel=f"predicted seconds ({v.device.name})",
    )
    if calibrated is not None:
        held = calibrated.held_out(calibrated.after)
        _scatter(
            axes[0][1],
            held,
            title=f"calibrated, the {len(held)} points the fit never saw",
            xlabel=xlabel,
            ylabel="predicted seconds (calibrated profile)",
        )
    if caption:
        fig.text(0.01, -0.01, caption, fontsize=8, family="monospace")
    fig.tight_layout()
    out = plots.save_figure(fig, path)
    plt.close(fig)
    return out
