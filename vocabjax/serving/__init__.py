"""Serving a trained run: load it, pick a head, generate with a jitted KV-cache decode engine,
and serve a trace of requests with a router and a quality controller.

engine.py      load_run, choose_head / load_policy, Engine (prefill + decode step), Sampling
trace.py       Request, load_trace / write_trace (JSONL), demo_trace (builtin corpus)
controller.py  Thresholds, derive_thresholds / training_bpb, QualityController (hysteresis)
server.py      serve: the virtual clock, the router's offset, ServeResult (records, summary)
"""

from vocabjax.serving.controller import (
    DEFAULT_BAND,
    DEFAULT_WINDOW,
    Move,
    QualityController,
    Thresholds,
    derive_thresholds,
    training_bpb,
)
from vocabjax.serving.engine import (
    Completion,
    Engine,
    Generation,
    HeadChoice,
    LoadedRun,
    Sampling,
    bucket_length,
    choose_head,
    load_policy,
    load_run,
)
from vocabjax.serving.server import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_NEW_TOKENS,
    ServeConfig,
    ServedBatch,
    ServedRequest,
    ServeResult,
    Switch,
    check_prompts,
    offset_bounds,
    prompt_room,
    serve,
    shift_head,
)
from vocabjax.serving.trace import (
    DEMO_PHASES,
    DemoPhase,
    PromptRoom,
    Request,
    demo_trace,
    load_trace,
    write_trace,
)

__all__ = [
    "DEFAULT_BAND",
    "DEFAULT_MAX_BATCH",
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_WINDOW",
    "DEMO_PHASES",
    "Completion",
    "DemoPhase",
    "Engine",
    "Generation",
    "HeadChoice",
    "LoadedRun",
    "Move",
    "PromptRoom",
    "QualityController",
    "Request",
    "Sampling",
    "ServeConfig",
    "ServeResult",
    "ServedBatch",
    "ServedRequest",
    "Switch",
    "Thresholds",
    "bucket_length",
    "check_prompts",
    "choose_head",
    "demo_trace",
    "derive_thresholds",
    "load_policy",
    "load_run",
    "load_trace",
    "offset_bounds",
    "prompt_room",
    "serve",
    "shift_head",
    "training_bpb",
    "write_trace",
]
