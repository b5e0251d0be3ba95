"""Fused decode kernel: max, argmax, logsumexp and a Gumbel-max sample of ``h @ W.T`` in one pass.

Memory-oriented, for small serving batches (B from 1 up to ``block_b``, 16-64 rows): the grid is
(batch tiles, vocabulary tiles); one program reads one (block_v, D) tile of W, once, for all
``block_b`` rows of h, and writes per-tile partial results; jnp merges the partials. At B <= block_b
W is streamed from HBM exactly once and the B x V logits never exist. Batches larger than
``block_b`` re-read W once per batch tile: use ``tiled_decode`` there.

Lowering: written for the Pallas Triton GPU backend (power-of-two tiles, masked loads for the
ragged vocabulary edge, reductions and dots only) and run on CPU with ``interpret=True``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import noise
from pallas_kernels._common import (
    DecodeStats,
    check_pow2,
    decode_pallas_call,
    merge_decode_partials,
    next_pow2,
    prepare_seeds,
    tile_decode_stats,
    tile_logits,
)


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    """Tiling of ``fused_decode``. Every size is a power of two."""

    block_v: int = 128  # vocabulary rows of W per program (one tile)
    block_b: int = 16  # batch rows per program; >= 16 gives Triton's dot a full MMA tile
    block_d: int = 128  # d_model columns per inner-loop step
    num_warps: int = 4  # Triton warps per program (GPU only)
    num_stages: int = 2  # Triton software-pipelining stages of the d_model loop (GPU only)

    def __post_init__(self):
        check_pow2(block_v=self.block_v, block_b=self.block_b, block_d=self.block_d)

    @classmethod
    def default(cls, batch: int, vocab: int, d_model: int, dtype) -> DecodeBlocks:
        """Blocks for a shape: every row in one batch tile (up to 64), 128-token W tiles."""
        del dtype  # the same tiles suit bf16 and f32 here; the autotuner refines them
        block_b = min(max(next_pow2(batch), 16), 64)
        block_v = min(128, next_pow2(vocab))
        block_d = min(128, max(16, next_pow2(d_model)))
        return cls(block_v=block_v, block_b=block_b, block_d=block_d)

    @classmethod
    def candidates(cls, batch: int, vocab: int, d_model: int, dtype) -> list[DecodeBlocks]:
        """A small search space around ``default`` for the autotuner (default first)."""
        base = cls.default(batch, vocab, d_model, dtype)
        out = [base]
        for block_v in (64, 128, 256):
            for block_d, num_warps, num_stages in ((64, 4, 3), (128, 4, 2), (128, 8, 3)):
                c = dataclasses.replace(
                    base,
                    block_v=min(block_v, next_pow2(vocab)),
                    block_d=min(block_d, max(16, next_pow2(d_model))),
                    num_warps=num_warps,
                    num_stages=num_stages,
                )
                if c not in out:
                    out.append(c)
        return out


def _fused_decode_kernel(
    h_ref,
    w_ref,
    *refs,
    vocab: int,
    d_model: int,
    block_v: int,
    block_b: int,
    block_d: int,
    has_seeds: bool,
):
    """One (batch tile i, vocabulary tile j) program.

    Refs: h (block_b, D_pad); w (block_v, D) tile j of W; with seeds also seeds (2,) uint32 and
    inv_temperature (1,) f32; outputs (block_b,) each: tile max, tile argmax, tile logsumexp and,
    with seeds, the tile's best tempered-plus-Gumbel score and its token id.
    """
    if has_seeds:
        seeds_ref, invt_ref, max_ref, arg_ref, lse_ref, score_ref, sample_ref = refs
    else:
        max_ref, arg_ref, lse_ref = refs
    i, j = pl.program_id(0), pl.program_id(1)
    v0 = j * block_v
    logits_bv = tile_logits(
        h_ref, w_ref, 0, vocab - v0, block_v=block_v, block_d=block_d, d_model=d_model
    )
    rows_b = i * block_b + jnp.arange(block_b, dtype=jnp.int32)
    if has_seeds:
        seeds, inv_t = (seeds_ref[0], seeds_ref[1]), invt_ref[0]
        out_refs = (max_ref, arg_ref, lse_ref, score_ref, sample_ref)
    else:
        seeds, inv_t = None, None
        out_refs = (max_ref, arg_ref, lse_ref)
    stats = tile_decode_stats(logits_bv, v0, vocab, rows_b, seeds, inv_t)
    for ref, value in zip(out_refs, stats.values(), strict=True):
        ref[...] = value


def _decode_partials(
    h_bd: jax.Array,
    w_vd: jax.Array,
    seeds: jax.Array | None,
    inv_temperature,
    *,
    blocks: DecodeBlocks,
    interpret: bool,
    poison: bool = False,
) -> dict[str, jax.Array]:
    """The kernel's raw per-tile partials, each (n_vocab_tiles, B_pad); see ``fused_decode``."""
    return decode_pallas_call(
        _fused_decode_kernel,
        h_bd,
        w_vd,
        seeds,
        inv_temperature,
        block_b=blocks.block_b,
        block_d=blocks.block_d,
        w_block_rows=blocks.block_v,
        statics={"block_v": blocks.block_v},
        compiler_params=plgpu.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        poison=poison,
        name="fused_decode",
    )


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def fused_decode(
    h_bd: jax.Array,
    w_vd: jax.Array,
    seeds: jax.Array | None = None,
    *,
    inv_temperature: float | jax.Array = 1.0,
    blocks: DecodeBlocks | None = None,
    interpret: bool = False,
) -> DecodeStats:
    """Max, argmax, logsumexp and a sample of ``h_bd @ w_vd.T`` per row, never storing the logits.

    Args:
      h_bd: (B, D) hidden states, bfloat16, float16 or float32.
      w_vd: (V, D) unembedding, the same dtype. V and B need not be multiples of any block.
      seeds: optional (2,) uint32 from ``noise.seeds_from_key``; without it ``sample_b`` is -1.
      inv_temperature: 1 / temperature, a positive finite scalar (a traced value is fine: it
        is a kernel input, not a compile-time constant). Greedy decoding is ``argmax_b``.
      blocks: tiling; ``DecodeBlocks.default(B, V, D, dtype)`` when None.
      interpret: run the Pallas interpreter (CPU) instead of compiling for the GPU.

    Returns:
      DecodeStats of (B,) arrays: f32 max, int32 argmax (lowest id on ties), f32 logsumexp of
      the raw logits, int32 sample (Gumbel-max over ``logits * inv_temperature``, noise keyed by
      (seeds, row, token id), so it does not depend on ``blocks``).
    """
    if blocks is None:
        blocks = DecodeBlocks.default(h_bd.shape[0], w_vd.shape[0], w_vd.shape[1], h_bd.dtype)
    parts = _decode_partials(h_bd, w_vd, seeds, inv_temperature, blocks=blocks, interpret=interpret)
    return merge_decode_partials(parts, h_bd.shape[0], seeds is not None)


def decode_logits_reference(h_bd: jax.Array, w_vd: jax.Array) -> jax.Array:
    """Materialized (B, V) float32 logits at HIGHEST precision."""
    return jnp.einsum(
        "bd,vd->bv",
        h_bd,
        w_vd,
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


@jax.jit
def fused_decode_reference(
    h_bd: jax.Array,
    w_vd: jax.Array,
    seeds: jax.Array | None = None,
    *,
    inv_temperature: float | jax.Array = 1.0,
) -> DecodeStats:
    """Plain-jnp ``fused_decode``: materializes the (B, V) logits. Same arguments and result."""
    logits_bv = decode_logits_reference(h_bd, w_vd)
    batch, vocab = logits_bv.shape
    max_b = jnp.max(logits_bv, axis=1)
    argmax_b = jnp.argmax(logits_bv, axis=1).astype(jnp.int32)  # first occurrence: lowest id
    lse_b = jax.nn.logsumexp(logits_bv, axis=1)
    if seeds is None:
        sample_b = jnp.full((batch,), -1, jnp.int32)
    else:
        rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
        toks = jnp.arange(vocab, dtype=jnp.int32)[None, :]
        g_bv = noise.gumbel(prepare_seeds(seeds), rows, toks)
        score_bv = logits_bv * jnp.asarray(inv_temperature, jnp.float32) + g_bv
        sample_b = jnp.argmax(score_bv, axis=1).astype(jnp.int32)
    return DecodeStats(max_b=max_b, argmax_b=argmax_b, lse_b=lse_b, sample_b=sample_b)
