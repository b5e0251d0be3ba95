"""What a served trace records, and the settings it is served with: ``ServeConfig``; a record
per request, per batch (a static batch, or the requests that joined a running batch together),
per device call of a running batch, per switch of level; ``ServeResult`` with its summary and
JSON; and ``_Record``, which keeps them while a loop serves and gives each served prompt's bits
per byte to the quality controller.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from vocabjax.errors import UserError
from vocabjax.hardware import DeviceProfile, load_device
from vocabjax.profiles import SCHEMA
from vocabjax.serving.admission import MemoryPlan
from vocabjax.serving.batching import Call, CallKind
from vocabjax.serving.controller import DEFAULT_WINDOW, QualityController, Thresholds
from vocabjax.serving.engine import Generation, Sampling
from vocabjax.serving.mixing import MIXING, Mixing
from vocabjax.serving.router import (
    RoutedBatch,
    Routes,
    RouteTable,
    Routing,
    choose_head,
    router_step,
    shift_head,
)
from vocabjax.serving.trace import Request

DEFAULT_MAX_BATCH = 32
DEFAULT_MAX_NEW_TOKENS = 32


Batching = Literal["static", "continuous"]
BATCHING: tuple[Batching, ...] = ("continuous", "static")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """How the server runs a trace."""

    max_batch: int = DEFAULT_MAX_BATCH  # most requests in one batch (static) or running at a head
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # per request, unless its trace line says
    window: int = DEFAULT_WINDOW  # requests in the controller's windowed mean
    # greedy by default; sampled: a static batch k uses seed (seed, k), a request i of a
    # continuous run seed (seed, i)
    sampling: Sampling = Sampling()
    pad_batches: bool = True  # run a static B as the next power of two (<= max_batch) rows
    progress_every: int = 10  # a progress line every this many batches
    batching: Batching = "continuous"  # requests join a running batch, or wait for the next
    memory_bytes: int | None = None  # the KV plan's budget (continuous); None: default_memory()
    # continuous: rows at several heads share a step or run as separate groups, as the cost
    # model prices it ("auto"), or always when they may ("mixed"), or never ("separate")
    mixing: Mixing = "auto"
    # the device the cost model prices that choice on; None: mixing.default_device()
    device: DeviceProfile | None = None
    # each prompt's bits per byte under its head (the prefill also scores the prompt: an
    # unembedding of every prompt position), the quality controller's signal; off: no scoring,
    # no prompt bits per byte, and no controller
    score_prompts: bool = True
    # continuous and live: when more requests wait than rows are free, prefill up to this many
    # together (the ones without a row staged, their caches held, joining as rows free); 0 or
    # 1: a prefill takes only the requests that get a row now
    prefill_ahead: int = 16
    # continuous: while requests wait for rows, a decode call runs until as many rows have
    # stopped as ``cadence.stops_to_wait`` prices worth one round trip to the host on
    # ``device``; False: every call ends at the first row that stops
    priced_stops: bool = True

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_new_tokens", "window", "progress_every"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise UserError(f"{name}={x!r} must be a positive integer")
        if self.batching not in BATCHING:
            raise UserError(f"batching={self.batching!r} must be one of {', '.join(BATCHING)}")
        if self.mixing not in MIXING:
            raise UserError(f"mixing={self.mixing!r} must be one of {', '.join(MIXING)}")
        ahead = self.prefill_ahead
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
            raise UserError(f"prefill_ahead={ahead!r} must be an integer >= 0")
        m = self.memory_bytes
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise UserError(f"memory_bytes={m!r} must be a positive integer")

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> ServeConfig:
        """The config of ``serve``'s options (cli.py's names: max_batch, max_new_tokens, window,
        temperature, top_k, seed, batching, memory, mixing, device_spec, score_prompts,
        prefill_ahead, priced_stops)."""
        spec = options["device_spec"]
        return cls(
            max_batch=options["max_batch"],
            max_new_tokens=options["max_new_tokens"],
            window=options["window"],
            sampling=Sampling(options["temperature"], options["top_k"], options["seed"]),
            batching=options["batching"],
            memory_bytes=options["memory"],
            mixing=options["mixing"],
            device=load_device(spec) if spec else None,
            score_prompts=options.get("score_prompts", True),
            prefill_ahead=options.get("prefill_ahead", 16),
            priced_stops=options.get("priced_stops", True),
        )

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
    prompt_bpb: float | None  # bits per byte of the prompt under ``head`` (None: not scored)
    window_bpb: float | None  # the controller's windowed mean after it (None: not counted)
    stop: str
    text: str  # what was generated
    running: int | None = None  # requests running at its head once it was admitted, itself too

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
    mean_bpb: float | None  # mean prompt bits per byte of its requests (None: not scored)
    running: int | None = None  # requests running at its head once it was admitted
    kv_bytes: int | None = None  # KV cache the running requests of every head reserve then
    steps: int | None = None  # static: the decode steps the batch ran
    group: int | None = None  # continuous: the running group it joined (numbered as created)
    mixed: bool = False  # continuous: that group then held rows at several heads
    grouping: str | None = None  # continuous: why that group (``mixing.Placement.reason``)

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
            "running": self.running,
            "kv_bytes": self.kv_bytes,
            "steps": self.steps,
            "group": self.group,
            "mixed": self.mixed,
        }


@dataclasses.dataclass(frozen=True)
class ServedChunk:
    """A device call of a running batch between admissions: decode steps, a regroup into
    another bucket, a merge of two groups into one, the join of staged requests (prefilled
    by an earlier admission) into free rows, or the empty carry of a new group they join."""

    index: int
    kind: CallKind
    start_s: float
    service_s: float  # measured wall time, compiling left out
    compile_s: float
    head: int
    rows: int  # the bucket it ran at
    running: int  # requests running at its head when it started
    steps: int  # decode steps
    new_tokens: int  # tokens those steps produced
    held: int  # requests running at every head
    kv_bytes: int  # KV cache they reserve
    mixed: bool = False  # rows at several heads in one step (``head``: the widest)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(start_s=round(self.start_s, 6), service_s=round(self.service_s, 6))
        out["compile_s"] = round(self.compile_s, 3)
        return out


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


def _mean(xs: Sequence[float | None]) -> float | None:
    """The mean of the figures that are there (None where none is)."""
    there = [x for x in xs if x is not None]
    return sum(there) / len(there) if there else None


@dataclasses.dataclass(frozen=True)
class ServeResult:
    config: ServeConfig
    heads: tuple[int, ...]
    thresholds: Thresholds | None  # None: the controller was off
    offset_range: tuple[int, int]
    requests: tuple[ServedRequest, ...]  # in the order they were served
    batches: tuple[ServedBatch, ...]
    switches: tuple[Switch, ...]
    chunks: tuple[ServedChunk, ...] = ()  # continuous: the device calls between admissions
    memory: MemoryPlan | None = None  # continuous: the KV plan admission kept to
    memory_waits: int = 0  # continuous: requests that waited for memory at least once
    # continuous: every device call the clock was charged for, in order (``serving.pricing``)
    calls: tuple[Call, ...] = ()

    def summary(self) -> dict[str, Any]:
        reqs, batches, chunks = self.requests, self.batches, self.chunks
        latency = np.asarray([r.latency_s for r in reqs])
        queue = np.asarray([r.queue_s for r in reqs])
        generated = sum(r.new_tokens for r in reqs)
        first = min(r.arrival_s for r in reqs)
        makespan = max(r.finish_s for r in reqs) - first
        busy = sum(b.service_s for b in batches) + sum(c.service_s for c in chunks)
        compiling = sum(b.compile_s for b in batches) + sum(c.compile_s for c in chunks)
        steps = sum(c.steps for c in chunks)
        if chunks:  # requests producing a token per decode step, and the most running
            mean_running = sum(c.new_tokens for c in chunks) / steps if steps else 0.0
            most_running = max(c.running for c in chunks)
        else:  # a static batch's requests all run from its start
            mean_running = _mean([b.batch for b in batches]) or 0.0
            most_running = max(b.batch for b in batches)
        held = [b.kv_bytes for b in batches if b.kv_bytes is not None]
        return {
            "batching": self.config.batching,
            "requests": len(reqs),
            "batches": len(batches),
            "prompt_tokens": sum(r.prompt_tokens for r in reqs),
            "generated_tokens": generated,
            "generated_bytes": sum(len(r.text.encode("utf-8")) for r in reqs),
            "makespan_s": round(makespan, 6),  # first arrival to last finish, virtual
            "busy_s": round(busy, 6),  # the batches' and device calls' service times
            "compile_s": round(compiling, 3),  # not on the clock
            "tokens_per_s": round(generated / makespan, 1) if makespan > 0 else None,
            "busy_tokens_per_s": round(generated / busy, 1) if busy > 0 else None,
            "latency_p50_s": round(float(np.percentile(latency, 50)), 6),
            "latency_p95_s": round(float(np.percentile(latency, 95)), 6),
            "latency_p99_s": round(float(np.percentile(latency, 99)), 6),
            "queue_mean_s": round(float(np.mean(queue)), 6),
            "queue_p95_s": round(float(np.percentile(queue, 95)), 6),
            "running_mean": round(mean_running, 2),
            "running_max": most_running,
            "memory_waits": self.memory_waits,
            "kv_peak_bytes": max(held + [c.kv_bytes for c in chunks], default=None),
            "mixed_steps": sum(c.steps for c in chunks if c.mixed),  # rows at several heads
            "decode_steps": steps,  # continuous: every group's decode steps (0 for static)
            "merges": sum(c.kind == "merge" for c in chunks),  # groups merged into one
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
                "batching": c.batching,
                "mixing": c.mixing,
                "device": None if c.device is None else c.device.name,
                "clock": "virtual: measured batch wall time, compiling not charged",
            },
            "memory": None if self.memory is None else self.memory.to_json(),
            "heads": list(self.heads),
            "controller": None
            if self.thresholds is None
            else {**self.thresholds.to_json(), "offset_range": list(self.offset_range)},
            "summary": self.summary(),
            "by_head": self.head_rows(),
            "by_phase": self.phase_rows(),
            "switches": [s.to_json() for s in self.switches],
            "batches": [
                {**b.row(), "impl_reason": b.impl_reason, "grouping": b.grouping}
                for b in self.batches
            ],
            "chunks": [c.to_json() for c in self.chunks],
            "requests": [r.to_json() for r in self.requests],
        }


class _Record:
    """Recording: the served requests, batches and switches so far, and the quality controller
    that each served prompt's bits per byte goes to."""

    def __init__(
        self,
        heads: tuple[int, ...],
        routes: Routes,
        thresholds: Thresholds | None,
        window: int,
        bounds: tuple[int, int],
    ) -> None:
        self.heads = heads
        self.routes = routes
        self.table = RouteTable.of(heads, routes)
        self.last = np.int32(-1)  # the router's state: the head the next batch would keep
        self.controller = (
            None
            if thresholds is None
            else QualityController(thresholds, window=window, lowest=bounds[0], highest=bounds[1])
        )
        self.served: list[ServedRequest] = []
        self.batches: list[ServedBatch] = []
        self.switches: list[Switch] = []
        self.chunks: list[ServedChunk] = []
        self.calls: list[Call] = []  # continuous: every device call charged to the clock
        self.bounds = bounds
        self.thresholds = thresholds

    def result(self, config: ServeConfig, **extra: Any) -> ServeResult:
        """What was recorded, as a ``ServeResult`` (``extra``: its continuous fields)."""
        return ServeResult(
            config=config,
            heads=self.heads,
            thresholds=self.thresholds,
            offset_range=self.bounds,
            requests=tuple(self.served),
            batches=tuple(self.batches),
            switches=tuple(self.switches),
            chunks=tuple(self.chunks),
            calls=tuple(self.calls),
            **extra,
        )

    @property
    def offset(self) -> int:
        """The controller's offset in levels (0 with the controller off)."""
        return self.controller.offset if self.controller else 0

    def route(self, now: float, batch: int, k: int) -> RoutedBatch:
        """The router's decision for batch ``k`` of ``batch`` requests (``router_step`` from the
        head the last batch kept), and a router switch when it is another head."""
        offset = self.offset
        before = self.last
        self.last, d = router_step(self.table, before, Routing(np.int32(batch), np.int32(offset)))
        routed = choose_head(self.heads, "auto", batch=batch, routes=self.routes)
        route = RoutedBatch(routed, offset, self.heads[int(d.head)])
        if d.switched:
            from_head = self.heads[int(before)]
            self.switches.append(
                Switch(now, from_head, route.head, "router", route.reason, offset, offset, k)
            )
        return route

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
        b = len(admitted)
        for r, c in zip(admitted, gen.completions, strict=True):
            bpb = c.prompt_bpb  # None when the prompts were not scored
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
                    window_bpb=None
                    if bpb is None
                    else self.observe(bpb, c.prompt_bytes, route, k, finish),
                    stop=c.stop,
                    text=c.text,
                    running=b,
                )
            )
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
                steps=gen.decode_steps,
                mean_bpb=_mean([s.prompt_bpb for s in self.served[-b:]]),
                running=b,
            )
        )

    def observe(
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
        self.last = np.int32(self.heads.index(to))
        return move.window_mean

    def progress_line(self, requests: int, now: float) -> str:
        last = self.batches[-1]
        window = None if self.controller is None else self.controller.window_mean
        return (
            f"batch {last.index + 1}: {len(self.served)}/{requests} requests served by "
            f"t = {now:.3f} s (virtual); last B={last.batch} at head {last.head}"
            + ("" if window is None else f"; windowed BPB {window:.3f}")
        )
