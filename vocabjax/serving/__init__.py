"""Serving a trained run: load it, pick a head, generate with a jitted KV-cache decode engine.

engine.py   load_run, choose_head / load_policy, Engine (prefill + decode step), Sampling
"""

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

__all__ = [
    "Completion",
    "Engine",
    "Generation",
    "HeadChoice",
    "LoadedRun",
    "Sampling",
    "bucket_length",
    "choose_head",
    "load_policy",
    "load_run",
]
