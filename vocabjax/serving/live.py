"""Serving live traffic: one engine loop, on its own thread, batches the requests of many
clients continuously (the HTTP endpoint, ``http.py``, is one caller).

    live = LiveServer(engine, routes, ServeConfig(max_batch=32), plan, thresholds=...)
    live.start()
    ticket = live.submit(LiveRequest("def main(", max_tokens=16))
    ticket.result()                              # Outcome(text, tokens, stop, head, ...)
    live.drain(); live.stop()

The loop is the virtual clock's (``continuous.py``) on the wall clock. Each turn it takes the
submitted requests into the queue and the cancelled ones out, admits waiting requests first come
first served into running batches, at the head the router picks for B = running plus waiting
(at most ``max_batch``, shifted by the quality controller's offset, which each joined prompt's
bits per byte moves) or the head a request asks for, within the KV plan's memory
(``admission.admit_count``; a running batch per head, whose rows each sample their own way:
greedy, or at their own temperature and top k), and then runs every running batch for at most
``steps_per_call`` decode steps (fewer when a request stops), so new requests join within a
few steps. When more requests wait than rows are free, a batch's prefill also takes up to
``ServeConfig.prefill_ahead`` waiting requests of its head and padded prompt length in all,
within the KV plan; those without a row are staged and join, first come first served, as rows
free at their head, ahead of any new prefill there (``staging.py``, as on the virtual clock;
a request routed to another head is prefilled meanwhile).
Streaming requests get the text their new tokens add after each call. A request's tokens are
those ``Engine.generate`` gives its prompt alone with its seed.

``drain()`` refuses new requests (``Draining``) and waits for the held ones, staged or
running, to finish.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import math
import queue
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from vocabjax.errors import UserError
from vocabjax.progress import Progress
from vocabjax.serving.admission import MemoryPlan, Wait, admit_count
from vocabjax.serving.batching import (
    Call,
    Finished,
    Joining,
    RunningBatch,
    Staged,
    prefill,
    prefill_rows,
    row_picks,
    solo_key,
)
from vocabjax.serving.cadence import Cadence
from vocabjax.serving.controller import QualityController, Thresholds
from vocabjax.serving.decode import Sampling
from vocabjax.serving.engine import Engine, attention_window, bucket_length, prompt_ids
from vocabjax.serving.mixing import Pricer, default_device
from vocabjax.serving.records import ServeConfig
from vocabjax.serving.router import RoutedBatch, Routes, offset_bounds, route_batch
from vocabjax.serving.staging import Stages, ahead, may_stage

STEPS_PER_CALL = 8  # decode steps between looks at the queue
IDLE_WAIT_S = 0.05  # how long an idle loop sleeps before it looks again (a submit wakes it)


class Draining(Exception):
    """The server is draining: it takes no new requests."""


@dataclasses.dataclass(frozen=True)
class LiveRequest:
    """One client's request."""

    prompt: str
    max_tokens: int = 16  # most tokens to generate
    sampling: Sampling = Sampling()  # greedy, or sampled with its seed (None below: a fresh one)
    head: int | None = None  # a fixed head; None: the router's
    stream: bool = False  # post the text as it grows


@dataclasses.dataclass(frozen=True)
class Delta:
    """Text a streaming request's new tokens add."""

    text: str


End = Literal["eos", "max_new_tokens", "max_seq", "cancelled", "failed"]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a request ended."""

    text: str  # everything it generated
    tokens: tuple[int, ...]
    stop: End
    head: int | None  # the head that served it (None: it never joined)
    prompt_tokens: int
    prompt_bpb: float | None
    queue_s: float  # submitted to joined
    latency_s: float  # submitted to finished
    error: str | None = None  # why it failed


class Ticket:
    """A submitted request's channel: the engine thread posts its ``Delta``s and last its
    ``Outcome``; an asyncio caller awaits ``next()``, a thread calls ``result()``."""

    def __init__(self, number: int, request: LiveRequest, loop: asyncio.AbstractEventLoop | None):
        self.number = number
        self.request = request
        self.submitted = time.perf_counter()
        self._loop = loop
        self._events: Any = asyncio.Queue() if loop is not None else queue.Queue()

    def post(self, event: Delta | Outcome) -> None:
        if self._loop is None:
            self._events.put(event)
            return
        with contextlib.suppress(RuntimeError):  # its event loop has closed: nobody reads it
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    async def next(self) -> Delta | Outcome:
        return await self._events.get()

    def result(self, timeout: float | None = None) -> Outcome:
        """The outcome, waiting for it on this thread (for callers without an event loop)."""
        while True:
            event = self._events.get(timeout=timeout)
            if isinstance(event, Outcome):
                return event


@dataclasses.dataclass(frozen=True)
class _Admitted:
    """A waiting request taken into a prefill."""

    ticket: Ticket
    ids: np.ndarray  # its prompt ids at its head
    need: int  # the KV cache it reserves
    offset: int | None  # the controller's offset it was routed at (None: a fixed head)


@dataclasses.dataclass
class _Held:
    """A request in a running batch, or staged for one."""

    ticket: Ticket
    head: int  # its running batch's
    kv_bytes: int
    prompt_tokens: int
    offset: int | None  # the controller's offset it was routed at (None: a fixed head)
    joined: float  # when it got a row (staged: when it was prefilled, until then)
    prompt_bpb: float | None = None
    sent: str = ""  # text posted so far (streaming)


@dataclasses.dataclass
class _Counts:
    """What /metrics reports, kept by the engine thread."""

    submitted: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    memory_waits: int = 0
    router_switches: int = 0
    controller_moves: int = 0
    late_shapes: int = 0  # device functions compiled while requests waited for them
    late_compile_s: float = 0.0
    by_head: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)


class LiveServer:
    """The engine loop for live requests; see the module doc."""

    def __init__(
        self,
        engine: Engine,
        routes: Routes,
        config: ServeConfig,
        plan: MemoryPlan,
        *,
        thresholds: Thresholds | None = None,
        steps_per_call: int = STEPS_PER_CALL,
        progress: Progress | None = None,
    ) -> None:
        self.engine, self.routes, self.config, self.plan = engine, routes, config, plan
        self.heads = tuple(sorted(engine.run.heads))
        lowest, highest = offset_bounds(self.heads, routes, config.max_batch)
        self.controller = (
            None
            if thresholds is None
            else QualityController(thresholds, window=config.window, lowest=lowest, highest=highest)
        )
        self.steps_per_call = steps_per_call
        # how many stops a decode call waits for while requests want rows (--first-stop: one)
        self._cadence = None
        if config.priced_stops:
            device = config.device or default_device()[0]
            pricer = Pricer.of(engine, device, max_rows=config.max_batch, sampling=Sampling())
            self._cadence = Cadence(pricer, engine.run.max_seq)
        self.log = progress or (lambda _line: None)
        self.draining = False
        self._numbers = itertools.count(1)
        self._lock = threading.Condition()
        self._inbox: list[Ticket] = []
        self._cancels: set[int] = set()
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._prompt_ids: dict[tuple[int, int], np.ndarray] = {}  # (ticket, head) -> its ids
        self._batches: dict[int, RunningBatch] = {}  # by head
        self._held: dict[int, _Held] = {}  # requests in rows
        self._staged: dict[int, _Held] = {}  # requests prefilled ahead, without a row yet
        self._stages = Stages()  # their prefills, in order
        self._waited: set[int] = set()
        self._last_head: int | None = None
        self._counts = _Counts(by_head={v: _head_counts() for v in self.heads})
        self._stop = False
        self._thread: threading.Thread | None = None
        # what other threads read, published by the engine thread under the lock
        self._running: dict[int, int] = {v: 0 for v in self.heads}
        self._queued = 0  # waiting requests (never fewer than there are)
        self._holding = 0
        self._staging = 0
        self._kv_bytes = 0
        self._loop_cpu_s = 0.0  # the engine thread's CPU seconds, as of its last turn
        self._routed: dict[tuple[int, int], RoutedBatch] = {}  # (B, offset): the router's route
        self._window: float | None = None  # the controller's windowed bits per byte
        self._offset = 0

    # ---- the callers' side (any thread) -------------------------------------------------------

    def submit(self, request: LiveRequest, loop: asyncio.AbstractEventLoop | None = None) -> Ticket:
        """Queue ``request``: its ticket. ``Draining`` while draining; a UserError when its
        prompt does not fit the run's positions at every head it may get or its head is not
        one of the run's."""
        self.check(request)
        with self._lock:
            if self.draining:
                raise Draining("the server is draining: it takes no new requests")
            ticket = Ticket(next(self._numbers), request, loop)
            self._inbox.append(ticket)
            self._counts.submitted += 1
            self._lock.notify()
        return ticket

    def check(self, request: LiveRequest) -> None:
        """A request's problems as one UserError, before it is queued."""
        run = self.engine.run
        if request.head is not None and request.head not in self.heads:
            raise UserError(f"head {request.head} is not one of the run's heads {self.heads}")
        if not request.prompt:
            raise UserError("the prompt is empty: give the text to continue")
        if request.sampling.top_k is not None and request.sampling.top_k > self.heads[0]:
            raise UserError(f"top_k={request.sampling.top_k} must be <= {self.heads[0]}")
        for vocab in [request.head] if request.head is not None else self.heads:
            n = len(prompt_ids(run.level(vocab), request.prompt))
            if n > run.max_seq:
                raise UserError(
                    f"the prompt is {n} tokens at head {vocab} (separator included), above the "
                    f"run's context of {run.max_seq} positions"
                )
            if self.plan.sequence_bytes(n, request.max_tokens) > self.plan.kv_budget:
                raise UserError(
                    f"the request's KV cache at head {vocab} does not fit the server's memory "
                    "budget: ask for fewer tokens"
                )

    def compile_shapes(self, *, sampled: bool = False) -> tuple[int, float]:
        """Compile, before any traffic, every device call the loop can make for greedy requests
        (and with ``sampled``, for requests sampled at any temperature without a top k), so
        that none waits for the compiler: at each head, a prefill of each power of two of rows
        up to the most one admission takes and of each padded prompt length, then a running
        batch's calls (``RunningBatch.compile_shapes``: its empty carries, decode calls at every
        attention window, joins from each size of stage and regroups). A top k's bucket
        (``decode.RowPicks``) compiles its own when first met. The shapes compiled and the
        seconds it took."""
        engine, config = self.engine, self.config
        max_seq, before, started = engine.run.max_seq, engine.shapes, time.perf_counter()
        most = max(config.max_batch, config.prefill_ahead)  # prompts one admission prefills
        stage_rows = sorted({prefill_rows(n) for n in range(1, most + 1)})
        buckets = sorted({bucket_length(n, max_seq) for n in range(1, max_seq + 1)})
        windows = list(dict.fromkeys(attention_window([e], max_seq) for e in range(1, max_seq + 1)))
        settings = [Sampling(), Sampling(1.0)] if sampled else [Sampling()]
        picks = [row_picks([s], mixed=False) for s in settings]
        for head in self.heads:
            at = time.perf_counter()
            stages = {}
            for rows, bucket, s in itertools.product(stage_rows, buckets, settings):
                joining = [
                    Joining(i, np.zeros(bucket, np.int32), 1, solo_key(0), s) for i in range(rows)
                ]
                stages[rows], _ = prefill(engine, joining, head, score=True)
            batch = RunningBatch(engine, head, max_rows=config.max_batch, score=True)
            batch.compile_shapes(list(stages.values()), windows, picks)
            self.log(
                f"  warm-up, head {head}: {engine.shapes - before} shapes so far, "
                f"{time.perf_counter() - at:.1f} s"
            )
        return engine.shapes - before, time.perf_counter() - started

    def cancel(self, ticket: Ticket) -> None:
        """The client is gone: free what its request holds (its ``Outcome`` says cancelled)."""
        with self._lock:
            self._cancels.add(ticket.number)
            self._lock.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="vocabjax-engine", daemon=True)
        self._thread.start()

    def drain(self, timeout: float | None = None) -> bool:
        """Take no new requests and wait until the held ones have finished: whether they did
        within ``timeout``."""
        with self._lock:
            self.draining = True
            return self._lock.wait_for(self._idle, timeout)

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()

    def metrics(self) -> dict[str, Any]:
        """Counters and the loop's state, as /metrics reports them."""
        with self._lock:
            c = self._counts
            window = self._window
            running = dict(self._running)
            return {
                "requests": {
                    "submitted": c.submitted,
                    "completed": c.completed,
                    "cancelled": c.cancelled,
                    "failed": c.failed,
                    "in_flight": len(self._inbox) + self._queued + self._staging + self._holding,
                },
                "queue_length": len(self._inbox) + self._queued,
                "staged": self._staging,
                "running": sum(running.values()),
                "by_head": [{"head": v, "running": running[v], **c.by_head[v]} for v in self.heads],
                "windowed_bpb": None if window is None else round(window, 4),
                "offset": self._offset,
                "switches": {"router": c.router_switches, "controller": c.controller_moves},
                "memory": {
                    "kv_bytes": self._kv_bytes,
                    "kv_budget_bytes": self.plan.kv_budget,
                    "waits": c.memory_waits,
                },
                "compiled": {
                    "shapes": self.engine.shapes,
                    "while_waiting": c.late_shapes,
                    "while_waiting_s": round(c.late_compile_s, 3),
                },
                # CPU seconds so far: the engine loop's own thread (its host work; the compiled
                # calls run on XLA's threads) and the whole process's
                "cpu_s": {
                    "engine_loop": round(self._loop_cpu_s, 3),
                    "process": round(time.process_time(), 3),
                },
                "draining": self.draining,
            }

    def _idle(self) -> bool:
        """Nothing submitted, waiting, staged or running (the engine thread's published counts,
        which a request leaves only at the end of the turn that ended it)."""
        return not (self._inbox or self._queued or self._staging or self._holding)

    # ---- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stop:
                    break
                if self._idle():
                    self._lock.notify_all()  # a drain may be waiting for this
                    self._lock.wait(IDLE_WAIT_S)
                    continue
                self._waiting.extend(self._inbox)
                self._inbox.clear()
                self._queued = len(self._waiting)
                cancels, self._cancels = self._cancels, set()
            try:
                self._cancel(cancels)
                self._admit()
                self._advance()
            except Exception as exc:  # a failed call fails what it held, not the server
                self._fail_all(exc)
            self._publish()
        self._fail_all(Draining("the server stopped"))

    def _publish(self) -> None:
        """What the other threads read: the requests waiting, staged and running per head, the
        cache they hold, the controller's window and offset."""
        running = {v: self._running_at(v) for v in self.heads}
        loop_cpu_s = time.thread_time()  # this thread's: the loop's host work, not the device's
        with self._lock:
            self._running = running
            self._loop_cpu_s = loop_cpu_s
            self._queued = len(self._waiting)
            self._staging = len(self._staged)
            self._holding = len(self._held)
            self._kv_bytes = self._reserved()
            if self.controller is not None:
                self._window, self._offset = self.controller.window_mean, self.controller.offset
            self._lock.notify_all()

    def _cancel(self, numbers: set[int]) -> None:
        for number in numbers:
            gone = [t for t in self._waiting if t.number == number]
            for t in gone:
                self._waiting.remove(t)
                self._end(t, _outcome(t, "", (), "cancelled"), None)
            staged = self._staged.pop(number, None)
            if staged is not None:  # its reservation is free now, its stage's caches once unused
                self._stages.cancel(number)
                self._end(staged.ticket, _outcome(staged.ticket, "", (), "cancelled"), None)
            held = self._held.pop(number, None)
            if held is not None:
                self._batches[held.head].cancel(number)
                outcome = _outcome(held.ticket, "", (), "cancelled")
                self._end(held.ticket, outcome, None)

    def _admit(self) -> None:
        """Staged requests join rows as rows free; then waiting requests join running batches,
        first come first served, while they fit and their head has none staged, each batch's
        prefill taking more waiting requests ahead when rows hold the next one back
        (``_ahead``)."""
        self._stages.join(lambda s: self.config.max_batch - self._running_at(s.head), self._join)
        staged_at = self._stages.heads  # their staged requests join before any new prefill
        groups: dict[int, list[_Admitted]] = collections.defaultdict(list)
        running = {v: self._running_at(v) for v in self.heads}
        held_bytes = self._reserved()
        wait: Wait | None = None  # why the first request left waiting waits, and at which head
        load = blocked = 0
        while self._waiting:
            ticket = self._waiting[0]
            request = ticket.request
            load = len(self._held) + sum(map(len, groups.values())) + len(self._waiting)
            head, offset = self._head(request, load, count=True)
            if head in staged_at:  # first come first served: it waits behind them
                wait = None  # not for rows: nothing prefills ahead for it
                break
            ids = self._ids(ticket, head)
            need = self.plan.sequence_bytes(len(ids), request.max_tokens)
            n, wait = admit_count(
                [need],
                held_bytes=held_bytes,
                running=running[head],
                max_batch=self.config.max_batch,
                b_max=self.plan.b_max[head],
                kv_budget=self.plan.kv_budget,
            )
            if n == 0:
                if wait == "memory" and not self._held and not groups:
                    self._waiting.popleft()
                    error = f"its KV cache at head {head} does not fit the memory budget"
                    self._end(ticket, _outcome(ticket, "", (), "failed", error=error), None)
                    wait = None
                    continue
                if wait == "memory" and ticket.number not in self._waited:
                    self._waited.add(ticket.number)
                    self._counts.memory_waits += 1
                blocked = head
                break
            self._waiting.popleft()
            groups[head].append(_Admitted(ticket, ids, need, offset))
            running[head] += 1
            held_bytes += need
        for head, group in groups.items():
            # a batch prefills ahead when rows at its own head hold the next request back
            here = wait if head == blocked else None
            picks = self._ahead(head, group, here, load, held_bytes, running[head])
            held_bytes += sum(a.need for a in picks)
            running[head] += len(picks)  # a staged cache counts against b_max
            self._prefill(head, group, picks)

    def _ahead(
        self,
        head: int,
        group: Sequence[_Admitted],
        wait: Wait | None,
        load: int,
        held: int,
        running: int,
    ) -> list[_Admitted]:
        """The waiting requests that ``group``'s prefill also takes and stages, out of the
        queue (``staging.ahead``: those routed at ``load`` to its head and of its padded
        prompt length, up to ``prefill_ahead`` in all, within the KV budget and b_max beside
        ``held`` bytes and ``running`` requests at its head)."""
        if not may_stage(wait, self.config.prefill_ahead, len(group)):
            return []  # the queue need not be read
        max_seq = self.engine.run.max_seq
        same: list[_Admitted] = []
        for ticket in self._waiting:
            request = ticket.request
            at, offset = self._head(request, load)
            if at == head:
                ids = self._ids(ticket, head)
                need = self.plan.sequence_bytes(len(ids), request.max_tokens)
                same.append(_Admitted(ticket, ids, need, offset))
        picks = ahead(
            max(bucket_length(len(a.ids), max_seq) for a in group),
            [bucket_length(len(a.ids), max_seq) for a in same],
            [a.need for a in same],
            joining=len(group),
            wait=wait,
            most=self.config.prefill_ahead,
            held_bytes=held,
            running=running,
            b_max=self.plan.b_max[head],
            kv_budget=self.plan.kv_budget,
        )
        taken = {same[p].ticket.number for p in picks}
        self._waiting = collections.deque(t for t in self._waiting if t.number not in taken)
        return [same[p] for p in picks]

    def _prefill(self, head: int, group: Sequence[_Admitted], picks: Sequence[_Admitted]) -> None:
        """One prefill of ``group`` and ``picks`` at ``head``: ``group`` joins its running
        batch, ``picks`` are staged until rows free. Every prompt's bits per byte goes to the
        quality controller now."""
        batch = self._batch(head)
        admitted = [*group, *picks]
        joining = []
        for a in admitted:
            request = a.ticket.request
            key, number = solo_key(request.sampling.seed), a.ticket.number
            joining.append(Joining(number, a.ids, request.max_tokens, key, request.sampling))
        started = time.perf_counter()
        staged, call = prefill(self.engine, joining, head, batch.score)
        self._compiled([call])
        for a, j in zip(admitted, staged.joined, strict=True):
            held = _Held(a.ticket, head, a.need, len(a.ids), a.offset, started)
            self._staged[a.ticket.number] = held
            self._observe(held, j.prompt_nats)
        self._join(staged, len(group), started)
        self._stages.add(staged)

    def _join(self, staged: Staged, m: int, started: float | None = None) -> None:
        """The next ``m`` of ``staged`` join rows of their running batch, joined ``started``
        (by default now: the join call gives them their rows)."""
        head = self._staged[staged.waiting[0].tag].head
        joined_at = time.perf_counter() if started is None else started
        joined, finished, calls = self._batch(head).join_staged(staged, m)
        self._compiled(calls)
        for j in joined:
            self._held[j.tag] = dataclasses.replace(self._staged.pop(j.tag), joined=joined_at)
        self._finished(finished)

    def _head(
        self, request: LiveRequest, load: int, *, count: bool = False
    ) -> tuple[int, int | None]:
        """The head ``request`` gets and the controller's offset it is routed at (None: a fixed
        head): the router's for B = ``load`` (at most max_batch); ``count``: a new head counts
        as a router switch."""
        if request.head is not None:
            return request.head, None
        offset = 0 if self.controller is None else self.controller.offset
        b = min(load, self.config.max_batch)
        route = self._routed.get((b, offset))
        if route is None:  # the router is a pure function of (B, offset): each is routed once
            route = route_batch(self.heads, self.routes, batch=b, offset=offset)
            self._routed[(b, offset)] = route
        if count:
            if self._last_head is not None and route.head != self._last_head:
                self._counts.router_switches += 1
            self._last_head = route.head
        return route.head, offset

    def _observe(self, held: _Held, nats: float | None) -> None:
        """A joined prompt's bits per byte to the quality controller."""
        if nats is None:
            return
        nbytes = len(held.ticket.request.prompt.encode("utf-8"))
        held.prompt_bpb = nats / (math.log(2) * nbytes)
        if self.controller is None or held.offset is None:
            return  # a request at a fixed head says nothing about the routed level
        move = self.controller.observe(held.prompt_bpb, held.offset, weight=nbytes)
        if move is not None:
            self._counts.controller_moves += 1
            self.log(f"  quality controller: {move.reason}")

    def _advance(self) -> None:
        for head, batch in list(self._batches.items()):
            if not batch.live:
                continue
            stops = 1
            if self._cadence is not None:
                stops = self._cadence.stops(batch, len(self._waiting) + self._stages.left)
            finished, calls = batch.advance(self.steps_per_call, stops)
            self._compiled(calls)
            self._finished(finished)
            streaming = [
                h for h in self._held.values() if h.head == head and h.ticket.request.stream
            ]
            if streaming:
                tokens = batch.partial()
                for h in streaming:
                    self._stream(h, tokens.get(h.ticket.number, ()))

    def _compiled(self, calls: Sequence[Call]) -> None:
        """A line per new shape: its first request waited for the compiling (counted for
        /metrics)."""
        for c in calls:
            if c.compile_s:
                with self._lock:
                    self._counts.late_shapes += 1
                    self._counts.late_compile_s += c.compile_s
                self.log(f"  {c.compiled_line()} (its requests waited for it)")

    def _stream(self, held: _Held, tokens: Sequence[int]) -> None:
        text = self._text(held.head, tokens)
        if text.endswith("\ufffd"):  # a character cut between tokens: wait for the rest
            text = text.rstrip("\ufffd")
        if len(text) > len(held.sent) and text.startswith(held.sent):
            held.ticket.post(Delta(text[len(held.sent) :]))
            held.sent = text

    def _finished(self, finished: Sequence[Finished]) -> None:
        for f in finished:
            self._finish(self._held[f.tag], f)

    def _finish(self, held: _Held, f: Finished) -> None:
        """A held request ends: its last text, its outcome, its counts and its memory back."""
        self._held.pop(held.ticket.number, None)
        head = held.head
        text = self._text(head, f.tokens)
        if held.ticket.request.stream and len(text) > len(held.sent):
            held.ticket.post(Delta(text[len(held.sent) :]))
        outcome = Outcome(
            text=text,
            tokens=tuple(f.tokens),
            stop=f.stop,
            head=head,
            prompt_tokens=held.prompt_tokens,
            prompt_bpb=held.prompt_bpb,
            queue_s=held.joined - held.ticket.submitted,
            latency_s=time.perf_counter() - held.ticket.submitted,
        )
        self._end(held.ticket, outcome, head)

    def _end(self, ticket: Ticket, outcome: Outcome, head: int | None) -> None:
        for v in self.heads:
            self._prompt_ids.pop((ticket.number, v), None)
        with self._lock:
            c = self._counts
            if outcome.stop == "cancelled":
                c.cancelled += 1
            elif outcome.stop == "failed":
                c.failed += 1
            else:
                c.completed += 1
            if head is not None:
                row = c.by_head[head]
                row["requests"] += 1
                row["prompt_tokens"] += outcome.prompt_tokens
                row["new_tokens"] += len(outcome.tokens)
            self._lock.notify_all()
        ticket.post(outcome)

    def _fail_all(self, exc: Exception) -> None:
        """Fail every request in the loop: a device call failed (the batches are dropped)."""
        with self._lock:
            pending = list(self._inbox) + list(self._waiting)
            self._inbox.clear()
            self._waiting.clear()
        for ticket in pending:
            self._end(ticket, _outcome(ticket, "", (), "failed", error=str(exc)), None)
        for held in [*self._staged.values(), *self._held.values()]:
            self._staged.pop(held.ticket.number, None)
            self._held.pop(held.ticket.number, None)
            self._end(held.ticket, _outcome(held.ticket, "", (), "failed", error=str(exc)), None)
        if not isinstance(exc, Draining):
            self.log(
                f"  engine error, {len(pending)} waiting and the staged and running requests "
                f"failed: {exc}"
            )
        self._stages.clear()
        self._batches.clear()

    def _running_at(self, head: int) -> int:
        """The requests in rows at ``head``, in every running batch."""
        batch = self._batches.get(head)
        return 0 if batch is None else batch.live

    def _reserved(self) -> int:
        """The KV cache every running or staged request reserves."""
        return sum(h.kv_bytes for h in [*self._held.values(), *self._staged.values()])

    def _ids(self, ticket: Ticket, head: int) -> np.ndarray:
        """``ticket``'s prompt ids at ``head``, encoded once while it is in the loop."""
        if (ticket.number, head) not in self._prompt_ids:
            self._prompt_ids[(ticket.number, head)] = self.engine.encode(
                [ticket.request.prompt], head
            )[0]
        return self._prompt_ids[(ticket.number, head)]

    def _batch(self, head: int) -> RunningBatch:
        if head not in self._batches:
            self._batches[head] = RunningBatch(
                self.engine, head, max_rows=self.config.max_batch, score=True
            )
        return self._batches[head]

    def _text(self, head: int, tokens: Sequence[int]) -> str:
        return self.engine.run.level(head).tokenizer.decode(list(tokens), skip_special_tokens=False)


def _head_counts() -> dict[str, int]:
    return {"requests": 0, "prompt_tokens": 0, "new_tokens": 0}


def _outcome(
    ticket: Ticket, text: str, tokens: tuple[int, ...], stop: End, *, error: str | None = None
) -> Outcome:
    """The outcome of a request that never joined a batch."""
    waited = time.perf_counter() - ticket.submitted
    return Outcome(text, tokens, stop, None, 0, None, waited, waited, error)


def fresh_seed() -> int:
    """A seed for a sampled request that gives none."""
    return secrets.randbits(31)
