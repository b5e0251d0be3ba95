"""Mixed heads: the requests of an admission join a running group whose rows are at other
nested heads, sharing one decode step, or run in a group of their own head, whichever the cost
model says is cheaper for the mix; and running groups that drained merge into one when that is
cheaper.

    pricer = Pricer.of(engine, device, max_rows=32, sampling=Sampling())
    place = pricer.place([Group({1024: 5}, rows=8), Group({4096: 2}, rows=2)], head=1024,
                         joining=3, mixing="auto")
    place.group, place.mixed, place.reason

A group of rows at several heads runs one jitted step over the widest head's ``W[:V_max]``,
each row picking over its own prefix ``W[:V_row]`` (``decode.pick_rows``, a per-row vocabulary
mask): the backbone's weights are read and its kernels launched once for every row, and the
unembedding reads ``V_max`` rows of W once, against each group's own head read for its rows
alone. Separate groups pay the backbone and launches once per group, but a row at a small head
no longer computes logits over the largest head. ``Pricer.place`` prices one decode step of
every running group after the join both ways with the simulator's decode step
(``CostModel.decode_step`` of the run's own shape at the group's widest head and its bucket of
rows, the context being every cache position, which the engine's attention reads) and takes
the cheapest.

Mixing needs nested heads (one matrix whose prefixes are the heads; separate head matrices
have none to mask), one separator for every level, and a token pick that materializes the
logits anyway: ``impl="auto"`` choosing ``xla`` for the group's widest head and rows, so that
the masked pick is the per-head pick's own matmul and every row gets the token its own head
gives it (tested).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from vocabjax import unembed
from vocabjax.costmodel import CostModel
from vocabjax.hardware import DEFAULT_DEVICE, DeviceProfile, load_device
from vocabjax.progress import Progress
from vocabjax.serving.batching import Call, RunningBatch, pow2_rows
from vocabjax.serving.decode import Sampling
from vocabjax.serving.engine import Engine
from vocabjax.serving.pricing import run_model
from vocabjax.xp import PyMath

Mixing = Literal["auto", "mixed", "separate"]
MIXING: tuple[Mixing, ...] = ("auto", "mixed", "separate")


@dataclasses.dataclass(frozen=True)
class Group:
    """A running group as the pricing reads it."""

    mix: Mapping[int, int]  # its live rows: head -> how many
    rows: int  # its bucket of rows

    @property
    def live(self) -> int:
        return sum(self.mix.values())

    @property
    def heads(self) -> list[int]:
        """The heads it holds live rows at."""
        return [v for v, n in self.mix.items() if n > 0]

    def joined(self, head: int, n: int, max_rows: int) -> Group:
        """The group once ``n`` requests at ``head`` have joined (a join grows the bucket to
        the next power of two that holds them all)."""
        mix = dict(self.mix)
        mix[head] = mix.get(head, 0) + n
        return Group(mix, max(self.rows, pow2_rows(self.live + n, max_rows)))


@dataclasses.dataclass(frozen=True)
class Merge:
    """Two running groups that run cheaper as one."""

    into: int  # the group that absorbs the other (an index into the groups given)
    other: int
    seconds: float  # predicted seconds of one decode step of the merged group
    apart: float  # the same for the two groups apart
    reason: str


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the requests of one admission run."""

    group: int | None  # the running group they join (an index into the groups given); None: new
    mixed: bool  # that group then holds rows at more than one head
    seconds: float  # predicted seconds of one decode step of every group after the join
    other: float | None  # the same for the best placement of the other kind; None: none
    reason: str  # one line: the choice and why
    choice: bool  # whether a placement of the other kind was possible (a choice was made)


class Pricer:
    """The cost model of a run's shape on a device, pricing decode steps of groups of rows,
    and what may mix on the run (``of``)."""

    def __init__(
        self,
        model: CostModel,
        *,
        context: int,
        max_rows: int,
        impl: Callable[[int, int], tuple[str, str]] = lambda vocab, rows: ("xla", ""),
        cannot_mix: str | None = None,
    ) -> None:
        self.model = model  # the run's shape on the device the choice is priced on
        self.device = model.device
        self.context = float(context)  # cache positions a decode step's attention reads
        self.max_rows = max_rows  # a group's largest bucket of rows
        self.impl = impl  # (head, rows) -> the token pick's implementation and why
        self.cannot_mix = cannot_mix  # why no rows of different heads may share a step here
        self._seconds: dict[tuple[int, int], float] = {}

    @classmethod
    def of(
        cls, engine: Engine, device: DeviceProfile, *, max_rows: int, sampling: Sampling
    ) -> Pricer:
        """The pricer of ``engine``'s run on ``device``: the run's shape and dtypes
        (``pricing.run_model``), every cache position read (the engine's attention reads them
        all, masked), the token pick ``impl="auto"`` chooses."""
        run = engine.run
        cannot_mix = None
        if run.model.config.heads_kind == "separate":
            cannot_mix = "the run's heads are separate matrices, with no shared prefix"
        elif len({level.separator for level in run.levels}) > 1:
            cannot_mix = "the run's levels stop at different separators"

        def impl(vocab: int, rows: int) -> tuple[str, str]:
            choice = engine.impl_choice(vocab, sampling, rows)
            return choice.impl, choice.reason

        return cls(
            run_model(run, device),
            context=run.max_seq,
            max_rows=max_rows,
            impl=impl,
            cannot_mix=cannot_mix,
        )

    def step_seconds(self, vocab: int, rows: int) -> float:
        """Predicted seconds of one decode step of ``rows`` rows over ``W[:vocab]``."""
        if (vocab, rows) not in self._seconds:
            t = self.model.decode_step(float(vocab), float(rows), self.context, xp=PyMath)
            self._seconds[(vocab, rows)] = float(t)
        return self._seconds[(vocab, rows)]

    def group_seconds(self, group: Group) -> float:
        """One decode step of ``group``: its widest head, its bucket of rows (0: empty)."""
        live = group.heads
        return self.step_seconds(max(live), group.rows) if live else 0.0

    def mask_refused(self, group: Group) -> str | None:
        """Why ``group`` (rows at several heads) may not share one step, or None."""
        if self.cannot_mix is not None:
            return self.cannot_mix
        vocab, rows = max(group.mix), group.rows
        impl, _ = self.impl(vocab, rows)
        if impl != "xla":
            return (
                f"impl auto picks {impl} for head {vocab} at {rows} rows, a pick that takes no "
                "per-row mask"
            )
        return None

    def place(
        self, groups: Sequence[Group], *, head: int, joining: int, mixing: Mixing = "auto"
    ) -> Placement:
        """Where ``joining`` requests at ``head`` run, given the running ``groups``: a group
        with room for them (mixed when it holds other heads, and mixing allowed) or a new one,
        the placement that makes the next decode step of every group cheapest (``mixing``
        "mixed" prefers any mixed placement, "separate" allows none)."""
        base = [self.group_seconds(g) for g in groups]
        total = sum(base)
        options: list[tuple[float, int | None, bool]] = []  # (seconds, group, mixed)
        refused: list[str] = []
        own = False
        for i, group in enumerate(groups):
            if not group.live or group.live + joining > self.max_rows:
                continue
            after = group.joined(head, joining, self.max_rows)
            mixed = len(after.heads) > 1
            if mixed:
                why = "--mixing separate" if mixing == "separate" else self.mask_refused(after)
                if why is not None:
                    refused.append(why)
                    continue
            else:
                own = True
            options.append((total - base[i] + self.group_seconds(after), i, mixed))
        if not own:
            alone = Group({head: joining}, pow2_rows(joining, self.max_rows))
            options.append((total + self.group_seconds(alone), None, False))
        kinds = {mixed for _, _, mixed in options}
        if mixing == "mixed" and True in kinds:
            options = [o for o in options if o[2]]
        # cheapest; on a tie, separate before mixed, then a running group before a new one
        seconds, group, mixed = min(
            options, key=lambda o: (o[0], o[2], o[1] is None, -1 if o[1] is None else o[1])
        )
        others = [s for s, _, m in options if m != mixed]
        other = min(others) if others else None
        return Placement(
            group,
            mixed,
            seconds,
            other,
            self._reason(groups, group, head, joining, seconds, other, mixed, refused, mixing),
            choice=len(kinds) > 1 or bool(refused),
        )

    def merge(self, groups: Sequence[Group], *, mixing: Mixing = "auto") -> Merge | None:
        """The two running groups to merge into one, or None: among the pairs whose requests fit
        one group's rows and may share a step (rows at different heads only when mixing is
        allowed, ``mask_refused``), the one whose merged decode step saves the most against the
        two apart, when it saves anything. A placement looks one step ahead, so a burst can
        leave one head's traffic in two groups that each run half empty; merging them when they
        drain is what keeps their steps few. The larger group absorbs the smaller."""
        best: Merge | None = None
        for i, a in enumerate(groups):
            for j in range(i + 1, len(groups)):
                b = groups[j]
                if not a.live or not b.live or a.live + b.live > self.max_rows:
                    continue
                into, other = (i, j) if a.live >= b.live else (j, i)
                mix = dict(collections.Counter(a.mix) + collections.Counter(b.mix))
                merged = Group(mix, pow2_rows(a.live + b.live, self.max_rows))
                if len(merged.heads) > 1 and (
                    mixing == "separate" or self.mask_refused(merged) is not None
                ):
                    continue
                seconds = self.group_seconds(merged)
                apart = self.group_seconds(a) + self.group_seconds(b)
                saves = apart - seconds
                if saves > 0 and (best is None or saves > best.apart - best.seconds):
                    heads = "+".join(str(v) for v in sorted(merged.mix))
                    reason = (
                        f"groups of {a.live} and {b.live} rows at heads {heads} merge into one of "
                        f"{merged.rows} rows: {_ms(seconds)} per step predicted on "
                        f"{self.device.name}, against {_ms(apart)} apart"
                    )
                    best = Merge(into, other, seconds, apart, reason)
        return best

    def _reason(
        self,
        groups: Sequence[Group],
        group: int | None,
        head: int,
        joining: int,
        seconds: float,
        other: float | None,
        mixed: bool,
        refused: list[str],
        mixing: Mixing,
    ) -> str:
        before = Group({}, 0) if group is None else groups[group]
        joined = before.joined(head, joining, self.max_rows)
        after = {v: n for v, n in joined.mix.items() if n > 0}
        rows = joined.rows
        heads = "+".join(str(v) for v in sorted(after))
        where = f"on {self.device.name}"
        if mixed:
            what = f"heads {heads} share one step at {max(after)} ({rows} rows)"
            if mixing == "mixed":
                return f"{what}: --mixing mixed"
            return (
                f"{what}: {_ms(seconds)} per step predicted {where}, against "
                f"{_ms(other)} as separate groups"
            )
        what = f"head {head} runs in its own group ({rows} rows)"
        if refused:
            return f"{what}: no mixed step ({refused[0]})"
        if other is None:
            return what
        return (
            f"{what}: {_ms(seconds)} per step predicted {where}, against {_ms(other)} with "
            "heads mixed in one step"
        )


class Placer:
    """Places each admission in a running group by the pricer (``Pricer.place``), starting a
    group when none is chosen, and logs a choice between mixing heads and separate groups when
    it is new or changed for those heads: what the trace loop (``continuous.py``) calls."""

    def __init__(self, pricer: Pricer, mixing: Mixing, log: Progress) -> None:
        self.pricer, self.mixing, self.log = pricer, mixing, log
        self._said: dict[frozenset[int], bool] = {}  # the heads of a choice -> mixed, as logged
        self._merged: set[frozenset[int]] = set()  # the heads of merges logged

    def __call__(
        self,
        groups: list[RunningBatch],
        head: int,
        joining: int,
        new: Callable[[], RunningBatch],
    ) -> tuple[Placement, RunningBatch]:
        """The placement of ``joining`` requests at ``head`` among ``groups`` (a new group,
        made by ``new``, is appended to them) and the group they join."""
        live = [b for b in groups if b.live]
        place = self.pricer.place(
            [Group(b.mix, b.rows) for b in live], head=head, joining=joining, mixing=self.mixing
        )
        if place.group is None:
            batch = new()
            groups.append(batch)
        else:
            batch = live[place.group]
        if place.choice:
            heads = frozenset({head, *(v for b in live for v in b.mix)})
            if self._said.get(heads) != place.mixed:
                self._said[heads] = place.mixed
                self.log(f"  {place.reason}")
        return place, batch

    def consolidate(self, groups: list[RunningBatch]) -> list[Call]:
        """Merge running groups while the pricer says a pair runs cheaper as one
        (``Pricer.merge``); the absorbed groups leave ``groups``. The merges' device calls."""
        calls = []
        while True:
            live = [b for b in groups if b.live]
            merge = self.pricer.merge([Group(b.mix, b.rows) for b in live], mixing=self.mixing)
            if merge is None:
                return calls
            into, other = live[merge.into], live[merge.other]
            calls.append(into.absorb(other))
            groups.remove(other)
            heads = frozenset(into.mix)
            if heads not in self._merged:
                self._merged.add(heads)
                self.log(f"  {merge.reason}")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.3g} ms"


def default_device() -> tuple[DeviceProfile, str]:
    """The device mixing is priced on when none is given: the profile ``impl="auto"`` reads
    (``$VOCABJAX_DEVICE_PROFILE``), else the default device's datasheet; and where it came
    from."""
    profile = unembed.device_profile()
    if profile is not None:
        return profile, f"the unembedding selector's profile (${unembed.PROFILE_ENV})"
    return load_device(DEFAULT_DEVICE), f"no device profile given: the {DEFAULT_DEVICE} datasheet"
