"""Tiled decode kernel: the decode statistics of ``fused_decode`` for large batches.

Compute-oriented. The grid is (batch tiles, vocabulary ranges): a program takes a
tensor-core-sized tile of ``block_b`` rows (64-128) and walks ``tiles_per_program`` vocabulary
tiles of its range in a loop, merging max / argmax / logsumexp / Gumbel-max candidates online
(flash-decoding style) in registers. Compared with ``fused_decode`` (one tile per program, small
batch tiles) this keeps the MMA tiles full at large B and writes ``tiles_per_program`` times fewer
partials, which matters once B x n_tiles partials stop being negligible. The programs of one
vocabulary range (all batch tiles) share the same W rows, so W is read from HBM about once and
re-served from L2 to the other batch tiles.

Same result type and reference as ``fused_decode`` (``fused_decode_reference``).
Lowering: Pallas Triton GPU backend; ``interpret=True`` on CPU.
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
    DecodeStats,
    cdiv,
    check_pow2,
    decode_pallas_call,
    finite_lse,
    merge_decode_partials,
    next_pow2,
    takes_over,
    tile_decode_stats,
    tile_logits,
)
from pallas_kernels.fused_decode import fused_decode_reference

tiled_decode_reference = fused_decode_reference


@dataclasses.dataclass(frozen=True)
class TiledBlocks:
    """Tiling of ``tiled_decode``. Block sizes are powers of two."""

    block_b: int = 64  # batch rows per program: the MMA tile's M
    block_v: int = 128  # vocabulary rows per loop step: the MMA tile's N
    block_d: int = 64  # d_model columns per inner step: the MMA tile's K
    tiles_per_program: int = 8  # vocabulary tiles one program walks (online merge)
    num_warps: int = 4  # Triton warps per program (GPU only)
    num_stages: int = 3  # Triton software-pipelining stages (GPU only)

    def __post_init__(self):
        check_pow2(block_b=self.block_b, block_v=self.block_v, block_d=self.block_d)
        if self.tiles_per_program < 1:
            raise ValueError(f"tiles_per_program={self.tiles_per_program} must be >= 1")

    @classmethod
    def default(cls, batch: int, vocab: int, d_model: int, dtype) -> TiledBlocks:
        """64 x 128 x 64 tiles (128-row batch tiles from B = 256 up), about 8 tiles a program."""
        del dtype
        block_b = 128 if batch >= 256 else min(64, max(16, next_pow2(batch)))
        block_v = min(128, max(16, next_pow2(vocab)))
        n_tiles = cdiv(vocab, block_v)
        return cls(
            block_b=block_b,
            block_v=block_v,
            block_d=min(64, max(16, next_pow2(d_model))),
            tiles_per_program=max(1, min(8, n_tiles)),
            num_warps=8 if block_b >= 128 else 4,
        )

    @classmethod
    def candidates(cls, batch: int, vocab: int, d_model: int, dtype) -> list[TiledBlocks]:
        """A small search space around ``default`` for the autotuner (default first)."""
        base = cls.default(batch, vocab, d_model, dtype)
        out = [base]
        for block_b, block_v, block_d, tiles, warps in (
            (64, 128, 64, 4, 4),
            (64, 64, 64, 16, 4),
            (128, 128, 32, 8, 8),
            (128, 64, 64, 8, 4),
            (64, 128, 32, 16, 4),
        ):
            c = dataclasses.replace(
                base,
                block_b=min(block_b, max(16, next_pow2(batch))),
                block_v=min(block_v, max(16, next_pow2(vocab))),
                block_d=min(block_d, max(16, next_pow2(d_model))),
                tiles_per_program=max(1, min(tiles, cdiv(vocab, block_v))),
                num_warps=warps,
            )
            if c not in out:
                out.append(c)
        return out


def _merge_into(run: dict, new: dict) -> dict:
    """Online merge of tile stats into running stats (``new`` holds the higher token ids)."""
    out = {}
    for value, index in (("max", "argmax"), ("score", "sample")):
        if value not in run:
            continue
        take = takes_over(new[value], run[value])  # ties keep the earlier, lower id
        out[value] = jnp.where(take, new[value], run[value])
        out[index] = jnp.where(take, new[index], run[index])
    nan = jnp.isnan(run["lse"]) | jnp.isnan(new["lse"])
    hi = jnp.where(nan, jnp.nan, jnp.maximum(run["lse"], new["lse"]))
    out["lse"] = finite_lse(hi, hi + jnp.log(jnp.exp(run["lse"] - hi) + jnp.exp(new["lse"] - hi)))
    return out


def _tiled_decode_kernel(
    h_ref,
    w_ref,
    *refs,
    vocab: int,
    d_model: int,
    block_b: int,
    block_v: int,
    block_d: int,
    tiles_per_program: int,
    has_seeds: bool,
):
    """Program (batch tile i, vocabulary range s): stats over the range's tiles, merged online.

    Refs: h (block_b, D_pad); w (tiles_per_program * block_v, D) range s of W; with seeds also
    seeds (2,) uint32 and inv_temperature (1,) f32; outputs (block_b,) each: max, argmax, lse
    and, with seeds, best score and its token id, over the range.
    """
    if has_seeds:
        seeds_ref, invt_ref, *out_refs = refs
        seeds, inv_t = (seeds_ref[0], seeds_ref[1]), invt_ref[0]
    else:
        out_refs, seeds, inv_t = list(refs), None, None
    i, s = pl.program_id(0), pl.program_id(1)
    range0 = s * (tiles_per_program * block_v)
    rows_b = i * block_b + jnp.arange(block_b, dtype=jnp.int32)
    # The range's first tile always exists (the grid has cdiv(n_tiles, tiles_per_program) ranges).
    first = tile_decode_stats(
        tile_logits(
            h_ref, w_ref, 0, vocab - range0, block_v=block_v, block_d=block_d, d_model=d_model
        ),
        range0,
        vocab,
        rows_b,
        seeds,
        inv_t,
    )
    names = list(first)

    def step(t, carry):
        t0 = pl.multiple_of(t * block_v, block_v)
        v0 = range0 + t0
        logits = tile_logits(
            h_ref, w_ref, t0, vocab - v0, block_v=block_v, block_d=block_d, d_model=d_model
        )
        new = tile_decode_stats(logits, v0, vocab, rows_b, seeds, inv_t)
        merged = _merge_into(dict(zip(names, carry, strict=True)), new)
        return tuple(merged[k] for k in names)

    n_tiles = jnp.clip(lax.div(vocab - range0 + block_v - 1, block_v), 1, tiles_per_program)
    final = lax.fori_loop(1, n_tiles, step, tuple(first[k] for k in names))
    for ref, value in zip(out_refs, final, strict=True):
        ref[...] = value


def _tiled_partials(
    h_bd, w_vd, seeds, inv_temperature, *, blocks: TiledBlocks, interpret: bool, poison=False
) -> dict[str, jax.Array]:
    """Per-range partials, each (n_ranges, B_pad); see ``tiled_decode``."""
    tiles = min(blocks.tiles_per_program, cdiv(w_vd.shape[0], blocks.block_v))
    return decode_pallas_call(
        _tiled_decode_kernel,
        h_bd,
        w_vd,
        seeds,
        inv_temperature,
        block_b=blocks.block_b,
        block_d=blocks.block_d,
        w_block_rows=tiles * blocks.block_v,
        statics={"block_v": blocks.block_v, "tiles_per_program": tiles},
        compiler_params=plgpu.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        poison=poison,
        name="tiled_decode",
    )


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def tiled_decode(
    h_bd: jax.Array,
    w_vd: jax.Array,
    seeds: jax.Array | None = None,
    *,
    inv_temperature: float | jax.Array = 1.0,
    blocks: TiledBlocks | None = None,
    interpret: bool = False,
) -> DecodeStats:
    """``fused_decode``'s DecodeStats (same arguments, same results) with large-batch tiling.

    Args:
      h_bd: (B, D) hidden states, bfloat16, float16 or float32.
      w_vd: (V, D) unembedding, same dtype.
      seeds: optional (2,) uint32 from ``noise.seeds_from_key``; without it ``sample_b`` is -1.
      inv_temperature: 1 / temperature, positive and finite; may be traced.
      blocks: tiling; ``TiledBlocks.default(B, V, D, dtype)`` when None.
      interpret: run the Pallas interpreter (CPU).

    Returns:
      DecodeStats of (B,) arrays (f32 max, int32 argmax with lowest-id ties, f32 logsumexp,
      int32 sample), bit-for-bit the same sample as ``fused_decode`` for the same seeds up to
      float32 rounding of near-tied scores.
    """
    if blocks is None:
        blocks = TiledBlocks.default(h_bd.shape[0], w_vd.shape[0], w_vd.shape[1], h_bd.dtype)
    parts = _tiled_partials(h_bd, w_vd, seeds, inv_temperature, blocks=blocks, interpret=interpret)
    return merge_decode_partials(parts, h_bd.shape[0], seeds is not None)
