"""Helpers for the Pallas kernel tests: inputs, float64 ground truth, tolerance checks.

Each kernel test module has a base class with ``INTERPRET = False`` (its concrete subclass is
marked ``gpu``) and a subclass with ``INTERPRET = True`` that runs the same tests on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# GPT-2's d_model on a GPU; on CPU the kernels are interpreted, at a cost in proportion to
# B * V * D, so 128 there (still two d tiles of 64; the ragged vocabulary and row tiles that
# GPT-2's odd V = 50,257 makes do not depend on D).
D_GPT2 = 128 if jax.default_backend() == "cpu" else 768


@functools.lru_cache(maxsize=8)
def _normal(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    out = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    out.flags.writeable = False
    return out


def random_hw(seed: int, batch, vocab, d_model, dtype, *, scale=3.0):
    """h ~ N(0, 1) of (B, D) and w ~ N(0, scale^2 / D) of (V, D): logits have std ``scale``.

    Drawn with numpy from the explicit integer ``seed`` (much faster than jax.random on CPU for
    the 50,257 x 768 case); W for a (seed, shape) is cached, h is drawn per batch.
    """
    w_vd = jnp.asarray(_normal(seed, (vocab, d_model)) * np.float32(scale / d_model**0.5))
    h_bd = jnp.asarray(_normal(seed + 1, (batch, d_model)))
    return h_bd.astype(dtype), w_vd.astype(dtype)


def logits64(h_bd, w_vd) -> np.ndarray:
    """Ground-truth logits in float64 from the (already rounded) inputs."""
    return np.asarray(h_bd, np.float64) @ np.asarray(w_vd, np.float64).T


def lse64(logits: np.ndarray) -> np.ndarray:
    m = logits.max(axis=1)
    return m + np.log(np.exp(logits - m[:, None]).sum(axis=1))


def assert_close(actual, expected, tol, what: str):
    """|actual - expected| <= atol + rtol |expected| everywhere (NaN fails)."""
    atol, rtol = tol
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    err = np.abs(actual - expected)
    bound = atol + rtol * np.abs(expected)
    bad = ~(err <= bound)
    assert not bad.any(), (
        f"{what}: {bad.sum()} of {bad.size} elements off; max err {np.nanmax(err):.3g} "
        f"(atol={atol}, rtol={rtol}); first bad at {np.argwhere(bad)[:3].tolist()}"
    )


def assert_argmax_exact(argmax_b, logits_bv: np.ndarray, gap: float):
    """The kernel's argmax equals the float64 one on every row whose top-2 gap exceeds ``gap``.

    Rows closer than ``gap`` may legitimately differ in float32, so there the chosen token only
    has to be within ``gap`` of the max. At least half the rows must be decisive, or the check
    would say nothing.
    """
    argmax_b = np.asarray(argmax_b)
    top2 = np.sort(logits_bv, axis=1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > gap
    assert decisive.mean() >= 0.5, "test inputs too tie-prone to check argmax"
    want = logits_bv.argmax(axis=1)
    np.testing.assert_array_equal(argmax_b[decisive], want[decisive])
    rows = np.arange(len(argmax_b))
    assert np.all(logits_bv[rows, argmax_b] >= logits_bv.max(axis=1) - gap)


def tied_w(w_vd, h_bd, tie_ids, *, scale=4.0):
    """W whose rows ``tie_ids`` are one shared vector, aligned with h row 0 so they win there.

    The shared row is ``scale * h0 / |h0|^2`` in f32 then rounded, copied bit for bit, so its
    logits are identical for every tied id under any blocking.
    """
    h0 = np.asarray(h_bd[0], np.float64)
    row = (scale * h0 / (h0 @ h0) * 10.0).astype(np.float32)
    w = np.array(w_vd.astype(jnp.float32))
    w[np.asarray(tie_ids)] = row
    return jnp.asarray(w).astype(w_vd.dtype)
