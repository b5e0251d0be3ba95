"""Serving a trace with continuous batching on the virtual clock: requests join a head's running
batch between decode steps and leave when they stop, within the KV plan's memory.

Each round, at the clock's ``now``:

1. the requests that have arrived by ``now`` wait, in arrival order; with none waiting and none
   running, the clock jumps to the next arrival;
2. admission: the router takes the policy's route for B = the requests running at every head
   plus those waiting (at most ``max_batch``), shifted by the controller's offset; the waiting
   requests are admitted at that head first come first served while it runs fewer than
   ``min(max_batch, b_max(head))`` and every head's KV reservations fit the budget
   (``admission.admit_count``), and join a running group: one of their own head, or one whose
   rows are at other heads (one decode step for all, each row over its own prefix of W), or a
   new one, whichever the cost model prices cheapest for the next decode step of every group
   (``mixing.Pricer.place``; ``ServeConfig.mixing`` can force either). They are prefilled
   together (the running rows are not recomputed), and each prompt's bits per byte goes to the
   quality controller. When more requests wait than rows are free, up to
   ``ServeConfig.prefill_ahead`` of them are prefilled in that one call (within the KV budget
   and b_max: a staged cache is held memory) and the ones without a row are staged
   (``staging.py``, shared with the live server): they join, first come first served, as rows
   free at their head, ahead of any new prefill there (the waiting requests routed to another
   head are prefilled meanwhile), so prefills run at many rows instead of the one or two a
   stop frees. A request that waits for memory is logged once and counted;
3. decoding: every group with running requests runs ``RunningBatch.advance(k)`` (its on-device
   loop), which ends early when a request stops. k runs to the step at which a request stops
   when requests are waiting or staged (a stop frees a row and its memory), else to about the next
   arrival (the time left over the last measured seconds per step, at least 1). Then groups
   whose requests now fit one group merge where the cost model prices one step of the merged
   group below the two apart (``mixing.Placer.consolidate``).

Every device call advances the clock by its measured wall time, compiling a new shape and its
warm-up call left out (reported as ``compile_s``), as in static batching. A request's start is
when it joined, its finish the end of the call in which it stopped. A sampled request i (in
order of arrival) draws with ``solo_key(request_seed(seed, i))``: it gets the tokens
``Engine.generate`` gives it alone with that seed, whatever it shares a batch with.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from vocabjax.errors import UserError
from vocabjax.hardware import DeviceProfile
from vocabjax.progress import Progress
from vocabjax.serving.admission import MemoryPlan, Wait, admit_count, human_bytes
from vocabjax.serving.batching import (
    Call,
    Finished,
    Joined,
    Joining,
    RunningBatch,
    Staged,
    prefill,
    solo_key,
)
from vocabjax.serving.cadence import Cadence
from vocabjax.serving.engine import Engine, bucket_length
from vocabjax.serving.mixing import Placement, Placer, Pricer
from vocabjax.serving.records import (
    ServeConfig,
    ServedBatch,
    ServedChunk,
    ServedRequest,
    _mean,
    _Record,
)
from vocabjax.serving.router import RoutedBatch, Routes, route_batch
from vocabjax.serving.staging import Stages, ahead, may_stage
from vocabjax.serving.trace import Request


def request_seed(seed: int, index: int) -> int:
    """The sampling seed of request ``index`` (in order of arrival) of a run seeded ``seed``."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


@dataclasses.dataclass(frozen=True)
class _Held:
    """A request running at a head, as it joined."""

    head: int
    kv_bytes: int  # the cache it reserves
    start_s: float  # when it joined a row
    batch: int  # the admission that prefilled it
    offset: int
    prompt_tokens: int
    prompt_bpb: float | None  # None: not scored
    window_bpb: float | None
    running: int  # requests running at its head once it joined


class Continuous:
    """The continuous loop's state: the queue, the running batches, what they hold."""

    def __init__(
        self,
        engine: Engine,
        queue: Sequence[Request],
        routes: Routes,
        config: ServeConfig,
        record: _Record,
        plan: MemoryPlan,
        log: Progress,
        device: DeviceProfile,
    ) -> None:
        self.engine, self.queue, self.routes, self.config = engine, queue, routes, config
        self.record, self.plan, self.log = record, plan, log
        self.heads = record.heads
        self.run = engine.run
        self.now = 0.0
        self.upcoming = 0  # the first request that has not arrived by now
        self.waiting: collections.deque[int] = collections.deque()
        self.groups: list[RunningBatch] = []  # running groups, each at one head or several
        self.numbers: dict[RunningBatch, int] = {}  # each group's number, in order of creation
        self.held: dict[int, _Held] = {}  # requests in rows
        self.staged: dict[int, _Held] = {}  # requests prefilled ahead, without a row yet
        self.stages = Stages()  # their prefills, in order
        self.memory_waits: set[int] = set()
        # (head, rows, mixed) -> the last measured seconds per decode step
        self.per_step: dict[tuple[int, int, bool], float] = {}
        self._ids: dict[tuple[int, int], np.ndarray] = {}
        pricer = Pricer.of(engine, device, max_rows=config.max_batch, sampling=config.sampling)
        self.placer = Placer(pricer, config.mixing, log)
        self.cadence = Cadence(pricer, self.run.max_seq)

    # ---- the loop -----------------------------------------------------------------------------

    def serve(self) -> None:
        n = len(self.queue)
        while self.upcoming < n or self.waiting or self.held or self.stages:
            while self.upcoming < n and self.queue[self.upcoming].arrival_s <= self.now:
                self.waiting.append(self.upcoming)
                self.upcoming += 1
            if not self.waiting and not self.held and not self.stages:
                self.now = self.queue[self.upcoming].arrival_s
                continue
            if self.waiting or self.stages:
                self.admit()
            if self.held:
                self.decode()

    def admit(self) -> None:
        """Staged requests join as rows free; then the waiting requests that fit are prefilled
        at the routed head unless requests are staged there, those with a row joining its
        running batch."""
        self._join_stages()
        if self.waiting:
            self._prefill()

    def _join_stages(self) -> None:
        """Staged requests join rows at their head, in order, while rows are free."""

        def join(staged: Staged, m: int) -> None:
            _, _, _, finished, calls = self._join(staged, m)
            self._chunks(calls)
            self._finish(finished)

        self.stages.join(lambda s: self.config.max_batch - self.running_at(s.head), join)

    def _prefill(self) -> None:
        """The waiting requests that fit are prefilled together at the routed head, and those
        with a row join its running batch; when more wait than rows are free, up to
        ``prefill_ahead`` in all are prefilled, the rest staged."""
        config, plan = self.config, self.plan
        load = min(len(self.held) + len(self.waiting), config.max_batch)
        route = route_batch(self.heads, self.routes, batch=load, offset=self.record.offset)
        head = route.head
        if head in self.stages.heads:  # its staged requests join first
            return
        need = [plan.sequence_bytes(len(self.ids(i, head)), self.limit(i)) for i in self.waiting]
        n, wait = admit_count(
            need,
            held_bytes=self.kv_bytes,
            running=self.running_at(head),
            max_batch=config.max_batch,
            b_max=plan.b_max[head],
            kv_budget=plan.kv_budget,
        )
        if n == 0:
            if wait == "memory":
                self._wait_for_memory(list(self.waiting), head, need[0], alone=True)
            return
        ahead = self._ahead(need, n, wait, head)
        admitted = [self.waiting[p] for p in range(n)] + [self.waiting[p] for p in ahead]
        taken = set(admitted)
        self.waiting = collections.deque(i for i in self.waiting if i not in taken)
        reserved = [need[p] for p in range(n)] + [need[p] for p in ahead]
        k = len(self.record.batches)
        self.record.route(self.now, load, k)  # the same decision, kept: they join
        start = self.now
        joining = [
            Joining(i, self.ids(i, head), self.limit(i), self.key(i), config.sampling)
            for i in admitted
        ]
        staged, first = prefill(self.engine, joining, head, config.score_prompts)
        bpbs = [self._stage(j, kv, route, k) for j, kv in zip(staged.joined, reserved, strict=True)]
        place, batch, running, finished, calls = self._join(staged, n)
        calls = [first, *calls]
        self._charge(calls)
        self.stages.add(staged)
        self._record_admission(
            k, start, calls, route, len(admitted), _mean(bpbs), running, batch, place
        )
        if wait == "memory":  # said once the others have joined: what they hold
            self._wait_for_memory(list(self.waiting), head, need[n], alone=False)
        self._finish(finished)
        if (k + 1) % config.progress_every == 0:
            self.log(self.record.progress_line(len(self.queue), self.now))

    def _join(
        self, staged: Staged, m: int
    ) -> tuple[Placement, RunningBatch, int, list[Finished], list[Call]]:
        """The next ``m`` of ``staged`` join rows at its head now: where they run, the batch,
        the requests running at the head with them (some may stop at once), the requests that
        stopped at their first token and the device calls (not yet charged)."""
        start = self.now
        place, batch = self._place(staged.head, m)
        running = self.running_at(staged.head) + m
        joined, finished, calls = batch.join_staged(staged, m)
        for j in joined:
            self._take(j.tag, start, running)
        return place, batch, running, finished, calls

    def _record_admission(
        self,
        k: int,
        start: float,
        calls: Sequence[Call],
        route: RoutedBatch,
        n: int,
        mean_bpb: float | None,
        running: int,
        batch: RunningBatch,
        place: Placement,
    ) -> None:
        """Admission ``k``: ``n`` requests joined ``batch`` at ``route``'s head by ``calls``."""
        join = next(c for c in calls if c.kind == "join")
        choice = self.engine.impl_choice(route.head, self.config.sampling, join.rows)
        self.record.batches.append(
            ServedBatch(
                index=k,
                start_s=start,
                service_s=sum(c.seconds for c in calls),
                compile_s=sum(c.compile_s for c in calls),
                batch=n,
                rows=join.rows,
                bucket=join.bucket,
                routed_head=route.routed.vocab,
                offset=route.offset,
                head=route.head,
                impl=choice.impl,
                impl_reason=choice.reason,
                new_tokens=0,  # known once its requests stop (``result``)
                mean_bpb=mean_bpb,
                running=running,
                kv_bytes=self.kv_bytes,
                group=self.numbers[batch],
                mixed=place.mixed,
                grouping=place.reason,
            )
        )

    def _ahead(self, need: Sequence[int], n: int, wait: Wait | None, head: int) -> list[int]:
        """Which more waiting requests (positions in the queue past the ``n`` that get a row)
        are prefilled now and staged (``staging.ahead``: up to ``prefill_ahead`` in all, of
        the ``n``'s padded length, within the KV budget and b_max)."""
        if not may_stage(wait, self.config.prefill_ahead, n):
            return []  # the queue's prompts need not be encoded at this head
        max_seq = self.run.max_seq
        buckets = [bucket_length(len(self.ids(i, head)), max_seq) for i in self.waiting]
        picks = ahead(
            max(buckets[:n]),
            buckets[n:],
            need[n:],
            joining=n,
            wait=wait,
            most=self.config.prefill_ahead,
            held_bytes=self.kv_bytes + sum(need[:n]),
            running=self.running_at(head) + n,
            b_max=self.plan.b_max[head],
            kv_budget=self.plan.kv_budget,
        )
        return [n + p for p in picks]

    def _stage(self, j: Joined, kv: int, route: RoutedBatch, k: int) -> float | None:
        """A prefilled request is staged with its KV bytes (held memory from now), and its
        prompt's bits per byte (the quality controller's observation, returned; None when
        prompts are not scored) recorded for batch ``k``."""
        prompt = self.queue[j.tag].prompt.encode("utf-8")
        bpb = window = None
        if j.prompt_nats is not None:
            bpb = j.prompt_nats / (math.log(2) * len(prompt))
            window = self.record.observe(bpb, len(prompt), route, k, self.now)
        self.staged[j.tag] = _Held(
            route.head, kv, self.now, k, route.offset, j.prompt_tokens, bpb, window, 0
        )
        return bpb

    def _take(self, tag: int, start: float, running: int) -> None:
        """A staged request joined a row at ``start``, ``running`` at its head with it."""
        self.held[tag] = dataclasses.replace(self.staged.pop(tag), start_s=start, running=running)

    def decode(self) -> None:
        """Every group with running requests runs its on-device loop for k steps at most, to
        the stops worth waiting for (``cadence``)."""
        k = self._steps()
        for batch in [b for b in self.groups if b.live]:
            finished, calls = batch.advance(k, self._stops(batch))
            self._chunks(calls)
            self._finish(finished)
        self.groups = [b for b in self.groups if b.live]  # an emptied group is dropped
        self._chunks(self.placer.consolidate(self.groups))  # drained groups that run cheaper as one

    def _chunks(self, calls: Sequence[Call]) -> None:
        """Record and charge the device calls of running groups between admissions."""
        held, kv = len(self.held), self.kv_bytes
        for c in calls:
            self.record.chunks.append(
                ServedChunk(
                    index=len(self.record.chunks),
                    kind=c.kind,
                    start_s=self.now,
                    service_s=c.seconds,
                    compile_s=c.compile_s,
                    head=c.head,
                    rows=c.rows,
                    running=c.running,
                    steps=c.steps,
                    new_tokens=c.tokens,
                    held=held,
                    kv_bytes=kv,
                    mixed=c.mixed,
                )
            )
            if c.steps:
                self.per_step[(c.head, c.rows, c.mixed)] = c.seconds / c.steps
            self._charge([c])

    def _stops(self, batch: RunningBatch) -> int:
        """The stops ``batch``'s decode call waits for: one unless requests wait or are
        staged for rows, else as ``cadence`` prices it on the loop's device."""
        if not self.config.priced_stops:
            return 1
        return self.cadence.stops(batch, len(self.waiting) + self.stages.left)

    def _steps(self) -> int:
        """Decode steps before the host looks again: to the next stop while requests wait or
        are staged, else to about the next arrival."""
        longest = self.run.max_seq
        if self.waiting or self.stages or self.upcoming >= len(self.queue):
            return longest
        live = [b for b in self.groups if b.live]
        per_step = sum(self.per_step.get((b.vocab, b.rows, b.mixed), 0.0) for b in live)
        if per_step <= 0:
            return 1
        gap = self.queue[self.upcoming].arrival_s - self.now
        return int(min(max(gap / per_step, 1), longest))

    # ---- bookkeeping --------------------------------------------------------------------------

    def running_at(self, head: int) -> int:
        """The requests running at ``head``, in every group."""
        return sum(h.head == head for h in self.held.values())

    @property
    def kv_bytes(self) -> int:
        """The KV cache every running or staged request reserves."""
        return sum(h.kv_bytes for h in self.held.values()) + sum(
            h.kv_bytes for h in self.staged.values()
        )

    def ids(self, i: int, head: int) -> np.ndarray:
        if (i, head) not in self._ids:
            self._ids[(i, head)] = self.engine.encode([self.queue[i].prompt], head)[0]
        return self._ids[(i, head)]

    def limit(self, i: int) -> int:
        return self.queue[i].max_new_tokens or self.config.max_new_tokens

    def key(self, i: int):
        return solo_key(request_seed(self.config.sampling.seed, i))

    def _place(self, head: int, n: int) -> tuple[Placement, RunningBatch]:
        """The group ``n`` requests at ``head`` join (``mixing.Placer``), numbered when new."""

        def new() -> RunningBatch:
            batch = RunningBatch(
                self.engine,
                head,
                max_rows=self.config.max_batch,
                score=self.config.score_prompts,
            )
            self.numbers[batch] = len(self.numbers)
            return batch

        return self.placer(self.groups, head, n, new)

    def _charge(self, calls: Sequence[Call]) -> None:
        """The clock advances by each call's service time; a new shape's compiling is logged."""
        self.record.calls.extend(calls)
        for c in calls:
            self.now += c.seconds
            if c.compile_s:
                self.log(f"  {c.compiled_line()} (not charged to the clock)")

    def _wait_for_memory(self, blocked: list[int], head: int, need: int, *, alone: bool) -> None:
        """Count the ``blocked`` requests as waiting for memory (the first needs ``need``) and
        say so when some are new; ``alone`` (nothing runs, none joined before it), the first
        never fits."""
        plan, first = self.plan, self.queue[blocked[0]]
        if alone and not self.held:
            raise UserError(
                f"request {first.id!r} needs {human_bytes(need)} of KV cache at head {head}, "
                f"more than the {human_bytes(plan.kv_budget)} that {{memory}} leaves beside the "
                f"weights (b_max {plan.b_max[head]}): give a larger budget",
                settings=["memory"],
            )
        new = set(blocked) - self.memory_waits
        if not new:
            return
        self.memory_waits |= new
        self.log(
            f"  {len(blocked)} request(s) wait for memory at head {head} (first {first.id}, "
            f"needing {human_bytes(need)}): {len(self.held)} running hold "
            f"{human_bytes(self.kv_bytes)} of the {human_bytes(plan.kv_budget)} KV budget, "
            f"{self.running_at(head)} at head {head} (b_max {plan.b_max[head]})"
        )

    def _finish(self, finished: Sequence[Finished]) -> None:
        for f in finished:
            h = self.held.pop(f.tag)
            r = self.queue[f.tag]
            level = self.run.level(h.head)
            self.record.served.append(
                ServedRequest(
                    id=r.id,
                    phase=r.phase,
                    arrival_s=r.arrival_s,
                    start_s=h.start_s,
                    finish_s=self.now,
                    batch=h.batch,
                    head=h.head,
                    offset=h.offset,
                    prompt_tokens=h.prompt_tokens,
                    new_tokens=len(f.tokens),
                    prompt_bytes=len(r.prompt.encode("utf-8")),
                    prompt_bpb=h.prompt_bpb,
                    window_bpb=h.window_bpb,
                    stop=f.stop,
                    text=level.tokenizer.decode(list(f.tokens), skip_special_tokens=False),
                    running=h.running,
                )
            )

    def new_tokens(self) -> list[ServedBatch]:
        """The admissions' records with their requests' generated tokens."""
        tokens = collections.Counter()
        for r in self.record.served:
            tokens[r.batch] += r.new_tokens
        return [dataclasses.replace(b, new_tokens=tokens[b.index]) for b in self.record.batches]
