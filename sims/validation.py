"""The cost model against this project's own runs on a CPU: docs/validation_cpu.md and its figure.

    python sims/validation.py        # seconds: prices the committed runs again, times nothing

Data: ``validate --out`` runs kept in sims/data/ (each point's measured seconds, the grid and
the profile it priced with; ``vocabjax.validation.measured_fields``): the full grid and the quick
grid several times each, each run in a fresh process, minutes apart. Only the runs that timed
today's engine count: runs 1-5 of each grid (2026-12-05) timed the token pick with
``jnp.argmax``, which commit 77cbf40 replaced on the CPU with ``vocabjax.unembed.argmax``'s
blocked pick; they stay in sims/data/ for the figures docs/validation.md quotes from them.
Each point's time is its median over the runs of its grid (``combine_runs``, as ``validate
--from A --from B ...`` does); every prediction is made again by today's cost model and fitted as ``validate --fit``
fits: two thirds of the step points by a hash of each point, the rest and every op held out.
Each run against the medians says how far this machine repeats itself.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics

import _common  # noqa: F401  (puts the checkout on sys.path)
from _common import ROOT, figure_path, write_doc

from vocabjax import validation
from vocabjax.validation.anchor import anchor_of, anchored
from vocabjax.validation.fit import calibrate, repriced
from vocabjax.validation.grid import FAMILIES, STEP_FAMILIES

DATA = ROOT / "sims" / "data"
FULL = tuple(f"validation_cpu_full_{i}.json" for i in (6, 7, 8, 9, 10))
QUICK = tuple(f"validation_cpu_quick_{i}.json" for i in (6, 7, 8, 9, 10))
# decode loops alone at 1, 8 and 32 steps a call (``validate --grid loops``), fitted beside FULL
LOOPS = tuple(f"validation_cpu_loops_{i}.json" for i in (1, 2))
# a later day's runs, priced by the profile fitted on FULL + LOOPS: the anchor grid timed
# before and after a loops-grid run (``validate --anchor``), and that loops run
ANCHORS = tuple(f"anchor_cpu_{i}.json" for i in (1, 2))
LATER = "validation_cpu_loops_3.json"
# the later processor's own runs (an Intel guest; the runs above: AMD), fitted on their own
OTHER_QUICK = tuple(f"validation_cpu_quick_{i}.json" for i in (11, 12, 13))
OTHER_FULL = tuple(f"validation_cpu_full_{i}.json" for i in (11, 12, 13))
# a third guest (Intel again, another machine: the suite ran 1.6x faster there), fitted on its own
THIRD_FULL = tuple(f"validation_cpu_full_{i}.json" for i in (14, 15, 16, 17))
THIRD_LOOPS = "validation_cpu_loops_4.json"
# the third guest's grids timed warm (``validate --warm``: each point's calls back to back, the
# cache not evicted), as a serving loop calls its steps
WARM = tuple(f"validation_cpu_warm_{grid}_{i}.json" for grid in ("full", "loops") for i in (1, 2))
FIGURE = "validation_cpu_full.png"
TARGET = (10.0, 30.0)  # issue 10: median and worst |error| of the held-out steps, percent


def _abs_errors(results) -> list[float]:
    return [abs(r.error_pct) for r in results]


def _cells(results) -> str:
    e = _abs_errors(results)
    return f"{statistics.median(e):.1f} | {max(e):.0f}" if e else "- | -"


def error_table(v, cal) -> list[str]:
    """Held-out |error| by family and over the steps, before and after the fit."""
    before = cal.held_out(v.results)
    after = cal.held_out(cal.after)
    groups = [(f, (f,)) for f in FAMILIES] + [("**steps**", STEP_FAMILIES)]
    lines = [
        "| held out | n | before: median | worst | after: median | worst |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, fams in groups:
        b = [r for r in before if r.point.family in fams]
        a = [r for r in after if r.point.family in fams]
        lines.append(f"| {name} | {len(a)} | {_cells(b)} | {_cells(a)} |")
    return lines


def _verdict(median_met: bool, worst_met: bool) -> str:
    if median_met and worst_met:
        return "met"
    if median_met or worst_met:
        return f"the {'median' if median_met else 'worst'} is met, **the {'worst' if median_met else 'median'} is not**"
    return "**not met**"


def steps_after(cal) -> tuple[float, float]:
    e = _abs_errors(r for r in cal.held_out(cal.after) if r.point.family in STEP_FAMILIES)
    return statistics.median(e), max(e)


def fitted(profile) -> list[str]:
    """The calibrated profile's parameters, one row each."""
    rows = validation.profile_rows(profile)
    return [
        "| parameter | value |",
        "|---|---|",
        *(f"| {r['parameter']} | {r['value']} |" for r in rows),
    ]


def worst(cal, n: int = 10) -> list[str]:
    held = [r for r in cal.held_out(cal.after) if r.point.family in STEP_FAMILIES]
    held.sort(key=lambda r: -abs(r.error_pct))
    lines = ["| held-out step | measured | after |", "|---|---:|---:|"]
    lines += [
        f"| {r.point.label()} | {r.measured_s * 1e3:.3g} ms | {r.error_pct:+.0f}% |"
        for r in held[:n]
    ]
    return lines


def by_loop(v, cal) -> list[str]:
    """Held-out decode steps by steps per call, before and after the fit."""
    lines = [
        "| held-out decode steps | n | before: median | worst | after: median | worst |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    steps = v.grid.decode_steps

    def decode(results, n):
        return [r for r in results if r.point.family == "decode" and r.point.per_call(steps) == n]

    before, after = cal.held_out(v.results), cal.held_out(cal.after)
    for n in sorted({r.point.per_call(steps) for r in after if r.point.family == "decode"}):
        lines.append(
            f"| {n} a call | {len(decode(after, n))} | {_cells(decode(before, n))} | "
            f"{_cells(decode(after, n))} |"
        )
    return lines


def repeatability(runs, combined) -> list[str]:
    """|difference| of each point's time in each run from its median over the runs, percent of
    the median, by family."""
    median = {r.point.label(): r.measured_s for r in combined.results}
    lines = ["| family | points | median | worst |", "|---|---:|---:|---:|"]
    for fams, name in [((f,), f) for f in FAMILIES] + [(STEP_FAMILIES, "**steps**")]:
        d = [
            100 * abs(r.measured_s / median[r.point.label()] - 1)
            for v in runs
            for r in v.results
            if r.point.family in fams
        ]
        n = sum(r.point.family in fams for r in combined.results)
        lines.append(f"| {name} | {n} | {statistics.median(d):.1f} | {max(d):.0f} |")
    return lines


def _signed(results) -> str:
    e = sorted(r.error_pct for r in results)
    return f"{statistics.median(e):+.1f}" if e else "-"


def later_day(profile) -> list[str]:
    """The profile fitted on one day's runs pricing a later day's loops run, as it is and
    anchored by each anchor run (its factor from that run's steps alone), beside the factor that
    would fit the later run best (its own median ratio: what no anchor can beat). The points of
    configurations the anchor grid also timed are told apart from the rest."""
    later = validation.read_validation(DATA / LATER, profile)
    anchors = [validation.read_validation(DATA / name, profile) for name in ANCHORS]
    shared = {r.point.configuration() for a in anchors for r in a.results}
    own = anchor_of(later)
    rows = [("fitted, not anchored", profile, "-")]
    for name, a in zip(ANCHORS, anchors, strict=True):
        speed = anchor_of(a)
        rows.append((f"anchored by `{name}` ({a.date})", anchored(profile, speed), speed))
    rows.append(("anchored by the later run itself (the best one factor can do)",
                 anchored(profile, own), own))  # fmt: skip
    lines = [
        "| profile | factor | all: n | median | worst | signed median | not in the anchor "
        "grid: n | median | worst |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for what, p, speed in rows:
        results = (later if p is profile else validation.read_validation(DATA / LATER, p)).results
        rest = [r for r in results if r.point.configuration() not in shared]
        factor = "-" if speed == "-" else f"{speed.factor:.3f}"
        lines.append(
            f"| {what} | {factor} | {len(results)} | {_cells(results)} | {_signed(results)} | "
            f"{len(rest)} | {_cells(rest)} |"
        )
    return [
        f"- {run_line(later, LATER)}",
        *(f"- {run_line(a, name)} {anchor_of(a).line()}." for name, a in zip(ANCHORS, anchors)),
        "",
        *lines,
    ]


def other_processor(fitted_profile) -> list[str]:
    """The later processor's own runs: each grid's runs combined and fitted on their own, beside
    the profile fitted on the first processor's runs pricing the same held-out steps."""
    grids = (
        ("The quick grid's three runs, each point the median", OTHER_QUICK, True),
        ("The full grid's three runs, each point the median", OTHER_FULL, True),
        ("The full grid's runs and the loops grid's (`combine_runs`, as above)",
         OTHER_FULL + (LATER,), False),
    )  # fmt: skip
    return own_fits(grids, fitted_profile, "the other processor's runs")


def own_fits(grids, fitted_profile, fitted_on: str) -> list[str]:
    """Each (label, run names, list the runs) of ``grids``: the runs combined and fitted on
    their own, beside ``fitted_profile`` (fitted on ``fitted_on``) pricing the same held-out
    steps."""
    lines = []
    for label, names, listed in grids:
        runs, v, cal = runs_fitted(names)
        m, w = steps_after(cal)
        steps = v.grid.decode_steps
        elsewhere = [  # the same held-out steps priced on the other processor's fit
            dataclasses.replace(r, prediction=repriced(r, fitted_profile, steps))
            for r in cal.held_out(v.results)
            if r.point.family in STEP_FAMILIES
        ]
        e = _abs_errors(elsewhere)
        lines += [
            *(each_run(names, runs) if listed else []),
            "",
            f"{label}, fitted on their own: held-out "
            f"steps **{m:.1f}% median, {w:.0f}% worst** (target {TARGET[0]:.0f}% and "
            f"{TARGET[1]:.0f}%: {_verdict(m <= TARGET[0], w <= TARGET[1])}); the profile fitted "
            f"on {fitted_on} prices the same {len(e)} held-out steps within "
            f"{statistics.median(e):.1f}% median, {max(e):.0f}% worst "
            f"(signed median {_signed(elsewhere)}%).",
            "",
            *error_table(v, cal),
            "",
        ]
    return lines


def one_run_worst(name: str, others) -> list[str]:
    """The held-out step a single run's own fit misses most, and what the runs ``others``
    measured at the same point: how much of the miss is the run's own."""
    _, _, cal = runs_fitted((name,))
    held = [r for r in cal.held_out(cal.after) if r.point.family in STEP_FAMILIES]
    r = max(held, key=lambda r: abs(r.error_pct))
    label = r.point.label()
    times = []
    for other in others:
        same = [x for x in validation.read_validation(DATA / other).results
                if x.point.label() == label]  # fmt: skip
        times += [f"{x.measured_s * 1e3:.2f}" for x in same]
    return [
        f"The worst held-out step of the full run's own fit is `{label}`: measured "
        f"{r.measured_s * 1e3:.2f} ms there, priced {r.error_pct:+.0f}% after the fit; the "
        f"{len(times)} other full runs above timed it at {', '.join(times)} ms. With one run "
        "per grid a single point's noise is the worst error; the runs above are medians of "
        "three to five for that reason.",
    ]


def noisiest(names, n: int = 6) -> list[str]:
    """The steps whose runs ``names`` disagree most, with each run's time and its timed calls'
    own spread (where the run recorded it): a run slow throughout, or a noisy point."""
    runs, v, _ = runs_fitted(names)
    steps = [r for r in v.results if r.point.family in STEP_FAMILIES]
    worst = sorted(steps, key=lambda r: -(r.runs_spread_pct or 0.0))[:n]
    rows = []
    for r in worst:
        label = r.point.label()
        each = [next(x for x in run.results if x.point.label() == label) for run in runs]
        cells = [
            f"{x.measured_s * 1e3:.2f} ms"
            + ("" if x.repeat_spread_pct is None else f" ({x.repeat_spread_pct:.0f}%)")
            for x in each
        ]
        rows.append(f"| {label} | {' | '.join(cells)} | {r.runs_spread_pct:.0f}% |")
    return [
        f"The {n} steps whose {len(runs)} runs disagree most: each run's time and, in brackets,",
        "the spread of that run's own timed calls ((max - min) / median of its repeats; the",
        "first run did not record it), then the runs' spread over their median:",
        "",
        f"| step | {' | '.join(f'run {i}' for i in range(1, len(runs) + 1))} | runs' spread |",
        "|---|" + "---:|" * (len(runs) + 1),
        *rows,
    ]


def warm_calls() -> list[str]:
    """The third guest's points timed warm against the same points timed with the cache evicted
    (each point's median over the evicted runs), by family, and the warm runs' own fit."""
    _, evicted, evicted_cal = runs_fitted(THIRD_FULL + (THIRD_LOOPS,))
    _, warm, _ = runs_fitted(WARM)
    cold = {r.point.label(): r.measured_s for r in evicted.results}
    ratios: dict[str, list[float]] = {}
    for r in warm.results:
        name = r.point.family + ("" if r.point.steps is None else f", {r.point.steps} a call")
        ratios.setdefault(name, []).append(cold[r.point.label()] / r.measured_s)
    rows = [
        f"| {name} | {len(q)} | {statistics.median(q):.2f} | {min(q):.2f} | {max(q):.2f} |"
        for name, q in sorted(ratios.items())
    ]
    return [
        "Each point's evicted time (its median over the runs above, full and loops) over its",
        "warm time:",
        "",
        "| family | n | evicted / warm: median | least | most |",
        "|---|---:|---:|---:|---:|",
        *rows,
        "",
        *own_fits(
            (("The warm runs (full and loops)", WARM, True),),
            evicted_cal.fit.profile,
            "this guest's evicted runs (full and loops)",
        ),
    ]


def second_guest_profile():
    """The profile fitted on the Intel guest's full runs and its loops run (``OTHER_FULL`` and
    ``LATER``: what ``profiles/cpu-xeon.json`` is)."""
    return runs_fitted(OTHER_FULL + (LATER,))[2].fit.profile


@functools.cache
def runs_fitted(names: tuple[str, ...]):
    """The runs ``names`` read, combined (one run: itself) and fitted, once per script:
    (the runs, the validation, its calibration)."""
    runs = [validation.read_validation(DATA / name) for name in names]
    v = validation.combine_runs(runs, names) if len(runs) > 1 else runs[0]
    return runs, v, calibrate(v)


def each_run(names, runs) -> list[str]:
    """One line per run: where and when it was timed, and its held-out steps after its own
    fit."""
    lines = []
    for name, v in zip(names, runs, strict=True):
        m, w = steps_after(calibrate(v))
        lines.append(f"- {run_line(v, name)} Fitted alone, held-out steps after: {m:.1f}% median, "
                     f"{w:.0f}% worst.")  # fmt: skip
    return lines


def run_line(v, name: str) -> str:
    d = v.device
    timed = (
        f"`sims/data/{name}`: grid `{v.grid.name}`, {len(v.results)} points timed "
        f"{v.date} on {v.host} (load average {v.load_average:.1f} at the start)"
    )
    if d.calibrated:  # a later run priced by a fitted profile, not by ceilings of its own
        return f"{timed}; priced by the calibrated profile `validate --device` named."
    return (
        f"{timed}; ceilings measured then: {d.flops('f32') / 1e9:.0f} GFLOP/s f32, "
        f"{d.hbm_bandwidth / 1e9:.1f} GB/s, launch {d.launch_overhead_s * 1e6:.1f} us."
    )


def main() -> None:
    full_runs = [validation.read_validation(DATA / name) for name in FULL]
    full = validation.combine_runs(full_runs, FULL)
    cal = calibrate(full)
    validation.plot(full, figure_path(FIGURE), caption="python sims/validation.py",
                    calibrated=cal)  # fmt: skip
    median, worst_ = steps_after(cal)
    quick_runs = [validation.read_validation(DATA / name) for name in QUICK]
    quick = validation.combine_runs(quick_runs, QUICK)
    quick_cal = calibrate(quick)
    verdict = _verdict(median <= TARGET[0], worst_ <= TARGET[1])
    q_median, q_worst = steps_after(quick_cal)
    loops_runs = [validation.read_validation(DATA / name) for name in LOOPS]
    both = validation.combine_runs(full_runs + loops_runs, FULL + LOOPS)
    both_cal = calibrate(both)
    b_median, b_worst = steps_after(both_cal)
    b_verdict = _verdict(b_median <= TARGET[0], b_worst <= TARGET[1])
    with_loops = " ".join(f"--from sims/data/{name}" for name in FULL + LOOPS)
    from_files = " ".join(f"--from sims/data/{name}" for name in FULL)
    body = [
        "The cost model against this project's own model, serving engine and training step on",
        "this CPU: runs of `python cli.py validate` kept in `sims/data/`, priced again by today's",
        "cost model and fitted as `validate --fit` fits them. Each grid was timed several times,",
        "in fresh processes minutes apart, and each point's time is its median over the runs",
        f"(`python cli.py validate {from_files} --fit` does the same). How the points are timed",
        "and what the fit fits: [validation.md](validation.md).",
        "",
        f"## The full grid, {len(FULL)} runs",
        "",
        *each_run(FULL, full_runs),
        "",
        f"Each point's median over the {len(FULL)} runs, priced on the first run's ceilings: "
        f"{len(cal.fit.fit_keys)} step points fitted; the other steps and every op held out.",
        "",
        f"![predicted against measured, before and after the fit]({FIGURE})",
        "",
        *error_table(full, cal),
        "",
        f"Held-out steps after the fit: **{median:.1f}% median, {worst_:.0f}% worst**; the "
        f"target is {TARGET[0]:.0f}% and {TARGET[1]:.0f}%: {verdict}.",
        "",
        "The calibrated profile (log residual spread on the fit points "
        f"{cal.fit.log_residual_sd:.3f}):",
        "",
        *fitted(cal.fit.profile),
        "",
        "The held-out steps the model misses most:",
        "",
        *worst(cal),
        "",
        "How far the machine repeats itself: each point's time in each run against its median",
        "over the runs (the same grid and code). A prediction cannot be expected to come closer",
        "to a point than the point comes to itself; the median of the runs comes closer than",
        "any one run.",
        "",
        *repeatability(full_runs, full),
        "",
        f"## The full grid with decode loops of 1, 8 and 32 steps a call ({len(LOOPS)} runs "
        "of the loops grid)",
        "",
        "Every decode point of the full grid runs 8 steps a call, so a call's fixed cost and",
        "its steps' own cost trade against each other in the fit. The `loops` grid",
        "(`python cli.py validate --grid loops`) times decode loops alone, each configuration",
        "at 1, 8 and 32 steps a call; its runs combine with the full grid's and are fitted",
        f"together (`python cli.py validate {with_loops} --fit`): the 8-step loops the two",
        f"grids share are each one's median over the {len(FULL) + len(LOOPS)} runs, a loop of",
        "1 or 32 steps its ratio to the 8-step loop timed beside it (the median over the",
        "loops runs) times that median (`combine_runs`), since a run made on another day can",
        "run at another speed altogether. A configuration's loops are fitted or held out",
        "together.",
        "",
        *each_run(LOOPS, loops_runs),
        "",
        *error_table(both, both_cal),
        "",
        *by_loop(both, both_cal),
        "",
        f"Held-out steps after the fit: **{b_median:.1f}% median, {b_worst:.0f}% worst**; the "
        f"target is {TARGET[0]:.0f}% and {TARGET[1]:.0f}%: {b_verdict}.",
        "",
        "The calibrated profile (log residual spread on the fit points "
        f"{both_cal.fit.log_residual_sd:.3f}):",
        "",
        *fitted(both_cal.fit.profile),
        "",
        "The held-out steps the model misses most:",
        "",
        *worst(both_cal),
        "",
        "## A later day: the fitted profile anchored to the machine's speed",
        "",
        "A profile prices at the speed the machine ran when its runs were timed. The runs",
        "below were timed on a later boot of this machine and priced by the profile fitted",
        "just above; `python cli.py validate --device PROFILE --anchor --save-profile OUT`",
        "times the `anchor` grid (decode loops, prefills and training steps of the three",
        "shapes, about a minute), takes the median of measured over predicted, and scales",
        "every price by it (vocabjax/validation/anchor.py). The anchor was timed before and",
        "after the loops run; the last row is the factor the loops run itself would give.",
        "",
        *later_day(both_cal.fit.profile),
        "",
        "## The later processor's own runs",
        "",
        "The same grids timed on the Intel guest (`python cli.py validate --quick --out ...`,",
        "three times, then the full grid once, back to back on the otherwise idle machine,",
        "the full grid again half an hour later, and a third time an hour after that (a new",
        "session on the same guest),",
        "ceilings measured at the start of each), each fitted as `validate --fit` fits: what a",
        "processor's own calibration gives, beside what the profile fitted on the other",
        "processor's runs gives on the same held-out steps.",
        "",
        *other_processor(both_cal.fit.profile),
        "## A third guest",
        "",
        "The loops grid and the full grid timed on another Intel Xeon guest, the machine",
        "otherwise idle: the loops grid once and the full grid once (2026-12-07, 19:13 and",
        "19:38 UTC), then the full grid twice more in a later session on the same guest (from",
        "21:31 UTC, one after the other, with each point's timed calls' spread recorded),",
        "and a fourth time in a third session (2026-12-08 02:04 UTC).",
        "The test suite runs in 6.3 min there against 9.4-10.8 on the guest of the runs above,",
        "and `lscpu` reports 480 MiB of L3. What a new machine's own runs give its own fit,",
        "beside the profile fitted on the Intel guest's runs above (`profiles/cpu-xeon.json` in",
        "docs/serving.md) pricing the same held-out steps:",
        "",
        *own_fits(
            (
                ("The full grid's first run alone", THIRD_FULL[:1], False),
                (
                    f"The full grid's {len(THIRD_FULL)} runs, each point the median",
                    THIRD_FULL,
                    True,
                ),
                (
                    f"The full grid's {len(THIRD_FULL)} runs and the loops grid's",
                    THIRD_FULL + (THIRD_LOOPS,),
                    False,
                ),
            ),
            second_guest_profile(),
            "the Intel guest's runs above (full and loops)",
        ),
        *one_run_worst(THIRD_FULL[0], OTHER_FULL + FULL + THIRD_FULL[1:]),
        "",
        *noisiest(THIRD_FULL),
        "",
        "### Warm calls",
        "",
        "The same guest's full and loops grids timed twice more each with `validate --warm`",
        "(from 22:21 and from 23:16 UTC, the loops grid first): each point's calls back to",
        "back, nothing between them, as a serving loop calls its steps, where the runs above",
        'write four times the last-level cache before every call (docs/validation.md, "Warm',
        'calls").',
        "",
        *warm_calls(),
        f"## The quick grid, {len(QUICK)} runs",
        "",
        *each_run(QUICK, quick_runs),
        "",
        f"Each point's median over the {len(QUICK)} runs: held-out steps after the fit "
        f"**{q_median:.1f}% median, {q_worst:.0f}% worst**.",
        "",
        *error_table(quick, quick_cal),
        "",
        "Each run against the median:",
        "",
        *repeatability(quick_runs, quick),
    ]
    write_doc("validation_cpu.md", "The cost model against measured runs on this CPU",
              "\n".join(body))  # fmt: skip


if __name__ == "__main__":
    main()
