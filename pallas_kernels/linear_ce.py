"""Fused linear cross-entropy: forward and backward of ``logsumexp(h @ W.T)`` and the target logit.

Never materializes the N x V logits. The forward runs a (row tiles, vocabulary tiles) grid that
writes per-tile logsumexp and target-logit partials, merged in jnp. The backward recomputes logit
tiles from h and W and runs two kernels:

- ``dh``: one program per row tile loops over every vocabulary tile, forms
  ``dlogits = g_lse * softmax + g_target * onehot(label)`` for the tile and adds
  ``dlogits @ W_tile`` into its own rows of dh;
- ``dW``: one program per vocabulary tile loops over every row tile and adds ``dlogits.T @ h``
  into its own rows of dW.

Each program owns the output rows it accumulates into (read-modify-write of its block, no atomics,
deterministic), which keeps the d_model-wide accumulator out of registers for any d_model. The
logits are recomputed twice in the backward (8 N V D flops in all against 6 N V D with stored
logits), the usual price of not storing them.

Lowering: written for the Pallas Triton GPU backend; on CPU run with ``interpret=True``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    DOT_PRECISION,
    NEG_INF,
    cdiv,
    check_hw,
    check_pow2,
    dlogits,
    load_tile,
    merge_lse,
    next_pow2,
    pad_cols,
    pad_rows,
    pallas_call_maybe_poisoned,
    store_tile,
    tile_logits,
    tile_mask,
)


@dataclasses.dataclass(frozen=True)
class CEBlocks:
    """Tiling of the linear cross-entropy kernels (forward, dh and dW). Powers of two."""

    block_n: int = 64  # rows (tokens) of h per tile
    block_v: int = 128  # vocabulary rows of W per tile
    block_d: int = 64  # d_model columns per inner-loop step
    num_warps: int = 4  # Triton warps per program (GPU only)
    num_stages: int = 3  # Triton software-pipelining stages (GPU only)
    dh_splits: int = 1  # vocabulary ranges of the dh kernel, each a partial dh summed after

    def __post_init__(self):
        check_pow2(block_n=self.block_n, block_v=self.block_v, block_d=self.block_d)
        if self.dh_splits < 1:
            raise ValueError(f"dh_splits={self.dh_splits} must be >= 1")

    @classmethod
    def default(cls, n_rows: int, vocab: int, d_model: int, dtype) -> CEBlocks:
        """Tensor-core sized tiles (64 x 128 x 64), shrunk for tiny shapes (never below 16)."""
        del dtype
        return cls(
            block_n=min(64, max(16, next_pow2(n_rows))),
            block_v=min(128, max(16, next_pow2(vocab))),
            block_d=min(64, max(16, next_pow2(d_model))),
        )

    @classmethod
    def candidates(cls, n_rows: int, vocab: int, d_model: int, dtype) -> list[CEBlocks]:
        """A small search space around ``default`` for the autotuner (default first)."""
        base = cls.default(n_rows, vocab, d_model, dtype)
        out = [base]
        for block_n, block_v, block_d, num_warps in (
            (32, 128, 64, 4),
            (64, 64, 64, 4),
            (64, 128, 32, 4),
            (128, 128, 32, 8),
            (128, 64, 64, 8),
        ):
            c = dataclasses.replace(
                base,
                block_n=min(block_n, max(16, next_pow2(n_rows))),
                block_v=min(block_v, max(16, next_pow2(vocab))),
                block_d=min(block_d, max(16, next_pow2(d_model))),
                num_warps=num_warps,
            )
            if c not in out:
                out.append(c)
        return out

    def compiler_params(self):
        return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def _blocks_for(h_nd, w_vd, blocks):
    check_hw(h_nd, w_vd)
    if blocks is None:
        blocks = CEBlocks.default(h_nd.shape[0], w_vd.shape[0], w_vd.shape[1], h_nd.dtype)
    return blocks


def _check_rows(name: str, x: jax.Array, n_rows: int):
    if x.shape != (n_rows,):
        raise ValueError(f"{name} must have shape ({n_rows},) like h's rows; got {x.shape}")


def _rows_left(vocab: int, v0, block_v: int):
    """Rows of W left from ``v0`` for ``tile_logits``: None when block_v divides the vocabulary
    (no tile has a ragged edge, so the loads need no mask)."""
    return None if vocab % block_v == 0 else vocab - v0


def _masked_logits(logits_nv, v0, vocab: int, block_v: int):
    """Token ids of the tile and its logits with the ids past the vocabulary set to -inf."""
    ids_v = v0 + jnp.arange(block_v, dtype=jnp.int32)
    valid_v = ids_v < vocab
    return ids_v, valid_v, jnp.where(valid_v[None, :], logits_nv, NEG_INF)


# ---------------------------------------------------------------------------------------------
# forward


def _linear_ce_fwd_kernel(
    h_ref, w_ref, labels_ref, lse_ref, target_ref, *, vocab, d_model, block_v, block_d
):
    """Program (row tile i, vocabulary tile j): the tile's logsumexp and target-logit partials.

    Refs: h (block_n, D_pad), w (block_v, D) tile j, labels (block_n,) int32; outputs
    (block_n,) f32: logsumexp over the tile, and the label's logit when it lies in the tile
    (else 0).
    """
    v0 = pl.program_id(1) * block_v
    logits = tile_logits(
        h_ref,
        w_ref,
        0,
        _rows_left(vocab, v0, block_v),
        block_v=block_v,
        block_d=block_d,
        d_model=d_model,
    )
    ids_v, valid_v, logits = _masked_logits(logits, v0, vocab, block_v)
    m_n = jnp.max(logits, axis=1)
    lse_ref[...] = m_n + jnp.log(jnp.sum(jnp.exp(logits - m_n[:, None]), axis=1))
    hit = (ids_v[None, :] == labels_ref[...][:, None]) & valid_v[None, :]
    target_ref[...] = jnp.sum(jnp.where(hit, logits, 0.0), axis=1)


def _fwd_partials(h_nd, w_vd, labels_n, *, blocks: CEBlocks, interpret: bool, poison=False):
    """Per-tile (n_vocab_tiles, N_pad) logsumexp and target partials of ``linear_ce_fwd``."""
    n_rows, d_model = h_nd.shape
    vocab = w_vd.shape[0]
    bn, bv, bd = blocks.block_n, blocks.block_v, blocks.block_d
    nn, nv = cdiv(n_rows, bn), cdiv(vocab, bv)
    d_pad = cdiv(d_model, bd) * bd
    kernel = functools.partial(
        _linear_ce_fwd_kernel, vocab=vocab, d_model=d_model, block_v=bv, block_d=bd
    )
    lse_tn, target_tn = pallas_call_maybe_poisoned(
        kernel,
        (
            pad_cols(pad_rows(h_nd, nn * bn), d_pad),
            w_vd,
            pad_rows(labels_n.astype(jnp.int32), nn * bn, -1),
        ),
        grid=(nn, nv),
        in_specs=[
            pl.BlockSpec((bn, d_pad), lambda i, j: (i, 0)),
            pl.BlockSpec((bv, d_model), lambda i, j: (j, 0)),
            pl.BlockSpec((bn,), lambda i, j: (i,)),
        ],
        out_specs=[pl.BlockSpec((None, bn), lambda i, j: (j, i))] * 2,
        out_shape=[jax.ShapeDtypeStruct((nv, nn * bn), jnp.float32)] * 2,
        poison=poison,
        interpret=interpret,
        compiler_params=blocks.compiler_params(),
        name="linear_ce_fwd",
    )
    return lse_tn, target_tn


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def linear_ce_fwd(
    h_nd: jax.Array,
    w_vd: jax.Array,
    labels_n: jax.Array,
    *,
    blocks: CEBlocks | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Logsumexp of each row's logits and the logit of its label, without N x V logits.

    Args:
      h_nd: (N, D) hidden states, bfloat16, float16 or float32.
      w_vd: (V, D) unembedding, same dtype.
      labels_n: (N,) integer labels. A label outside [0, V) (the caller maps ignore_index to
        -1) means "no target": its target logit is 0 and the caller masks its loss.
      blocks: tiling; ``CEBlocks.default(N, V, D, dtype)`` when None.
      interpret: run the Pallas interpreter (CPU).

    Returns:
      (lse_n, target_logit_n), both (N,) float32; the loss is ``lse_n - target_logit_n``.
    """
    blocks = _blocks_for(h_nd, w_vd, blocks)
    _check_rows("labels_n", labels_n, h_nd.shape[0])
    lse_tn, target_tn = _fwd_partials(h_nd, w_vd, labels_n, blocks=blocks, interpret=interpret)
    n_rows = h_nd.shape[0]
    return merge_lse(lse_tn)[:n_rows], jnp.sum(target_tn, axis=0)[:n_rows]


# ---------------------------------------------------------------------------------------------
# backward


def _dlogits(logits, ids_v, valid_v, labels_n, lse_n, g_lse_n, g_target_n):
    """g_lse * softmax + g_target * onehot(label) for one tile, f32 (0 on padded tokens)."""
    p = jnp.exp(logits - lse_n[:, None])
    hit = (ids_v[None, :] == labels_n[:, None]) & valid_v[None, :]
    return dlogits(p, hit, g_lse_n, g_target_n)


def _zero_fill(ref, row0, rows, row_ok, d_pad_chunks, block_d, d_model):
    """Write zeros into rows ``row0 : row0 + rows`` of ``ref`` (masked by row_ok, None when
    every row exists, and d_model)."""

    def body(c, carry):
        d0 = pl.multiple_of(c * block_d, block_d)
        store_tile(
            ref,
            (pl.ds(row0, rows), pl.ds(d0, block_d)),
            jnp.zeros((rows, block_d), ref.dtype),
            tile_mask(row_ok, d0, rows, block_d, d_model),
        )
        return carry

    lax.fori_loop(0, d_pad_chunks, body, 0)


def _linear_ce_dh_kernel(
    h_ref,
    w_ref,
    labels_ref,
    lse_ref,
    g_lse_ref,
    g_target_ref,
    dh_ref,
    *,
    vocab,
    d_model,
    block_n,
    block_v,
    block_d,
    tiles_per_split,
):
    """Program (row tile i, vocabulary range s): a partial dh over the range's tiles.

    Refs: h (block_n, D_pad), w (tiles_per_split * block_v, D) range s of W, labels / lse /
    g_lse / g_target (block_n,); output (block_n, D_pad) f32 partial dh of range s, zeroed first,
    then accumulated tile by tile (only this program touches it).
    """
    n_chunks = cdiv(d_model, block_d)
    d_pad = dh_ref.shape[1]
    _zero_fill(dh_ref, 0, block_n, None, d_pad // block_d, block_d, d_pad)
    labels_n, lse_n = labels_ref[...], lse_ref[...]
    g_lse_n, g_target_n = g_lse_ref[...], g_target_ref[...]
    range0 = pl.program_id(1) * (tiles_per_split * block_v)

    def v_tile(t, carry):
        t0 = pl.multiple_of(t * block_v, block_v)  # first row of the tile inside the range
        v0 = range0 + t0
        rows_left = _rows_left(vocab, v0, block_v)
        logits = tile_logits(
            h_ref, w_ref, t0, rows_left, block_v=block_v, block_d=block_d, d_model=d_model
        )
        ids_v, valid_v, logits = _masked_logits(logits, v0, vocab, block_v)
        dl = _dlogits(logits, ids_v, valid_v, labels_n, lse_n, g_lse_n, g_target_n)
        dl = dl.astype(w_ref.dtype)
        row_ok = None if rows_left is None else valid_v

        def d_chunk(c, carry):
            d0 = pl.multiple_of(c * block_d, block_d)
            cols = pl.ds(d0, block_d)
            w = load_tile(
                w_ref, (pl.ds(t0, block_v), cols), tile_mask(row_ok, d0, block_v, block_d, d_model)
            )
            dh_ref[:, cols] += jnp.dot(
                dl, w, precision=DOT_PRECISION, preferred_element_type=jnp.float32
            )
            return carry

        return lax.fori_loop(0, n_chunks, d_chunk, carry)

    # The last range may hold fewer tiles: loop only over tiles that exist.
    n_tiles = jnp.clip(lax.div(vocab - range0 + block_v - 1, block_v), 0, tiles_per_split)
    lax.fori_loop(0, n_tiles, v_tile, 0)


def _linear_ce_dw_kernel(
    h_ref,
    w_ref,
    labels_ref,
    lse_ref,
    g_lse_ref,
    g_target_ref,
    dw_ref,
    *,
    vocab,
    d_model,
    n_rows_pad,
    block_n,
    block_v,
    block_d,
):
    """Program (vocabulary tile j): dW for its block_v rows, looping over all row tiles.

    Refs: h (N_pad, D_pad) whole, w (block_v, D) tile j, labels / lse / g_lse / g_target
    (N_pad,) whole; output dw (block_v, D) tile j of the (V, D) f32 gradient: rows past V and
    columns past D are never stored (masked), every other element is zeroed, then accumulated.
    One kernel program, kept whole (as Triton and Pallas kernels are) so its loads, masks and
    stores read in the order the device runs them.
    """
    n_chunks = cdiv(d_model, block_d)
    v0 = pl.program_id(0) * block_v
    ids_v = v0 + jnp.arange(block_v, dtype=jnp.int32)
    valid_v = ids_v < vocab
    rows_left = _rows_left(vocab, v0, block_v)
    row_ok = None if rows_left is None else valid_v
    _zero_fill(dw_ref, 0, block_v, row_ok, n_chunks, block_d, d_model)

    def n_tile(i, carry):
        n0 = pl.multiple_of(i * block_n, block_n)
        rows = pl.ds(n0, block_n)
        logits = tile_logits(
            h_ref,
            w_ref,
            0,
            rows_left,
            h_row0=n0,
            rows=block_n,
            block_v=block_v,
            block_d=block_d,
            d_model=d_model,
        )
        logits = jnp.where(valid_v[None, :], logits, NEG_INF)
        dl = _dlogits(
            logits,
            ids_v,
            valid_v,
            labels_ref[rows],
            lse_ref[rows],
            g_lse_ref[rows],
            g_target_ref[rows],
        ).astype(h_ref.dtype)

        def d_chunk(c, carry):
            d0 = pl.multiple_of(c * block_d, block_d)
            cols = pl.ds(d0, block_d)
            mask = tile_mask(row_ok, d0, block_v, block_d, d_model)
            h = h_ref[rows, cols]
            upd = lax.dot_general(
                dl,
                h,
                (((0,), (0,)), ((), ())),
                precision=DOT_PRECISION,
                preferred_element_type=jnp.float32,
            )
            idx = (pl.ds(0, block_v), cols)
            store_tile(dw_ref, idx, load_tile(dw_ref, idx, mask, 0.0) + upd, mask)
            return carry

        return lax.fori_loop(0, n_chunks, d_chunk, carry)

    lax.fori_loop(0, n_rows_pad // block_n, n_tile, 0)


def _bwd_call(h_nd, w_vd, labels_n, lse_n, g_lse_n, g_target_n, *, blocks, interpret, poison=False):
    """Run the dh and dW kernels; dh comes back (N_pad, D_pad), dW exactly (V, D)."""
    n_rows, d_model = h_nd.shape
    vocab = w_vd.shape[0]
    bn, bv, bd = blocks.block_n, blocks.block_v, blocks.block_d
    nn, nv = cdiv(n_rows, bn), cdiv(vocab, bv)
    n_pad, d_pad = nn * bn, cdiv(d_model, bd) * bd
    h_pad = pad_cols(pad_rows(h_nd, n_pad), d_pad)
    # Padded rows carry label -1 and zero cotangents, so they add nothing to dW.
    rows = (
        pad_rows(labels_n.astype(jnp.int32), n_pad, -1),
        pad_rows(lse_n.astype(jnp.float32), n_pad),
        pad_rows(g_lse_n.astype(jnp.float32), n_pad),
        pad_rows(g_target_n.astype(jnp.float32), n_pad),
    )
    statics = dict(vocab=vocab, d_model=d_model, block_v=bv, block_d=bd)
    tiles_per_split = cdiv(nv, min(blocks.dh_splits, nv))
    splits = cdiv(nv, tiles_per_split)  # no empty ranges
    span = tiles_per_split * bv
    (dh_snd,) = pallas_call_maybe_poisoned(
        functools.partial(
            _linear_ce_dh_kernel, block_n=bn, tiles_per_split=tiles_per_split, **statics
        ),
        (h_pad, w_vd, *rows),
        grid=(nn, splits),
        in_specs=[
            pl.BlockSpec((bn, d_pad), lambda i, s: (i, 0)),
            pl.BlockSpec((span, d_model), lambda i, s: (s, 0)),
            *[pl.BlockSpec((bn,), lambda i, s: (i,))] * 4,
        ],
        out_specs=[pl.BlockSpec((None, bn, d_pad), lambda i, s: (s, i, 0))],
        out_shape=[jax.ShapeDtypeStruct((splits, n_pad, d_pad), jnp.float32)],
        poison=poison,
        interpret=interpret,
        compiler_params=blocks.compiler_params(),
        name="linear_ce_dh",
    )
    dh = dh_snd[0] if splits == 1 else jnp.sum(dh_snd, axis=0)
    (dw,) = pallas_call_maybe_poisoned(
        functools.partial(_linear_ce_dw_kernel, n_rows_pad=n_pad, block_n=bn, **statics),
        (h_pad, w_vd, *rows),
        grid=(nv,),
        in_specs=[
            pl.BlockSpec((n_pad, d_pad), lambda j: (0, 0)),
            pl.BlockSpec((bv, d_model), lambda j: (j, 0)),
            *[pl.BlockSpec((n_pad,), lambda j: (0,))] * 4,
        ],
        out_specs=[pl.BlockSpec((bv, d_model), lambda j: (j, 0))],
        out_shape=[jax.ShapeDtypeStruct((vocab, d_model), jnp.float32)],
        poison=poison,
        interpret=interpret,
        compiler_params=blocks.compiler_params(),
        name="linear_ce_dw",
    )
    return dh, dw


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def linear_ce_bwd(
    h_nd: jax.Array,
    w_vd: jax.Array,
    labels_n: jax.Array,
    lse_n: jax.Array,
    g_lse_n: jax.Array,
    g_target_n: jax.Array,
    *,
    blocks: CEBlocks | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Gradients of ``sum_n g_lse_n * lse_n + g_target_n * target_logit_n`` for h and W.

    ``dlogits = g_lse * softmax(logits) + g_target * onehot(label)`` is formed tile by tile from
    recomputed logits (no N x V buffer); ``dh = dlogits @ W`` and ``dW = dlogits.T @ h``.

    Args:
      h_nd, w_vd, labels_n: as for ``linear_ce_fwd`` (labels outside [0, V): no onehot term).
      lse_n: (N,) the forward's logsumexp (the softmax is ``exp(logits - lse_n)``).
      g_lse_n, g_target_n: (N,) cotangents of lse_n and target_logit_n (for a mean loss over
        kept rows: ``mask / count`` and ``-mask / count``).
      blocks, interpret: as for ``linear_ce_fwd``.

    Returns:
      (dh_nd (N, D), dw_vd (V, D)), float32. For bf16 inputs the second matmul of each tile
      takes dlogits rounded to bf16 (tensor-core operands, f32 accumulation), as flash-attention
      backward kernels do; float32 inputs stay float32 throughout.
    """
    blocks = _blocks_for(h_nd, w_vd, blocks)
    n_rows, d_model = h_nd.shape
    for name, x in (("labels_n", labels_n), ("lse_n", lse_n), ("g_lse_n", g_lse_n)):
        _check_rows(name, x, n_rows)
    _check_rows("g_target_n", g_target_n, n_rows)
    dh, dw = _bwd_call(
        h_nd, w_vd, labels_n, lse_n, g_lse_n, g_target_n, blocks=blocks, interpret=interpret
    )
    return dh[:n_rows, :d_model], dw


# ---------------------------------------------------------------------------------------------
# references


def _lse_target_reference(h_nd, w_vd, labels_n):
    logits_nv = jnp.einsum(
        "nd,vd->nv",
        h_nd,
        w_vd,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    vocab = w_vd.shape[0]
    lse_n = jax.nn.logsumexp(logits_nv, axis=1)
    labels_n = labels_n.astype(jnp.int32)
    has = (labels_n >= 0) & (labels_n < vocab)
    picked = jnp.take_along_axis(logits_nv, jnp.clip(labels_n, 0, vocab - 1)[:, None], axis=1)
    return lse_n, jnp.where(has, picked[:, 0], 0.0)


@jax.jit
def linear_ce_fwd_reference(h_nd, w_vd, labels_n):
    """Plain-jnp ``linear_ce_fwd`` with materialized f32 logits at HIGHEST precision."""
    return _lse_target_reference(h_nd, w_vd, labels_n)


@jax.jit
def linear_ce_bwd_reference(h_nd, w_vd, labels_n, lse_n, g_lse_n, g_target_n):
    """``jax.grad`` of the materialized forward (in f32); ``lse_n`` is recomputed, not used."""
    del lse_n

    def objective(h, w):
        lse, target = _lse_target_reference(h, w, labels_n)
        return jnp.sum(g_lse_n * lse + g_target_n * target)

    return jax.grad(objective, argnums=(0, 1))(h_nd.astype(jnp.float32), w_vd.astype(jnp.float32))
