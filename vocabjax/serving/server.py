"""Serving a trace on a virtual clock, with continuous batching (``continuous.py``, the
default) or static batches (here): a router over the policy's batch routes, the quality
controller's level offset, and a record of every request, batch and switch (``records.py``).

    run = load_run("runs/tiny")
    result = serve(Engine(run), load_trace("trace.jsonl"), load_policy("policy.json"),
                   ServeConfig(max_batch=32), thresholds=derive_thresholds(...))
    result.summary(), result.to_json()

Continuous batching admits within a KV-cache plan for a memory budget (``admission.py``): the
simulator's largest batch per head for ``memory_bytes`` (default: the device's memory, 2 GiB on
a CPU), with sequences of the trace's own prompts and limits.

Static batching: the clock starts at 0 and, each round,

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
batch's requests all finish when the batch does.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from vocabjax.errors import UserError
from vocabjax.profiles import SCHEMA
from vocabjax.progress import Progress
from vocabjax.serving.admission import MemoryPlan, default_memory, human_bytes, plan_memory
from vocabjax.serving.continuous import Continuous
from vocabjax.serving.controller import (
    DEFAULT_BAND,
    Thresholds,
    derive_thresholds,
    training_bpb,
)
from vocabjax.serving.engine import Engine, Generation, LoadedRun, Sampling, load_run, prompt_ids
from vocabjax.serving.live import LiveServer
from vocabjax.serving.mixing import default_device
from vocabjax.serving.records import (
    DEFAULT_MAX_NEW_TOKENS,
    ServeConfig,
    ServeResult,
    _Record,
)
from vocabjax.serving.router import (
    HeadChoice,
    Routes,
    choose_head,
    load_policy,
    offset_bounds,
)
from vocabjax.serving.trace import PromptRoom, Request, demo_trace, load_trace

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
    if thresholds is not None and not config.score_prompts:
        raise UserError(
            "the quality controller reads each prompt's bits per byte: keep prompt scoring on "
            "with it, or give no thresholds"
        )
    queue = sorted(requests, key=lambda r: r.arrival_s)
    check_prompts(engine.run, queue)
    heads = tuple(sorted(engine.run.heads))
    bounds = offset_bounds(heads, routes, config.max_batch)
    record = _Record(heads, routes, thresholds, config.window, bounds)
    log = progress or (lambda _line: None)
    if config.batching == "static":
        now = _serve_static(engine, queue, routes, config, record, log)
        log(record.progress_line(len(queue), now))
        return record.result(config)
    plan = memory_plan(engine.run, queue, config, log)
    device = config.device
    if device is None:
        device, where = default_device()
        config = dataclasses.replace(config, device=device)
    else:
        where = "given"
    if config.mixing == "auto" and len(heads) > 1:
        log(f"heads mixed in one step or run apart: the cheaper, priced on {device.name} ({where})")
    loop = Continuous(engine, queue, routes, config, record, plan, log, device)
    loop.serve()
    record.batches = loop.new_tokens()
    log(record.progress_line(len(queue), loop.now))
    return record.result(config, memory=plan, memory_waits=len(loop.memory_waits))


def _serve_static(
    engine: Engine,
    queue: Sequence[Request],
    routes: Routes,
    config: ServeConfig,
    record: _Record,
    log: Progress,
) -> float:
    """The static loop (see the module doc) over ``queue``; the clock when it ends."""
    now = 0.0
    first = 0  # the first request not yet admitted
    while first < len(queue):
        now = max(now, queue[first].arrival_s)  # nothing waiting: the clock jumps to the arrival
        end = admit(queue, first, now, config.max_batch)
        admitted, first = queue[first:end], end
        k = len(record.batches)
        route = record.route(now, len(admitted), k)
        gen, service = _run_batch(engine, admitted, route.head, config, k, log)
        record.batch(admitted, gen, route, k, start_s=now, service_s=service)
        now += service
        if (k + 1) % config.progress_every == 0 and first < len(queue):
            log(record.progress_line(len(queue), now))
    return now


def live_server(
    inputs: ServeInputs, config: ServeConfig, *, progress: Progress | None = None
) -> LiveServer:
    """The engine loop for live traffic (``live.py``) over the inputs' run, routes and
    thresholds, admitting within the KV plan of ``config.memory_bytes`` for traffic like
    ``inputs.requests`` (a trace, or the demo's). It always scores prompts: ``/metrics``
    reports their windowed bits per byte."""
    if not config.score_prompts:
        raise UserError("live serving reports windowed bits per byte: keep prompt scoring on")
    log = progress or (lambda _line: None)
    plan = memory_plan(inputs.run, inputs.requests, config, log)
    engine = Engine(inputs.run)
    return LiveServer(
        engine, inputs.routes, config, plan, thresholds=inputs.thresholds, progress=log
    )


def memory_plan(
    run: LoadedRun, requests: Sequence[Request], config: ServeConfig, log: Progress
) -> MemoryPlan:
    """The KV plan continuous batching admits within: ``config.memory_bytes`` (or the default)
    for sequences of the requests' mean prompt bytes and limit, at each head's bytes per token
    over their prompts."""
    memory, where = (config.memory_bytes, "given") if config.memory_bytes else default_memory()
    texts = [r.prompt for r in requests]
    prompt_bytes = [len(t.encode("utf-8")) for t in texts]
    per_token = {
        level.vocab: sum(prompt_bytes) / sum(_text_tokens(level, t) for t in texts)
        for level in run.levels
    }
    limits = [r.max_new_tokens or config.max_new_tokens for r in requests]
    plan = plan_memory(
        run,
        memory,
        prompt_bytes=float(np.mean(prompt_bytes)),
        max_new_tokens=float(np.mean(limits)),
        bytes_per_token=per_token,
    )
    b_max = ", ".join(f"{v}: {b:,}" for v, b in sorted(plan.b_max.items()))
    log(
        f"memory {human_bytes(memory)} ({where}): weights {human_bytes(plan.weight_bytes)}, "
        f"KV cache {human_bytes(plan.kv_bytes_per_token)} per position; largest running batch "
        f"per head (b_max) {b_max}"
    )
    return plan


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
        score=config.score_prompts,
        pad_batch_to=config.rows(len(admitted)),
    )
    service = time.perf_counter() - started - gen.compile_s
    if gen.compile_s:
        log(
            f"  compiled head {head}, {gen.padded_batch} rows x {gen.bucket} tokens in "
            f"{gen.compile_s:.2f} s (not charged to the clock)"
        )
    return gen, service


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


def _text_tokens(level, text: str) -> int:
    """Tokens of ``text`` alone at a level (its bytes per token leave the separator out)."""
    return _tokens(level, text) - (level.separator is not None)


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
