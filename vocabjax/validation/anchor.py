"""``validate --anchor``: scale a profile to the speed its machine runs at today.

A calibrated profile prices at the speed the machine ran when its runs were timed, and a shared
machine drifts: the same 8-step decode loops ran 1.37x and 1.54x as long a day after the full
grid's runs (docs/validation.md), more than the fit's own error. Anchoring times a handful of
steps now (the ``anchor`` grid: decode loops, prefills and training steps of three shapes, about
a minute), takes the median of measured over predicted across them, and multiplies every time
the profile prices by it:

    s = median_i(measured_i / predicted_i)        peak / s, bandwidth / s, fresh bandwidth / s,
                                                  launch x s, dispatch x s, kernel times x s

Every time the cost model gives is linear in those (the efficiency tables are read at an op's
FLOPs, bytes and intensity, which do not change), so the anchored profile prices each point
exactly ``s`` times the original; the ridge point and the V* a sweep picks at lambda = 0 stay.
The fit's shape (which op is slow against which) is kept; only the machine's overall speed
moves. The anchor's date, factor and the spread of its points' ratios go into the profile's
calibration record and its source, so every output that names the profile says it.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from vocabjax.errors import UserError
from vocabjax.hardware import DeviceProfile
from vocabjax.validation.grid import STEP_FAMILIES
from vocabjax.validation.run import Result, Validation

MIN_ANCHOR_POINTS = 3  # a median of fewer says little about the machine's speed


@dataclasses.dataclass(frozen=True)
class Anchor:
    """The speed factor of a validation's step points against the profile that priced them."""

    factor: float  # median of measured / predicted: > 1 when the machine runs slower today
    ratios: tuple[float, ...]  # measured / predicted of each step point, in grid order
    labels: tuple[str, ...]
    date: str  # when the anchor points were timed

    @property
    def quartiles(self) -> tuple[float, float]:
        """The ratios' first and third quartiles (their median is ``factor``)."""
        if len(self.ratios) < 2:
            return self.factor, self.factor
        q = statistics.quantiles(self.ratios, n=4, method="inclusive")
        return q[0], q[2]

    def record(self) -> dict[str, Any]:
        low, high = self.quartiles
        return {
            "date": self.date,
            "factor": self.factor,
            "points": len(self.ratios),
            "ratio_quartiles": [low, high],
            "ratio_range": [min(self.ratios), max(self.ratios)],
        }

    def line(self) -> str:
        low, high = self.quartiles
        return (
            f"anchored {self.date}: times x{self.factor:.3f} (median of {len(self.ratios)} "
            f"steps' measured / predicted; quartiles {low:.3f}-{high:.3f}, range "
            f"{min(self.ratios):.3f}-{max(self.ratios):.3f})"
        )


def anchor_of(v: Validation) -> Anchor:
    """The speed factor of ``v``'s step points (decode, prefill, train) against ``v.device``."""
    steps: Sequence[Result] = [r for r in v.results if r.point.family in STEP_FAMILIES]
    if len(steps) < MIN_ANCHOR_POINTS:
        raise UserError(
            f"--anchor needs at least {MIN_ANCHOR_POINTS} step points (decode, prefill, "
            f"train) to take a median over; grid {v.grid.name!r} has {len(steps)}"
        )
    ratios = tuple(r.measured_s / r.prediction.predicted_s for r in steps)
    labels = tuple(r.point.label() for r in steps)
    return Anchor(statistics.median(ratios), ratios, labels, v.date)


def anchored(device: DeviceProfile, anchor: Anchor) -> DeviceProfile:
    """``device`` pricing every time ``anchor.factor`` times as long (module docstring)."""
    s = anchor.factor
    if not s > 0.0:
        raise UserError(f"anchor factor {s!r} must be > 0")
    previous = (device.calibration or {}).get("anchor")
    total = s * (previous["total_factor"] if previous else 1.0)
    record = {**anchor.record(), "total_factor": total}
    kernel = lambda k: dataclasses.replace(k, time_s=k.time_s * s)  # noqa: E731
    return dataclasses.replace(
        device,
        peak_flops={k: v / s for k, v in device.peak_flops.items()},
        hbm_bandwidth=device.hbm_bandwidth / s,
        fresh_bandwidth=device.fresh_bandwidth / s,
        launch_overhead_s=device.launch_overhead_s * s,
        dispatch_overhead_s=device.dispatch_overhead_s * s,
        kernels=tuple(kernel(k) for k in device.kernels),
        best=tuple(kernel(k) for k in device.best),
        calibration={**(device.calibration or {}), "anchor": record},
        source=f"{_unanchored(device.source)}; {anchor.line()}"
        + (f", x{total:.3f} in all since the fit" if previous else ""),
    )


def _unanchored(source: str) -> str:
    """``source`` without an earlier anchor's note (the record keeps the product)."""
    head, sep, _ = source.partition("; anchored ")
    return head if sep else source
