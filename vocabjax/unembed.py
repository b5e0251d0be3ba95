"""Unembedding ops that never need the B x V logits in memory, and the kernel selector.

Public ops take ``h_bd`` (B, D) hidden states and ``w_vd`` (V, D) unembedding weights:

    greedy(h, w)                        -> ids_b int32, the argmax token (lowest index on ties)
    logsumexp(h, w)                     -> lse_b float32, log sum_v exp(h . w_v)
    top_k(h, w, k)                      -> (vals_bk float32, ids_bk int32), descending, ties by id
    sample(h, w, key, temperature, top_k=None) -> ids_b int32, Gumbel-max sample of softmax
    linear_cross_entropy(h, w, labels, ignore_index=-100, reduction="mean", z_loss=0.0)

Each takes ``impl="auto"|"xla"|"chunked"|"pallas"``:

- ``xla``: materialized logits ``h @ w.T`` then the plain jnp op (the baseline).
- ``chunked``: a ``lax.scan`` over vocabulary tiles of ``block_v`` rows with an online max,
  log-sum-exp, argmax and top-k merge; the largest temporary is one B x block_v tile.
- ``pallas``: the kernels in ``pallas_kernels/`` (fused decode for small B, the tiled decode for
  large B, fused top-k, fused linear cross-entropy forward and backward). On a CPU backend they
  run through Pallas' interpreter: ``interpret=None`` (the default) means "interpret when
  ``jax.default_backend() == 'cpu'``"; pass ``interpret=True/False`` to force it.
- ``auto``: :func:`select`, at trace time from static shapes, so it costs nothing per call: the
  device profile's ``best`` table (nearest measured shape) when one is set, else the roofline
  rule against the ridge point on a GPU or TPU, and on a CPU xla except where that backend was
  measured to need otherwise (``_cpu_rule``).

Numerics: the matmul runs in the weights' dtype (``h`` is cast to ``w.dtype``) with float32
accumulation; f32 weights use ``Precision.HIGHEST`` (no TF32). Values come back in float32.

Bad input, and what happens (all tested):

- ``h`` and ``w`` with different D, ``k`` < 1 or > V, an unknown impl or reduction, a Python or
  concrete temperature <= 0 or not finite: ``UserError`` at trace time.
- A label outside [0, V) that is not ``ignore_index``: ``UserError`` when the labels are concrete;
  under ``jit`` that token's loss is NaN (so the mean is NaN), never a silently wrong number.
- A row of ``h`` holding a NaN or an infinity: its token id is -1 (greedy, sample, top-k ids),
  its values are NaN. A traced temperature <= 0 gives -1 for every row.

All ops work under ``jit``, ``vmap`` (any leading axes the caller adds; ``sample`` keys its
noise by the row index within one call, so vmapped calls should get their own keys) and, for
``linear_cross_entropy``, ``grad`` with respect to ``h`` and ``w``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import noise
from pallas_kernels._common import dlogits, next_pow2, pad_rows
from vocabjax.errors import UserError
from vocabjax.hardware import BYTES_PER_ELEMENT, DeviceProfile, KernelTiming, load_device

Impl = Literal["auto", "xla", "chunked", "pallas"]
IMPLS: tuple[str, ...] = ("xla", "chunked", "pallas")
OPS: tuple[str, ...] = ("greedy", "logsumexp", "top_k", "sample", "linear_cross_entropy")
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "none")

# The ridge point used by the roofline rule when no device profile is set: the default device's.
_FALLBACK_DEVICE = "a100-80gb"
PROFILE_ENV = "VOCABJAX_DEVICE_PROFILE"  # a builtin device name or a profile JSON path


# --------------------------------------------------------------------------------------------
# Tiling of the chunked path


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
# Device profile and kernel selection

_profile_state: dict[str, Any] = {"profile": None, "env_read": False}


def set_device_profile(profile: DeviceProfile | str | os.PathLike | None) -> None:
    """Use ``profile`` (a DeviceProfile, builtin name or JSON path) for ``impl="auto"``."""
    if profile is not None and not isinstance(profile, DeviceProfile):
        profile = load_device(profile)
    _profile_state.update(profile=profile, env_read=True)


def device_profile() -> DeviceProfile | None:
    """The profile ``impl="auto"`` reads: the one set, else ``$VOCABJAX_DEVICE_PROFILE``."""
    if not _profile_state["env_read"]:
        _profile_state["env_read"] = True
        env = os.environ.get(PROFILE_ENV)
        if env:
            _profile_state["profile"] = load_device(env)
    return _profile_state["profile"]


@contextlib.contextmanager
def using_device_profile(profile: DeviceProfile | str | os.PathLike | None) -> Iterator[None]:
    """``with using_device_profile("profiles/cpu.json"): ...`` sets it for a block."""
    old_profile, old_read = _profile_state["profile"], _profile_state["env_read"]
    set_device_profile(profile)
    try:
        yield
    finally:
        _profile_state.update(profile=old_profile, env_read=old_read)


class Choice(NamedTuple):
    """What ``impl="auto"`` runs: an implementation, its tiling and why."""

    impl: str  # "xla", "chunked" or "pallas"
    blocks: Mapping[str, int]  # tile sizes ({} for xla or the implementation's default)
    reason: str  # "best table: nearest V=..., B=..." or "roofline: B=... vs ridge ..."


def dtype_name(dtype: Any) -> str:
    """``jnp.bfloat16`` -> "bf16", ``jnp.float32`` -> "f32"."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16:
        return "bf16"
    if dtype == jnp.float32:
        return "f32"
    raise UserError(f"unembedding weights must be bf16 or f32, got {dtype}")


def select(
    op: str,
    vocab: int,
    batch: int,
    d_model: int,
    dtype: str,
    *,
    profile: DeviceProfile | None = None,
    backend: str | None = None,
) -> Choice:
    """The implementation ``impl="auto"`` uses for ``op`` at shape (V, B, D, dtype).

    With a device profile holding ``best`` rows for ``op`` and ``dtype``: the row nearest in
    (log V, log B, log D), except an xla cross-entropy row for a larger N x V than its own.
    Otherwise, on a GPU or TPU, the roofline rule: a memory-bound shape (arithmetic intensity
    below the ridge point) runs ``pallas``; a compute-bound one runs ``xla``'s matmul, except
    ``linear_cross_entropy``, which always runs fused so that the N x V logits are never stored.
    On a CPU (where Pallas only interprets), the measured CPU rule of :func:`_cpu_rule`.
    """
    if op not in OPS:
        raise UserError(f"unknown op {op!r} (choose from {', '.join(OPS)})")
    profile = profile if profile is not None else device_profile()
    backend = backend or jax.default_backend()
    rows = profile.best_rows(op, dtype) if profile is not None else ()
    if backend == "cpu":  # a profile measured elsewhere may name pallas; CPU only interprets it
        rows = tuple(r for r in rows if r.impl != "pallas") or ()
    row = min(rows, key=lambda r: _shape_distance(r, vocab, batch, d_model)) if rows else None
    if row is not None and _materializes_beyond(op, row, vocab, batch):
        row = None  # xla would store N x V logits larger than any it was measured with
    if row is not None:
        blocks = dict(row.blocks) if row.impl != "xla" else {}
        if row.impl == "chunked" and "block_v" in blocks:  # a tile no larger than this V needs
            blocks["block_v"] = min(blocks["block_v"], next_pow2(vocab))
        return Choice(
            row.impl,
            blocks,
            f"best table of {profile.name}: nearest V={row.vocab}, B={row.batch}, D={row.d_model}",
        )
    if backend == "cpu":
        return _cpu_rule(op, vocab, batch, d_model, dtype)
    ridge_profile = profile if profile is not None else load_device(_FALLBACK_DEVICE)
    ridge = ridge_profile.ridge_point(dtype)
    intensity = unembed_intensity(vocab, batch, d_model, dtype)
    why = f"roofline: intensity {intensity:.1f} vs ridge {ridge:.1f} of {ridge_profile.name}"
    if op == "linear_cross_entropy" or intensity < ridge:
        return Choice("pallas", {}, why)
    return Choice("xla", {}, why)


def _cpu_rule(op: str, vocab: int, batch: int, d_model: int, dtype: str) -> Choice:
    """What ``auto`` runs on a CPU with no measured row for the op: xla, the baseline, except
    where this backend was measured to need otherwise.

    The roofline cannot tell the fused decode from xla's at small B: xla's extra traffic, the
    B x V f32 logits written and read back, is 8 B / (D w) of W's bytes (0.3% at B = 1,
    D = 768, f32), and past the ridge both run the same matmul. Measured on XLA's CPU backend
    with no profile (``benchmarks/unembed.py --profile none``, docs/benchmarks.md), the scan
    over V tiles ran 1.8-8.9x slower than xla for greedy, top-k and sampling at B = 4-64 in bf16
    (bf16 dots inside a loop body are slow there), and autotune's f32 candidates ran it
    1.5-2.2x slower than xla at B = 1 and 4 (benchmarks/unembed.py, 03:58 UTC). Two exceptions:

    - one bf16 row (B = 1): XLA's bf16 matrix-vector product runs ~14x slower than its two-row
      product, so the decode runs as one whole tile of W (no loop) with h padded to two rows;
    - cross-entropy whose N x V f32 logits outgrow W itself (training batches): the fused path,
      so that memory stays bounded (training steps measured 15-24% faster with it); below
      that the logits are small and xla runs (in bf16 the scan ran at 0.66-0.96x of xla's
      time at N = 4-256, in f32 autotune kept xla there: only a profile can tell).
    """
    w_bytes = vocab * d_model * BYTES_PER_ELEMENT[dtype]
    if op == "linear_cross_entropy":
        if 4 * batch * vocab > w_bytes:
            return Choice("chunked", {}, "cpu rule: N x V f32 logits larger than W: fused")
        return Choice("xla", {}, "cpu rule: N x V f32 logits within W's bytes: xla")
    if batch == 1 and dtype == "bf16":
        whole = {"block_v": next_pow2(vocab), "min_rows": 2}
        return Choice("chunked", whole, "cpu rule: one bf16 row: one whole tile, padded to 2 rows")
    return Choice("xla", {}, "cpu rule: no measured row: xla")


def _materializes_beyond(op: str, row: KernelTiming, vocab: int, batch: int) -> bool:
    """An xla cross-entropy row is trusted only up to its own N x V: beyond it the stored
    logits grow without bound (a training batch of 8,192 tokens at V = 131k holds 4 GiB), so
    the fused path takes over."""
    return (
        op == "linear_cross_entropy" and row.impl == "xla" and batch * vocab > row.batch * row.vocab
    )


def _shape_distance(row: KernelTiming, vocab: int, batch: int, d_model: int) -> float:
    return (
        (math.log(row.vocab) - math.log(vocab)) ** 2
        + (math.log(row.batch) - math.log(batch)) ** 2
        + (math.log(row.d_model) - math.log(d_model)) ** 2
    )


def unembed_intensity(vocab: int, batch: int, d_model: int, dtype: str) -> float:
    """FLOP per byte of the fused unembedding: 2 B V D over the bytes of W, h and the outputs."""
    flops, bytes_ = unembed_cost("greedy", vocab, batch, d_model, dtype)
    return flops / bytes_


def unembed_cost(op: str, vocab: int, batch: int, d_model: int, dtype: str) -> tuple[float, float]:
    """(flops, bytes) of the fused op: its roofline floor is ``max(flops/P, bytes/BW)``.

    Decode ops read W (V D w bytes) and h, and write O(B) results; cross-entropy forward plus
    backward does three matmuls (6 N V D flops), reads W twice and writes dW and dh.
    """
    w = BYTES_PER_ELEMENT[dtype]
    if op == "linear_cross_entropy":
        flops = 6.0 * batch * vocab * d_model
        bytes_ = 3.0 * vocab * d_model * w + 3.0 * batch * d_model * w + 12.0 * batch
        return flops, bytes_
    flops = 2.0 * batch * vocab * d_model
    bytes_ = vocab * d_model * w + batch * d_model * w + 8.0 * batch
    return flops, bytes_


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
        choice = select(op, vocab, h_bd.shape[0], d_model, dtype_name(w_vd.dtype))
        impl, blocks = choice.impl, (blocks if blocks is not None else (choice.blocks or None))
    if isinstance(blocks, Mapping):
        blocks = dict(blocks)
    return impl, blocks


def _interpret(interpret: bool | None) -> bool:
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def _bad_rows(h_bd: jax.Array) -> jax.Array:
    """Rows of h with a NaN or infinity: their ids become -1."""
    return ~jnp.all(jnp.isfinite(h_bd.astype(jnp.float32)), axis=-1)


def _precision(dtype: Any):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _logits(h_bd: jax.Array, w_vd: jax.Array) -> jax.Array:
    """h @ w.T in the weights' dtype with float32 accumulation."""
    return _contract(h_bd, w_vd, 1, 1)


def _contract(a: jax.Array, b: jax.Array, a_axis: int, b_axis: int) -> jax.Array:
    """The product of ``a`` and ``b`` over ``a_axis`` and ``b_axis``, in ``b``'s dtype (``a``
    is cast to it) with float32 accumulation."""
    return lax.dot_general(
        a.astype(b.dtype),
        b,
        (((a_axis,), (b_axis,)), ((), ())),
        precision=_precision(b.dtype),
        preferred_element_type=jnp.float32,
    )


def _check_temperature(temperature: Any) -> jax.Array:
    if isinstance(temperature, jax.core.Tracer):
        return jnp.asarray(temperature, jnp.float32)
    value = np.asarray(temperature, dtype=np.float64)
    if value.shape != ():
        raise UserError(f"temperature must be a scalar, got shape {value.shape}")
    if not math.isfinite(float(value)) or float(value) <= 0:
        raise UserError(f"temperature={float(value)} must be finite and > 0 (use greedy for 0)")
    return jnp.asarray(float(value), jnp.float32)


# --------------------------------------------------------------------------------------------
# The chunked scan over vocabulary tiles


def _scan_tiles(
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


def _concat_tiles(parts: list[jax.Array], width: int) -> jax.Array:
    """The per-tile outputs of ``_scan_tiles`` (stacked full tiles, then the remainder) as one
    array of rows ``width`` wide."""
    rows = [p.reshape(-1, width) for p in parts]
    return rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=0)


class _Stats(NamedTuple):
    max_b: jax.Array  # float32, the largest logit
    argmax_b: jax.Array  # int32, lowest index among the largest
    lse_b: jax.Array  # float32, logsumexp of the raw logits
    sample_b: jax.Array  # int32, argmax of logits * inv_temperature + Gumbel noise


def _chunked_decode(
    h_bd: jax.Array,
    w_vd: jax.Array,
    seeds: jax.Array | None,
    inv_temperature: jax.Array,
    *,
    block_v: int,
    want_lse: bool,
) -> _Stats:
    batch = h_bd.shape[0]
    rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
    neg = jnp.full((batch,), -jnp.inf, jnp.float32)
    zero_i = jnp.zeros((batch,), jnp.int32)
    init = (neg, zero_i, neg, jnp.zeros((batch,), jnp.float32), neg, zero_i)

    def merge_max(best, best_id, tile, start):
        t_max = jnp.max(tile, axis=1)
        t_id = jnp.argmax(tile, axis=1).astype(jnp.int32) + start
        better = t_max > best  # strict: earlier tiles (lower ids) win ties
        return jnp.where(better, t_max, best), jnp.where(better, t_id, best_id)

    def step(carry, w_tile, start):
        m, am, lm, ls, sm, sid = carry
        logits = _logits(h_bd, w_tile)
        m, am = merge_max(m, am, logits, start)
        if want_lse:
            new = jnp.maximum(lm, jnp.max(logits, axis=1))
            ls = ls * jnp.exp(lm - new) + jnp.sum(jnp.exp(logits - new[:, None]), axis=1)
            lm = new
        if seeds is not None:
            tok = start + jnp.arange(w_tile.shape[0], dtype=jnp.int32)[None, :]
            scores = logits * inv_temperature + noise.gumbel(seeds, rows, tok)
            sm, sid = merge_max(sm, sid, scores, start)
        return (m, am, lm, ls, sm, sid), None

    (m, am, lm, ls, _, sid), _ = _scan_tiles(step, init, w_vd, block_v)
    return _Stats(m, am, lm + jnp.log(ls), sid)


def _xla_decode(
    h_bd: jax.Array, w_vd: jax.Array, seeds: jax.Array | None, inv_temperature: jax.Array
) -> _Stats:
    logits = _logits(h_bd, w_vd)
    sample_b = jnp.zeros((h_bd.shape[0],), jnp.int32)
    if seeds is not None:
        rows = jnp.arange(h_bd.shape[0], dtype=jnp.int32)[:, None]
        tok = jnp.arange(w_vd.shape[0], dtype=jnp.int32)[None, :]
        scores = logits * inv_temperature + noise.gumbel(seeds, rows, tok)
        sample_b = jnp.argmax(scores, axis=1).astype(jnp.int32)
    return _Stats(
        jnp.max(logits, axis=1),
        jnp.argmax(logits, axis=1).astype(jnp.int32),
        jax.nn.logsumexp(logits, axis=1),
        sample_b,
    )


# --------------------------------------------------------------------------------------------
# Pallas dispatch (the kernels live in pallas_kernels/)


def _pallas_module(name: str):
    """A kernel module of pallas_kernels/, imported on first use (Pallas is slow to import)."""
    import importlib

    return importlib.import_module(f"pallas_kernels.{name}")


def _pallas_decode_blocks(batch: int, vocab: int, d_model: int, dtype: str, blocks: Any):
    """(kernel function, blocks instance): fused decode for small B, tiled for large B."""
    fused = _pallas_module("fused_decode")
    tiled = _pallas_module("tiled_decode")
    if isinstance(blocks, fused.DecodeBlocks):
        return fused.fused_decode, blocks
    if isinstance(blocks, tiled.TiledBlocks):
        return tiled.tiled_decode, blocks
    if isinstance(blocks, Mapping):
        blocks = dict(blocks)
        # Profile rows say which kernel their blocks belong to ("tiled": 0 or 1); a dict
        # without the key goes by batch size, as the default does.
        if blocks.pop("tiled", int(batch > _TILED_MIN_BATCH)):
            return tiled.tiled_decode, (_tiles(tiled.TiledBlocks, blocks) if blocks else None)
        return fused.fused_decode, (_tiles(fused.DecodeBlocks, blocks) if blocks else None)
    if blocks is not None:
        raise UserError(f"impl='pallas' takes DecodeBlocks, TiledBlocks or a dict, got {blocks!r}")
    if batch > _TILED_MIN_BATCH:
        return tiled.tiled_decode, None
    return fused.fused_decode, None


def _tiles(cls: type, blocks: Mapping[str, Any]) -> Any:
    """A Pallas tile dataclass from a dict (a profile row's ``blocks``, or a caller's): a name
    the class lacks or a size it refuses is one UserError, not a TypeError from ``cls(**d)``."""
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(blocks) - set(fields))
    if unknown:
        raise UserError(
            f"impl='pallas' blocks {dict(blocks)} name {', '.join(map(str, unknown))}, which "
            f"{cls.__name__} lacks (it takes {', '.join(fields)})"
        )
    wrong = [k for k, v in blocks.items() if isinstance(v, bool) or not isinstance(v, int)]
    if wrong:
        raise UserError(f"impl='pallas' blocks {dict(blocks)}: {wrong[0]} must be an integer")
    try:
        return cls(**blocks)
    except ValueError as exc:  # the class's own checks (powers of two)
        raise UserError(f"impl='pallas' {cls.__name__}: {exc}") from None


# Above this batch the decode is compute-bound on every datasheet profile (ridge points 100-300
# FLOP/byte at bf16 mean B ~ 2 x ridge): the tiled kernel, which reuses W tiles across B, wins.
_TILED_MIN_BATCH = 64


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
) -> _Stats:
    h_bd, w_vd = _check_pair(h_bd, w_vd, op=op)
    impl, blocks = _resolve(op, impl, h_bd, w_vd, blocks)
    inv_temperature = jnp.asarray(inv_temperature, jnp.float32)
    if impl == "xla":
        return _xla_decode(h_bd, w_vd, seeds, inv_temperature)
    if impl == "chunked":
        cb = _chunk_blocks(blocks, h_bd, w_vd)
        return _on_padded_rows(
            lambda h: _chunked_decode(
                h, w_vd, seeds, inv_temperature, block_v=cb.block_v, want_lse=want_lse
            ),
            h_bd,
            cb.min_rows,
        )
    vocab, d_model = w_vd.shape
    kernel, kblocks = _pallas_decode_blocks(
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
    return _Stats(out.max_b, out.argmax_b, out.lse_b, out.sample_b)


def _on_padded_rows(fn: Callable[[jax.Array], Any], h_bd: jax.Array, rows: int) -> Any:
    """``fn`` of ``h_bd`` padded with zero rows up to ``rows``, every output cut back to
    ``h_bd``'s rows (``ChunkBlocks.min_rows``)."""
    out = fn(pad_rows(h_bd, rows))
    return jax.tree_util.tree_map(lambda x: x[: h_bd.shape[0]], out)


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


# --------------------------------------------------------------------------------------------
# Public decode ops


def greedy(
    h_bd: jax.Array,
    w_vd: jax.Array,
    *,
    impl: Impl = "auto",
    blocks: Any = None,
    interpret: bool | None = None,
) -> jax.Array:
    """The argmax token of ``h_bd @ w_vd.T`` per row, int32 (B,); lowest id on ties, -1 for a
    row of ``h`` with a NaN or infinity. ``blocks``: ChunkBlocks / Pallas blocks / dict."""
    stats = _decode("greedy", h_bd, w_vd, impl=impl, blocks=blocks, interpret=interpret)
    return jnp.where(_bad_rows(h_bd), jnp.int32(-1), stats.argmax_b)


def logsumexp(
    h_bd: jax.Array,
    w_vd: jax.Array,
    *,
    impl: Impl = "auto",
    blocks: Any = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``log(sum_v exp(h . w_v))`` per row, float32 (B,); NaN for a row with a NaN."""
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
    and ``blocks`` are. -1 for rows of ``h`` with a NaN, and for all rows when a traced
    temperature is <= 0 (a concrete one raises ``UserError``).
    """
    inv_t = 1.0 / _check_temperature(temperature)
    seeds = noise.seeds_from_key(key)
    bad = _bad_rows(h_bd) | ~(inv_t > 0) | ~jnp.isfinite(inv_t)
    if top_k is not None:
        vals, ids = _top_k(h_bd, w_vd, top_k, impl=impl, blocks=blocks, interpret=interpret)
        rows = jnp.arange(ids.shape[0], dtype=jnp.int32)[:, None]
        scores = vals * inv_t + noise.gumbel(seeds, rows, ids)
        pick = jnp.argmax(scores, axis=1)
        token = jnp.take_along_axis(ids, pick[:, None], axis=1)[:, 0]
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
    (float32 (B, k), int32 (B, k)). Rows of ``h`` with a NaN give NaN values and ids -1."""
    vals, ids = _top_k(h_bd, w_vd, k, impl=impl, blocks=blocks, interpret=interpret)
    bad = _bad_rows(h_bd)[:, None]
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
        vals, ids = lax.top_k(_logits(h_bd, w_vd), k)
        return vals, ids.astype(jnp.int32)
    if impl == "chunked":
        cb = _chunk_blocks(blocks, h_bd, w_vd)
        return _on_padded_rows(lambda h: _chunked_top_k(h, w_vd, k, cb.block_v), h_bd, cb.min_rows)
    mod = _pallas_module("fused_topk")
    kblocks = blocks
    if isinstance(blocks, Mapping):
        kblocks = _tiles(mod.TopKBlocks, blocks) if blocks else None
    vals, ids = mod.fused_topk(h_bd, w_vd, k, blocks=kblocks, interpret=_interpret(interpret))
    return vals, ids.astype(jnp.int32)


def _chunked_top_k(h_bd, w_vd, k: int, block_v: int):
    batch = h_bd.shape[0]
    init = (jnp.full((batch, k), -jnp.inf, jnp.float32), jnp.zeros((batch, k), jnp.int32))

    def step(carry, w_tile, start):
        vals, ids = carry
        logits = _logits(h_bd, w_tile)
        t_vals, t_ids = lax.top_k(logits, min(k, w_tile.shape[0]))
        # Running entries first: lax.top_k keeps the lower position first on ties, and every
        # running id is below this tile's ids, so ties resolve to the lowest id.
        cat_vals = jnp.concatenate([vals, t_vals], axis=1)
        cat_ids = jnp.concatenate([ids, t_ids.astype(jnp.int32) + start], axis=1)
        new_vals, pos = lax.top_k(cat_vals, k)
        return (new_vals, jnp.take_along_axis(cat_ids, pos, axis=1)), None

    (vals, ids), _ = _scan_tiles(step, init, w_vd, block_v)
    return vals, ids


# --------------------------------------------------------------------------------------------
# Linear cross-entropy: one custom VJP shared by the chunked and Pallas backends


@dataclasses.dataclass(frozen=True)
class _CEBackend:
    """How (lse, target logit) and their gradient are computed; static (hashable)."""

    kind: str  # "chunked" or "pallas"
    blocks: Any  # ChunkBlocks for chunked, CEBlocks (or None) for pallas
    interpret: bool
    dtype: Any  # the weights' dtype (h is cast to it): the dtype of both gradients

    def fwd(self, h_nd, w_vd, labels_n):
        if self.kind == "chunked":
            return _chunked_ce_fwd(h_nd, w_vd, labels_n, self.blocks.block_v)
        mod = _pallas_module("linear_ce")
        return mod.linear_ce_fwd(h_nd, w_vd, labels_n, blocks=self.blocks, interpret=self.interpret)

    def bwd(self, h_nd, w_vd, labels_n, lse_n, g_lse_n, g_target_n):
        if self.kind == "chunked":
            return _chunked_ce_bwd(
                h_nd, w_vd, labels_n, lse_n, g_lse_n, g_target_n, self.blocks.block_v
            )
        mod = _pallas_module("linear_ce")
        return mod.linear_ce_bwd(
            h_nd,
            w_vd,
            labels_n,
            lse_n,
            g_lse_n,
            g_target_n,
            blocks=self.blocks,
            interpret=self.interpret,
        )

    def total_and_grad(self, h_nd, w_vd, labels_n, weight_n, z_loss: float):
        """``sum_n weight_n * (lse_n - target_n + z_loss * lse_n**2)`` and its float32 dh, dW.

        chunked: one pass over row tiles (``_chunked_ce_grad``); pallas: the forward kernel,
        then the backward kernels with the per-token cotangents this sum gives."""
        if self.kind == "chunked":
            n, (vocab, d_model) = h_nd.shape[0], w_vd.shape
            block_n = self.blocks.block_n or ChunkBlocks.default_block_n(
                n, vocab, d_model, dtype_name(w_vd.dtype)
            )
            return _chunked_ce_grad(h_nd, w_vd, labels_n, weight_n, z_loss, block_n)
        lse_n, target_n = self.fwd(h_nd, w_vd, labels_n)
        total = _weighted_total(lse_n, target_n, weight_n, z_loss)
        g_lse_n, g_target_n = _total_cotangents(lse_n, weight_n, z_loss)
        dh_nd, dw_vd = self.bwd(h_nd, w_vd, labels_n, lse_n, g_lse_n, g_target_n)
        return total, dh_nd, dw_vd


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ce_total(backend: _CEBackend, z_loss: float, h_nd, w_vd, labels_n, weight_n):
    """``sum_n weight_n * (lse_n - target_n + z_loss * lse_n**2)``, float32; ``h`` is in W's
    dtype and ``weight_n`` is a constant (no gradient). The mean and sum losses go through
    here: their per-token cotangents are known in the forward, so under ``grad`` the forward
    computes dh and dW as it goes and the backward only scales them (``_lse_target``'s
    backward would recompute the logits)."""
    return _weighted_total(*backend.fwd(h_nd, w_vd, labels_n), weight_n, z_loss)


def _weighted_total(lse_n, target_n, weight_n, z_loss: float) -> jax.Array:
    return jnp.sum(weight_n * (lse_n - target_n + z_loss * lse_n * lse_n))


def _ce_total_fwd(backend, z_loss, h_nd, w_vd, labels_n, weight_n):
    total, dh_nd, dw_vd = backend.total_and_grad(h_nd, w_vd, labels_n, weight_n, z_loss)
    return total, (dh_nd, dw_vd)


def _ce_total_bwd(backend, z_loss, residuals, g):
    dh_nd, dw_vd = residuals  # float32; cast to W's dtype after scaling (one rounding)
    return (g * dh_nd).astype(backend.dtype), (g * dw_vd).astype(backend.dtype), None, None


_ce_total.defvjp(_ce_total_fwd, _ce_total_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lse_target(backend: _CEBackend, h_nd, w_vd, labels_n):
    """(logsumexp of the logits, the logit at ``labels``; 0 where label < 0), float32 (N,).

    The backward recomputes the logits tile by tile from h and W (nothing N x V is saved).
    """
    return backend.fwd(h_nd, w_vd, labels_n)


def _lse_target_fwd(backend, h_nd, w_vd, labels_n):
    lse_n, target_n = backend.fwd(h_nd, w_vd, labels_n)
    return (lse_n, target_n), (h_nd, w_vd, labels_n, lse_n)


def _lse_target_bwd(backend, residuals, cotangents):
    h_nd, w_vd, labels_n, lse_n = residuals
    g_lse_n, g_target_n = cotangents
    dh_nd, dw_vd = backend.bwd(
        h_nd,
        w_vd,
        labels_n,
        lse_n,
        g_lse_n.astype(jnp.float32),
        g_target_n.astype(jnp.float32),
    )
    return dh_nd.astype(h_nd.dtype), dw_vd.astype(w_vd.dtype), None


_lse_target.defvjp(_lse_target_fwd, _lse_target_bwd)


def _chunked_ce_fwd(h_nd, w_vd, labels_n, block_v: int):
    n = h_nd.shape[0]
    init = (
        jnp.full((n,), -jnp.inf, jnp.float32),
        jnp.zeros((n,), jnp.float32),
        jnp.zeros((n,), jnp.float32),
    )

    def step(carry, w_tile, start):
        m, s, target = carry
        logits = _logits(h_nd, w_tile)
        new = jnp.maximum(m, jnp.max(logits, axis=1))
        s = s * jnp.exp(m - new) + jnp.sum(jnp.exp(logits - new[:, None]), axis=1)
        target = target + _target_logit(logits, labels_n, start)
        return (new, s, target), None

    (m, s, target), _ = _scan_tiles(step, init, w_vd, block_v)
    return m + jnp.log(s), target


def _chunked_ce_bwd(h_nd, w_vd, labels_n, lse_n, g_lse_n, g_target_n, block_v: int):
    """dh, dW of sum(g_lse * lse + g_target * target) with the logits recomputed per tile;
    the small matmuls run in float32 (dlogits are never rounded to bf16)."""
    h32 = h_nd.astype(jnp.float32)

    def step(dh, w_tile, start):
        logits = _logits(h_nd, w_tile)
        probs = jnp.exp(logits - lse_n[:, None])
        dlogits = _dlogits(probs, start, labels_n, g_lse_n, g_target_n)
        w32 = w_tile.astype(jnp.float32)
        hi = lax.Precision.HIGHEST
        dh = dh + jnp.dot(dlogits, w32, precision=hi)
        dw_tile = jnp.dot(dlogits.T, h32, precision=hi).astype(w_vd.dtype)
        return dh, dw_tile

    dh, parts = _scan_tiles(step, jnp.zeros(h_nd.shape, jnp.float32), w_vd, block_v)
    return dh, _concat_tiles(parts, w_vd.shape[1])


def _chunked_ce_grad(h_nd, w_vd, labels_n, weight_n, z_loss: float, block_n: int):
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
        logits = _logits(h_tile, w_vd)
        m = jnp.max(logits, axis=1)
        e = jnp.exp(logits - m[:, None])
        s = jnp.sum(e, axis=1)
        lse = m + jnp.log(s)
        total = total + _weighted_total(lse, _target_logit(logits, labels), weight, z_loss)
        g_lse, g_target = _total_cotangents(lse, weight, z_loss)
        dlogits = _dlogits(e / s[:, None], 0, labels, g_lse, g_target)
        dw = dw + _contract(dlogits, h_tile, 0, 0)
        return (total, dw), _contract(dlogits, w_vd, 1, 0)

    init = (jnp.zeros((), jnp.float32), jnp.zeros((vocab, d_model), jnp.float32))
    (total, dw), parts = _scan_tiles(step, init, (h_nd, labels_n, weight_n), block_n)
    return total, _concat_tiles(parts, d_model), dw


def _xla_lse_target(h_nd, w_vd, labels_n):
    logits = _logits(h_nd, w_vd)
    return jax.nn.logsumexp(logits, axis=1), _target_logit(logits, labels_n)


def _target_logit(logits_nv, labels_n, start=0) -> jax.Array:
    """Each row's logit at its label, for a tile holding ids ``start`` .. ``start + v - 1``;
    0 where the label is outside the tile (a label of -1: no target)."""
    width = logits_nv.shape[1]
    local = labels_n - start
    picked = jnp.take_along_axis(logits_nv, jnp.clip(local, 0, width - 1)[:, None], 1)[:, 0]
    return jnp.where((local >= 0) & (local < width), picked, 0.0)


def _dlogits(probs_nv, start, labels_n, g_lse_n, g_target_n) -> jax.Array:
    """d(sum g_lse * lse + g_target * target) / d logits for a tile of ids from ``start``:
    ``g_lse * softmax + g_target * onehot(label)``, given the tile's softmax ``probs``."""
    ids_v = start + jnp.arange(probs_nv.shape[1], dtype=jnp.int32)
    return dlogits(probs_nv, labels_n[:, None] == ids_v[None, :], g_lse_n, g_target_n)


def _total_cotangents(lse_n, weight_n, z_loss: float) -> tuple[jax.Array, jax.Array]:
    """(g_lse, g_target): the per-token cotangents of ``_weighted_total``."""
    return weight_n * (1.0 + 2.0 * z_loss * lse_n), -weight_n


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
    goes (``_ce_total``; chunked: row tiles of ``block_n`` tokens, the logits computed once) and
    the backward only scales them. ``reduction="none"`` keeps only h, W, labels and the (N,)
    log-sum-exp, and its backward recomputes each vocabulary tile (``_lse_target``). ``xla``
    differentiates the materialized logits.
    """
    if reduction not in REDUCTIONS:
        raise UserError(f"unknown reduction {reduction!r} (choose from {', '.join(REDUCTIONS)})")
    if not isinstance(z_loss, int | float) or not math.isfinite(z_loss) or z_loss < 0:
        raise UserError(f"z_loss={z_loss!r} must be a finite number >= 0")
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
    vocab = w_vd.shape[0]
    _check_labels(labels_n, vocab, ignore_index)
    impl, blocks = _resolve("linear_cross_entropy", impl, h_nd, w_vd, blocks)
    n_rows = h_nd.shape[0]
    if impl == "chunked":  # padded rows carry ignore_index: no loss, no gradient
        rows = _chunk_blocks(blocks, h_nd, w_vd).min_rows
        h_nd, labels = pad_rows(h_nd, rows), pad_rows(labels, rows, ignore_index)

    valid = labels != ignore_index
    out_of_range = valid & ((labels < 0) | (labels >= vocab))
    kernel_labels = jnp.where(valid & ~out_of_range, labels, -1)
    if impl != "xla" and reduction != "none":
        backend = _ce_backend(impl, blocks, interpret, h_nd, w_vd)
        counted = (valid & ~out_of_range).astype(jnp.float32)
        total = _ce_total(backend, float(z_loss), h_nd, w_vd, kernel_labels, counted)
        total = total + jnp.where(jnp.any(out_of_range), jnp.float32(jnp.nan), 0.0)
    else:
        if impl == "xla":
            lse, target = _xla_lse_target(h_nd, w_vd, kernel_labels)
        else:
            lse, target = _lse_target(
                _ce_backend(impl, blocks, interpret, h_nd, w_vd), h_nd, w_vd, kernel_labels
            )
        per_token = lse - target
        if z_loss:
            per_token = per_token + jnp.float32(z_loss) * lse * lse
        per_token = jnp.where(valid, per_token, 0.0)
        per_token = jnp.where(out_of_range, jnp.float32(jnp.nan), per_token)
        if reduction == "none":
            return per_token[:n_rows].reshape(lead)
        total = jnp.sum(per_token)
    if reduction == "sum":
        return total
    count = jnp.sum(valid.astype(jnp.float32))
    return total / jnp.maximum(count, 1.0)


def _ce_backend(impl, blocks, interpret, h_nd, w_vd) -> _CEBackend:
    if impl == "chunked":
        return _CEBackend("chunked", _chunk_blocks(blocks, h_nd, w_vd), False, w_vd.dtype)
    mod = _pallas_module("linear_ce")
    if isinstance(blocks, Mapping):
        blocks = dict(blocks)
        if "block_b" in blocks:  # a dict shared with the decode ops: its row tile is block_n here
            blocks.setdefault("block_n", blocks.pop("block_b"))
        blocks.pop("tiled", None)
        blocks = _tiles(mod.CEBlocks, blocks) if blocks else None
    return _CEBackend("pallas", blocks, _interpret(interpret), w_vd.dtype)


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


__all__ = [
    "IMPLS",
    "OPS",
    "ChunkBlocks",
    "Choice",
    "unembed_intensity",
    "device_profile",
    "greedy",
    "linear_cross_entropy",
    "logsumexp",
    "sample",
    "select",
    "set_device_profile",
    "top_k",
    "unembed_cost",
    "using_device_profile",
]
