"""The engine's device side: prefill and the on-device decode loop as pure functions of a
``DecodeConfig`` (static) and arrays, each jittable on its own; and the row changes a running
batch needs (``put_rows``, ``take_rows``) with the loop that yields to the host
(``decode_some``).

    config = DecodeConfig(run.fn, run.max_seq, head=500, separator=0)
    caches, first_b, _ = jax.jit(partial(prefill, config))(params, ids_bt, lengths_b, rng)
    done = jax.jit(partial(decode, config))(params, caches, first_b, lengths_b, limits_b,
                                            real_b, rng)
    done.out_bs, done.n_b, done.stop_b                  # generated ids, counts, STOP_CODES

``prefill`` runs right-padded prompts through ``GPT.cached`` at positions 0..T_p-1 (``fresh``:
they attend among themselves, not over the whole cache), filling per-layer K/V caches of (B,
max_seq, K, Dh), and picks each row's first token from its last real prompt position.
``decode`` is ``start`` (the carry, with the first tokens taken) and then ``step`` in a
``lax.while_loop`` until every real row has stopped: each step feeds one token per running row
at its own position (its length so far), appends its K/V there and attends to the positions
before it, within the first ``config.window`` positions when the caller gives a window no row
reaches past (``engine.attention_window``), so the padding a shorter prompt leaves in the
cache is overwritten before any query can see it. ``take`` appends a step's tokens and sets
each row's stop code.

Every per-row quantity (position, count, limit, stop code, whether the row holds a request)
lives in the carry ``Decoding``, so a caller may change rows between runs of ``step``: continuous
batching prefills only the joining prompts (``prefill`` of their own rows), writes them into
free rows of the running carry (``put_rows`` of ``start``'s rows), runs ``decode_some`` (at most
k steps, ending early when a row stops) and regroups the rows into a smaller or larger bucket
(``take_rows``).

The next token is ``vocabjax.unembed.greedy`` (temperature 0) or ``sample`` (Gumbel-max at a
temperature, optionally within the top k) on the head ``W[:V]`` with ``impl="auto"``. Sampling
is keyed per row: ``rng`` is one key for the batch (row i gets ``fold_in(rng, i)``) or one key
per row, and a row's token j (0: the prefill's pick) uses ``fold_in(row key, j)``. So a key
reproduces a generation, and a row's tokens depend on its own key alone, never on its row or
the rows beside it.

Rows can pick each their own way in one step (``DecodeConfig.per_row``, a ``RowPicks``): each
row's head, temperature and top k are in the carry (``vocab_b``, ``temp_b``, ``topk_b``), and
``pick_rows`` picks over the row's own prefix ``W[:vocab_b]`` of ``W[:head]`` (``head`` the
widest), greedy where its temperature is 0, else sampled at its temperature within its top k.
That is what the row's own head and setting pick alone where that pick is ``unembed``'s xla
path. Only whether any row samples and a bucket of the largest top k are static, so a running
batch serves requests of any temperature and top k with a few compiled steps (``RowPicks.of``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import noise
from vocabjax import unembed
from vocabjax.errors import UserError
from vocabjax.models import GPT, head_loss
from vocabjax.train import IGNORE, Functional
from vocabjax.unembed.argmax import max_argmax
from vocabjax.unembed.chunked import tile_logits

Stop = Literal["eos", "max_new_tokens", "max_seq"]
# How the decode loop marks a row: still running, or why it stopped.
STOP_CODES = {"running": 0, "eos": 1, "max_new_tokens": 2, "max_seq": 3, "nonfinite": 4}
STOP_NAMES = {code: name for name, code in STOP_CODES.items()}


MIN_TEMPERATURE = 1e-6  # the least temperature above 0 (its inverse is far inside float32)


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
        if 0 < t < MIN_TEMPERATURE:  # 1 / t would overflow float32 and stop the row as non-finite
            raise UserError(
                f"temperature={t!r} is below {MIN_TEMPERATURE:g}: give 0 for greedy picks"
            )
        if self.top_k is not None:
            k = self.top_k
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise UserError(f"top_k={k!r} must be a positive integer")
            if t == 0:
                raise UserError("top_k applies to sampling: give a temperature > 0 with it")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


TOP_K_BUCKET = 4  # per-row top k is compiled for buckets 16, 64, 256, ... (powers of this)


class RowPicks(NamedTuple):
    """What a per-row pick (``pick_rows``) is compiled for: whether any row samples, and a
    bucket at least every row's top k (0: no row restricts its sample to a top k)."""

    sampled: bool
    top_k: int

    @classmethod
    def of(cls, samplings: Iterable[Sampling]) -> RowPicks:
        """The picks rows of these settings need: sampled if any samples, and the top-k bucket
        of the largest k (the next of 16, 64, 256, ...)."""
        samplings = list(samplings)
        largest = max((s.top_k or 0 for s in samplings), default=0)
        bucket = 0
        if largest:
            bucket = 16
            while bucket < largest:
                bucket *= TOP_K_BUCKET
        return cls(any(not s.greedy for s in samplings), bucket)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """What prefill and the decode loop are specialised to (static under jit)."""

    fn: Functional  # the model's graph; fn.model(params) rebuilds it inside jit
    max_seq: int  # cache positions; learned positions end there
    head: int  # V: tokens are picked on the head W[:V]
    sampling: Sampling = Sampling()  # greedy or sampled; its seed is not read (rng is an argument)
    separator: int | None = None  # the id that stops a row (the stop is not part of its text)
    score: bool = False  # prefill also returns each prompt's nats under the head
    # None: every row picks by ``sampling`` over W[:head] (unembed's ``auto`` kernels); else
    # each row by its own head, temperature and top k in the carry (``pick_rows``), which
    # ``sampling`` then only fills in where a caller gives none
    per_row: RowPicks | None = None
    # cache positions a decode step attends to (None: all max_seq): the caller's bound on every
    # position its rows reach, so a step reads that much of the cache (``attention_window``)
    window: int | None = None

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
    vocab_b: jax.Array  # each row's head V (a per-row pick is over W[:V] of the row)
    temp_b: jax.Array  # each row's temperature, float32 (0: greedy; read by a per-row pick)
    topk_b: jax.Array  # each row's top k (0: the whole head; read by a per-row pick)
    steps: jax.Array  # decode steps run
    produced: jax.Array  # tokens the steps produced for running rows


def row_keys(rng: jax.Array, rows: int) -> jax.Array:
    """One typed key per row: ``rng`` itself when it holds ``rows`` keys, else ``fold_in(rng,
    row)`` of the one key."""
    if rng.shape == (rows,):
        return rng
    return jax.vmap(jax.random.fold_in, (None, 0))(rng, jnp.arange(rows, dtype=jnp.uint32))


def row_sampling(
    config: DecodeConfig, rows: int, temp_b: jax.Array | None, topk_b: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Each row's temperature (float32) and top k (int32, 0: none): those given, else
    ``config.sampling``'s for every row."""
    s = config.sampling
    if temp_b is None:
        temp_b = jnp.full((rows,), s.temperature, jnp.float32)
    if topk_b is None:
        topk_b = jnp.full((rows,), s.top_k or 0, jnp.int32)
    return jnp.asarray(temp_b, jnp.float32), jnp.asarray(topk_b, jnp.int32)


def pick(
    config: DecodeConfig,
    model: GPT,
    h_bd: jax.Array,
    keys_b: jax.Array,
    j_b: jax.Array,
    vocab_b: jax.Array | None = None,
    temp_b: jax.Array | None = None,
    topk_b: jax.Array | None = None,
) -> jax.Array:
    """The next token of each row from its hidden state (B, D), the row's token ``j_b`` drawn
    with ``fold_in(keys_b, j_b)``; -1 where the state is not finite. With ``config.per_row``
    each row picks by its own head ``vocab_b``, temperature ``temp_b`` and top k ``topk_b``
    (``pick_rows``; one not given: the head and ``config.sampling``'s for every row)."""
    if config.per_row is not None:
        rows = h_bd.shape[0]
        vocab_b = jnp.full((rows,), config.head, jnp.int32) if vocab_b is None else vocab_b
        temp_b, topk_b = row_sampling(config, rows, temp_b, topk_b)
        return pick_rows(config, model, h_bd, keys_b, j_b, vocab_b, temp_b, topk_b)
    w_vd = model.head(config.head)
    s = config.sampling
    if s.greedy:
        return unembed.greedy(h_bd, w_vd, impl="auto")

    def one(h_d, key, j):  # a row alone: its noise cannot depend on its row index
        return unembed.sample(
            h_d[None], w_vd, jax.random.fold_in(key, j), s.temperature, s.top_k, impl="auto"
        )[0]

    return jax.vmap(one)(h_bd, keys_b, j_b)


def pick_rows(
    config: DecodeConfig,
    model: GPT,
    h_bd: jax.Array,
    keys_b: jax.Array,
    j_b: jax.Array,
    vocab_b: jax.Array,
    temp_b: jax.Array,
    topk_b: jax.Array,
) -> jax.Array:
    """``pick`` of rows that each pick their own way, in one call: the logits over the widest
    head ``W[:config.head]``, ids at or above a row's ``vocab_b`` masked out, then the argmax
    where its ``temp_b`` is 0, else the Gumbel-max sample at its temperature (within its
    ``topk_b`` largest when > 0) with the noise of ``unembed.sample``. This is ``unembed``'s
    xla path with per-row masks and scales: the same matmul and, on each row's prefix, the same
    scores, so a row gets the token its own head and setting's xla pick gives it (-1 where its
    prefix's logits hold a NaN, or its temperature's inverse is not finite). Sampling is
    compiled only when ``config.per_row.sampled``, the top k for the bucket
    ``config.per_row.top_k`` (``_sample_row``)."""
    per_row = config.per_row
    assert per_row is not None
    w_vd = model.head(config.head)
    bad_b = ~jnp.all(jnp.isfinite(h_bd.astype(jnp.float32)), axis=-1)
    ids_v = jnp.arange(config.head, dtype=jnp.int32)
    logits_bv = tile_logits(h_bd, w_vd)
    logits_bv = jnp.where(ids_v[None, :] < vocab_b[:, None], logits_bv, -jnp.inf)
    best_b, tokens_b = max_argmax(logits_bv)
    tokens_b = jnp.where(jnp.isnan(best_b), jnp.int32(-1), tokens_b)
    if per_row.sampled:
        sampled_b = jax.vmap(functools.partial(_sample_row, min(per_row.top_k, config.head)))(
            logits_bv, keys_b, j_b, temp_b, topk_b
        )
        tokens_b = jnp.where(temp_b > 0, sampled_b, tokens_b)
    return jnp.where(bad_b, jnp.int32(-1), tokens_b)


def _sample_row(
    bucket: int, logits_v: jax.Array, key: jax.Array, j: jax.Array, temp: jax.Array, k: jax.Array
) -> jax.Array:
    """One row's Gumbel-max sample of its (masked) logits at temperature ``temp``, within its
    ``k`` largest when k > 0; -1 where the logits hold a NaN or 1 / temp is not finite. The
    noise is ``unembed.sample``'s for the row alone (row 0 of its call), so the token does not
    depend on the row's place.

    The top k are the ids ``lax.top_k`` of the ``bucket`` (>= k) largest ranks first (ties by
    lower id): those above the k-th largest logit and those equal to it up to its id. The
    others are masked out and one Gumbel-max runs over the whole head for every row, so rows
    with a top k and rows without share one pass."""
    seeds = noise.seeds_from_key(jax.random.fold_in(key, j))
    inv_t = 1.0 / jnp.where(temp > 0, temp, jnp.float32(1)).astype(jnp.float32)
    ids_v = jnp.arange(logits_v.shape[0], dtype=jnp.int32)
    nan = jnp.zeros((), bool)
    if bucket:
        vals_k, ids_k = lax.top_k(logits_v, bucket)
        last = jnp.clip(k - 1, 0, bucket - 1)
        kth, kth_id = vals_k[last], ids_k[last]
        keep = (logits_v > kth) | ((logits_v == kth) & (ids_v <= kth_id)) | (k <= 0)
        nan = (k > 0) & jnp.isnan(logits_v).any()
        logits_v = jnp.where(keep, logits_v, -jnp.inf)
    best, token = max_argmax(logits_v * inv_t + noise.gumbel(seeds, jnp.int32(0), ids_v))
    bad = jnp.isnan(best) | nan | ~jnp.isfinite(inv_t)
    return jnp.where(bad, jnp.int32(-1), token)


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
    config: DecodeConfig,
    params,
    ids_bt: jax.Array,
    lengths_b: jax.Array,
    rng: jax.Array,
    temp_b: jax.Array | None = None,
    topk_b: jax.Array | None = None,
) -> tuple[Any, jax.Array, jax.Array | None]:
    """(caches, each row's first token, each prompt's nats or None) of right-padded prompts
    ``ids_bt`` whose real lengths are ``lengths_b``; ``rng`` is one key or one per row;
    ``temp_b``, ``topk_b``: each row's sampling, read with ``config.per_row``."""
    model = config.fn.model(params)
    rows = ids_bt.shape[0]
    caches = model.init_cache(rows, config.max_seq)
    h_btd, caches = model.cached(ids_bt, caches, jnp.zeros((rows,), jnp.int32), fresh=True)
    h_bd = jnp.take_along_axis(h_btd, (lengths_b - 1)[:, None, None], axis=1)[:, 0]
    nats_b = prompt_nats(config, model, h_btd, ids_bt, lengths_b) if config.score else None
    keys_b, zeros_b = row_keys(rng, rows), jnp.zeros((rows,), jnp.int32)
    first_b = pick(config, model, h_bd, keys_b, zeros_b, None, temp_b, topk_b)
    return caches, first_b, nats_b


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
    temp_b: jax.Array | None = None,
    topk_b: jax.Array | None = None,
) -> Decoding:
    """The carry after a prefill: ``first_b`` taken for the real rows, whose next token goes at
    ``start_b`` (their prompt lengths); each row's temperature and top k ``temp_b``, ``topk_b``
    (by default ``config.sampling``'s)."""
    zeros_b = jnp.zeros(first_b.shape, jnp.int32)
    temp_b, topk_b = row_sampling(config, first_b.shape[0], temp_b, topk_b)
    state = Decoding(
        caches=caches,
        out_bs=jnp.zeros((first_b.shape[0], config.max_seq), jnp.int32),
        n_b=zeros_b,
        stop_b=zeros_b,
        last_b=zeros_b,
        pos_b=start_b,
        limits_b=limits_b,
        real_b=real_b,
        vocab_b=jnp.full(first_b.shape, config.head, jnp.int32),
        temp_b=temp_b,
        topk_b=topk_b,
        steps=jnp.int32(0),
        produced=jnp.int32(0),
    )
    return take(config, state, first_b, real_b)


def step(config: DecodeConfig, params, state: Decoding, rng: jax.Array) -> Decoding:
    """One decode step: each running row feeds its last token at its position and takes the
    next; the other rows keep their state. ``rng``: one key or one per row."""
    model = config.fn.model(params)
    run_b = running(state)
    rows = run_b.shape[0]
    pos_b = jnp.minimum(state.pos_b, config.max_seq - 1)  # finished rows write harmlessly
    h_b1d, caches = model.cached(state.last_b[:, None], state.caches, pos_b, window=config.window)
    tokens_b = pick(
        config, model, h_b1d[:, 0], row_keys(rng, rows), state.n_b, state.vocab_b, state.temp_b,
        state.topk_b,
    )  # fmt: skip
    state = state._replace(
        caches=caches,
        pos_b=state.pos_b + run_b.astype(jnp.int32),
        steps=state.steps + 1,
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


def decode_some(
    config: DecodeConfig,
    params,
    state: Decoding,
    rng: jax.Array,
    max_steps: jax.Array,
    stops: jax.Array | int = 1,
) -> Decoding:
    """At most ``max_steps`` decode steps in one on-device loop, ending early once ``stops``
    rows that were running have stopped (one by default): the host can then free their rows
    and admit waiting requests. ``stops`` may be traced: one compiled loop serves any."""
    was_b = running(state)

    def more(carry: tuple[Decoding, jax.Array]) -> jax.Array:
        s, i = carry
        run_b = running(s)
        stopped = (was_b & ~run_b).sum()
        return (i < max_steps) & run_b.any() & (stopped < stops)

    def body(carry: tuple[Decoding, jax.Array]) -> tuple[Decoding, jax.Array]:
        s, i = carry
        return step(config, params, s, rng), i + 1

    return lax.while_loop(more, body, (state, jnp.int32(0)))[0]


# The carry's fields with a leading row axis (``steps`` and ``produced`` are the batch's).
ROW_FIELDS = (
    "caches", "out_bs", "n_b", "stop_b", "last_b", "pos_b", "limits_b", "real_b", "vocab_b",
    "temp_b", "topk_b",
)  # fmt: skip


def put_rows(state: Decoding, new: Decoding, slots_n: jax.Array) -> Decoding:
    """``state`` with row ``slots_n[i]`` replaced by ``new``'s row i (a ``start`` of joining
    prompts); a slot past the last row is dropped, so ``new`` may carry padding rows."""

    def put(x, y):
        return x.at[slots_n].set(y, mode="drop")

    return state._replace(
        **{f: jax.tree.map(put, getattr(state, f), getattr(new, f)) for f in ROW_FIELDS}
    )


def take_rows(state: Decoding, index_r: jax.Array, real_r: jax.Array) -> Decoding:
    """A carry of ``len(index_r)`` rows, row r being ``state``'s row ``index_r[r]`` where
    ``real_r`` holds and an empty row (no request) elsewhere: a batch regrouped into another
    bucket of rows."""

    def take_(x):
        return jnp.take(x, index_r, axis=0)

    out = state._replace(**{f: jax.tree.map(take_, getattr(state, f)) for f in ROW_FIELDS})
    return out._replace(real_b=out.real_b & real_r)


def empty(config: DecodeConfig, params, *, rows: int) -> Decoding:
    """A carry of ``rows`` rows that hold no request (zero caches)."""
    caches = config.fn.model(params).init_cache(rows, config.max_seq)
    zeros_b = jnp.zeros((rows,), jnp.int32)
    return start(config, caches, zeros_b, zeros_b, zeros_b + 1, zeros_b.astype(bool))


def join(
    config: DecodeConfig,
    state: Decoding,
    keys_b: jax.Array,
    caches: Any,
    first_n: jax.Array,
    lengths_n: jax.Array,
    limits_n: jax.Array,
    real_n: jax.Array,
    keys_n: jax.Array,
    slots_n: jax.Array,
    temp_n: jax.Array | None = None,
    topk_n: jax.Array | None = None,
) -> tuple[Decoding, jax.Array]:
    """Prefilled prompts (``caches``, ``first_n`` of their own ``prefill``) into rows
    ``slots_n`` of a running carry and its row keys: each starts as ``start`` starts it (with
    its temperature and top k ``temp_n``, ``topk_n``), the other rows untouched; padding
    prompts carry a slot past the last row and are dropped."""
    new = start(config, caches, first_n, lengths_n, limits_n, real_n, temp_n, topk_n)
    return put_rows(state, new, slots_n), keys_b.at[slots_n].set(keys_n, mode="drop")
