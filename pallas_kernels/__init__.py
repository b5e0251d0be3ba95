"""Pallas kernels for the unembedding, one kernel per file, each beside its pure-jnp reference.

- ``fused_decode``: memory-oriented decode statistics (max, argmax, logsumexp, sample).
- ``tiled_decode``: the same statistics, compute-oriented tiling for large batches.
- ``fused_topk``: top-k values and ids (per-tile candidates, one sort to merge).
- ``linear_ce``: fused linear cross-entropy forward (lse, target logit) and backward (dh, dW).
- ``noise``: the counter-based Gumbel noise every sampler shares.
- ``selfcheck``: ``run_all(interpret)``, every kernel against its reference.

Backends: every kernel is written for the Pallas Triton GPU backend (power-of-two tiles, masked
loads and stores at ragged edges, Triton compiler params) and runs on CPU with
``interpret=True``. All of them lower to Triton IR at every ``candidates()`` tiling (checked on
CPU by ``tests/test_pallas_lowering.py``); Mosaic GPU and TPU are not targeted (the masked
``pallas.triton`` loads are Triton-specific).
"""

from pallas_kernels._common import DecodeStats
from pallas_kernels.fused_decode import DecodeBlocks, fused_decode, fused_decode_reference
from pallas_kernels.fused_topk import TopKBlocks, fused_topk, fused_topk_reference
from pallas_kernels.linear_ce import (
    CEBlocks,
    linear_ce_bwd,
    linear_ce_bwd_reference,
    linear_ce_fwd,
    linear_ce_fwd_reference,
)
from pallas_kernels.tiled_decode import TiledBlocks, tiled_decode, tiled_decode_reference

__all__ = [
    "CEBlocks",
    "DecodeBlocks",
    "DecodeStats",
    "fused_decode",
    "fused_decode_reference",
    "linear_ce_bwd",
    "linear_ce_bwd_reference",
    "linear_ce_fwd",
    "linear_ce_fwd_reference",
    "TiledBlocks",
    "TopKBlocks",
    "fused_topk",
    "fused_topk_reference",
    "tiled_decode",
    "tiled_decode_reference",
]
