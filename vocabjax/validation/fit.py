"""``validate --fit``: calibrate the profile on the run's own points (vocabjax.calibration), and
re-price every point with the calibrated profile. The error after is reported on the held-out
points only, which the fit never saw; the error before is shown on the same points beside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from vocabjax.calibration import Fit, Sample, fit_profile
from vocabjax.errors import UserError
from vocabjax.validation.grid import FAMILIES, OP_FAMILIES, STEP_FAMILIES
from vocabjax.validation.prediction import DTYPE, predict
from vocabjax.validation.run import Result, Validation


def sample(r: Result) -> Sample:
    """A point as the fit sees it: each op's work, its launches, and the time of ops priced by
    an autotuned kernel table (which the fit leaves as they are)."""
    ops = [o for o in r.prediction.ops if o.bound != "measured"]
    fixed = sum(o.t for o in r.prediction.ops if o.bound == "measured")
    return Sample(
        key=r.point.label(),
        group=r.point.configuration(),
        family=r.point.family,
        flops=tuple(o.flops for o in ops),
        nbytes=tuple(o.bytes or 0.0 for o in ops),
        launches=r.prediction.launches,
        calls=r.prediction.calls,
        measured_s=r.measured_s,
        fixed_s=fixed,
        kernels=tuple(o.kernels for o in ops),
        kinds=tuple(o.kind for o in ops),
        row_bytes=tuple(o.row_bytes for o in ops),
        working_bytes=sum(o.bytes or 0.0 for o in r.prediction.ops),  # all a step reads
        fresh_bytes=r.prediction.fresh_bytes,
    )


def repriced(r: Result, device, decode_steps: int):
    """``r``'s point priced on ``device``, with the memory its call maps afresh."""
    return predict(r.point, device, decode_steps=decode_steps, fresh_bytes=r.fresh_bytes or 0.0)


FIT_ON: dict[str, tuple[str, ...]] = {
    "steps": STEP_FAMILIES,
    "ops": OP_FAMILIES,
    "all": FAMILIES,
    **{family: (family,) for family in FAMILIES},
}


def fit_families(spec: str) -> tuple[str, ...]:
    """``"steps"``, ``"ops"``, ``"all"`` or a comma list of families -> the families to fit on."""
    out: list[str] = []
    for part in (x.strip() for x in spec.split(",")):
        if part not in FIT_ON:
            raise UserError(
                f"{{fit_on}} {part!r} is not one of {', '.join(FIT_ON)}", settings=["fit_on"]
            )
        out += [f for f in FIT_ON[part] if f not in out]
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Calibrated:
    """The fit of a validation run and its points re-priced by the calibrated profile."""

    fit: Fit
    after: tuple[Result, ...]  # every point, priced by fit.profile

    def is_held_out(self, r: Result) -> bool:
        """Never seen by the fit: in the held-out third, or of a family it was not fitted on."""
        return r.point.label() not in self.fit.fit_keys

    def held_out(self, results: Sequence[Result]) -> list[Result]:
        return [r for r in results if self.is_held_out(r)]


def calibrate(v: Validation, families: Sequence[str] = STEP_FAMILIES) -> Calibrated:
    """Fit ``v.device``'s efficiency tables and overheads on the fit split of the points of
    ``families`` (by default the steps: decode, prefill, train, the times the simulator's
    answers are made of; an op called alone runs colder than inside a step, see
    docs/validation.md)."""
    runs = f" (each point the median of {v.runs} runs)" if v.runs > 1 else ""
    source = (
        f"validate --grid {v.grid.name} on {v.running_on} ({v.host}), {v.date}{runs}; "
        f"fitted on {', '.join(families)}"
    )
    chosen = [sample(r) for r in v.results if r.point.family in families]
    if not chosen:
        raise UserError(f"no points of {', '.join(families)} in grid {v.grid.name!r} to fit on")
    fit = fit_profile(v.device, chosen, dtype=DTYPE, source=source)
    record = {**(fit.profile.calibration or {}), "fitted_families": list(families)}
    fit = dataclasses.replace(fit, profile=dataclasses.replace(fit.profile, calibration=record))
    steps = v.grid.decode_steps
    after = tuple(
        dataclasses.replace(r, prediction=repriced(r, fit.profile, steps)) for r in v.results
    )
    return Calibrated(fit, after)
