"""The engine's device side: prefill and the on-device decode loop as pure functions of a
``DecodeConfig`` (static) and arrays, each jittable on its own.

    config = DecodeConfig(run.fn, run.max_seq, head=500, separator=0)
    caches, first_b, _ = jax.jit(partial(prefill, config))(params, ids_bt, lengths_b, rng)
    done = jax.jit(partial(decode, config))(params, caches, first_b, lengths_b, limits_b,
                                            real_b, rng)
    done.out_bs, done.n_b, done.stop_b                  # generated ids, counts, STOP_CODES

``prefill`` runs right-padded prompts through ``GPT.cached`` at positions 0..T_p-1, filling
per-layer K/V caches of (B, max_seq, K, Dh), and picks each row's first token from its last real
prompt position. ``decode`` is ``start`` (the carry, with the first tokens taken) and then
``step`` in a ``lax.while_loop`` until every real row has stopped: each step feeds one token
per running row at its own position (its length so far), appends its K/V there and attends to
the positions before it, so the padding a shorter prompt leaves in the cache is overwritten
before any query can see it. ``take`` appends a step's tokens and sets each row's stop code.

Every per-row quantity (position, count, limit, stop code, whether the row holds a request)
lives in the carry ``Decoding``, so a caller may change rows between runs of ``step``.

The next token is ``vocabjax.unembed.greedy`` (temperature 0) or ``sample`` (Gumbel-max at a
temperature, optionally within the top k) on the head ``W[:V]`` with ``impl="auto"``. Step i
samples with ``fold_in(rng, i)`` (the prefill's pick with ``fold_in(rng, 0)``), so a key
reproduces a generation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from vocabjax import unembed
from vocabjax.errors import UserError
from vocabjax.models import GPT, head_loss
from vocabjax.train import IGNORE, Functional

Stop = Literal["eos", "max_new_tokens", "max_seq"]
# How the decode loop marks a row: still running, or why it stopped.
STOP_CODES = {"running": 0, "eos": 1, "max_new_tokens": 2, "max_seq": 3, "nonfinite": 4}
STOP_NAMES = {code: name for name, code in STOP_CODES.items()}


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is picked."""

    temperature: float = 0.0  # 0: greedy (argmax); > 0: sample softmax(logits / temperature)
    top_k: int | None = None  # sample among the k largest logits only (temperature > 0)
    seed: int = 0  # the sampling key: jax.random.key(seed), folded with the step

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise UserError(f"temperature={t!r} must be a finite number >= 0 (0: greedy)")
        if self.top_k is not None:
            k = self.top_k
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise UserError(f"top_k={k!r} must be a positive integer")
            if t == 0:
                raise UserError("top_k applies to sampling: give a temperature > 0 with it")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """What prefill and the decode loop are specialised to (static under jit)."""

    fn: Functional  # the model's graph; fn.model(params) rebuilds it inside jit
    max_seq: int  # cache positions; learned positions end there
    head: int  # V: tokens are picked on the head W[:V]
    sampling: Sampling = Sampling()  # greedy or sampled; its seed is not read (rng is an argument)
    separator: int | None = None  # the id that stops a row (the stop is not part of its text)
    score: bool = False  # prefill also returns each prompt's nats under the head

    @property
    def stop_id(self) -> int:
        """The separator's id, or -1 (ids are >= 0: it matches none)."""
        return -1 if self.separator is None else int(self.separator)


class Decoding(NamedTuple):
    """The decode loop's carry: the caches, generated ids and every per-row counter."""

    caches: Any  # per-layer K/V, (B, max_seq, K, Dh) each
    out_bs: jax.Array  # generated ids, row i's first n_b[i] valid
    n_b: jax.Array  # tokens generated per row
    stop_b: jax.Array  # STOP_CODES
    last_b: jax.Array  # the token each row feeds next (its last generated; 0 before any)
    pos_b: jax.Array  # where each row's next fed token goes
    limits_b: jax.Array  # most tokens each row may generate
    real_b: jax.Array  # rows that hold a request (the others never run)
    steps: jax.Array  # decode steps run (step i samples with fold_in(rng, i))
    produced: jax.Array  # tokens the steps produced for running rows


def pick(config: DecodeConfig, model: GPT, h_bd: jax.Array, rng: jax.Array) -> jax.Array:
    """The next token of each row from its hidden state (B, D); -1 where it is not finite."""
    w_vd = model.head(config.head)
    s = config.sampling
    if s.greedy:
        return unembed.greedy(h_bd, w_vd, impl="auto")
    return unembed.sample(h_bd, w_vd, rng, s.temperature, s.top_k, impl="auto")


def prompt_nats(
    config: DecodeConfig, model: GPT, h_btd: jax.Array, ids_bt: jax.Array, lengths_b: jax.Array
) -> jax.Array:
    """Each prompt's teacher-forced nats under the head: position t predicts token t + 1, and
    predictions past a prompt's end are left out (the leading separator is given)."""
    t = ids_bt.shape[1]
    real_bt = jnp.arange(1, t, dtype=lengths_b.dtype)[None, :] < lengths_b[:, None]
    labels_bt = jnp.where(real_bt, ids_bt[:, 1:], IGNORE)
    w_vd = model.head(config.head)
    nats_bt = head_loss(h_btd[:, :-1], w_vd, labels_bt, impl="auto", reduction="none")
    return nats_bt.sum(axis=1)


def prefill(
    config: DecodeConfig, params, ids_bt: jax.Array, lengths_b: jax.Array, rng: jax.Array
) -> tuple[Any, jax.Array, jax.Array | None]:
    """(caches, each row's first token, each prompt's nats or None) of right-padded prompts
    ``ids_bt`` whose real lengths are ``lengths_b``."""
    model = config.fn.model(params)
    rows = ids_bt.shape[0]
    caches = model.init_cache(rows, config.max_seq)
    h_btd, caches = model.cached(ids_bt, caches, jnp.zeros((rows,), jnp.int32))
    h_bd = jnp.take_along_axis(h_btd, (lengths_b - 1)[:, None, None], axis=1)[:, 0]
    nats_b = prompt_nats(config, model, h_btd, ids_bt, lengths_b) if config.score else None
    return caches, pick(config, model, h_bd, jax.random.fold_in(rng, 0)), nats_b


def running(state: Decoding) -> jax.Array:
    """The rows still generating: real and not stopped."""
    return state.real_b & (state.stop_b == STOP_CODES["running"])


def take(
    config: DecodeConfig, state: Decoding, tokens_b: jax.Array, running_b: jax.Array
) -> Decoding:
    """Each running row's new token: a non-finite state (id -1) or the separator stops it, any
    other token is appended, then the row stops at its limit or at max_seq."""
    bad = running_b & (tokens_b < 0)
    eos = running_b & ~bad & (tokens_b == config.stop_id)
    keep = running_b & ~bad & ~eos
    col = jnp.arange(config.max_seq, dtype=jnp.int32)[None, :]
    out_bs = jnp.where(keep[:, None] & (col == state.n_b[:, None]), tokens_b[:, None], state.out_bs)
    n_b = state.n_b + keep.astype(jnp.int32)
    stop_b = jnp.where(bad, STOP_CODES["nonfinite"], state.stop_b)
    stop_b = jnp.where(eos, STOP_CODES["eos"], stop_b)
    full = keep & (n_b >= state.limits_b)
    stop_b = jnp.where(full, STOP_CODES["max_new_tokens"], stop_b)
    ended = keep & ~full & (state.pos_b >= config.max_seq)
    stop_b = jnp.where(ended, STOP_CODES["max_seq"], stop_b)
    last_b = jnp.where(keep, tokens_b, state.last_b)
    return state._replace(out_bs=out_bs, n_b=n_b, stop_b=stop_b, last_b=last_b)


def start(
    config: DecodeConfig,
    caches,
    first_b: jax.Array,
    start_b: jax.Array,
    limits_b: jax.Array,
    real_b: jax.Array,
) -> Decoding:
    """The carry after a prefill: ``first_b`` taken for the real rows, whose next token goes at
    ``start_b`` (their prompt lengths)."""
    zeros_b = jnp.zeros(first_b.shape, jnp.int32)
    state = Decoding(
        caches=caches,
        out_bs=jnp.zeros((first_b.shape[0], config.max_seq), jnp.int32),
        n_b=zeros_b,
        stop_b=zeros_b,
        last_b=zeros_b,
        pos_b=start_b,
        limits_b=limits_b,
        real_b=real_b,
        steps=jnp.int32(0),
        produced=jnp.int32(0),
    )
    return take(config, state, first_b, real_b)


def step(config: DecodeConfig, params, state: Decoding, rng: jax.Array) -> Decoding:
    """One decode step: each running row feeds its last token at its position and takes the
    next; the other rows keep their state."""
    model = config.fn.model(params)
    run_b = running(state)
    steps = state.steps + 1
    pos_b = jnp.minimum(state.pos_b, config.max_seq - 1)  # finished rows write harmlessly
    h_b1d, caches = model.cached(state.last_b[:, None], state.caches, pos_b)
    tokens_b = pick(config, model, h_b1d[:, 0], jax.random.fold_in(rng, steps))
    state = state._replace(
        caches=caches,
        pos_b=state.pos_b + run_b.astype(jnp.int32),
        steps=steps,
        produced=state.produced + run_b.sum(dtype=jnp.int32),
    )
    return take(config, state, tokens_b, run_b)


def decode(
    config: DecodeConfig,
    params,
    caches,
    first_b: jax.Array,
    start_b: jax.Array,
    limits_b: jax.Array,
    real_b: jax.Array,
    rng: jax.Array,
) -> Decoding:
    """Every decode step in one on-device loop, until each real row has stopped: no host round
    trip per token. The caches come back in the result, so a caller that donates them gets the
    loop's own buffers."""
    state = start(config, caches, first_b, start_b, limits_b, real_b)
    body = functools.partial(step, config, params, rng=rng)
    return lax.while_loop(lambda s: running(s).any(), body, state)
