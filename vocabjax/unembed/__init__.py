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
  measured to need otherwise.

Numerics: the matmul runs in the weights' dtype (``h`` is cast to ``w.dtype``) with float32
accumulation; f32 weights use ``Precision.HIGHEST`` (no TF32). Values come back in float32.

Bad input, and what happens (all tested):

- ``h`` and ``w`` with different D, ``k`` < 1 or > V, an unknown impl or reduction, a Python or
  concrete temperature <= 0 or not finite: ``UserError`` at trace time.
- A label outside [0, V) that is not ``ignore_index``: ``UserError`` when the labels are concrete;
  under ``jit`` that token's loss is NaN (so the mean is NaN), never a silently wrong number.
- A row of ``h`` holding a NaN or an infinity: its token id is -1 (greedy, sample, top-k ids),
  its values are NaN. So is a finite row whose logits hold a NaN (a NaN in ``w``, or an
  infinity in ``w`` times a zero in ``h``), the same in every implementation; a logit of +inf
  (no NaN) is picked, and its row's logsumexp is +inf. A traced temperature <= 0 gives -1 for
  every row.

All ops work under ``jit``, ``vmap`` (any leading axes the caller adds; ``sample`` keys its
noise by the row index within one call, so vmapped calls should get their own keys) and, for
``linear_cross_entropy``, ``grad`` with respect to ``h`` and ``w``.

from __future__ import annotations


The package, one job a module:

- ``ops``: the public ops above and their dispatch to an implementation;
- ``chunked``: the scan implementation beside its tiling, ``ChunkBlocks``;
- ``pallas``: which Pallas kernel runs and the tile dataclass a dict of blocks becomes;
- ``vjp``: the cross-entropy's custom VJPs, shared by the chunked and Pallas backends;
- ``selector``: ``select`` (what ``auto`` runs, and why) and the device profile it reads.
"""

from vocabjax.unembed.chunked import ChunkBlocks
from vocabjax.unembed.ops import REDUCTIONS, greedy, linear_cross_entropy, logsumexp, sample, top_k
from vocabjax.unembed.selector import (
    IMPLS,
    OPS,
    PROFILE_ENV,
    Choice,
    Impl,
    device_profile,
    dtype_name,
    select,
    set_device_profile,
    unembed_cost,
    unembed_intensity,
    using_device_profile,
)

__all__ = [
    "IMPLS",
    "OPS",
    "PROFILE_ENV",
    "REDUCTIONS",
    "ChunkBlocks",
    "Choice",
    "Impl",
    "device_profile",
    "dtype_name",
    "greedy",
    "linear_cross_entropy",
    "logsumexp",
    "sample",
    "select",
    "set_device_profile",
    "top_k",
    "unembed_cost",
    "unembed_intensity",
    "using_device_profile",
]
