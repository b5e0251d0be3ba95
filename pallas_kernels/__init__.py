"""Pallas kernels for the unembedding, one kernel per file, each beside its pure-jnp reference.

- ``fused_decode``: memory-oriented decode statistics (max, argmax, logsumexp, sample).
- ``noise``: the counter-based Gumbel noise every sampler shares.
"""

from pallas_kernels._common import DecodeStats
from pallas_kernels.fused_decode import DecodeBlocks, fused_decode, fused_decode_reference

__all__ = [
    "DecodeBlocks",
    "DecodeStats",
    "fused_decode",
    "fused_decode_reference",
]
