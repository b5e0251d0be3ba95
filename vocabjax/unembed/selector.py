"""Which implementation ``impl="auto"`` runs for an op at a shape, and the device profile it
reads.

``select`` is called at trace time from static shapes, so it costs nothing per call; its
``Choice`` says what runs, with which tiles, and why (the profile's name or the rule). The
profile is the ``profile=`` argument when given, else the one :func:`set_device_profile` set,
else ``$VOCABJAX_DEVICE_PROFILE``. A function already traced keeps the choice it was traced
with: set the profile before the first call, or pass it.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels._common import next_pow2
from vocabjax.errors import UserError
from vocabjax.hardware import BYTES_PER_ELEMENT, DeviceProfile, KernelTiming, load_device

Impl = Literal["auto", "xla", "chunked", "pallas"]
IMPLS: tuple[str, ...] = ("xla", "chunked", "pallas")
OPS: tuple[str, ...] = ("greedy", "logsumexp", "top_k", "sample", "linear_cross_entropy")

# The ridge point used by the roofline rule when no device profile is set: the default device's.
_FALLBACK_DEVICE = "a100-80gb"
PROFILE_ENV = "VOCABJAX_DEVICE_PROFILE"  # a builtin device name or a profile JSON path

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
    *,
    vocab: int,
    batch: int,
    d_model: int,
    dtype: str,
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
        return _cpu_rule(op, vocab=vocab, batch=batch, d_model=d_model, dtype=dtype)
    ridge_profile = profile if profile is not None else load_device(_FALLBACK_DEVICE)
    ridge = ridge_profile.ridge_point(dtype)
    intensity = unembed_intensity(vocab=vocab, batch=batch, d_model=d_model, dtype=dtype)
    why = f"roofline: intensity {intensity:.1f} vs ridge {ridge:.1f} of {ridge_profile.name}"
    if op == "linear_cross_entropy" or intensity < ridge:
        return Choice("pallas", {}, why)
    return Choice("xla", {}, why)


def _cpu_rule(op: str, *, vocab: int, batch: int, d_model: int, dtype: str) -> Choice:
    """What ``auto`` runs on a CPU with no measured row for the op: xla, the baseline, except
    where this backend was measured to need otherwise.

    The roofline cannot tell the fused decode from xla's at small B: xla's extra traffic, the
    B x V f32 logits written and read back, is 8 B / (D w) of W's bytes (0.3% at B = 1,
    D = 768, f32), and past the ridge both run the same matmul. Measured on XLA's CPU backend
    with no profile (``benchmarks/unembed.py --profile none``, docs/benchmarks.md), the scan
    over V tiles ran 1.8-8.9x slower than xla for greedy, top-k and sampling at B = 4-64 in bf16
    (bf16 dots inside a loop body are slow there), and autotune's f32 candidates ran it
    1.5-2.2x slower than xla at B = 1 and 4 (``benchmarks/unembed.py``). Two exceptions:

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


def unembed_intensity(*, vocab: int, batch: int, d_model: int, dtype: str) -> float:
    """FLOP per byte of the fused unembedding: 2 B V D over the bytes of W, h and the outputs."""
    flops, bytes_ = unembed_cost("greedy", vocab=vocab, batch=batch, d_model=d_model, dtype=dtype)
    return flops / bytes_


def unembed_cost(
    op: str, *, vocab: int, batch: int, d_model: int, dtype: str
) -> tuple[float, float]:
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
