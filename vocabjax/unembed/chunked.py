"""The ``chunked`` implementation: a ``lax.scan`` over vocabulary tiles of ``block_v`` rows of
W, laid out as a kernel file is: its tiling (``ChunkBlocks``), then the scan, then one function
per op.

Each step computes one B x block_v tile of logits and merges it into a running max, argmax,
log-sum-exp, Gumbel-max sample or top-k, so the largest temporary is one tile. The
cross-entropy backward recomputes the logits tile by tile; its mean and sum gradient
(``ce_grad``) runs over row tiles of ``block_n`` tokens instead, each tile's logits computed
once. Tiles are dynamic slices of W, never a padded copy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import noise
from pallas_kernels._common import dlogits, finite_lse, next_pow2, takes_over
from vocabjax.errors import UserError
from vocabjax.hardware import BYTES_PER_ELEMENT
from vocabjax.unembed.argmax import max_argmax


@dataclasses.dataclass(frozen=True)
class ChunkBlocks:
    """Tiling of the ``chunked`` implementation."""

    block_v: int  # vocabulary rows per scan step; the last tile may be shorter
    # Rows of h per step of the cross-entropy gradient (the mean or sum loss under grad), which
    # runs over row tiles of block_n x V logits; None: ``default_block_n`` for the shape.
    block_n: int | None = None
    # Pad h to at least this many rows (zeros; the extra rows' results are dropped): XLA's CPU
    # bf16 matrix-vector product (one row of h) ran 14x slower than its two-row product
    # (V = 32k, D = 768: 31.6 against 2.3 ms), while W is read once either way.
    min_rows: int = 1

    # A logits tile of B x block_v float32 should stay within this many bytes, and the tile of W
    # within ``W_TILE_BYTES``: on a CPU, XLA copies each dynamic slice of W before its dot, so a
    # tile that fits in cache streams W once while a large one is written and read back from
    # memory (measured: block_v = 65,536 ran 6x slower than 2,048 at B = 1, V = 131k, D = 768).
    TILE_BYTES = 8 * 2**20
    W_TILE_BYTES = 4 * 2**20
    MAX_BLOCK_V = 65536
    # A gradient row tile's block_n x V float32 logits stay within half of W's bytes (the
    # gradient writes a V x D dW anyway) and within this many bytes.
    ROW_TILE_BYTES = 256 * 2**20

    def __post_init__(self) -> None:
        if self.block_v < 1:
            raise UserError(f"block_v={self.block_v} must be >= 1")
        if self.block_n is not None and self.block_n < 1:
            raise UserError(f"block_n={self.block_n} must be >= 1")
        if self.min_rows < 1:
            raise UserError(f"min_rows={self.min_rows} must be >= 1")

    @classmethod
    def default(cls, batch: int, vocab: int, d_model: int, dtype: str) -> ChunkBlocks:
        """The largest power-of-two tile whose logits fit ``TILE_BYTES`` and whose W rows fit
        ``W_TILE_BYTES`` (at least 256 rows, at most the next power of two above V); one row
        of bf16 ``h`` padded to two (``min_rows``)."""
        by_logits = cls.TILE_BYTES // (4 * max(batch, 1))
        by_weights = cls.W_TILE_BYTES // (d_model * BYTES_PER_ELEMENT[dtype])
        cap = max(256, min(by_logits, by_weights, cls.MAX_BLOCK_V))
        block = 1 << int(math.floor(math.log2(cap)))
        min_rows = 2 if batch == 1 and dtype == "bf16" else 1
        return cls(block_v=min(block, next_pow2(vocab)), min_rows=min_rows)

    @classmethod
    def default_block_n(cls, n_rows: int, vocab: int, d_model: int, dtype: str) -> int:
        """Rows per gradient tile: the largest power of two whose f32 logits (block_n x V) fit
        in half of W's bytes and in ``ROW_TILE_BYTES`` (at least 8 rows, at most N).

        Half of W means ``block_n <= D w / 8`` (256 rows at D = 768 in f32, 128 at D = 512 in
        bf16): each tile's three matmuls then do 6 block_n V D flops per 4 V D w bytes of W
        read twice and dW updated, far above a CPU's ridge point."""
        by_weights = d_model * BYTES_PER_ELEMENT[dtype] // 8
        by_cap = cls.ROW_TILE_BYTES // (4 * vocab)
        cap = max(8, min(by_weights, by_cap))
        return max(1, min(1 << int(math.floor(math.log2(cap))), n_rows))

    @classmethod
    def candidates(
        cls,
        batch: int,
        vocab: int,
        d_model: int,
        dtype: str,
        *,
        quick: bool = False,
        op: str = "greedy",
    ) -> tuple[ChunkBlocks, ...]:
        """Tiles the autotuner tries: powers of two from 1k up and one tile of all of W, within
        8x ``TILE_BYTES``; for ``linear_cross_entropy`` (timed as loss and gradient), gradient
        row tiles from 8 rows up to N within 4x ``ROW_TILE_BYTES``, with the default vocabulary
        tile. At one row of h, the default tile again with the other ``min_rows`` (1 or 2)."""
        default = cls.default(batch, vocab, d_model, dtype)
        found = cls._tile_candidates(default, batch, vocab, d_model, dtype, quick=quick, op=op)
        if batch == 1:
            padded = dataclasses.replace(found[0], min_rows=3 - found[0].min_rows)
            found = (*found, padded)
        return found

    @classmethod
    def _tile_candidates(
        cls, default: ChunkBlocks, batch, vocab, d_model, dtype, *, quick, op
    ) -> tuple[ChunkBlocks, ...]:
        if op == "linear_cross_entropy":
            base = cls.default_block_n(batch, vocab, d_model, dtype)
            rows = [1 << p for p in range(3, 31) if (1 << p) < batch]
            rows = [r for r in rows if 4 * r * vocab <= 4 * cls.ROW_TILE_BYTES] + [batch]
            if quick:
                rows = [r for r in rows if r in (base // 4, base * 4) or r == batch]
            out_n = {base: dataclasses.replace(default, block_n=base)}
            for r in rows:
                out_n.setdefault(r, dataclasses.replace(default, block_n=r))
            return tuple(out_n.values())
        whole = next_pow2(vocab)  # one tile: no loop at all
        sizes = [1 << p for p in range(10, 17) if (1 << p) <= whole]
        if quick:
            sizes = [s for s in sizes if s in (default.block_v // 4, default.block_v * 4)]
        sizes = [s for s in [*sizes, whole] if 4 * batch * s <= 8 * cls.TILE_BYTES]
        out = {default.block_v: default}
        for s in sizes:
            out.setdefault(s, dataclasses.replace(default, block_v=s))
        return tuple(out.values())

    def to_json(self) -> dict[str, int]:
        out = {"block_v": self.block_v}
        if self.block_n is not None:
            out["block_n"] = self.block_n
        if self.min_rows != 1:
            out["min_rows"] = self.min_rows
        return out


# --------------------------------------------------------------------------------------------
# The matmul every tile runs


def precision(dtype: Any):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def tile_logits(h_bd: jax.Array, w_vd: jax.Array) -> jax.Array:
    """h @ w.T in the weights' dtype with float32 accumulation."""
    return contract(h_bd, w_vd, 1, 1)


def contract(a: jax.Array, b: jax.Array, a_axis: int, b_axis: int) -> jax.Array:
    """The product of ``a`` and ``b`` over ``a_axis`` and ``b_axis``, in ``b``'s dtype (``a``
    is cast to it) with float32 accumulation."""
    return lax.dot_general(
        a.astype(b.dtype),
        b,
        (((a_axis,), (b_axis,)), ((), ())),
        precision=precision(b.dtype),
        preferred_element_type=jnp.float32,
    )


# --------------------------------------------------------------------------------------------
# The scan over tiles


def scan_tiles(
    step: Callable[[Any, Any, jax.Array], tuple[Any, Any]],
    carry: Any,
    xs: Any,
    block: int,
) -> tuple[Any, list[Any]]:
    """Run ``step(carry, tile, start) -> (carry, y)`` over tiles of ``block`` rows of ``xs`` (an
    array, or a pytree of arrays with the same leading axis, sliced alike): a scan over the full
    tiles, then one step on the remainder. Tiles are dynamic slices, never a padded copy.

    Returns the final carry and the outputs as a list: the stacked full-tile outputs (if any),
    then the remainder's (if any).
    """
    rows = jax.tree_util.tree_leaves(xs)[0].shape[0]
    block = min(block, rows)
    n_full, rem = divmod(rows, block)
    ys = []
    if n_full == 1 and not rem:  # one tile, the whole array: no loop (XLA's CPU backend runs a
        # bf16 dot inside a loop body 15x slower than the same dot at the top level)
        carry, y = step(carry, xs, jnp.int32(0))
        return carry, [jax.tree_util.tree_map(lambda a: a[None], y)]
    if n_full:

        def body(c, i):
            start = i * block
            tile = jax.tree_util.tree_map(
                lambda x: lax.dynamic_slice_in_dim(x, start, block, axis=0), xs
            )
            return step(c, tile, start)

        carry, y = lax.scan(body, carry, jnp.arange(n_full, dtype=jnp.int32))
        ys.append(y)
    if rem:
        start = n_full * block
        carry, y = step(carry, jax.tree_util.tree_map(lambda x: x[start:], xs), jnp.int32(start))
        ys.append(y)
    return carry, ys


def concat_tiles(parts: list[jax.Array], width: int) -> jax.Array:
    """The per-tile outputs of ``scan_tiles`` (stacked full tiles, then the remainder) as one
    array of rows ``width`` wide."""
    rows = [p.reshape(-1, width) for p in parts]
    return rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=0)


# --------------------------------------------------------------------------------------------
# Decode ops: greedy, logsumexp and sample in one pass; top-k


class Stats(NamedTuple):
    max_b: jax.Array  # float32, the largest logit; NaN where a logit is NaN
    argmax_b: jax.Array  # int32, lowest index among the largest (the first NaN, as jnp.argmax)
    lse_b: jax.Array  # float32, logsumexp of the raw logits (+inf where a logit is +inf)
    sample_b: jax.Array  # int32, argmax of logits * inv_temperature + Gumbel noise
    nan_b: jax.Array  # bool, the row's logits hold a NaN (its picks become -1)


def decode(
    h_bd: jax.Array,
    w_vd: jax.Array,
    seeds: jax.Array | None,
    inv_temperature: jax.Array,
    *,
    block_v: int,
    want_lse: bool,
) -> Stats:
    batch = h_bd.shape[0]
    rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
    neg = jnp.full((batch,), -jnp.inf, jnp.float32)
    zero_i = jnp.zeros((batch,), jnp.int32)
    init = (neg, zero_i, neg, jnp.zeros((batch,), jnp.float32), neg, zero_i)

    def merge_max(best, best_id, tile, start):
        """The running (max, argmax) with a tile's: a later tile wins only with a larger value
        (so ties go to lower ids) or with the row's first NaN."""
        t_max, t_id = max_argmax(tile)
        better = takes_over(t_max, best)
        return jnp.where(better, t_max, best), jnp.where(better, t_id + start, best_id), t_max

    def step(carry, w_tile, start):
        m, am, lm, ls, sm, sid = carry
        logits = tile_logits(h_bd, w_tile)
        m, am, t_max = merge_max(m, am, logits, start)
        if want_lse:
            new = jnp.maximum(lm, t_max)
            ls = ls * jnp.exp(lm - new) + jnp.sum(jnp.exp(logits - new[:, None]), axis=1)
            lm = new
        if seeds is not None:
            tok = start + jnp.arange(w_tile.shape[0], dtype=jnp.int32)[None, :]
            scores = logits * inv_temperature + noise.gumbel(seeds, rows, tok)
            sm, sid, _ = merge_max(sm, sid, scores, start)
        return (m, am, lm, ls, sm, sid), None

    (m, am, lm, ls, _, sid), _ = scan_tiles(step, init, w_vd, block_v)
    return Stats(m, am, finite_lse(m, lm + jnp.log(ls)), sid, jnp.isnan(m))


def top_k(h_bd, w_vd, k: int, block_v: int):
    batch = h_bd.shape[0]
    init = (
        jnp.full((batch, k), -jnp.inf, jnp.float32),
        jnp.zeros((batch, k), jnp.int32),
        jnp.zeros((batch,), bool),
    )

    def step(carry, w_tile, start):
        vals, ids, nan_b = carry
        logits = tile_logits(h_bd, w_tile)
        # Counted apart: where lax.top_k ranks a NaN depends on its sign bit.
        nan_b = nan_b | jnp.isnan(logits).any(axis=1)
        t_vals, t_ids = lax.top_k(logits, min(k, w_tile.shape[0]))
        # Running entries first: lax.top_k keeps the lower position first on ties, and every
        # running id is below this tile's ids, so ties resolve to the lowest id.
        cat_vals = jnp.concatenate([vals, t_vals], axis=1)
        cat_ids = jnp.concatenate([ids, t_ids.astype(jnp.int32) + start], axis=1)
        new_vals, pos = lax.top_k(cat_vals, k)
        return (new_vals, jnp.take_along_axis(cat_ids, pos, axis=1), nan_b), None

    (vals, ids, nan_b), _ = scan_tiles(step, init, w_vd, block_v)
    return vals, ids, nan_b


# --------------------------------------------------------------------------------------------
# Cross-entropy: forward, backward by vocabulary tiles, loss and gradient by row tiles


def ce_fwd(h_nd, w_vd, labels_n, block_v: int):
    n = h_nd.shape[0]
    init = (
        jnp.full((n,), -jnp.inf, jnp.float32),
        jnp.zeros((n,), jnp.float32),
        jnp.zeros((n,), jnp.float32),
    )

    def step(carry, w_tile, start):
        m, s, target = carry
        logits = tile_logits(h_nd, w_tile)
        new = jnp.maximum(m, jnp.max(logits, axis=1))
        s = s * jnp.exp(m - new) + jnp.sum(jnp.exp(logits - new[:, None]), axis=1)
        target = target + target_logit(logits, labels_n, start)
        return (new, s, target), None

    (m, s, target), _ = scan_tiles(step, init, w_vd, block_v)
    return m + jnp.log(s), target


def ce_bwd(h_nd, w_vd, labels_n, lse_n, g_lse_n, g_target_n, block_v: int):
    """dh, dW of sum(g_lse * lse + g_target * target) with the logits recomputed per tile;
    the small matmuls run in float32 (dlogits are never rounded to bf16)."""
    h32 = h_nd.astype(jnp.float32)

    def step(dh, w_tile, start):
        logits = tile_logits(h_nd, w_tile)
        probs = jnp.exp(logits - lse_n[:, None])
        dlogits = tile_dlogits(probs, start, labels_n, g_lse_n, g_target_n)
        w32 = w_tile.astype(jnp.float32)
        hi = lax.Precision.HIGHEST
        dh = dh + jnp.dot(dlogits, w32, precision=hi)
        dw_tile = jnp.dot(dlogits.T, h32, precision=hi).astype(w_vd.dtype)
        return dh, dw_tile

    dh, parts = scan_tiles(step, jnp.zeros(h_nd.shape, jnp.float32), w_vd, block_v)
    return dh, concat_tiles(parts, w_vd.shape[1])


def ce_grad(h_nd, w_vd, labels_n, weight_n, z_loss: float, block_n: int):
    """``sum_n weight_n * (lse_n - target_n + z_loss * lse_n**2)`` with its gradients for h and
    W (float32), over row tiles of ``block_n`` tokens: each tile's block_n x V logits give its
    loss, ``dlogits``, its rows of dh and its share of dW, so the logits are computed once
    (6 N V D flops in all, as with stored logits) and never more than a tile is held. The
    gradient matmuls run in W's dtype with float32 accumulation, as the logits do."""
    vocab, d_model = w_vd.shape

    def step(carry, tile, start):
        del start
        total, dw = carry
        h_tile, labels, weight = tile
        logits = tile_logits(h_tile, w_vd)
        m = jnp.max(logits, axis=1)
        e = jnp.exp(logits - m[:, None])
        s = jnp.sum(e, axis=1)
        lse = m + jnp.log(s)
        total = total + weighted_total(lse, target_logit(logits, labels), weight, z_loss)
        g_lse, g_target = total_cotangents(lse, weight, z_loss)
        dlogits = tile_dlogits(e / s[:, None], 0, labels, g_lse, g_target)
        dw = dw + contract(dlogits, h_tile, 0, 0)
        return (total, dw), contract(dlogits, w_vd, 1, 0)

    init = (jnp.zeros((), jnp.float32), jnp.zeros((vocab, d_model), jnp.float32))
    (total, dw), parts = scan_tiles(step, init, (h_nd, labels_n, weight_n), block_n)
    return total, concat_tiles(parts, d_model), dw


def weighted_total(lse_n, target_n, weight_n, z_loss: float) -> jax.Array:
    return jnp.sum(weight_n * (lse_n - target_n + z_loss * lse_n * lse_n))


def total_cotangents(lse_n, weight_n, z_loss: float) -> tuple[jax.Array, jax.Array]:
    """(g_lse, g_target): the per-token cotangents of ``weighted_total``."""
    return weight_n * (1.0 + 2.0 * z_loss * lse_n), -weight_n


def target_logit(logits_nv, labels_n, start=0) -> jax.Array:
    """Each row's logit at its label, for a tile holding ids ``start`` .. ``start + v - 1``;
    0 where the label is outside the tile (a label of -1: no target)."""
    width = logits_nv.shape[1]
    local = labels_n - start
    picked = jnp.take_along_axis(logits_nv, jnp.clip(local, 0, width - 1)[:, None], 1)[:, 0]
    return jnp.where((local >= 0) & (local < width), picked, 0.0)


def tile_dlogits(probs_nv, start, labels_n, g_lse_n, g_target_n) -> jax.Array:
    """d(sum g_lse * lse + g_target * target) / d logits for a tile of ids from ``start``:
    ``g_lse * softmax + g_target * onehot(label)``, given the tile's softmax ``probs``."""
    ids_v = start + jnp.arange(probs_nv.shape[1], dtype=jnp.int32)
    return dlogits(probs_nv, labels_n[:, None] == ids_v[None, :], g_lse_n, g_target_n)
