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
(``admission.admit_count``; a running batch per head and sampling setting, since a batch is
compiled for one temperature and top-k), and then runs every running batch for at most
``steps_per_call`` decode steps (fewer when a request stops), so new requests join within a
few steps. Streaming requests get the text their new tokens add after each call. A request's
tokens are those ``Engine.generate`` gives its prompt alone with its seed.

``drain()`` refuses new requests (``Draining``) and waits for the held ones to finish.
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

from vocabjax.errors import UserError
from vocabjax.progress import Progress
from vocabjax.serving.admission import MemoryPlan, admit_count
from vocabjax.serving.batching import Call, Finished, Joining, RunningBatch, solo_key
from vocabjax.serving.controller import QualityController, Thresholds
from vocabjax.serving.decode import Sampling
from vocabjax.serving.engine import Engine, prompt_ids
from vocabjax.serving.records import ServeConfig
from vocabjax.serving.router import Routes, offset_bounds, route_batch

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


@dataclasses.dataclass
class _Held:
    """A request in a running batch."""

    ticket: Ticket
    batch: tuple[int, float, int | None]  # its running batch: (head, temperature, top_k)
    kv_bytes: int
    prompt_tokens: int
    offset: int | None  # the controller's offset it was routed at (None: a fixed head)
    joined: float
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
        self.log = progress or (lambda _line: None)
        self.draining = False
        self._numbers = itertools.count(1)
        self._lock = threading.Condition()
        self._inbox: list[Ticket] = []
        self._cancels: set[int] = set()
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._batches: dict[tuple[int, float, int | None], RunningBatch] = {}
        self._held: dict[int, _Held] = {}
        self._waited: set[int] = set()
        self._last_head: int | None = None
        self._counts = _Counts(by_head={v: _head_counts() for v in self.heads})
        self._stop = False
        self._thread: threading.Thread | None = None
        # what other threads read, published by the engine thread under the lock
        self._running: dict[int, int] = {v: 0 for v in self.heads}
        self._queued = 0  # waiting requests (never fewer than there are)
        self._holding = 0
        self._kv_bytes = 0
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
                    "in_flight": len(self._inbox) + self._queued + self._holding,
                },
                "queue_length": len(self._inbox) + self._queued,
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
                "draining": self.draining,
            }

    def _idle(self) -> bool:
        """Nothing submitted, waiting or running (the engine thread's published counts, which
        a request leaves only at the end of the turn that ended it)."""
        return not (self._inbox or self._queued or self._holding)

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
        """What the other threads read: the requests waiting and running per head, the cache
        they hold, the controller's window and offset."""
        running = {v: 0 for v in self.heads}
        for (head, *_), batch in self._batches.items():
            running[head] += batch.live
        with self._lock:
            self._running = running
            self._queued = len(self._waiting)
            self._holding = len(self._held)
            self._kv_bytes = sum(h.kv_bytes for h in self._held.values())
            if self.controller is not None:
                self._window, self._offset = self.controller.window_mean, self.controller.offset
            self._lock.notify_all()

    def _cancel(self, numbers: set[int]) -> None:
        for number in numbers:
            gone = [t for t in self._waiting if t.number == number]
            for t in gone:
                self._waiting.remove(t)
                self._end(t, _outcome(t, "", (), "cancelled"), None)
            held = self._held.pop(number, None)
            if held is not None:
                self._batches[held.batch].cancel(number)
                outcome = _outcome(held.ticket, "", (), "cancelled")
                self._end(held.ticket, outcome, None)

    def _admit(self) -> None:
        """Waiting requests join running batches, first come first served, while they fit."""
        joining: dict[tuple[int, float, int | None], list[Joining]] = collections.defaultdict(list)
        admitted: list[tuple[Ticket, tuple[int, float, int | None], int, int, int | None]] = []
        running = {v: 0 for v in self.heads}
        for (head, *_), batch in self._batches.items():
            running[head] += batch.live
        held_bytes = sum(h.kv_bytes for h in self._held.values())
        while self._waiting:
            ticket = self._waiting[0]
            request = ticket.request
            if request.head is not None:
                head, offset = request.head, None
            else:
                head, offset = self._route(len(self._held) + len(admitted) + len(self._waiting))
            ids = self.engine.encode([request.prompt], head)[0]
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
                if wait == "memory" and not self._held and not admitted:
                    self._waiting.popleft()
                    error = f"its KV cache at head {head} does not fit the memory budget"
                    self._end(ticket, _outcome(ticket, "", (), "failed", error=error), None)
                    continue
                if wait == "memory" and ticket.number not in self._waited:
                    self._waited.add(ticket.number)
                    self._counts.memory_waits += 1
                break
            self._waiting.popleft()
            s = request.sampling
            key = (head, s.temperature, s.top_k)
            joining[key].append(Joining(ticket.number, ids, request.max_tokens, solo_key(s.seed)))
            admitted.append((ticket, key, need, len(ids), offset))
            running[head] += 1
            held_bytes += need
        now = time.perf_counter()
        for t, key, need, tokens, offset in admitted:
            self._held[t.number] = _Held(t, key, need, tokens, offset, now)
        for key, group in joining.items():
            batch = self._batch(key)
            joined, finished, calls = batch.join(group)
            self._compiled(calls)
            for j in joined:
                self._observe(self._held[j.tag], j.prompt_nats)
            self._finished(finished)

    def _route(self, load: int) -> tuple[int, int]:
        """The router's head for B = ``load`` (at most max_batch), and the offset it used."""
        offset = 0 if self.controller is None else self.controller.offset
        route = route_batch(
            self.heads, self.routes, batch=min(load, self.config.max_batch), offset=offset
        )
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
        for key, batch in list(self._batches.items()):
            if not batch.live:
                continue
            finished, calls = batch.advance(self.steps_per_call)
            self._compiled(calls)
            self._finished(finished)
            streaming = [
                h for h in self._held.values() if h.batch == key and h.ticket.request.stream
            ]
            if streaming:
                tokens = batch.partial()
                for h in streaming:
                    self._stream(h, tokens.get(h.ticket.number, ()))

    def _compiled(self, calls: Sequence[Call]) -> None:
        """A line per new shape: its first request waited for the compiling."""
        for c in calls:
            if c.compile_s:
                self.log(f"  {c.compiled_line()} (its requests waited for it)")

    def _stream(self, held: _Held, tokens: Sequence[int]) -> None:
        text = self._text(held.batch[0], tokens)
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
        head = held.batch[0]
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
        for held in list(self._held.values()):
            self._held.pop(held.ticket.number)
            self._end(held.ticket, _outcome(held.ticket, "", (), "failed", error=str(exc)), None)
        if not isinstance(exc, Draining):
            self.log(
                f"  engine error, {len(pending)} waiting and the running requests failed: {exc}"
            )
        self._batches.clear()

    def _batch(self, key: tuple[int, float, int | None]) -> RunningBatch:
        if key not in self._batches:
            head, temperature, top_k = key
            self._batches[key] = RunningBatch(
                self.engine,
                head,
                Sampling(temperature, top_k),
                max_rows=self.config.max_batch,
                score=True,
            )
        return self._batches[key]

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
