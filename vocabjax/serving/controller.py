"""The quality controller: move the served vocabulary level up or down when the windowed bits
per byte of the prompts leave a band, with hysteresis.

The router picks a head per batch from the policy (the cost side); the controller shifts that
choice by an offset in levels (the quality side). It watches the prompt bits per byte of the
requests served at its current offset:

    window full and mean > high  ->  one level up    (larger V: the traffic is harder than the
                                                      text the run was measured on)
    window full and mean < low   ->  one level down  (smaller V: the traffic is easy; save cost)

and after a move it clears the window, so the next move waits for ``window`` requests served
at the new offset (dwell); values served at an older offset are not counted. ``low < high``
is the hysteresis band: values oscillating inside it never move the level. The offset stays
within ``[lowest, highest]``: at a bound the window keeps sliding and nothing moves.

The controller is one pure function of (state, observation) -> (state, decision),
``controller_step``, written against an array namespace: ``QualityController`` is its thin host
caller on numpy, and the same function runs under ``jax.jit`` (or in a ``lax.scan`` over a
recorded sequence; tested equal to the host).

Default thresholds come from the run's own measurement (``training.json``: the held-out bits
per byte of each head): ``high = (1 + band) * max_h bpb_h`` and ``low = (1 - band) * min_h
bpb_h``, so text like the held-out text keeps the level at every head, and one level's change
of bits per byte (the spread between heads) cannot by itself undo the move that caused it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np

from vocabjax.errors import UserError
from vocabjax.train import TRAINING_FILE
from vocabjax.trainprofile import load_training

DEFAULT_BAND = 0.1  # thresholds 10% beyond the heads' held-out bits per byte
DEFAULT_WINDOW = 16  # requests per windowed value


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """The band of windowed bits per byte inside which the controller keeps its level."""

    high: float  # above: one level up (larger V)
    low: float  # below: one level down (smaller V)
    source: str  # one line: where the numbers came from

    def __post_init__(self) -> None:
        for name in ("high", "low"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
                raise UserError(f"bpb {name}={x!r} must be a finite number")
            if x <= 0:
                raise UserError(f"bpb {name}={x!r} must be > 0 (bits per byte)")
        if self.low >= self.high:
            raise UserError(
                f"bpb low={self.low:g} must be below high={self.high:g} (the band between them "
                "is the hysteresis)"
            )

    def to_json(self) -> dict[str, float | str]:
        return {"high": self.high, "low": self.low, "source": self.source}


def training_bpb(run_dir: str | Path, heads: Sequence[int]) -> dict[int, float] | None:
    """Held-out bits per byte per head from the run's ``training.json``; None when the run
    holds none (``train`` writes it after the last step; a run trained with measuring off has
    none). A corrupt file is one UserError."""
    path = Path(run_dir) / TRAINING_FILE
    if not path.is_file():
        return None
    profile = load_training(path)
    if profile.bpb is None:
        return None
    found = {v: b for v, b in zip(profile.vocab, profile.bpb, strict=True) if v in heads}
    return found or None


def derive_thresholds(
    heldout: dict[int, float] | None,
    *,
    high: float | None = None,
    low: float | None = None,
    band: float = DEFAULT_BAND,
    where: str = "the run",
) -> Thresholds | None:
    """The controller's band: given values win, the others come from the held-out bits per
    byte ``high = (1 + band) max``, ``low = (1 - band) min``. None (controller off) when a
    value is missing and there is nothing to derive it from."""
    if not (isinstance(band, int | float) and 0 < band < 1):
        raise UserError(f"bpb band={band!r} must be in (0, 1)")
    if heldout is None:
        if high is None and low is None:
            return None
        if high is None or low is None:
            given, missing = ("low", "high") if high is None else ("high", "low")
            raise UserError(
                f"{{bpb_{given}}} given without {{bpb_{missing}}}, and {where} has no held-out "
                "bits per byte (training.json) to derive it from: give both",
                settings=[f"bpb_{given}", f"bpb_{missing}"],
            )
        return Thresholds(high=high, low=low, source="given")
    heads = ", ".join(f"{v}: {b:.3f}" for v, b in sorted(heldout.items()))
    derived = f"held-out bpb of {where} ({heads}) -/+ {band:.0%}"
    out_high = (1 + band) * max(heldout.values()) if high is None else high
    out_low = (1 - band) * min(heldout.values()) if low is None else low
    if high is None and low is None:
        source = derived
    elif high is not None and low is not None:
        source = "given"
    else:
        source = f"{'high' if high is not None else 'low'} given, the other from the {derived}"
    return Thresholds(high=out_high, low=out_low, source=source)


Direction = Literal["up", "down"]


@dataclasses.dataclass(frozen=True)
class Move:
    """One level move of the controller."""

    direction: Direction
    from_offset: int
    to_offset: int
    window_mean: float  # the windowed bits per byte that crossed a threshold
    reason: str  # one line for the switch log


# ---- the controller as a pure function ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    """What the controller's step is specialised to (static under jit)."""

    high: float  # a full window above: one level up
    low: float  # a full window below: one level down
    window: int  # values per windowed mean
    lowest: int  # the offset never goes below
    highest: int  # nor above


class ControllerState(NamedTuple):
    """The controller's state as arrays: its offset and its window, a ring of the last values
    served at that offset (slots 0..count-1 hold them until the ring is full)."""

    offset: Any  # int: the level shift
    values_w: Any  # (window,) bits per byte
    weights_w: Any  # (window,) their weights
    count: Any  # int: values in the window since the last move, at most window
    next: Any  # int: the slot the next value goes to


class Observation(NamedTuple):
    """One served request, as the controller sees it."""

    bpb: Any  # its prompt's bits per byte
    offset: Any  # the offset it was served at
    weight: Any  # its weight (the server gives the prompt's bytes)


class Decision(NamedTuple):
    """What the controller made of one observation."""

    counted: Any  # bool: it entered the window (served at the current offset, finite)
    move: Any  # int: +1 one level up, -1 one level down, 0 none
    mean: Any  # the windowed mean after it, before a move clears the window (nan: empty)


def controller_init(config: ControllerConfig, *, xp=np) -> ControllerState:
    """Offset 0 and an empty window (``xp``: numpy on the host, jax.numpy under jit)."""
    zeros_w = xp.zeros((config.window,), xp.float32 if xp is not np else np.float64)
    zero = xp.asarray(0, xp.int32)
    return ControllerState(zero, zeros_w, zeros_w, zero, zero)


def window_mean(state: ControllerState, *, xp=np) -> Any:
    """The weighted mean of the values in the window, sum of w x / sum of w; nan when empty."""
    valid_w = xp.arange(state.values_w.shape[0]) < state.count
    total = xp.sum(xp.where(valid_w, state.weights_w, 0.0))
    bits = xp.sum(xp.where(valid_w, state.weights_w * state.values_w, 0.0))
    return xp.where(total > 0, bits / xp.where(total > 0, total, 1.0), xp.nan)


def controller_step(
    config: ControllerConfig, state: ControllerState, obs: Observation, *, xp=np
) -> tuple[ControllerState, Decision]:
    """One observation: a value served at the current offset enters the window; a full window
    whose mean is above ``high`` (below ``low``) moves one level up (down) within the offset
    bounds and clears the window. Pure: numpy or, jitted, jax.numpy (``xp``)."""
    counted = (obs.offset == state.offset) & xp.isfinite(obs.bpb)
    slot_w = (xp.arange(config.window) == state.next) & counted
    state = state._replace(
        values_w=xp.where(slot_w, obs.bpb, state.values_w),
        weights_w=xp.where(slot_w, obs.weight, state.weights_w),
        count=xp.where(counted, xp.minimum(state.count + 1, config.window), state.count),
        next=xp.where(counted, (state.next + 1) % config.window, state.next),
    )
    mean = window_mean(state, xp=xp)
    full = counted & (state.count == config.window)
    up = full & (mean > config.high) & (state.offset < config.highest)
    down = full & ~up & (mean < config.low) & (state.offset > config.lowest)
    move = xp.where(up, 1, xp.where(down, -1, 0)).astype(xp.int32)
    moved = move != 0
    state = state._replace(
        offset=(state.offset + move).astype(xp.int32),
        count=xp.where(moved, 0, state.count).astype(xp.int32),
        next=xp.where(moved, 0, state.next).astype(xp.int32),
    )
    return state, Decision(counted, move, mean)


class QualityController:
    """Windowed-mean hysteresis on prompt bits per byte; no model. A thin host caller of
    ``controller_step`` (numpy), which a jitted loop can run as it is.

    ``observe(bpb, offset, weight)`` takes one served request's bits per byte, the offset it
    was served at and its weight (the server passes the prompt's bytes, so that the windowed
    value is the bits per byte of the window's text, sum of bits / sum of bytes, as train's
    held-out bpb is; default 1: the plain mean), and returns the Move it caused or None.
    ``offset`` is the current level shift.
    """

    def __init__(
        self, thresholds: Thresholds, *, window: int = DEFAULT_WINDOW, lowest: int, highest: int
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise UserError(f"window={window!r} must be a positive integer (requests)")
        if not lowest <= 0 <= highest:
            raise UserError(f"offset bounds {lowest=}, {highest=} must include 0")
        self.thresholds = thresholds
        self.window = window
        self.lowest = lowest
        self.highest = highest
        self.config = ControllerConfig(thresholds.high, thresholds.low, window, lowest, highest)
        self.state = controller_init(self.config)

    @property
    def offset(self) -> int:
        return int(self.state.offset)

    @property
    def window_mean(self) -> float | None:
        """The weighted mean of the values now in the window (None when it is empty)."""
        return float(window_mean(self.state)) if self.state.count else None

    @property
    def filled(self) -> int:
        return int(self.state.count)

    def observe(self, bpb: float, offset: int, weight: float = 1.0) -> Move | None:
        if not (weight > 0 and math.isfinite(weight)):
            raise UserError(f"weight={weight!r} must be a finite number > 0")
        before = self.offset
        obs = Observation(np.float64(bpb), np.int32(offset), np.float64(weight))
        self.state, decision = controller_step(self.config, self.state, obs)
        if not decision.move:
            return None
        mean = float(decision.mean)
        t = self.thresholds
        direction: Direction = "up" if decision.move > 0 else "down"
        why = (
            f"windowed BPB {mean:.3f} > high {t.high:.3f}"
            if direction == "up"
            else f"windowed BPB {mean:.3f} < low {t.low:.3f}"
        )
        return Move(
            direction,
            before,
            self.offset,
            mean,
            f"{why} over the last {self.window} requests: one level {direction} "
            f"(offset {before:+d} -> {self.offset:+d})",
        )
