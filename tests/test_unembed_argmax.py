"""vocabjax.unembed.argmax: the blocked pick gives ``jnp.argmax``'s index for every input.

Ties (the lowest index), NaN (the first one), all -inf rows, +inf, blocks of every size
``block_for`` picks and lengths it leaves to ``jnp.argmax``, several leading axes, and under
vmap, the way the serving engine's per-row sample calls it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vocabjax.unembed.argmax import BLOCK, argmax, block_for, blocked_argmax

# blocks of 256 (768, 32,000), 128 (151,936), 32 (3,552); jnp.argmax (1, 7, 256, 257, 1,000)
LENGTHS = (1, 7, BLOCK, BLOCK + 1, 3 * BLOCK, 1000, 3552, 32_000, 151_936)


def test_block_for():
    assert [block_for(v) for v in (32_000, 151_936, 3552, 131_072)] == [256, 128, 32, 256]
    assert [block_for(v) for v in (50_257, 1000, 256, 1)] == [None] * 4
    assert block_for(4096, 64) == 64


def _want(x: np.ndarray) -> np.ndarray:
    """numpy's argmax: the lowest index on ties, the first NaN where there is one."""
    return np.argmax(x, axis=-1).astype(np.int32)


def _both(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    xj = jnp.asarray(x)
    return np.asarray(jax.jit(blocked_argmax)(xj)), np.asarray(jax.jit(argmax)(xj))


@pytest.mark.parametrize("v", LENGTHS)
def test_random_rows(v):
    x = np.random.default_rng(v).standard_normal((5, v), dtype=np.float32)
    for got in _both(x):
        np.testing.assert_array_equal(got, _want(x))
        assert got.dtype == np.int32


@pytest.mark.parametrize("v", (3 * BLOCK, 3 * 128, 1000))
def test_ties_nan_and_infinities(v):
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 3, size=(9, v)).astype(np.float32)  # many ties in every row
    x[1, :] = -np.inf  # all -inf: index 0
    x[2, v - 1] = np.inf  # +inf in the last block
    x[3, [v // 2, v - 1]] = np.nan  # first NaN wins, even over a later one
    x[4, [5, v - 2]] = [np.nan, np.inf]
    x[5, :] = np.nan
    x[6, v - 1] = 3.0  # the unique max in the last block
    x[7, [127, 128]] = 9.0  # a tie across a block boundary: the first
    x[8, :] = 0.0  # one long tie: index 0
    # The whole array falls back to jnp.argmax (NaN; +inf beside -inf); each row alone and the
    # rows of neither kind together take the blocks.
    for part in (x, *x[:, None], x[[0, 1, 6, 7, 8]], x[[0, 2, 6, 7, 8]]):
        for got in _both(part):
            np.testing.assert_array_equal(got, _want(part))
    assert _want(x)[7] == 127 and _want(x)[3] == v // 2


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_leading_axes_and_dtypes(dtype):
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 768)), dtype)
    want = _want(np.asarray(x.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(x)), want)
    assert jax.jit(argmax)(x[0, 0]).shape == ()  # a single row


def test_under_vmap():
    x = np.random.default_rng(2).standard_normal((4, 3 * BLOCK), dtype=np.float32)
    x[2, 100] = np.nan
    got = jax.jit(jax.vmap(argmax))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got), _want(x))


@given(
    st.integers(1, 9),
    st.integers(5, 8),  # blocks of 32 .. 256
    st.integers(1, 12),
    st.integers(0, 2**32 - 1),
    st.sampled_from([3, 1000]),  # a few distinct values (ties) or nearly none
    st.floats(0.0, 0.05),
)
def test_matches_numpy_property(rows, log_block, blocks, seed, levels, nan_share):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, levels, size=(rows, blocks * 2**log_block)).astype(np.float32)
    x[rng.random(x.shape) < nan_share] = np.nan
    np.testing.assert_array_equal(np.asarray(jax.jit(blocked_argmax)(jnp.asarray(x))), _want(x))


def test_vmap_rule_over_any_axis_and_nested():
    x = np.random.default_rng(3).standard_normal((2, 3, 2 * BLOCK), dtype=np.float32)
    x[1, 2, 7] = np.nan  # one NaN: the whole batched call takes jnp.argmax's branch
    want = _want(x)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(jax.vmap(argmax)))(x)), want)
    moved = np.ascontiguousarray(np.moveaxis(x, 0, 1))  # (3, 2, V), mapped over its axis 1
    got = jax.jit(jax.vmap(argmax, in_axes=1, out_axes=0))(jnp.asarray(moved))
    np.testing.assert_array_equal(np.asarray(got), want)


def test_gradient_through_a_function_that_also_picks():
    # unembed.logsumexp computes the pick beside the log-sum-exp and is differentiated
    x = jnp.asarray(np.random.default_rng(4).standard_normal((4, 2 * BLOCK)), jnp.float32)

    def f(x):
        return jnp.sum(jax.nn.logsumexp(x, axis=-1) + 0.0 * argmax(x).astype(jnp.float32))

    np.testing.assert_allclose(
        np.asarray(jax.grad(f)(x)), np.asarray(jax.nn.softmax(x, axis=-1)), rtol=1e-6
    )
