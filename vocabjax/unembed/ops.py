"""The public unembedding ops and their dispatch to an implementation (see the package's
docstring for what each op returns and how bad input is handled)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import noise
from pallas_kernels._common import pad_rows
from vocabjax.errors import UserError
from vocabjax.unembed import chunked, pallas, vjp
from vocabjax.unembed.argmax import max_argmax
from vocabjax.unembed.chunked import ChunkBlocks
from vocabjax.unembed.selector import IMPLS, Impl, dtype_name, select

REDUCTIONS: tuple[str, ...] = ("mean", "sum", "none")


# --------------------------------------------------------------------------------------------
# Checks shared by every op


def _check_pair(h_bd: jax.Array, w_vd: jax.Array, *, op: str) -> tuple[jax.Array, jax.Array]:
    if w_vd.ndim != 2:
        raise UserError(f"{op}: w must be (V, D), got shape {tuple(w_vd.shape)}")
    if h_bd.ndim != 2:
        raise UserError(f"{op}: h must be (B, D), got shape {tuple(h_bd.shape)} (vmap extra axes)")
    if h_bd.shape[1] != w_vd.shape[1]:
        raise UserError(
            f"{op}: h has d_model={h_bd.shape[1]} but w has d_model={w_vd.shape[1]} "
            f"(h {tuple(h_bd.shape)}, w {tuple(w_vd.shape)})"
        )
    dtype_name(w_vd.dtype)
    if not jnp.issubdtype(h_bd.dtype, jnp.floating):
        raise UserError(f"{op}: h must be floating point, got {h_bd.dtype}")
    return h_bd.astype(w_vd.dtype), w_vd


def _resolve(op: str, impl: str, h_bd: jax.Array, w_vd: jax.Array, blocks: Any) -> tuple[str, Any]:
    """(impl, blocks) after ``auto``; ``blocks`` may be None (the implementation's default)."""
    if impl not in ("auto", *IMPLS):
        raise UserError(f"unknown impl {impl!r} (choose from auto, {', '.join(IMPLS)})")
    if impl == "auto":
        vocab, d_model = w_vd.shape
        choice = select(
            op,
            vocab=vocab,
            batch=h_bd.shape[0],
            d_model=d_model,
            dtype=dtype_name(w_vd.dtype),
        )
        impl, blocks = choice.impl, (blocks if blocks is not None else (choice.blocks or None))
    if isinstance(blocks, Mapping):
        blocks = dict(blocks)
    return impl, blocks


def _interpret(interpret: bool | None) -> bool:
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def _bad_rows(h_bd: jax.Array) -> jax.Array:
    """Rows of h with a NaN or infinity: their ids become -1."""
    return ~jnp.all(jnp.isfinite(h_bd.astype(jnp.float32)), axis=-1)


def _check_temperature(temperature: Any) -> jax.Array:
    if isinstance(temperature, jax.core.Tracer):
        return jnp.asarray(temperature, jnp.float32)
    value = np.asarray(temperature, dtype=np.float64)
    if value.shape != ():
        raise UserError(f"temperature must be a scalar, got shape {value.shape}")
    if not math.isfinite(float(value)) or float(value) <= 0:
        raise UserError(f"temperature={float(value)} must be finite and > 0 (use greedy for 0)")
    return jnp.asarray(float(value), jnp.float32)


def _chunk_blocks(blocks: Any, h_bd: jax.Array, w_vd: jax.Array) -> ChunkBlocks:
    """``blocks`` as ChunkBlocks: an instance, an int (block_v), or a dict of its fields whose
    missing ones take the shape's defaults."""
    if isinstance(blocks, ChunkBlocks):
        return blocks
    if isinstance(blocks, int):
        return ChunkBlocks(block_v=blocks)
    if blocks is not None and not isinstance(blocks, Mapping):
        raise UserError(f"impl='chunked' takes ChunkBlocks, a dict or an int, got {blocks!r}")
    vocab, d_model = w_vd.shape
    default = ChunkBlocks.default(h_bd.shape[0], vocab, d_model, dtype_name(w_vd.dtype))
    fields = {f.name for f in dataclasses.fields(ChunkBlocks)}
    unknown = sorted(set(blocks or {}) - fields)
    if unknown:
        raise UserError(f"impl='chunked' blocks take {', '.join(sorted(fields))}, got {unknown}")
    wrong = [
        k
        for k, v in (blocks or {}).items()
        if isinstance(v, bool) or not (isinstance(v, int) or (v is None and k == "block_n"))
    ]
    if wrong:
        raise UserError(f"impl='chunked' blocks {dict(blocks)}: {wrong[0]} must be an integer")
    return dataclasses.replace(default, **dict(blocks or {}))


def _on_padded_rows(fn: Callable[[jax.Array], Any], h_bd: jax.Array, rows: int) -> Any:
    """``fn`` of ``h_bd`` padded with zero rows up to ``rows``, every output cut back to
    ``h_bd``'s rows (``ChunkBlocks.min_rows``)."""
    out = fn(pad_rows(h_bd, rows))
    return jax.tree_util.tree_map(lambda x: x[: h_bd.shape[0]], out)


# --------------------------------------------------------------------------------------------
# Decode ops


def _xla_decode(
    h_bd: jax.Array, w_vd: jax.Array, seeds: jax.Array | None, inv_temperature: jax.Array
) -> chunked.Stats:
    logits = chunked.tile_logits(h_bd, w_vd)
    max_b, argmax_b = max_argmax(logits)
    sample_b = jnp.zeros((h_bd.shape[0],), jnp.int32)
    nan_b = jnp.isnan(max_b)
    if seeds is not None:
        rows = jnp.arange(h_bd.shape[0], dtype=jnp.int32)[:, None]
        tok = jnp.arange(w_vd.shape[0], dtype=jnp.int32)[None, :]
        scores = logits * inv_temperature + noise.gumbel(seeds, rows, tok)
        best_b, sample_b = max_argmax(scores)
        nan_b = jnp.isnan(best_b)  # a NaN logit's score is NaN: no pass over the logits
    return chunked.Stats(max_b, argmax_b, jax.nn.logsumexp(logits, axis=1), sample_b, nan_b)


def _decode(
    op: str,
    h_bd: jax.Array,
    w_vd: jax.Array,
    *,
    impl: str,
    blocks: Any,
    interpret: bool | None,
    seeds: jax.Array | None = None,
    inv_temperature: jax.Array | float = 1.0,
    want_lse: bool = False,
) -> chunked.Stats:
    h_bd, w_vd = _check_pair(h_bd, w_vd, op=op)
    impl, blocks = _resolve(op, impl, h_bd, w_vd, blocks)
    inv_temperature = jnp.asarray(inv_temperature, jnp.float32)
    if impl == "xla":
        return _xla_decode(h_bd, w_vd, seeds, inv_temperature)
    if impl == "chunked":
        cb = _chunk_blocks(blocks, h_bd, w_vd)
        return _on_padded_rows(
            lambda h: chunked.decode(
                h, w_vd, seeds, inv_temperature, block_v=cb.block_v, want_lse=want_lse
            ),
            h_bd,
            cb.min_rows,
        )
    vocab, d_model = w_vd.shape
    kernel, kblocks = pallas.decode_kernel(
        h_bd.shape[0], vocab, d_model, dtype_name(w_vd.dtype), blocks
    )
    out = kernel(
        h_bd,
        w_vd,
        seeds,
        inv_temperature=inv_temperature,
        blocks=kblocks,
        interpret=_interpret(interpret),
    )
    return chunked.Stats(out.max_b, out.argmax_b, out.lse_b, out.sample_b, jnp.isnan(out.max_b))


def greedy(
    h_bd: jax.Array,
    w_vd: jax.Array,
    *,
    impl: Impl = "auto",
    blocks: Any = None,
    interpret: bool | None = None,
) -> jax.Array:
    """The argmax token of ``h_bd @ w_vd.T`` per row, int32 (B,); lowest id on ties, -1 for a
    row of ``h`` with a NaN or infinity and for a row whose logits hold a NaN (a NaN or
    infinity in ``w``). ``blocks``: ChunkBlocks / Pallas blocks / dict."""
    stats = _decode("greedy", h_bd, w_vd, impl=impl, blocks=blocks, interpret=interpret)
    return jnp.where(_bad_rows(h_bd) | stats.nan_b, jnp.int32(-1), stats.argmax_b)


def logsumexp(
    h_bd: jax.Array,
    w_vd: jax.Array,
    *,
    impl: Impl = "auto",
    blocks: Any = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``log(sum_v exp(h . w_v))`` per row, float32 (B,); NaN for a row of ``h`` with a NaN or
    infinity and for a row whose logits hold a NaN, +inf where a logit is +inf."""
    stats = _decode(
        "logsumexp", h_bd, w_vd, impl=impl, blocks=blocks, interpret=interpret, want_lse=True
    )
    return jnp.where(_bad_rows(h_bd), jnp.float32(jnp.nan), stats.lse_b)


def sample(
    h_bd: jax.Array,
    w_vd: jax.Array,
    key: jax.Array,
    temperature: float | jax.Array = 1.0,
    top_k: int | None = None,
    *,
    impl: Impl = "auto",
    blocks: Any = None,
    interpret: bool | None = None,
) -> jax.Array:
    """A token per row drawn from ``softmax(logits / temperature)`` (restricted to the ``top_k``
    largest logits when given), int32 (B,), by Gumbel-max.

    The noise of (row, token id) is ``pallas_kernels.noise.gumbel(seeds_from_key(key), row, id)``
    for every implementation and tiling, so the same key gives the same token whatever ``impl``
    and ``blocks`` are. -1 for rows of ``h`` with a NaN or infinity and for rows whose logits
    hold a NaN, and for all rows when a traced temperature is <= 0 (a concrete one raises
    ``UserError``).
    """
    inv_t = 1.0 / _check_temperature(temperature)
    seeds = noise.seeds_from_key(key)
    bad = _bad_rows(h_bd) | ~(inv_t > 0) | ~jnp.isfinite(inv_t)
    if top_k is not None:
        vals, ids, nan_b = _top_k(h_bd, w_vd, top_k, impl=impl, blocks=blocks, interpret=interpret)
        rows = jnp.arange(ids.shape[0], dtype=jnp.int32)[:, None]
        scores = vals * inv_t + noise.gumbel(seeds, rows, ids)
        pick = jnp.argmax(scores, axis=1)
        token = jnp.take_along_axis(ids, pick[:, None], axis=1)[:, 0]
        bad = bad | nan_b
    else:
        stats = _decode(
            "sample",
            h_bd,
            w_vd,
            impl=impl,
            blocks=blocks,
            interpret=interpret,
            seeds=seeds,
            inv_temperature=inv_t,
        )
        token = stats.sample_b
        bad = bad | stats.nan_b
    return jnp.where(bad, jnp.int32(-1), token)


def top_k(
    h_bd: jax.Array,
    w_vd: jax.Array,
    k: int,
    *,
    impl: Impl = "auto",
    blocks: Any = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The ``k`` largest logits per row, descending, and their ids (lower id first on ties):
    (float32 (B, k), int32 (B, k)). Rows of ``h`` with a NaN or infinity, and rows whose
    logits hold a NaN, give NaN values and ids -1."""
    vals, ids, nan_b = _top_k(h_bd, w_vd, k, impl=impl, blocks=blocks, interpret=interpret)
    bad = (_bad_rows(h_bd) | nan_b)[:, None]
    return jnp.where(bad, jnp.float32(jnp.nan), vals), jnp.where(bad, jnp.int32(-1), ids)


def _top_k(h_bd, w_vd, k, *, impl, blocks, interpret):
    h_bd, w_vd = _check_pair(h_bd, w_vd, op="top_k")
    vocab = w_vd.shape[0]
    if isinstance(k, bool) or not isinstance(k, int | np.integer):
        raise UserError(f"top_k: k must be a Python int, got {k!r}")
    if not 1 <= k <= vocab:
        raise UserError(f"top_k: k={k} must be between 1 and V={vocab}")
    k = int(k)
    impl, blocks = _resolve("top_k", impl, h_bd, w_vd, blocks)
    if impl == "xla":
        logits = chunked.tile_logits(h_bd, w_vd)
        vals, ids = lax.top_k(logits, k)
        return vals, ids.astype(jnp.int32), jnp.isnan(logits).any(axis=1)
    if impl == "chunked":
        cb = _chunk_blocks(blocks, h_bd, w_vd)
        return _on_padded_rows(lambda h: chunked.top_k(h, w_vd, k, cb.block_v), h_bd, cb.min_rows)
    mod = pallas.module("fused_topk")
    kblocks = blocks
    if isinstance(blocks, Mapping):
        kblocks = pallas.tiles(mod.TopKBlocks, blocks) if blocks else None
    vals, ids = mod.fused_topk(h_bd, w_vd, k, blocks=kblocks, interpret=_interpret(interpret))
    return vals, ids.astype(jnp.int32), jnp.isnan(vals[:, 0])  # the kernel ranks NaN first


# --------------------------------------------------------------------------------------------
# Linear cross-entropy


def linear_cross_entropy(
    h_nd: jax.Array,
    w_vd: jax.Array,
    labels_n: jax.Array,
    *,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum", "none"] = "mean",
    z_loss: float = 0.0,
    impl: Impl = "auto",
    blocks: Any = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Cross-entropy of ``softmax(h @ w.T)`` against ``labels``, float32, without the N x V logits.

    ``h`` is (..., D) and ``labels`` the matching (...) int array; per token the loss is
    ``lse - logit[label] + z_loss * lse**2`` (the z-loss of PaLM). Tokens whose label equals
    ``ignore_index`` count zero and are left out of the mean (an all-ignored batch gives 0
    with zero gradient). ``reduction="none"`` returns the (...) per-token losses.

    ``chunked`` and ``pallas`` share two ``jax.custom_vjp``s. The mean and sum losses know each
    token's cotangent in the forward, so under ``grad`` their forward computes dh and dW as it
    goes (``vjp.ce_total``; chunked: row tiles of ``block_n`` tokens, the logits computed once) and
    the backward only scales them. ``reduction="none"`` keeps only h, W, labels and the (N,)
    log-sum-exp, and its backward recomputes each vocabulary tile (``vjp.lse_target``). ``xla``
    differentiates the materialized logits.
    """
    if reduction not in REDUCTIONS:
        raise UserError(f"unknown reduction {reduction!r} (choose from {', '.join(REDUCTIONS)})")
    if not isinstance(z_loss, int | float) or not math.isfinite(z_loss) or z_loss < 0:
        raise UserError(f"z_loss={z_loss!r} must be a finite number >= 0")
    lead = labels_n.shape
    h_nd, w_vd, labels = _ce_inputs(h_nd, w_vd, labels_n, ignore_index)
    impl, blocks = _resolve("linear_cross_entropy", impl, h_nd, w_vd, blocks)
    n_rows = h_nd.shape[0]
    if impl == "chunked":  # padded rows carry ignore_index: no loss, no gradient
        rows = _chunk_blocks(blocks, h_nd, w_vd).min_rows
        h_nd, labels = pad_rows(h_nd, rows), pad_rows(labels, rows, ignore_index)

    valid = labels != ignore_index
    out_of_range = valid & ((labels < 0) | (labels >= w_vd.shape[0]))
    kernel_labels = jnp.where(valid & ~out_of_range, labels, -1)
    if impl != "xla" and reduction != "none":
        backend = _ce_backend(impl, blocks, interpret, h_nd, w_vd)
        counted = (valid & ~out_of_range).astype(jnp.float32)
        total = vjp.ce_total(backend, float(z_loss), h_nd, w_vd, kernel_labels, counted)
        total = total + jnp.where(jnp.any(out_of_range), jnp.float32(jnp.nan), 0.0)
    else:
        per_token = _per_token_loss(impl, blocks, interpret, h_nd, w_vd, kernel_labels, z_loss)
        per_token = jnp.where(valid, per_token, 0.0)
        per_token = jnp.where(out_of_range, jnp.float32(jnp.nan), per_token)
        if reduction == "none":
            return per_token[:n_rows].reshape(lead)
        total = jnp.sum(per_token)
    if reduction == "sum":
        return total
    count = jnp.sum(valid.astype(jnp.float32))
    return total / jnp.maximum(count, 1.0)


def _ce_inputs(
    h_nd: jax.Array, w_vd: jax.Array, labels_n: jax.Array, ignore_index: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(h as (N, D) in w's dtype, w, labels as (N,) int32) after checking that they match and
    that concrete labels are in range."""
    lead = labels_n.shape
    if h_nd.shape[:-1] != lead:
        raise UserError(
            f"linear_cross_entropy: h has shape {tuple(h_nd.shape)} but labels {tuple(lead)}; "
            "labels must match h without its last axis"
        )
    if not jnp.issubdtype(labels_n.dtype, jnp.integer):
        raise UserError(f"linear_cross_entropy: labels must be integers, got {labels_n.dtype}")
    h_nd = h_nd.reshape(-1, h_nd.shape[-1]) if h_nd.ndim != 2 else h_nd
    labels = labels_n.reshape(-1).astype(jnp.int32)
    h_nd, w_vd = _check_pair(h_nd, w_vd, op="linear_cross_entropy")
    _check_labels(labels_n, w_vd.shape[0], ignore_index)
    return h_nd, w_vd, labels


def _per_token_loss(impl, blocks, interpret, h_nd, w_vd, labels_n, z_loss) -> jax.Array:
    """(N,) ``lse - logit[label] + z_loss * lse**2`` of every row, ignored rows included;
    ``labels_n`` is -1 where a row has no target."""
    if impl == "xla":
        lse, target = _xla_lse_target(h_nd, w_vd, labels_n)
    else:
        backend = _ce_backend(impl, blocks, interpret, h_nd, w_vd)
        lse, target = vjp.lse_target(backend, h_nd, w_vd, labels_n)
    per_token = lse - target
    if z_loss:
        per_token = per_token + jnp.float32(z_loss) * lse * lse
    return per_token


def _xla_lse_target(h_nd, w_vd, labels_n):
    logits = chunked.tile_logits(h_nd, w_vd)
    return jax.nn.logsumexp(logits, axis=1), chunked.target_logit(logits, labels_n)


def _ce_backend(impl, blocks, interpret, h_nd, w_vd) -> vjp.CEBackend:
    if impl == "chunked":
        return vjp.CEBackend("chunked", _chunk_blocks(blocks, h_nd, w_vd), False, w_vd.dtype)
    mod = pallas.module("linear_ce")
    if isinstance(blocks, Mapping):
        blocks = dict(blocks)
        if "block_b" in blocks:  # a dict shared with the decode ops: its row tile is block_n here
            blocks.setdefault("block_n", blocks.pop("block_b"))
        blocks.pop("tiled", None)
        blocks = pallas.tiles(mod.CEBlocks, blocks) if blocks else None
    return vjp.CEBackend("pallas", blocks, _interpret(interpret), w_vd.dtype)


def _check_labels(labels: jax.Array, vocab: int, ignore_index: int) -> None:
    """Concrete labels are checked now (one line naming the first bad one); traced ones give NaN."""
    if isinstance(labels, jax.core.Tracer):
        return
    values = np.asarray(labels)
    bad = (values != ignore_index) & ((values < 0) | (values >= vocab))
    if bad.any():
        first = values[bad].flat[0]
        raise UserError(
            f"linear_cross_entropy: label {int(first)} is outside [0, V={vocab}) and is not "
            f"ignore_index={ignore_index} ({int(bad.sum())} such label(s))"
        )
