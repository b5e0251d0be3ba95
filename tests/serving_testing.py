"""A tiny trained run shared by the serving tests (engine, generate, serve): ``make_run`` builds
it, and conftest's session fixture ``served_run_dir`` builds it once for all of them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
from vocab_testing import MAX_BYTES, nested

from vocabjax.serving import Engine, LoadedRun, load_run
from vocabjax.shapes import ModelShape
from vocabjax.train import CorpusSpec, RunConfig, train

MICRO = ModelShape("micro", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, glu=True)
HEADS = (300, 500)
SEQ_LEN = 40


def make_run(out: Path) -> Path:
    """A tiny trained run (a few seconds): its own copy of the test tokenizer, 6 steps."""
    from vocabjax.vocab import save_nested

    save_nested(nested(), out / "tok", corpus="test")
    config = RunConfig(
        shape=MICRO,
        heads=HEADS,
        tokenizer=str(out / "tok"),
        corpus=CorpusSpec("builtin", max_bytes=MAX_BYTES),
        steps=6,
        seq_len=SEQ_LEN,
        batch=2,
        warmup=2,
        eval_tokens=256,
        checkpoint_every=0,
        impl="chunked",
    )
    train(config, out / "run", measure=False)
    return out / "run"


def scramble(run: LoadedRun) -> LoadedRun:
    """The run with larger random weights: a 6-step model predicts mostly spaces, which would
    make greedy agreement a weak check; these give varied tokens with clear margins."""
    keys = jax.random.split(jax.random.key(7), len(run.params))
    params = {
        name: v if v.ndim == 1 else 0.2 * jax.random.normal(k, v.shape, v.dtype)
        for k, (name, v) in zip(keys, sorted(run.params.items()), strict=True)
    }
    return dataclasses.replace(run, params=params, model=run.fn.model(params))


def scrambled_engine(run_dir: Path) -> Engine:
    """An engine of the shared run with scrambled weights (``scramble``)."""
    return Engine(scramble(load_run(run_dir)))
