"""Serving a trained run: load it, pick a head, generate with a jitted KV-cache decode engine,
and serve a trace of requests with a router and a quality controller.

decode.py      the device side: prefill and the on-device decode loop as pure, jittable
               functions of a DecodeConfig, with their carry (Decoding); Sampling
engine.py      load_run, Engine: host packing of prompts, the compile cache, timed generation
batching.py    RunningBatch: continuous batching, requests joining and leaving a running batch
staging.py     prefilling ahead: which waiting requests a prefill also takes (ahead), and the
               queue of staged prefills joining rows as rows free (Stages); both loops use it
router.py      load_policy, choose_head / shift_head / offset_bounds, route_batch, router_step
trace.py       Request, load_trace / write_trace (JSONL), demo_trace and poisson_trace
               (builtin corpus)
controller.py  Thresholds, derive_thresholds / training_bpb, controller_step (hysteresis, a
               pure function) and its host caller QualityController
admission.py   MemoryPlan, plan_memory (the KV plan for a memory budget), admit_count
mixing.py      Pricer: rows at several heads in one decode step or in separate groups, the
               cheaper by the cost model
pricing.py     CallPricer: the cost model's price of each device call a served trace made,
               beside what it measured; run_model, the cost model of a served run
cadence.py     stops_to_wait: how many rows a decode call frees before the host looks again
records.py     ServeConfig, the records of a served trace, ServeResult (summary, JSON)
continuous.py  the continuous-batching loop on the virtual clock
live.py        LiveServer: the engine loop for live traffic on its own thread (http.py, the
               HTTP endpoint over it, needs the serve extra and is not imported here)
server.py      serve (continuous or static batching on the virtual clock), memory_plan,
               live_server;
               load_serve_inputs and generate: what the serve and generate commands do
"""

from vocabjax.serving.admission import MemoryPlan, admit_count, default_memory, plan_memory
from vocabjax.serving.batching import Finished, Joined, Joining, RunningBatch, solo_key
from vocabjax.serving.continuous import request_seed
from vocabjax.serving.controller import (
    DEFAULT_BAND,
    DEFAULT_WINDOW,
    ControllerConfig,
    ControllerState,
    Decision,
    Move,
    Observation,
    QualityController,
    Thresholds,
    controller_init,
    controller_step,
    derive_thresholds,
    training_bpb,
)
from vocabjax.serving.decode import STOP_CODES, DecodeConfig, Decoding, Sampling
from vocabjax.serving.engine import (
    Compiled,
    Completion,
    Engine,
    Generation,
    LoadedRun,
    attention_window,
    bucket_length,
    load_run,
)
from vocabjax.serving.live import Delta, Draining, LiveRequest, LiveServer, Outcome, Ticket
from vocabjax.serving.mixing import MIXING, Group, Placement, Pricer
from vocabjax.serving.records import (
    BATCHING,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_NEW_TOKENS,
    ServeConfig,
    ServedBatch,
    ServedChunk,
    ServedRequest,
    ServeResult,
    Switch,
)
from vocabjax.serving.router import (
    HeadChoice,
    RoutedBatch,
    RouteDecision,
    RouteTable,
    Routing,
    choose_head,
    load_policy,
    offset_bounds,
    route_batch,
    router_step,
    shift_head,
)
from vocabjax.serving.server import (
    Generated,
    ServeInputs,
    admit,
    check_prompts,
    generate,
    live_server,
    load_serve_inputs,
    memory_plan,
    prompt_room,
    serve,
)
from vocabjax.serving.trace import (
    DEMO_PHASES,
    DemoPhase,
    PoissonMix,
    PromptRoom,
    Request,
    demo_trace,
    load_trace,
    poisson_trace,
    write_trace,
)

__all__ = [
    "BATCHING",
    "DEFAULT_BAND",
    "DEFAULT_MAX_BATCH",
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_WINDOW",
    "DEMO_PHASES",
    "STOP_CODES",
    "Compiled",
    "Completion",
    "ControllerConfig",
    "ControllerState",
    "Decision",
    "DecodeConfig",
    "Decoding",
    "Delta",
    "DemoPhase",
    "Draining",
    "Engine",
    "Finished",
    "Generated",
    "Generation",
    "HeadChoice",
    "Joined",
    "Joining",
    "LiveRequest",
    "LiveServer",
    "LoadedRun",
    "MemoryPlan",
    "MIXING",
    "Group",
    "Placement",
    "Pricer",
    "Move",
    "Observation",
    "Outcome",
    "PromptRoom",
    "QualityController",
    "Request",
    "RouteDecision",
    "RouteTable",
    "RoutedBatch",
    "Routing",
    "RunningBatch",
    "Sampling",
    "ServeConfig",
    "ServeInputs",
    "ServeResult",
    "ServedBatch",
    "ServedChunk",
    "ServedRequest",
    "Switch",
    "Thresholds",
    "Ticket",
    "admit",
    "admit_count",
    "attention_window",
    "bucket_length",
    "check_prompts",
    "choose_head",
    "controller_init",
    "controller_step",
    "default_memory",
    "demo_trace",
    "poisson_trace",
    "PoissonMix",
    "derive_thresholds",
    "generate",
    "live_server",
    "load_policy",
    "load_run",
    "load_serve_inputs",
    "load_trace",
    "memory_plan",
    "offset_bounds",
    "plan_memory",
    "prompt_room",
    "request_seed",
    "route_batch",
    "router_step",
    "serve",
    "shift_head",
    "solo_key",
    "training_bpb",
    "write_trace",
]
