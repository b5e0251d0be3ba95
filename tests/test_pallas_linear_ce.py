"""Fused linear cross-entropy kernels against float64 ground truth and jax.grad of the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_testing import D_GPT2, assert_close, logits64, lse64, random_hw

from pallas_kernels.linear_ce import (
    CEBlocks,
    _bwd_call,
    _fwd_partials,
    linear_ce_bwd,
    linear_ce_bwd_reference,
    linear_ce_fwd,
    linear_ce_fwd_reference,
)

# lse and target logit: f32 accumulation over d_model terms (bf16 products are exact in f32).
FWD_TOL = {jnp.float32: (1e-5, 1e-5), jnp.bfloat16: (1e-4, 1e-4)}
# Gradients, atol as a fraction of the array's largest magnitude. f32 stays f32; for bf16 the
# second matmul of each tile takes dlogits rounded to bf16 (relative error 2^-9 per element),
# so allow one bf16 ulp (2^-8).
GRAD_TOL = {jnp.float32: (1e-5, 1e-5), jnp.bfloat16: (2.0**-8, 2.0**-8)}

# (N, V, D), dtype: GPT-2's odd vocabulary (50,257) at N = 3 (bf16) and 513 (f32), a small ragged
# shape in both dtypes, and a vocabulary the tiles divide (unmasked loads of W), with d_model
# divided too (f32) or ragged (bf16).
# On CPU D is 128 (``pallas_testing.D_GPT2``: the kernels are interpreted there).
CASES = [
    ((3, 50257, D_GPT2), jnp.bfloat16),
    pytest.param((513, 50257, D_GPT2), jnp.float32, marks=pytest.mark.slow),  # ragged rows
    ((37, 1000, 100), jnp.float32),
    ((37, 1000, 100), jnp.bfloat16),
    ((37, 1024, 64), jnp.float32),
    ((37, 1024, 100), jnp.bfloat16),
]


def make_labels(seed, n_rows, vocab):
    """Random labels with ignored rows (-1) and both vocabulary ends present."""
    labels = np.random.default_rng(seed).integers(0, vocab, n_rows)
    labels[::5] = -1
    labels[1] = vocab - 1
    if n_rows > 2:
        labels[2] = 0
    return jnp.asarray(labels, jnp.int32)


def ground_truth(h_nd, w_vd, labels, g_lse, g_target):
    """float64 lse, target logit, dh and dW of sum(g_lse * lse + g_target * target)."""
    logits = logits64(h_nd, w_vd)
    lse = lse64(logits)
    labels = np.asarray(labels)
    has = labels >= 0
    rows = np.arange(len(labels))
    target = np.where(has, logits[rows, np.maximum(labels, 0)], 0.0)
    dl = logits  # reuse the (N, V) buffer: dl = g_lse * exp(logits - lse) + g_target * onehot
    dl -= lse[:, None]
    np.exp(dl, out=dl)
    dl *= np.asarray(g_lse, np.float64)[:, None]
    dl[rows[has], labels[has]] += np.asarray(g_target, np.float64)[has]
    h64, w64 = np.asarray(h_nd, np.float64), np.asarray(w_vd, np.float64)
    dh = dl @ w64
    dw = (h64.T @ dl).T
    return lse, target, dh, dw


def assert_close_scaled(actual, expected, tol, what):
    atol, rtol = tol
    assert_close(actual, expected, (atol * np.abs(expected).max(), rtol), what)


class LinearCETestBase:
    INTERPRET = False

    def blocks(self, n_rows, vocab, d_model, dtype):
        if self.INTERPRET:
            # Few, large tiles for the interpreter; still ragged in N, V and (small case) D.
            if vocab > 8192:
                block_n = 256 if n_rows > 16 else 4  # padded rows cost as much as real ones
                return CEBlocks(block_n=block_n, block_v=8192, block_d=1024, dh_splits=8)
            return CEBlocks(block_n=16, block_v=128, block_d=32, dh_splits=3)
        return CEBlocks.default(n_rows, vocab, d_model, dtype)

    def fwd(self, h, w, labels, blocks=None):
        blocks = blocks or self.blocks(h.shape[0], w.shape[0], w.shape[1], h.dtype)
        return linear_ce_fwd(h, w, labels, blocks=blocks, interpret=self.INTERPRET)

    def bwd(self, h, w, labels, lse, g_lse, g_target, blocks=None):
        blocks = blocks or self.blocks(h.shape[0], w.shape[0], w.shape[1], h.dtype)
        return linear_ce_bwd(
            h, w, labels, lse, g_lse, g_target, blocks=blocks, interpret=self.INTERPRET
        )

    @pytest.mark.slow
    @pytest.mark.parametrize("shape,dtype", CASES)
    def test_fwd_bwd_match_float64(self, shape, dtype):
        n_rows, vocab, d_model = shape
        h_nd, w_vd = random_hw(vocab, n_rows, vocab, d_model, dtype)  # W shared by N
        labels = make_labels(n_rows, n_rows, vocab)
        rng = np.random.default_rng(vocab)
        g_lse = jnp.asarray(rng.standard_normal(n_rows), jnp.float32)
        g_target = jnp.asarray(rng.standard_normal(n_rows), jnp.float32)

        lse, target = self.fwd(h_nd, w_vd, labels)
        assert lse.dtype == jnp.float32 and target.dtype == jnp.float32
        lse64_, target64, dh64, dw64 = ground_truth(h_nd, w_vd, labels, g_lse, g_target)
        assert_close(lse, lse64_, FWD_TOL[dtype], "lse")
        assert_close(target, target64, FWD_TOL[dtype], "target logit")
        np.testing.assert_array_equal(np.asarray(target)[np.asarray(labels) < 0], 0.0)

        dh, dw = self.bwd(h_nd, w_vd, labels, lse, g_lse, g_target)
        assert dh.shape == h_nd.shape and dw.shape == w_vd.shape
        assert dh.dtype == jnp.float32 and dw.dtype == jnp.float32
        assert_close_scaled(dh, dh64, GRAD_TOL[dtype], "dh")
        assert_close_scaled(dw, dw64, GRAD_TOL[dtype], "dW")
        if vocab < 5000:  # the reference's own check, on the small shapes (for time)
            rdh, rdw = linear_ce_bwd_reference(h_nd, w_vd, labels, lse, g_lse, g_target)
            assert_close_scaled(rdh, dh64, GRAD_TOL[jnp.float32], "reference dh")
            assert_close_scaled(rdw, dw64, GRAD_TOL[jnp.float32], "reference dW")

    def test_ignored_labels_have_no_target_term(self):
        n_rows, vocab, d_model = 9, 300, 40
        h_nd, w_vd = random_hw(4, n_rows, vocab, d_model, jnp.float32)
        labels = jnp.asarray([-1, 5, vocab, 7, -1, 299, 0, -1, 3], jnp.int32)  # vocab: outside
        ignored = np.asarray((labels < 0) | (labels >= vocab))
        lse, target = self.fwd(h_nd, w_vd, labels)
        np.testing.assert_array_equal(np.asarray(target)[ignored], 0.0)
        g_lse = jnp.ones((n_rows,), jnp.float32)
        g_target = jnp.full((n_rows,), -2.0, jnp.float32)
        dh, dw = self.bwd(h_nd, w_vd, labels, lse, g_lse, g_target)
        # The cotangent of an ignored row's target logit must not matter.
        g_target0 = jnp.where(jnp.asarray(ignored), 0.0, g_target)
        dh0, dw0 = self.bwd(h_nd, w_vd, labels, lse, g_lse, g_target0)
        np.testing.assert_array_equal(dh, dh0)
        np.testing.assert_array_equal(dw, dw0)
        *_, dh64, dw64 = ground_truth(h_nd, w_vd, np.where(ignored, -1, labels), g_lse, g_target)
        assert_close_scaled(dh, dh64, GRAD_TOL[jnp.float32], "dh")
        assert_close_scaled(dw, dw64, GRAD_TOL[jnp.float32], "dW")

    @pytest.mark.slow
    def test_mean_loss_custom_vjp_matches_jax_grad(self):
        """The way unembed uses the kernels: a custom_vjp mean loss with ignore_index."""
        n_rows, vocab, d_model, ignore = 21, 500, 48, -100
        h_nd, w_vd = random_hw(6, n_rows, vocab, d_model, jnp.float32)
        labels = make_labels(3, n_rows, vocab)
        labels = jnp.where(labels < 0, ignore, labels)
        blocks = self.blocks(n_rows, vocab, d_model, jnp.float32)
        interpret = self.INTERPRET

        def loss_fn(h, w):
            keep = labels != ignore
            lab = jnp.where(keep, labels, -1)
            count = jnp.maximum(jnp.sum(keep), 1).astype(jnp.float32)

            @jax.custom_vjp
            def f(h, w):
                lse, tgt = linear_ce_fwd(h, w, lab, blocks=blocks, interpret=interpret)
                return jnp.sum(jnp.where(keep, lse - tgt, 0.0)) / count

            def f_fwd(h, w):
                lse, tgt = linear_ce_fwd(h, w, lab, blocks=blocks, interpret=interpret)
                return jnp.sum(jnp.where(keep, lse - tgt, 0.0)) / count, (h, w, lse)

            def f_bwd(res, g):
                h, w, lse = res
                g_lse = jnp.where(keep, g / count, 0.0)
                return linear_ce_bwd(
                    h, w, lab, lse, g_lse, -g_lse, blocks=blocks, interpret=interpret
                )

            f.defvjp(f_fwd, f_bwd)
            return f(h, w)

        def ref_loss(h, w):
            keep = labels != ignore
            logits = jnp.einsum("nd,vd->nv", h, w, precision=jax.lax.Precision.HIGHEST)
            logp = jax.nn.log_softmax(logits, axis=1)
            nll = -jnp.take_along_axis(logp, jnp.where(keep, labels, 0)[:, None], axis=1)[:, 0]
            return jnp.sum(jnp.where(keep, nll, 0.0)) / jnp.sum(keep).astype(jnp.float32)

        loss, (dh, dw) = jax.value_and_grad(loss_fn, argnums=(0, 1))(h_nd, w_vd)
        rloss, (rdh, rdw) = jax.value_and_grad(ref_loss, argnums=(0, 1))(h_nd, w_vd)
        assert_close(loss, rloss, FWD_TOL[jnp.float32], "loss")
        assert_close_scaled(dh, rdh, GRAD_TOL[jnp.float32], "dh")
        assert_close_scaled(dw, rdw, GRAD_TOL[jnp.float32], "dW")

    @pytest.mark.slow
    @pytest.mark.parametrize("shape", [(37, 1000, 100), (37, 1024, 64)])
    def test_poisoned_outputs_all_written(self, shape):
        n_rows, vocab, d_model = shape
        h_nd, w_vd = random_hw(2, n_rows, vocab, d_model, jnp.float32)
        labels = make_labels(2, n_rows, vocab)
        blocks = CEBlocks(block_n=16, block_v=128, block_d=32, dh_splits=3)
        lse_tn, target_tn = _fwd_partials(
            h_nd, w_vd, labels, blocks=blocks, interpret=self.INTERPRET, poison=True
        )
        assert np.isfinite(np.asarray(lse_tn)).all() and np.isfinite(np.asarray(target_tn)).all()
        ones = jnp.ones((n_rows,), jnp.float32)
        lse = jax.nn.logsumexp(lse_tn, axis=0)[:n_rows]
        dh, dw = _bwd_call(
            h_nd,
            w_vd,
            labels,
            lse,
            ones,
            ones,
            blocks=blocks,
            interpret=self.INTERPRET,
            poison=True,
        )
        assert dw.shape == (vocab, d_model)
        assert np.isfinite(np.asarray(dh)).all() and np.isfinite(np.asarray(dw)).all()
        # Padded rows and columns of dh are exactly zero; the real part matches the kernel.
        np.testing.assert_array_equal(np.asarray(dh)[n_rows:], 0.0)
        np.testing.assert_array_equal(np.asarray(dh)[:, d_model:], 0.0)

    def test_bad_arguments(self):
        h_nd, w_vd = random_hw(0, 4, 64, 32, jnp.float32)
        with pytest.raises(ValueError, match="labels_n"):
            self.fwd(h_nd, w_vd, jnp.zeros((3,), jnp.int32))
        with pytest.raises(ValueError, match="dh_splits"):
            CEBlocks(dh_splits=0)


def test_blocks_default_and_candidates():
    b = CEBlocks.default(8192, 50257, 768, jnp.bfloat16)
    assert (b.block_n, b.block_v, b.block_d) == (64, 128, 64)
    assert CEBlocks.default(3, 50257, 768, jnp.bfloat16).block_n == 16
    cands = CEBlocks.candidates(8192, 50257, 768, jnp.bfloat16)
    assert cands[0] == b and len(set(cands)) == len(cands)


def test_reference_forward_matches_float64():
    h_nd, w_vd = random_hw(1, 5, 77, 24, jnp.float32)
    labels = jnp.asarray([3, -1, 76, 0, 10], jnp.int32)
    lse, target = linear_ce_fwd_reference(h_nd, w_vd, labels)
    lse64_, target64, _, _ = ground_truth(h_nd, w_vd, labels, np.ones(5), np.ones(5))
    assert_close(lse, lse64_, FWD_TOL[jnp.float32], "lse")
    assert_close(target, target64, FWD_TOL[jnp.float32], "target")


@pytest.mark.gpu
class TestLinearCEGpu(LinearCETestBase):
    INTERPRET = False


class TestLinearCEInterpret(LinearCETestBase):
    INTERPRET = True
