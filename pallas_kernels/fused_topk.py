"""Fused top-k of ``h @ W.T``: per-tile top-k candidates in a kernel, merged by one sort in jnp.

The grid is (batch tiles, vocabulary tiles) as in ``fused_decode``; a program computes its logit
tile and extracts the tile's k best (value, id) pairs by k rounds of "row max, lowest id at the
max, knock it out". That uses only max / min reductions and selects, which the Pallas Triton
backend lowers (it has no sort or top_k lowering: ``lax.sort_p`` and ``lax.top_k_p`` have no
Triton rule in jax 0.10), so the kernel targets GPU like the other kernels and runs with
``interpret=True`` on CPU. The candidates, ``n_tiles * k_pad`` per row, are merged by a
two-key ``lax.sort`` (value descending, id ascending) in XLA outside the kernel. Each round costs
a few passes over a (block_b, block_v) register tile, so the kernel suits serving-size k
(up to a few hundred); for large k it is linear in k.
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
    BIG_ID,
    NEG_INF,
    cdiv,
    check_hw,
    check_pow2,
    next_pow2,
    pad_cols,
    pad_rows,
    pallas_call_maybe_poisoned,
    tile_logits,
    tile_max_argmax,
)
from pallas_kernels.fused_decode import decode_logits_reference


@dataclasses.dataclass(frozen=True)
class TopKBlocks:
    """Tiling of ``fused_topk``. Powers of two."""

    block_v: int = 256  # vocabulary rows per program (each yields k candidates per row)
    block_b: int = 16  # batch rows per program; >= 16 gives Triton's dot a full MMA tile
    block_d: int = 128  # d_model columns per inner-loop step
    num_warps: int = 4  # Triton warps per program (GPU only)
    num_stages: int = 2  # Triton software-pipelining stages (GPU only)

    def __post_init__(self):
        check_pow2(block_v=self.block_v, block_b=self.block_b, block_d=self.block_d)

    @classmethod
    def default(cls, batch: int, vocab: int, d_model: int, dtype) -> TopKBlocks:
        """Every row in one batch tile (up to 64), 256-token tiles (fewer candidates to sort)."""
        del dtype
        return cls(
            block_v=min(256, max(16, next_pow2(vocab))),
            block_b=min(max(next_pow2(batch), 16), 64),
            block_d=min(128, max(16, next_pow2(d_model))),
        )

    @classmethod
    def candidates(cls, batch: int, vocab: int, d_model: int, dtype) -> list[TopKBlocks]:
        """A small search space around ``default`` for the autotuner (default first)."""
        base = cls.default(batch, vocab, d_model, dtype)
        out = [base]
        for block_v, block_d, num_warps in ((128, 128, 4), (512, 64, 8), (256, 64, 4)):
            c = dataclasses.replace(
                base,
                block_v=min(block_v, max(16, next_pow2(vocab))),
                block_d=min(block_d, max(16, next_pow2(d_model))),
                num_warps=num_warps,
            )
            if c not in out:
                out.append(c)
        return out


def _fused_topk_kernel(h_ref, w_ref, vals_ref, ids_ref, *, vocab, d_model, k, block_v, block_d):
    """Program (batch tile i, vocabulary tile j): the tile's top k per row, best first.

    Refs: h (block_b, D_pad), w (block_v, D) tile j; outputs (block_b, k_pad): f32 values and
    int32 ids, columns past k hold -inf / BIG_ID, as do rounds past the tile's valid tokens.
    """
    v0 = pl.program_id(1) * block_v
    logits = tile_logits(
        h_ref, w_ref, 0, vocab - v0, block_v=block_v, block_d=block_d, d_model=d_model
    )
    ids_v = (v0 + jnp.arange(block_v, dtype=jnp.int32))[None, :]
    logits = jnp.where(ids_v < vocab, logits, NEG_INF)
    rows, k_pad = vals_ref.shape
    col = jnp.arange(k_pad, dtype=jnp.int32)[None, :]

    def round_(t, carry):
        x, vals, ids = carry
        m, a = tile_max_argmax(x, ids_v)
        exhausted = m == NEG_INF
        a = jnp.where(exhausted, BIG_ID, a)
        vals = jnp.where(col == t, m[:, None], vals)
        ids = jnp.where(col == t, a[:, None], ids)
        return jnp.where(ids_v == a[:, None], NEG_INF, x), vals, ids

    init = (
        logits,
        jnp.full((rows, k_pad), NEG_INF, jnp.float32),
        jnp.full((rows, k_pad), BIG_ID, jnp.int32),
    )
    _, vals, ids = lax.fori_loop(0, min(k, block_v), round_, init)
    vals_ref[...] = vals
    ids_ref[...] = ids


def _topk_partials(h_bd, w_vd, k: int, *, blocks: TopKBlocks, interpret: bool, poison=False):
    """Per-tile candidates, (n_vocab_tiles, B_pad, k_pad) values and ids."""
    check_hw(h_bd, w_vd)
    batch, d_model = h_bd.shape
    vocab = w_vd.shape[0]
    if not 1 <= k <= vocab:
        raise ValueError(f"k={k} must be in [1, {vocab=}]")
    bb, bv, bd = blocks.block_b, blocks.block_v, blocks.block_d
    nb, nv, k_pad = cdiv(batch, bb), cdiv(vocab, bv), next_pow2(k)
    d_pad = cdiv(d_model, bd) * bd
    kernel = functools.partial(
        _fused_topk_kernel, vocab=vocab, d_model=d_model, k=k, block_v=bv, block_d=bd
    )
    return pallas_call_maybe_poisoned(
        kernel,
        (pad_cols(pad_rows(h_bd, nb * bb), d_pad), w_vd),
        grid=(nb, nv),
        in_specs=[
            pl.BlockSpec((bb, d_pad), lambda i, j: (i, 0)),
            pl.BlockSpec((bv, d_model), lambda i, j: (j, 0)),
        ],
        out_specs=[pl.BlockSpec((None, bb, k_pad), lambda i, j: (j, i, 0))] * 2,
        out_shape=[
            jax.ShapeDtypeStruct((nv, nb * bb, k_pad), jnp.float32),
            jax.ShapeDtypeStruct((nv, nb * bb, k_pad), jnp.int32),
        ],
        poison=poison,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        name="fused_topk",
    )


def _sorted_topk(vals_bc, ids_bc, k: int):
    """The k best (value desc, id asc) of candidate columns, a NaN ranked first whatever its
    sign bit (``lax.sort`` orders a negative NaN below -inf)."""
    nan = jnp.isnan(vals_bc)
    keys = (jnp.where(nan, 0, 1), jnp.where(nan, 0.0, -vals_bc), ids_bc)
    *_, ids, vals = lax.sort((*keys, vals_bc), dimension=1, num_keys=3)
    return vals[:, :k], ids[:, :k]


@functools.partial(jax.jit, static_argnames=("k", "blocks", "interpret"))
def fused_topk(
    h_bd: jax.Array,
    w_vd: jax.Array,
    k: int,
    *,
    blocks: TopKBlocks | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The k largest logits of ``h_bd @ w_vd.T`` per row and their token ids.

    Args:
      h_bd: (B, D) hidden states, bfloat16, float16 or float32.
      w_vd: (V, D) unembedding, same dtype; V need not be a multiple of any block.
      k: static, 1 <= k <= V.
      blocks: tiling; ``TopKBlocks.default(B, V, D, dtype)`` when None.
      interpret: run the Pallas interpreter (CPU).

    Returns:
      (vals_bk f32, ids_bk int32), sorted by value descending; equal values by lowest id.
    """
    if blocks is None:
        blocks = TopKBlocks.default(h_bd.shape[0], w_vd.shape[0], w_vd.shape[1], h_bd.dtype)
    vals_tbk, ids_tbk = _topk_partials(h_bd, w_vd, k, blocks=blocks, interpret=interpret)
    n_tiles, b_pad, k_pad = vals_tbk.shape
    batch = h_bd.shape[0]
    # Candidates ordered (tile, rank) per row; the two-key sort makes the order irrelevant.
    vals = jnp.transpose(vals_tbk, (1, 0, 2)).reshape(b_pad, n_tiles * k_pad)[:batch]
    ids = jnp.transpose(ids_tbk, (1, 0, 2)).reshape(b_pad, n_tiles * k_pad)[:batch]
    return _sorted_topk(vals, ids, k)


@functools.partial(jax.jit, static_argnames=("k",))
def fused_topk_reference(h_bd: jax.Array, w_vd: jax.Array, k: int):
    """Plain-jnp ``fused_topk``: materialized HIGHEST-precision logits, one full sort."""
    logits_bv = decode_logits_reference(h_bd, w_vd)
    ids_bv = jnp.broadcast_to(jnp.arange(logits_bv.shape[1], dtype=jnp.int32), logits_bv.shape)
    return _sorted_topk(logits_bv, ids_bv, k)
