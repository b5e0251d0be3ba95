"""Counter-based Gumbel noise keyed by (seed, row, token id).

Every sampler (xla, chunked, Pallas) draws its noise from this one function, so a sample depends
only on the key, the row and the token ids, never on how the vocabulary was tiled. It uses only
32-bit integer arithmetic and ``log``, so it lowers inside Pallas kernels as well as in XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _mix32(x: jax.Array) -> jax.Array:
    """A 32-bit integer finaliser with good avalanche (Wellons' "lowbias32")."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    x = x ^ (x >> 16)
    return x


def seeds_from_key(key: jax.Array) -> jax.Array:
    """Two uint32 seeds, shape (2,), from a JAX PRNG key (typed or raw)."""
    return jax.random.bits(key, (2,), jnp.uint32)


def uniform(seeds: jax.Array, row: jax.Array, tok: jax.Array) -> jax.Array:
    """Uniform noise in (0, 1), float32, broadcast over ``row`` and ``tok`` (int or uint32)."""
    row = row.astype(jnp.uint32)
    tok = tok.astype(jnp.uint32)
    h = _mix32(seeds[0] ^ _mix32(row + jnp.uint32(0x9E3779B9)))
    h = _mix32(h ^ seeds[1] ^ _mix32(tok * jnp.uint32(0x85EBCA6B) + jnp.uint32(0x68E31DA4)))
    # 24 random bits, centred in their bucket: never exactly 0 or 1.
    mant = (h >> 8).astype(jnp.float32)
    return (mant + 0.5) * jnp.float32(1.0 / (1 << 24))


def gumbel(seeds: jax.Array, row: jax.Array, tok: jax.Array) -> jax.Array:
    """Standard Gumbel noise, float32: ``-log(-log(u))`` of ``uniform``."""
    return -jnp.log(-jnp.log(uniform(seeds, row, tok)))
