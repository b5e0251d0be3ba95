"""Serving a trace: a virtual clock, a router over the policy's batch routes, the quality
controller's level offset, and a record of every request, batch and switch.

    run = load_run("runs/tiny")
    result = serve(Engine(run), load_trace("trace.jsonl"), load_policy("policy.json"),
                   ServeConfig(max_batch=32), thresholds=derive_thresholds(...))
    result.summary(), result.to_json()

The clock is virtual: it starts at 0 and, each round,

1. jumps to the next arrival when no request is waiting;
2. admits up to ``max_batch`` waiting requests (arrival <= now), first come first served:
   B = how many;
3. the router takes the policy's route for B (``choose_head``, snapped to the run's heads),
   shifted by the controller's offset in levels and clamped to the run's smallest and
   largest head (``shift_head``); the whole batch runs at that head, each request from
   prefill to its last token (a running request keeps its level);
4. runs it through ``Engine.generate`` (``score=True``: each prompt's bits per byte comes
   from the prefill; B padded to a power of two, at most ``max_batch``, so batch sizes share
   compiled shapes) and advances the clock by the batch's measured wall time, less the
   seconds spent compiling a new (head, B, prompt bucket) shape and its warm-up calls: those
   are reported (``compile_s``) but not charged to the clock, as a server compiles its shapes
   before it takes traffic;
5. gives each prompt's bits per byte to the quality controller, in the batch's order.

A request's latency is its queue wait (admission - arrival) plus its batch's service time: a
batch's requests all finish when the batch does (static batching).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from vocabjax.errors import UserError
from vocabjax.profiles import SCHEMA
from vocabjax.progress import Progress
from vocabjax.serving.controller import DEFAULT_WINDOW, QualityController, Thresholds
from vocabjax.serving.engine import Engine, LoadedRun, Sampling, choose_head, prompt_ids
from vocabjax.serving.trace import PromptRoom, Request

DEFAULT_MAX_BATCH = 32
DEFAULT_MAX_NEW_TOKENS = 32
Routes = Sequence[tuple[int | None, int]]


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """How the server runs a trace."""

    max_batch: int = DEFAULT_MAX_BATCH  # most requests admitted into one batch
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # per request, unless its trace line says
    window: int = DEFAULT_WINDOW  # requests in the controller's windowed mean
    sampling: Sampling = Sampling()  # greedy by default; a sampled batch k uses seed (seed, k)
    pad_batches: bool = True  # run B as the next power of two (<= max_batch) rows
    progress_every: int = 10  # a progress line every this many batches

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_new_tokens", "window", "progress_every"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise UserError(f"{name}={x!r} must be a positive integer")

    def rows(self, batch: int) -> int:
        """The rows a batch of ``batch`` requests runs as."""
        if not self.pad_batches:
            return batch
        return min(self.max_batch, 1 << (batch - 1).bit_length())


def shift_head(heads: Sequence[int], head: int, offset: int) -> int:
    """The head ``offset`` levels above ``head`` among ``heads`` (below for a negative
    offset), clamped to the smallest and largest."""
    order = sorted(heads)
    i = min(max(order.index(head) + offset, 0), len(order) - 1)
    return order[i]


def offset_bounds(heads: Sequence[int], routes: Routes, max_batch: int) -> tuple[int, int]:
    """(lowest, highest) offsets that still change the head of some batch size 1..max_batch:
    below, every routed head is already the smallest; above, every one is the largest."""
    order = sorted(heads)
    routed = {
        order.index(choose_head(order, "auto", batch=b, routes=routes).vocab)
        for b in range(1, max_batch + 1)
    }
    return -max(routed), len(order) - 1 - min(routed)


# ---- records ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServedRequest:
    id: str
    phase: str | None
    arrival_s: float
    start_s: float  # admitted into its batch
    finish_s: float  # its batch finished
    batch: int  # index of its batch
    head: int  # the head that served it, from prefill to its last token
    offset: int  # the controller's offset when it was admitted
    prompt_tokens: int  # with the separator
    new_tokens: int
    prompt_bytes: int
    prompt_bpb: float  # bits per byte of the prompt under ``head``
    window_bpb: float | None  # the controller's windowed mean after it (None: not counted)
    stop: str
    text: str  # what was generated

    @property
    def queue_s(self) -> float:
        return self.start_s - self.arrival_s

    @property
    def service_s(self) -> float:
        return self.finish_s - self.start_s

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for k in ("arrival_s", "start_s", "finish_s"):
            out[k] = round(out[k], 6)
        out.update(
            queue_s=round(self.queue_s, 6),
            service_s=round(self.service_s, 6),
            latency_s=round(self.latency_s, 6),
            prompt_bpb=_round(self.prompt_bpb, 4),
            window_bpb=_round(self.window_bpb, 4),
        )
        return out


@dataclasses.dataclass(frozen=True)
class ServedBatch:
    index: int
    start_s: float
    service_s: float  # measured wall time, compiling left out
    compile_s: float  # compiling a new shape and its warm-up calls (0 when it was kept)
    batch: int  # B: requests admitted
    rows: int  # B padded to the compiled batch size
    bucket: int  # padded prompt length
    routed_head: int  # the policy's route for B (snapped to the run's heads)
    offset: int  # the controller's offset
    head: int  # routed_head shifted by offset, clamped
    impl: str  # the unembedding implementation impl="auto" picked for (head, rows)
    impl_reason: str
    new_tokens: int
    mean_bpb: float  # mean prompt bits per byte of its requests

    def row(self) -> dict[str, Any]:
        return {
            "batch": self.index,
            "start_s": round(self.start_s, 6),
            "B": self.batch,
            "rows": self.rows,
            "bucket": self.bucket,
            "routed_head": self.routed_head,
            "offset": self.offset,
            "head": self.head,
            "impl": self.impl,
            "service_ms": round(1e3 * self.service_s, 3),
            "compile_s": round(self.compile_s, 3),
            "new_tokens": self.new_tokens,
            "mean_bpb": _round(self.mean_bpb, 4),
        }


By = Literal["router", "controller"]


@dataclasses.dataclass(frozen=True)
class Switch:
    """A change of level: the head the next batch would get changed."""

    time_s: float
    from_head: int
    to_head: int
    by: By
    reason: str
    from_offset: int
    to_offset: int
    batch: int  # the batch it happened before (router) or after (controller)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "time_s": round(self.time_s, 6)}


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, digits)


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


@dataclasses.dataclass(frozen=True)
class ServeResult:
    config: ServeConfig
    heads: tuple[int, ...]
    thresholds: Thresholds | None  # None: the controller was off
    offset_range: tuple[int, int]
    requests: tuple[ServedRequest, ...]  # in the order they were served
    batches: tuple[ServedBatch, ...]
    switches: tuple[Switch, ...]

    def summary(self) -> dict[str, Any]:
        reqs, batches = self.requests, self.batches
        latency = np.asarray([r.latency_s for r in reqs])
        generated = sum(r.new_tokens for r in reqs)
        first = min(r.arrival_s for r in reqs)
        makespan = max(r.finish_s for r in reqs) - first
        busy = sum(b.service_s for b in batches)
        return {
            "requests": len(reqs),
            "batches": len(batches),
            "prompt_tokens": sum(r.prompt_tokens for r in reqs),
            "generated_tokens": generated,
            "makespan_s": round(makespan, 6),  # first arrival to last finish, virtual
            "busy_s": round(busy, 6),  # the batches' service times
            "compile_s": round(sum(b.compile_s for b in batches), 3),  # not on the clock
            "tokens_per_s": round(generated / makespan, 1) if makespan > 0 else None,
            "busy_tokens_per_s": round(generated / busy, 1) if busy > 0 else None,
            "latency_p50_s": round(float(np.percentile(latency, 50)), 6),
            "latency_p95_s": round(float(np.percentile(latency, 95)), 6),
            "queue_mean_s": round(float(np.mean([r.queue_s for r in reqs])), 6),
            "mean_prompt_bpb": _round(_mean([r.prompt_bpb for r in reqs]), 4),
            "router_switches": sum(s.by == "router" for s in self.switches),
            "controller_moves": sum(s.by == "controller" for s in self.switches),
        }

    def head_rows(self) -> list[dict[str, Any]]:
        """Per head: batches, requests, tokens, mean prompt bits per byte, the impl(s)."""
        out = []
        for head in self.heads:
            bs = [b for b in self.batches if b.head == head]
            rs = [r for r in self.requests if r.head == head]
            out.append(
                {
                    "head": head,
                    "batches": len(bs),
                    "requests": len(rs),
                    "new_tokens": sum(r.new_tokens for r in rs),
                    "mean_prompt_bpb": _round(_mean([r.prompt_bpb for r in rs]), 4),
                    "impl": ",".join(dict.fromkeys(b.impl for b in bs)) or None,
                }
            )
        return out

    def phase_rows(self) -> list[dict[str, Any]]:
        """Per trace phase (label), in order of first arrival: requests, heads used, mean
        prompt bits per byte; empty when the trace has no phases."""
        phases = list(dict.fromkeys(r.phase for r in self.requests if r.phase is not None))
        out = []
        for phase in phases:
            rs = [r for r in self.requests if r.phase == phase]
            out.append(
                {
                    "phase": phase,
                    "requests": len(rs),
                    "mean_B": round(_mean([self.batches[r.batch].batch for r in rs]) or 0.0, 2),
                    "heads": ",".join(str(h) for h in sorted({r.head for r in rs})),
                    "mean_prompt_bpb": _round(_mean([r.prompt_bpb for r in rs]), 4),
                    "latency_p50_s": round(float(np.median([r.latency_s for r in rs])), 6),
                }
            )
        return out

    def to_json(self, **context: Any) -> dict[str, Any]:
        """The ``serve --format json`` document; ``context`` (run, policy, trace, ...) first."""
        c = self.config
        return {
            "schema": SCHEMA,
            "kind": "serve",
            **context,
            "config": {
                "max_batch": c.max_batch,
                "max_new_tokens": c.max_new_tokens,
                "window": c.window,
                "temperature": c.sampling.temperature,
                "top_k": c.sampling.top_k,
                "seed": c.sampling.seed,
                "pad_batches": c.pad_batches,
                "clock": "virtual: measured batch wall time, compiling not charged",
            },
            "heads": list(self.heads),
            "controller": None
            if self.thresholds is None
            else {**self.thresholds.to_json(), "offset_range": list(self.offset_range)},
            "summary": self.summary(),
            "by_head": self.head_rows(),
            "by_phase": self.phase_rows(),
            "switches": [s.to_json() for s in self.switches],
            "batches": [{**b.row(), "impl_reason": b.impl_reason} for b in self.batches],
            "requests": [r.to_json() for r in self.requests],
        }


# ---- the loop -----------------------------------------------------------------------------------


def serve(
    engine: Engine,
    requests: Sequence[Request],
    routes: Routes,
    config: ServeConfig | None = None,
    *,
    thresholds: Thresholds | None = None,
    progress: Progress | None = None,
) -> ServeResult:
    """Serve ``requests`` (sorted by arrival here) on a virtual clock; see the module doc."""
    config = config or ServeConfig()
    if not requests:
        raise UserError("the trace holds no requests")
    run: LoadedRun = engine.run
    heads = tuple(sorted(run.heads))
    log = progress or (lambda _line: None)
    queue = sorted(requests, key=lambda r: r.arrival_s)
    check_prompts(run, queue)
    bounds = offset_bounds(heads, routes, config.max_batch)
    controller = (
        None
        if thresholds is None
        else QualityController(
            thresholds, window=config.window, lowest=bounds[0], highest=bounds[1]
        )
    )
    served: list[ServedRequest] = []
    batches: list[ServedBatch] = []
    switches: list[Switch] = []
    now = 0.0
    i = 0  # the first request not yet admitted
    last_head: int | None = None  # the head the next batch would keep
    while i < len(queue):
        now = max(now, queue[i].arrival_s)  # nothing waiting: the clock jumps to the arrival
        j = i
        while j < len(queue) and j - i < config.max_batch and queue[j].arrival_s <= now:
            j += 1
        admitted, i = queue[i:j], j
        k, b = len(batches), len(admitted)
        offset = controller.offset if controller else 0
        routed = choose_head(heads, "auto", batch=b, routes=routes)
        head = shift_head(heads, routed.vocab, offset)
        if last_head is not None and head != last_head:
            note = f"; offset {offset:+d}: serving {head}" if offset else ""
            switches.append(
                Switch(now, last_head, head, "router", routed.reason + note, offset, offset, k)
            )
        sampling = dataclasses.replace(config.sampling, seed=_batch_seed(config.sampling.seed, k))
        started = time.perf_counter()
        gen = engine.generate(
            [r.prompt for r in admitted],
            head=head,
            max_new_tokens=[r.max_new_tokens or config.max_new_tokens for r in admitted],
            sampling=sampling,
            score=True,
            pad_batch_to=config.rows(b),
        )
        service = time.perf_counter() - started - gen.compile_s
        if gen.compile_s:
            log(
                f"  compiled head {head}, {gen.padded_batch} rows x {gen.bucket} tokens in "
                f"{gen.compile_s:.2f} s (not charged to the clock)"
            )
        start, now = now, now + service
        last_head = head
        for r, c in zip(admitted, gen.completions, strict=True):
            bpb = c.prompt_bpb
            assert bpb is not None  # score=True
            window_bpb = None
            if controller is not None:
                move = controller.observe(bpb, offset, weight=c.prompt_bytes)
                if move is None:  # counted unless a move earlier in this batch made it stale
                    window_bpb = controller.window_mean if controller.offset == offset else None
                else:
                    window_bpb = move.window_mean
                    to = shift_head(heads, routed.vocab, move.to_offset)
                    switches.append(
                        Switch(now, head, to, "controller", move.reason, offset, move.to_offset, k)
                    )
                    last_head = to
            served.append(
                ServedRequest(
                    id=r.id,
                    phase=r.phase,
                    arrival_s=r.arrival_s,
                    start_s=start,
                    finish_s=now,
                    batch=k,
                    head=head,
                    offset=offset,
                    prompt_tokens=c.prompt_tokens,
                    new_tokens=len(c.tokens),
                    prompt_bytes=c.prompt_bytes,
                    prompt_bpb=bpb,
                    window_bpb=window_bpb,
                    stop=c.stop,
                    text=c.text,
                )
            )
        batches.append(
            ServedBatch(
                index=k,
                start_s=start,
                service_s=service,
                compile_s=gen.compile_s,
                batch=b,
                rows=gen.padded_batch,
                bucket=gen.bucket,
                routed_head=routed.vocab,
                offset=offset,
                head=head,
                impl=gen.impl,
                impl_reason=gen.impl_reason,
                new_tokens=sum(len(c.tokens) for c in gen.completions),
                mean_bpb=sum(s.prompt_bpb for s in served[-b:]) / b,
            )
        )
        if (k + 1) % config.progress_every == 0 or i == len(queue):
            window = None if controller is None else controller.window_mean
            log(
                f"batch {k + 1}: {len(served)}/{len(queue)} requests served by t = {now:.3f} s "
                f"(virtual); last B={b} at head {head}"
                + ("" if window is None else f"; windowed BPB {window:.3f}")
            )
    return ServeResult(
        config=config,
        heads=heads,
        thresholds=thresholds,
        offset_range=bounds,
        requests=tuple(served),
        batches=tuple(batches),
        switches=tuple(switches),
    )


def _batch_seed(seed: int, batch: int) -> int:
    """A sampling seed per batch, so that batches do not repeat one another's noise."""
    return int(np.random.SeedSequence([seed, batch]).generate_state(1)[0])


def check_prompts(run: LoadedRun, requests: Sequence[Request]) -> None:
    """Every prompt fits the run's positions at every head (any head may serve it), before
    anything is served; else one UserError naming the request."""
    for r in requests:
        for level in run.levels:
            n = _tokens(level, r.prompt)
            if n > run.max_seq:
                raise UserError(
                    f"request {r.id!r}: its prompt is {n} tokens at head {level.vocab} "
                    f"(separator included), above the run's max_seq={run.max_seq}; shorten it"
                )


def _tokens(level, text: str) -> int:
    """Tokens of ``text`` at a level, with the separator the engine puts before it."""
    return len(prompt_ids(level, text))


def prompt_room(run: LoadedRun, max_new_tokens: int) -> PromptRoom:
    """Room for a prompt that leaves ``max_new_tokens`` within the run's positions at every
    head: the demo's prompts are cut to it."""
    return PromptRoom(
        tokens=lambda text: max(_tokens(level, text) for level in run.levels),
        max_tokens=run.max_seq + 1 - max_new_tokens,
    )
