"""``validate --fit``: calibrate the profile on the run's own points (vocabjax.calibration), and
re-price every point with the calibrated profile. The error after is reported on the held-out
points only, which the fit never saw; the error before is shown on the same points beside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from vocabjax.calibration import Fit, Sample, fit_profile, is_held_out
from vocabjax.validation.prediction import DTYPE, predict
from vocabjax.validation.run import Result, Validation


def sample(r: Result) -> Sample:
    """A point as the fit sees it: each op's work, its launches, and the time of ops priced by
    an autotuned kernel table (which the fit leaves as they are)."""
    ops = [o for o in r.prediction.ops if o.bound != "measured"]
    fixed = sum(o.t for o in r.prediction.ops if o.bound == "measured")
    return Sample(
        key=r.point.label(),
        family=r.point.family,
        flops=tuple(o.flops for o in ops),
        nbytes=tuple(o.bytes or 0.0 for o in ops),
        launches=r.prediction.launches,
        calls=r.prediction.calls,
        measured_s=r.measured_s,
        fixed_s=fixed,
        kernels=tuple(o.kernels for o in ops),
        kinds=tuple(o.kind for o in ops),
    )


@dataclasses.dataclass(frozen=True)
class Calibrated:
    """The fit of a validation run and its points re-priced by the calibrated profile."""

    fit: Fit
    after: tuple[Result, ...]  # every point, priced by fit.profile

    def held_out(self, results: Sequence[Result]) -> list[Result]:
        return [r for r in results if is_held_out(r.point.label())]


def calibrate(v: Validation) -> Calibrated:
    """Fit ``v.device``'s efficiency tables and launch overhead on the fit split of ``v``."""
    source = f"validate --grid {v.grid.name} on {v.running_on} ({v.host}), {v.date}"
    fit = fit_profile(v.device, [sample(r) for r in v.results], dtype=DTYPE, source=source)
    steps = v.grid.decode_steps
    after = tuple(
        Result(
            r.point, predict(r.point, fit.profile, decode_steps=steps), r.measured_s, r.compile_s
        )
        for r in v.results
    )
    return Calibrated(fit, after)
