"""Pieces shared by the unembedding kernels: the decode result type, tile merging, small helpers.

Every kernel here follows one pattern. A ``pallas_call`` grid runs over tiles of the vocabulary
(and of the batch); each program writes a *partial* result for its tile into a small
``(n_tiles, rows)`` output, and plain jnp merges the partials afterwards. The merge is exact for
max / argmax / sampling and numerically stable for logsumexp. This keeps every grid step
independent (the Triton backend has no sequential grid axes and no scratch memory), so the same
kernel runs on GPU and in interpret mode on CPU, and the extra traffic is tiny: a handful of f32
per (tile, row) against ``block_v * d_model`` weights read per tile.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import noise

# Larger than any vocabulary id: the "no index" value inside min-reductions over ids.
BIG_ID = 2**31 - 1
NEG_INF = float("-inf")
# In-kernel dots: on the Triton backend Precision.DEFAULT means TF32 for float32 operands
# (10-bit mantissa); HIGHEST keeps them IEEE float32. It changes nothing for bf16 operands.
DOT_PRECISION = lax.Precision.HIGHEST


class DecodeStats(NamedTuple):
    """Per-row statistics of ``logits_bv = h_bd @ w_vd.T`` without materializing the logits.

    All fields have shape (B,).

    max_b:    float32, the largest logit.
    argmax_b: int32, the token id of the largest logit; the lowest id when several tie.
    lse_b:    float32, logsumexp of the raw (untempered) logits.
    sample_b: int32, a Gumbel-max sample: the argmax over tokens of
              ``logits * inv_temperature + gumbel(seeds, row, token)`` (``noise.gumbel``),
              lowest id on ties. -1 for every row when no seeds are given.

    A NaN ranks above everything, as in ``jnp.argmax``: a row whose logits hold one has max
    NaN, argmax and sample the first NaN's id, lse NaN. A +inf logit (no NaN) gives lse +inf.
    """

    max_b: jax.Array
    argmax_b: jax.Array
    lse_b: jax.Array
    sample_b: jax.Array


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (and >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_pow2(**sizes: int) -> None:
    """Raise ValueError unless every named size is a positive power of two (Triton's rule)."""
    for name, size in sizes.items():
        if size < 1 or size & (size - 1):
            raise ValueError(f"{name}={size} must be a positive power of two")


def check_hw(h_bd: jax.Array, w_vd: jax.Array) -> None:
    """Check that h is (B, D) and w is (V, D) with matching d_model and one float dtype."""
    if h_bd.ndim != 2 or w_vd.ndim != 2:
        raise ValueError(f"h must be (B, D) and w (V, D); got {h_bd.shape=} and {w_vd.shape=}")
    if h_bd.shape[1] != w_vd.shape[1]:
        raise ValueError(f"d_model differs: {h_bd.shape[1]=} vs {w_vd.shape[1]=}")
    if h_bd.dtype != w_vd.dtype:
        raise ValueError(f"h and w must share a dtype; got {h_bd.dtype=} and {w_vd.dtype=}")
    if h_bd.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"dtype {h_bd.dtype} is not one of bfloat16, float16, float32")


def pad_rows(x: jax.Array, rows: int, value=0) -> jax.Array:
    """Pad axis 0 of x up to ``rows`` with ``value`` (a no-op when it has that many or more)."""
    extra = rows - x.shape[0]
    if extra <= 0:
        return x
    pad = [(0, extra)] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, pad, constant_values=jnp.asarray(value, x.dtype))


def dlogits(p_nv: jax.Array, hit_nv: jax.Array, g_lse_n: jax.Array, g_target_n: jax.Array):
    """d(g_lse * lse + g_target * target logit) / d logits = g_lse * softmax + g_target *
    onehot(label), for a tile of softmax ``p`` and label hits ``hit`` (f32)."""
    return g_lse_n[:, None] * p_nv + jnp.where(hit_nv, g_target_n[:, None], 0.0)


def prepare_seeds(seeds: jax.Array) -> jax.Array:
    """Check and return the two uint32 seeds (``noise.seeds_from_key``) as shape (2,)."""
    seeds = jnp.asarray(seeds)
    if seeds.shape != (2,) or seeds.dtype != jnp.uint32:
        raise ValueError(f"seeds must be uint32 of shape (2,); got {seeds.dtype}{seeds.shape}")
    return seeds


def tile_max_argmax(x_bv: jax.Array, ids_v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Row max of a tile and the lowest id attaining it, with reductions that lower everywhere.
    A NaN ranks above everything, as in ``jnp.argmax``: a row holding one gets max NaN and the
    id of its first NaN (a max reduction may drop NaN: XLA's CPU one does from eight rows).

    ``ids_v`` are the global token ids of the tile's columns, shape (1, block_v) or (block_v,).
    """
    m_b = jnp.max(x_bv, axis=1)
    arg_b = jnp.min(jnp.where(x_bv == m_b[:, None], ids_v, BIG_ID), axis=1)
    nan_b = jnp.min(jnp.where(jnp.isnan(x_bv), ids_v, BIG_ID), axis=1)
    has_nan = nan_b < BIG_ID
    return jnp.where(has_nan, jnp.nan, m_b), jnp.where(has_nan, nan_b, arg_b)


def takes_over(new: jax.Array, run: jax.Array) -> jax.Array:
    """Where a later tile's max replaces the running one: larger (ties keep the lower id), or
    the row's first NaN."""
    return (new > run) | (jnp.isnan(new) & ~jnp.isnan(run))


def finite_lse(m_b: jax.Array, lse_b: jax.Array) -> jax.Array:
    """A logsumexp ``lse_b`` taken around the max ``m_b``: +inf where the max is +inf (the sum
    then holds inf - inf), NaN where the max is NaN."""
    return jnp.where(m_b == jnp.inf, jnp.inf, jnp.where(jnp.isnan(m_b), jnp.nan, lse_b))


def tile_decode_stats(logits_bv, v0, vocab: int, rows_b, seeds, inv_t):
    """Decode statistics of one logit tile, inside a kernel.

    ``logits_bv`` (rows, block_v) f32 are the logits of tokens ``v0 : v0 + block_v``; those past
    ``vocab`` are masked out. ``rows_b`` are the tiles' global row ids (for the noise). With
    ``seeds`` (a pair of uint32 scalars) also the Gumbel-max candidate of the tile.

    Returns a dict of (rows,) arrays: max, argmax (lowest id), lse and, with seeds, score (the
    best ``logit * inv_t + gumbel``) and sample (its lowest id).
    """
    block_v = logits_bv.shape[1]
    ids_v = v0 + jnp.arange(block_v, dtype=jnp.int32)
    valid = (ids_v < vocab)[None, :]
    logits_bv = jnp.where(valid, logits_bv, NEG_INF)
    m_b, arg_b = tile_max_argmax(logits_bv, ids_v[None, :])
    out = {
        "max": m_b,
        "argmax": arg_b,
        "lse": finite_lse(m_b, m_b + jnp.log(jnp.sum(jnp.exp(logits_bv - m_b[:, None]), axis=1))),
    }
    if seeds is not None:
        g_bv = noise.gumbel(seeds, rows_b[:, None], ids_v[None, :])
        score_bv = jnp.where(valid, logits_bv * inv_t + g_bv, NEG_INF)
        out["score"], out["sample"] = tile_max_argmax(score_bv, ids_v[None, :])
    return out


def merge_max_argmax(m_tb: jax.Array, arg_tb: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Merge per-tile (max, lowest argmax) partials over axis 0 (tiles in increasing id order);
    a NaN tile max wins, as in ``tile_max_argmax``."""
    nan_tb = jnp.isnan(m_tb)
    has_nan = nan_tb.any(axis=0)
    m_b = jnp.max(m_tb, axis=0)
    hit = jnp.where(has_nan[None, :], nan_tb, m_tb == m_b[None, :])
    arg_b = jnp.min(jnp.where(hit, arg_tb, BIG_ID), axis=0)
    return jnp.where(has_nan, jnp.nan, m_b), arg_b


def merge_lse(lse_tb: jax.Array) -> jax.Array:
    """logsumexp over axis 0 of per-tile logsumexps (every tile holds at least one token): NaN
    where a tile's is, +inf where one is +inf."""
    m_b = jnp.max(lse_tb, axis=0)
    m_b = jnp.where(jnp.isnan(lse_tb).any(axis=0), jnp.nan, m_b)
    return finite_lse(m_b, m_b + jnp.log(jnp.sum(jnp.exp(lse_tb - m_b[None, :]), axis=0)))


def merge_decode_partials(parts: dict[str, jax.Array], batch: int, has_seeds: bool) -> DecodeStats:
    """Merge the (n_tiles, B_pad) partials of a decode kernel into DecodeStats of length B."""
    max_b, argmax_b = merge_max_argmax(parts["max"], parts["argmax"])
    lse_b = merge_lse(parts["lse"])
    if has_seeds:
        _, sample_b = merge_max_argmax(parts["score"], parts["sample"])
    else:
        sample_b = jnp.full(max_b.shape, -1, jnp.int32)
    return DecodeStats(
        max_b=max_b[:batch],
        argmax_b=argmax_b[:batch].astype(jnp.int32),
        lse_b=lse_b[:batch],
        sample_b=sample_b[:batch].astype(jnp.int32),
    )


def inv_temperature_array(inv_temperature) -> jax.Array:
    """The inverse temperature as a float32 array of shape (1,) (a kernel input, not static)."""
    return jnp.reshape(jnp.asarray(inv_temperature, jnp.float32), (1,))


def tile_logits(
    h_ref,
    w_ref,
    w_row0,
    valid_v,
    *,
    h_row0=0,
    rows: int | None = None,
    block_v: int,
    block_d: int,
    d_model: int,
) -> jax.Array:
    """f32 logits of one (rows, block_v) tile, inside a kernel, looping over d_model chunks.

    Reads rows ``h_row0 : h_row0 + rows`` of ``h_ref`` (all of them when ``rows`` is None), whose
    width is a multiple of ``block_d`` (zero padded, so it loads unmasked), and rows
    ``w_row0 : w_row0 + block_v`` of ``w_ref``, of which only the first ``valid_v`` (dynamic)
    exist; ``valid_v=None`` says all of them do (the caller knows ``block_v`` divides the
    vocabulary). Rows past ``valid_v`` and columns past ``d_model`` are loaded masked, as zeros,
    so a ragged edge never reads out of bounds on GPU (the Triton backend does no bounds checks
    of its own); their logits come out as 0 and the caller masks them. Without a ragged edge the
    load is a plain one: no mask to evaluate on GPU, and the interpreter, which pads the whole
    ref by one tile for every masked load, copies nothing. Each load uses one indexer (Triton
    lowering takes no nested ``.at``).

    Products accumulate in float32 (``preferred_element_type``). ``DOT_PRECISION`` (HIGHEST)
    makes float32 inputs use IEEE f32 dots on Triton, not TF32 (its default); bf16 inputs use
    bf16 tensor-core dots with f32 accumulation either way.
    """
    if rows is None:
        rows = h_ref.shape[0]
    n_chunks = cdiv(d_model, block_d)
    row_ok = None if valid_v is None else jnp.arange(block_v, dtype=jnp.int32) < valid_v

    def body(c, acc):
        d0 = pl.multiple_of(c * block_d, block_d)
        cols = pl.ds(d0, block_d)
        h = h_ref[pl.ds(h_row0, rows), cols]
        w = load_tile(
            w_ref, (pl.ds(w_row0, block_v), cols), tile_mask(row_ok, d0, block_v, block_d, d_model)
        )
        return acc + lax.dot_general(
            h,
            w,
            (((1,), (1,)), ((), ())),
            precision=DOT_PRECISION,
            preferred_element_type=jnp.float32,
        )

    acc = jnp.zeros((rows, block_v), jnp.float32)
    return lax.fori_loop(0, n_chunks, body, acc)


def col_mask(d0, block_d: int, d_model: int) -> jax.Array:
    """Which of the ``block_d`` columns from ``d0`` lie inside ``d_model`` (all when it divides)."""
    if d_model % block_d == 0:
        return jnp.ones((block_d,), jnp.bool_)
    return (d0 + jnp.arange(block_d, dtype=jnp.int32)) < d_model


def tile_mask(row_ok, d0, rows: int, block_d: int, d_model: int) -> jax.Array | None:
    """Mask of a (rows, block_d) tile from column ``d0``: ``row_ok`` (rows,) bool, or None when
    every row exists, and the columns inside ``d_model``. None when every element exists."""
    if row_ok is None:
        if d_model % block_d == 0:
            return None
        row_ok = jnp.ones((rows,), jnp.bool_)
    return row_ok[:, None] & col_mask(d0, block_d, d_model)[None, :]


def load_tile(ref, idx: tuple, mask: jax.Array | None, other=0) -> jax.Array:
    """``ref[idx]``; with a mask, a masked load (``other`` where it is False, never out of bounds).

    Only ragged tiles pay for the mask: in interpret mode a masked load pads the whole ref by
    one tile (a copy of it, for a whole-W block), a plain load slices it in place.
    """
    if mask is None:
        return ref[idx]
    return plgpu.load(ref.at[idx], mask=mask, other=other)


def store_tile(ref, idx: tuple, value: jax.Array, mask: jax.Array | None) -> None:
    """``ref[idx] = value``; with a mask, only where it is True (like ``load_tile``)."""
    if mask is None:
        ref[idx] = value
    else:
        plgpu.store(ref.at[idx], value, mask=mask)


def pad_cols(x: jax.Array, cols: int) -> jax.Array:
    """Zero-pad axis 1 of a 2-D array up to ``cols``."""
    extra = cols - x.shape[1]
    if extra == 0:
        return x
    return jnp.pad(x, [(0, 0), (0, extra)])


def poison_like(shape_dtype: jax.ShapeDtypeStruct) -> jax.Array:
    """An array that no correct result contains: NaN for floats, the minimum for integers."""
    if jnp.issubdtype(shape_dtype.dtype, jnp.floating):
        return jnp.full(shape_dtype.shape, jnp.nan, shape_dtype.dtype)
    return jnp.full(shape_dtype.shape, jnp.iinfo(shape_dtype.dtype).min, shape_dtype.dtype)


def pallas_call_maybe_poisoned(
    kernel,
    args: tuple,
    *,
    grid: tuple[int, ...],
    in_specs: list,
    out_specs: list,
    out_shape: list,
    poison: bool,
    interpret: bool,
    compiler_params=None,
    name: str,
):
    """``pl.pallas_call`` whose outputs start as poison when ``poison`` is set.

    With ``poison`` the outputs are NaN / INT_MIN filled arrays aliased in through
    ``input_output_aliases``, so any element a kernel forgets to write stays visibly wrong, on GPU
    as well as in interpret mode. The kernel body never sees the aliased inputs.
    """
    n_in = len(args)
    if poison:
        n_out = len(out_shape)

        def body(*refs):
            kernel(*refs[:n_in], *refs[n_in + n_out :])

        args = (*args, *(poison_like(s) for s in out_shape))
        in_specs = [*in_specs, *out_specs]
        aliases = {n_in + k: k for k in range(n_out)}
    else:
        body, aliases = kernel, {}
    return pl.pallas_call(
        body,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=compiler_params,
        interpret=interpret,
        name=name,
    )(*args)


def decode_pallas_call(
    kernel_fn,
    h_bd: jax.Array,
    w_vd: jax.Array,
    seeds,
    inv_temperature,
    *,
    block_b: int,
    block_d: int,
    w_block_rows: int,
    statics: dict,
    compiler_params,
    interpret: bool,
    poison: bool,
    name: str,
) -> dict[str, jax.Array]:
    """Run a decode kernel over a (batch tiles, W blocks of ``w_block_rows`` rows) grid.

    The kernel takes refs h (block_b, D_pad), w (w_block_rows, D), with seeds also seeds (2,)
    and inv_temperature (1,), then (block_b,) outputs max, argmax, lse (+ score, sample), and
    the keywords vocab, d_model, block_b, block_d, has_seeds and ``statics``. Returns the
    partials by name, each (n_w_blocks, B_pad). Long for its block specs: one per input and
    output, each beside the shape it tiles.
    """
    check_hw(h_bd, w_vd)
    batch, d_model = h_bd.shape
    vocab = w_vd.shape[0]
    nb, nw = cdiv(batch, block_b), cdiv(vocab, w_block_rows)
    d_pad = cdiv(d_model, block_d) * block_d
    has_seeds = seeds is not None
    in_specs = [
        pl.BlockSpec((block_b, d_pad), lambda i, j: (i, 0)),
        pl.BlockSpec((w_block_rows, d_model), lambda i, j: (j, 0)),
    ]
    args = [pad_cols(pad_rows(h_bd, nb * block_b), d_pad), w_vd]
    names = ["max", "argmax", "lse"]
    dtypes = [jnp.float32, jnp.int32, jnp.float32]
    if has_seeds:
        in_specs += [pl.BlockSpec((2,), lambda i, j: (0,)), pl.BlockSpec((1,), lambda i, j: (0,))]
        args += [prepare_seeds(seeds), inv_temperature_array(inv_temperature)]
        names += ["score", "sample"]
        dtypes += [jnp.float32, jnp.int32]
    kernel = functools.partial(
        kernel_fn,
        vocab=vocab,
        d_model=d_model,
        block_b=block_b,
        block_d=block_d,
        has_seeds=has_seeds,
        **statics,
    )
    outs = pallas_call_maybe_poisoned(
        kernel,
        tuple(args),
        grid=(nb, nw),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, block_b), lambda i, j: (j, i)) for _ in names],
        out_shape=[jax.ShapeDtypeStruct((nw, nb * block_b), dt) for dt in dtypes],
        poison=poison,
        interpret=interpret,
        compiler_params=compiler_params,
        name=name,
    )
    return dict(zip(names, outs, strict=True))
