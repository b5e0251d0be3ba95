"""Serving a trace: a virtual clock, a router over the policy's batch routes, the quality
controller's level offset, and a record of every request, batch and switch.

    run = load_run("runs/tiny")
    result = serve(Engine(run), load_trace("trace.jsonl"), load_policy("policy.json"),
                   ServeConfig(max_batch=32), thresholds=derive_thresholds(...))
    result.summary(), result.to_json()

The clock is virtual: it starts at 0 and, each round,

1. jumps to the next arrival when no request is waiting;
2. admits up to ``max_batch`` waiting requests (arrival <= now), first come first served:
   B = how many (``admit``);
3. the router (``router.route_batch``) takes the policy's route for B, snapped to the run's
   heads, shifted by the controller's offset in levels and clamped to the run's smallest and
   largest head; the whole batch runs at that head, each request from prefill to its last
   token (a running request keeps its level);
4. runs it through ``Engine.generate`` (``score=True``: each prompt's bits per byte comes
   from the prefill; B padded to a power of two, at most ``max_batch``, so batch sizes share
   compiled shapes) and advances the clock by the batch's measured wall time, less the
   seconds spent compiling a new (head, B, prompt bucket) shape and its warm-up calls: those
   are reported (``compile_s``) but not charged to the clock, as a server compiles its shapes
   before it takes traffic;
5. records the batch and its requests and gives each prompt's bits per byte to the quality
   controller, in the batch's order (``_Record``).

A request's latency is its queue wait (admission - arrival) plus its batch's service time: a
batch's requests all finish when the batch does (static batching).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from vocabjax.errors import UserError
from vocabjax.profiles import SCHEMA
from vocabjax.progress import Progress
from vocabjax.serving.controller import (
    DEFAULT_BAND,
    DEFAULT_WINDOW,
    QualityController,
    Thresholds,
    derive_thresholds,
    training_bpb,
)
from vocabjax.serving.engine import Engine, Generation, LoadedRun, Sampling, load_run, prompt_ids
from vocabjax.serving.router import (
    HeadChoice,
    RoutedBatch,
    Routes,
    choose_head,
    load_policy,
    offset_bounds,
    route_batch,
    shift_head,
)
from vocabjax.serving.trace import PromptRoom, Request, demo_trace, load_trace

DEFAULT_MAX_BATCH = 32
DEFAULT_MAX_NEW_TOKENS = 32


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
    queue = sorted(requests, key=lambda r: r.arrival_s)
    check_prompts(engine.run, queue)
    heads = tuple(sorted(engine.run.heads))
    bounds = offset_bounds(heads, routes, config.max_batch)
    record = _Record(heads, thresholds, config.window, bounds)
    log = progress or (lambda _line: None)
    now = 0.0
    first = 0  # the first request not yet admitted
    while first < len(queue):
        now = max(now, queue[first].arrival_s)  # nothing waiting: the clock jumps to the arrival
        end = admit(queue, first, now, config.max_batch)
        admitted, first = queue[first:end], end
        k = len(record.batches)
        route = route_batch(heads, routes, batch=len(admitted), offset=record.offset)
        record.route(now, route, k)
        gen, service = _run_batch(engine, admitted, route.head, config, k, log)
        record.batch(admitted, gen, route, k, start_s=now, service_s=service)
        now += service
        if (k + 1) % config.progress_every == 0 or first == len(queue):
            log(record.progress_line(len(queue), now))
    return ServeResult(
        config=config,
        heads=heads,
        thresholds=thresholds,
        offset_range=bounds,
        requests=tuple(record.served),
        batches=tuple(record.batches),
        switches=tuple(record.switches),
    )


def admit(queue: Sequence[Request], first: int, now: float, max_batch: int) -> int:
    """Admission: the end of the batch that starts at ``now`` with ``queue[first]``, first come
    first served: up to ``max_batch`` requests that have arrived by ``now``."""
    end = first
    while end < len(queue) and end - first < max_batch and queue[end].arrival_s <= now:
        end += 1
    return end


def _run_batch(
    engine: Engine,
    admitted: Sequence[Request],
    head: int,
    config: ServeConfig,
    k: int,
    log: Progress,
) -> tuple[Generation, float]:
    """Batch ``k`` through the engine at ``head``: its generation and its service seconds (the
    wall time less the seconds spent compiling a new shape)."""
    sampling = dataclasses.replace(config.sampling, seed=_batch_seed(config.sampling.seed, k))
    started = time.perf_counter()
    gen = engine.generate(
        [r.prompt for r in admitted],
        head=head,
        max_new_tokens=[r.max_new_tokens or config.max_new_tokens for r in admitted],
        sampling=sampling,
        score=True,
        pad_batch_to=config.rows(len(admitted)),
    )
    service = time.perf_counter() - started - gen.compile_s
    if gen.compile_s:
        log(
            f"  compiled head {head}, {gen.padded_batch} rows x {gen.bucket} tokens in "
            f"{gen.compile_s:.2f} s (not charged to the clock)"
        )
    return gen, service


class _Record:
    """Recording: the served requests, batches and switches so far, and the quality controller
    that each served prompt's bits per byte goes to."""

    def __init__(
        self,
        heads: tuple[int, ...],
        thresholds: Thresholds | None,
        window: int,
        bounds: tuple[int, int],
    ) -> None:
        self.heads = heads
        self.controller = (
            None
            if thresholds is None
            else QualityController(thresholds, window=window, lowest=bounds[0], highest=bounds[1])
        )
        self.served: list[ServedRequest] = []
        self.batches: list[ServedBatch] = []
        self.switches: list[Switch] = []
        self.last_head: int | None = None  # the head the next batch would keep

    @property
    def offset(self) -> int:
        """The controller's offset in levels (0 with the controller off)."""
        return self.controller.offset if self.controller else 0

    def route(self, now: float, route: RoutedBatch, k: int) -> None:
        """A router switch before batch ``k`` when its head is not the one the last kept."""
        if self.last_head is not None and route.head != self.last_head:
            self.switches.append(
                Switch(
                    now,
                    self.last_head,
                    route.head,
                    "router",
                    route.reason,
                    route.offset,
                    route.offset,
                    k,
                )
            )
        self.last_head = route.head

    def batch(
        self,
        admitted: Sequence[Request],
        gen: Generation,
        route: RoutedBatch,
        k: int,
        *,
        start_s: float,
        service_s: float,
    ) -> None:
        """Batch ``k`` served from ``start_s`` for ``service_s``: each prompt's bits per byte
        to the controller in the batch's order, a record per request and one for the batch."""
        finish = start_s + service_s
        for r, c in zip(admitted, gen.completions, strict=True):
            bpb = c.prompt_bpb
            assert bpb is not None  # score=True
            self.served.append(
                ServedRequest(
                    id=r.id,
                    phase=r.phase,
                    arrival_s=r.arrival_s,
                    start_s=start_s,
                    finish_s=finish,
                    batch=k,
                    head=route.head,
                    offset=route.offset,
                    prompt_tokens=c.prompt_tokens,
                    new_tokens=len(c.tokens),
                    prompt_bytes=c.prompt_bytes,
                    prompt_bpb=bpb,
                    window_bpb=self._observe(bpb, c.prompt_bytes, route, k, finish),
                    stop=c.stop,
                    text=c.text,
                )
            )
        b = len(admitted)
        self.batches.append(
            ServedBatch(
                index=k,
                start_s=start_s,
                service_s=service_s,
                compile_s=gen.compile_s,
                batch=b,
                rows=gen.padded_batch,
                bucket=gen.bucket,
                routed_head=route.routed.vocab,
                offset=route.offset,
                head=route.head,
                impl=gen.impl,
                impl_reason=gen.impl_reason,
                new_tokens=sum(len(c.tokens) for c in gen.completions),
                mean_bpb=sum(s.prompt_bpb for s in self.served[-b:]) / b,
            )
        )

    def _observe(
        self, bpb: float, weight: int, route: RoutedBatch, k: int, now: float
    ) -> float | None:
        """One prompt to the controller: the windowed bits per byte after it (None when it is
        not counted), and a switch when it moves the level."""
        if self.controller is None:
            return None
        move = self.controller.observe(bpb, route.offset, weight=weight)
        if move is None:  # counted unless a move earlier in this batch made it stale
            same = self.controller.offset == route.offset
            return self.controller.window_mean if same else None
        to = shift_head(self.heads, route.routed.vocab, move.to_offset)
        self.switches.append(
            Switch(now, route.head, to, "controller", move.reason, route.offset, move.to_offset, k)
        )
        self.last_head = to
        return move.window_mean

    def progress_line(self, requests: int, now: float) -> str:
        last = self.batches[-1]
        window = None if self.controller is None else self.controller.window_mean
        return (
            f"batch {last.index + 1}: {len(self.served)}/{requests} requests served by "
            f"t = {now:.3f} s (virtual); last B={last.batch} at head {last.head}"
            + ("" if window is None else f"; windowed BPB {window:.3f}")
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


# ---- from files, for the command line and notebooks ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServeInputs:
    """What ``serve`` takes from its files, read and checked."""

    run: LoadedRun
    routes: list[tuple[int | None, int]]  # the policy's batch routes
    requests: tuple[Request, ...]  # the trace's, or the demo trace's
    thresholds: Thresholds | None  # the quality controller's band; None: it is off
    policy: str  # the policy file
    trace: str | None  # the trace file; None: the demo trace
    seed: int  # the demo trace's seed

    def context(self) -> dict[str, Any]:
        """Where a served result came from, as ``ServeResult.to_json`` leads with it."""
        trace = self.trace if self.trace is not None else f"demo (seed {self.seed})"
        run = self.run
        return {"run": str(run.run_dir), "step": run.step, "policy": self.policy, "trace": trace}


def load_serve_inputs(
    run_dir: str | Path,
    policy: str | Path,
    *,
    trace: str | Path | None = None,
    seed: int = 0,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    bpb_high: float | None = None,
    bpb_low: float | None = None,
    bpb_band: float = DEFAULT_BAND,
    progress: Progress | None = None,
) -> ServeInputs:
    """Read the policy, the trace, the run and the controller's thresholds (the given ones, the
    others from the run's held-out bits per byte: ``derive_thresholds``), in that order, so a
    problem with an earlier input is the one reported; without a trace, build the demo trace of
    ``seed``, its prompts cut to leave room for ``max_new_tokens``."""
    routes = load_policy(policy)
    requests = load_trace(trace) if trace else None
    run = load_run(run_dir)
    thresholds = derive_thresholds(
        training_bpb(run.run_dir, run.heads),
        high=bpb_high,
        low=bpb_low,
        band=bpb_band,
        where=str(run.run_dir),
    )
    if progress is not None:
        heads = ", ".join(map(str, run.heads))
        progress(f"{run.run_dir}: {run.config.shape.name} at step {run.step}, heads {heads}")
    if requests is None:
        requests = demo_trace(seed, room=prompt_room(run, max_new_tokens))
    trace_name = str(trace) if trace else None
    return ServeInputs(run, routes, tuple(requests), thresholds, str(policy), trace_name, seed)


@dataclasses.dataclass(frozen=True)
class Generated:
    """Prompts continued as one batch: the head the router chose and why, and the generation."""

    run: LoadedRun
    choice: HeadChoice
    generation: Generation
    sampling: Sampling
    max_new_tokens: int | Sequence[int]

    def rows(self) -> list[dict[str, Any]]:
        """One row per prompt: its text, head, tokens in and out, why it stopped, the text."""
        return [
            {
                "prompt": c.prompt,
                "head": c.head,
                "prompt_tokens": c.prompt_tokens,
                "new_tokens": len(c.tokens),
                "stop": c.stop,
                "text": c.text,
            }
            for c in self.generation.completions
        ]

    def to_json(self) -> dict[str, Any]:
        """The ``generate --format json`` document."""
        gen, s = self.generation, self.sampling
        return {
            "schema": SCHEMA,
            "kind": "generate",
            "run": str(self.run.run_dir),
            "step": self.run.step,
            "head": gen.head,
            "head_reason": self.choice.reason,
            "impl": gen.impl,
            "temperature": s.temperature,
            "top_k": s.top_k,
            "seed": s.seed,
            "max_new_tokens": self.max_new_tokens,
            "completions": [
                {**r, "tokens": list(c.tokens)}
                for r, c in zip(self.rows(), gen.completions, strict=True)
            ],
            "timing": gen.timing(),
        }


def generate(
    engine: Engine,
    prompts: Sequence[str],
    *,
    head: int | Literal["auto"] = "auto",
    routes: Routes | None = None,
    max_new_tokens: int | Sequence[int] = 64,
    sampling: Sampling | None = None,
    progress: Progress | None = None,
) -> Generated:
    """Continue ``prompts`` as one batch at ``head``; ``"auto"``: the policy's route for their
    count (``choose_head``), or the largest head without ``routes``. ``progress`` gets the
    choice and, after the generation, its kernel and timings."""
    sampling = sampling or Sampling()
    run = engine.run
    choice = choose_head(run.heads, head, batch=len(prompts), routes=routes)
    engine.encode(prompts, choice.vocab)  # an empty or too long prompt fails before any log
    log = progress or (lambda _line: None)
    log(f"{run.run_dir}: {run.config.shape.name} at step {run.step}; {choice.reason}")
    gen = engine.generate(
        list(prompts), head=choice.vocab, max_new_tokens=max_new_tokens, sampling=sampling
    )
    log(_timing_line(gen))
    return Generated(run, choice, gen, sampling, max_new_tokens)


def _timing_line(gen: Generation) -> str:
    t = gen.timing()
    rate = t["decode_tokens_per_s"]
    decoding = (
        f"decode {rate:,.0f} tokens/s ({t['decode_steps']} steps, "
        f"{t['decode_ms_per_step']:.2f} ms/step)"
        if rate is not None
        else "no decode steps"
    )
    return (
        f"unembedding impl {gen.impl} ({gen.impl_reason}); compiled in {t['compile_s']:.2f} s; "
        f"prefill {t['prefill_ms']:.2f} ms (B={t['batch']}, padded to {t['bucket']} tokens); "
        + decoding
    )
