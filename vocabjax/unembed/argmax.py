"""The argmax over the vocabulary axis, as the pick of a token needs it: ``jnp.argmax``'s answer
(the lowest index on ties, the first NaN where a row has one), int32, computed on a CPU from
block maxima.

XLA's CPU backend runs ``jnp.argmax``, a reduction that carries an index, at 0.7-1.8 GB/s of
logits read whatever B, about a tenth of a plain ``max`` over the same array (at V = 131k,
B = 64: 18.8 ms against 1.9 ms; ``benchmarks/xla_cpu_argmax.py``, docs/validation.md). Taking
each block of ``BLOCK`` logits' max (a plain reduction over all of them), then the argmax of the
block maxima and the argmax inside the chosen block (both over few elements) gives the same
index: the first block holding the row's max holds its first occurrence. Other backends keep
``jnp.argmax`` (``lax.platform_dependent`` picks when the call is lowered).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap

BLOCK = 256  # logits per block at most: 1 KiB of f32, a few cache lines' worth per row
MIN_BLOCK = 32  # a V with no power-of-two divisor this large runs ``jnp.argmax``


def argmax(x: jax.Array) -> jax.Array:
    """The index of the largest entry along the last axis, int32, lowest on ties; equal to
    ``jnp.argmax(x, axis=-1)`` for every input, NaN and infinities included. An index has no
    derivative: ``x`` passes ``stop_gradient`` (``custom_vmap`` has no differentiation rule,
    and a caller such as ``unembed.logsumexp`` is differentiated beside its unused pick)."""
    return _argmax(lax.stop_gradient(x))


def max_argmax(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the largest entry, its index) along the last axis, as ``argmax`` picks it: the value
    is NaN exactly where the row holds a NaN (XLA's CPU ``jnp.max`` of eight or more rows
    drops NaN, so it is read at the picked index instead of reduced again). The token picks
    give -1 where it is NaN."""
    i = argmax(x)
    return jnp.take_along_axis(x, i[..., None], axis=-1)[..., 0], i


@custom_vmap
def _argmax(x: jax.Array) -> jax.Array:
    return lax.platform_dependent(x, cpu=blocked_argmax, default=plain_argmax)


@_argmax.def_vmap
def _argmax_vmap(axis_size: int, in_batched: list[bool], x: jax.Array):
    """Under ``vmap``, the pick of the whole batched array (its batch axis leads, the vocabulary
    axis stays last): ``blocked_argmax``'s NaN check then covers every row at once and stays a
    ``lax.cond``, where vmap's own rule would make it a select that runs both branches, slower
    than ``jnp.argmax`` alone. The serving engine samples each row as its own call under vmap:
    there this picks 2.1-10.6x faster than ``jnp.argmax`` at V = 16k and 128k
    (``benchmarks/xla_cpu_argmax.py``, its third table)."""
    return _argmax(x), in_batched[0]


def plain_argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax`` over the last axis, int32 (the baseline ``argmax`` matches)."""
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


def block_for(vocab: int, block: int = BLOCK) -> int | None:
    """The largest power of two up to ``block`` that divides ``vocab`` (32,000 = 125 x 256,
    151,936 = 1,187 x 128), or None where it is below ``MIN_BLOCK`` (50,257 is odd) or one block
    would hold the whole axis. A block must divide the axis: a padded copy of the logits, or
    the view of a sliced-off multiple of the block, cost XLA a copy of the B x V logits that
    took more than the pick saved (V = 50,257, B = 64, D = 512: the greedy pick 34 against
    26 ms with ``jnp.argmax``)."""
    size = vocab & -vocab  # the largest power of two dividing vocab
    size = min(size, block)
    return size if MIN_BLOCK <= size < vocab else None


def blocked_argmax(x: jax.Array, block: int = BLOCK) -> jax.Array:
    """``plain_argmax`` from the maxima of blocks of ``block_for(V, block)`` entries
    (``plain_argmax`` itself where there is no such block).

    XLA's CPU max reduction drops a NaN once eight or more rows are reduced together (jax 0.10:
    ``jnp.max`` of an 8 x 1024 array holding one NaN gave 0), and looking for NaN per block
    cost as much as ``jnp.argmax`` itself. A sum keeps NaN, so one plain sum over ``x`` tells
    whether it may hold one (also true for +inf beside -inf); if so the whole call runs
    ``plain_argmax`` instead (``lax.cond``: under ``vmap`` both branches run, which ``argmax``'s
    own vmap rule avoids)."""
    *lead, v = x.shape
    size = block_for(v, block)
    if size is None:
        return plain_argmax(x)

    def from_blocks(x):
        blocks = x.reshape(*lead, v // size, size)
        first = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
        inside = jnp.take_along_axis(blocks, first[..., None, None], axis=-2)[..., 0, :]
        return (first * size + jnp.argmax(inside, axis=-1)).astype(jnp.int32)

    maybe_nan = jnp.isnan(jnp.sum(x.astype(jnp.float32)))
    return lax.cond(maybe_nan, plain_argmax, from_blocks, x)
