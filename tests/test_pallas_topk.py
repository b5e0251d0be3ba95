"""Fused top-k kernel against float64 ground truth (GPU and interpret)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from pallas_testing import D_GPT2, assert_close, logits64, random_hw, tied_w

from pallas_kernels.fused_topk import TopKBlocks, _topk_partials, fused_topk, fused_topk_reference

TOL = {jnp.float32: (1e-5, 1e-5), jnp.bfloat16: (1e-4, 1e-4)}
GAP = 1e-3  # neighbours closer than this may swap in float32; there only values are checked

CASES = [
    ((3, 50257, D_GPT2, 50), jnp.float32),
    ((3, 50257, D_GPT2, 50), jnp.bfloat16),
    ((37, 1000, 100, 7), jnp.float32),
    ((5, 1000, 100, 1), jnp.bfloat16),
    ((4, 20, 24, 20), jnp.float32),  # k = V: every tile runs out of tokens
]


def truth_topk(logits: np.ndarray, k: int):
    """float64 top k per row: value descending, then id ascending."""
    order = np.lexsort((np.broadcast_to(np.arange(logits.shape[1]), logits.shape), -logits))
    ids = order[:, :k]
    return (
        np.take_along_axis(logits, ids, axis=1),
        ids,
        np.take_along_axis(logits, order[:, : k + 1], axis=1),
    )


def check_topk(vals, ids, logits: np.ndarray, k: int, tol):
    vals, ids = np.asarray(vals), np.asarray(ids)
    want_vals, want_ids, top_k1 = truth_topk(logits, k)
    assert vals.shape == ids.shape == (logits.shape[0], k)
    assert vals.dtype == np.float32 and ids.dtype == np.int32
    assert_close(vals, want_vals, tol, "top-k values")
    # Each returned value is the logit of its returned id; ids are distinct per row.
    assert_close(vals, np.take_along_axis(logits, ids, axis=1), tol, "value at id")
    assert all(len(set(r)) == k for r in ids.tolist())
    # Ids exact wherever the rank is decisive (both neighbours farther than GAP).
    if top_k1.shape[1] == k:  # k = V: nothing below the k-th value
        top_k1 = np.concatenate([top_k1, np.full((len(top_k1), 1), -np.inf)], axis=1)
    gaps = -np.diff(top_k1, axis=1)  # (B, k): gap from rank r to rank r + 1
    nxt = gaps
    prev = np.concatenate([np.full((len(gaps), 1), np.inf), gaps[:, : k - 1]], axis=1)
    decisive = (prev > GAP) & (nxt > GAP)
    assert decisive.mean() >= 0.5, "inputs too tie-prone to check ids"
    np.testing.assert_array_equal(ids[decisive], want_ids[decisive])


class FusedTopKTestBase:
    INTERPRET = False

    def blocks(self, batch, vocab, d_model, dtype):
        if self.INTERPRET:
            if vocab > 8192:
                return TopKBlocks(block_v=8192, block_b=4, block_d=1024)
            return TopKBlocks(block_v=128 if vocab > 128 else 16, block_b=16, block_d=32)
        return TopKBlocks.default(batch, vocab, d_model, dtype)

    def topk(self, h_bd, w_vd, k, blocks=None):
        blocks = blocks or self.blocks(h_bd.shape[0], w_vd.shape[0], w_vd.shape[1], h_bd.dtype)
        return fused_topk(h_bd, w_vd, k, blocks=blocks, interpret=self.INTERPRET)

    @pytest.mark.slow
    @pytest.mark.parametrize(
        "case", CASES, ids=[f"{b}x{v}x{d}-k{k}-{jnp.dtype(t).name}" for (b, v, d, k), t in CASES]
    )
    def test_matches_float64(self, case):
        (batch, vocab, d_model, k), dtype = case
        h_bd, w_vd = random_hw(vocab + k, batch, vocab, d_model, dtype)
        vals, ids = self.topk(h_bd, w_vd, k)
        check_topk(vals, ids, logits64(h_bd, w_vd), k, TOL[dtype])

    @pytest.mark.slow
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    def test_ties_in_id_order(self, dtype):
        batch, vocab, d_model, k = 3, 1000, 100, 6
        h_bd, w_vd = random_hw(7, batch, vocab, d_model, dtype)
        w_vd = tied_w(w_vd, h_bd, [999, 517, 300, 301])  # across tiles and inside one
        vals, ids = self.topk(h_bd, w_vd, k)
        np.testing.assert_array_equal(np.asarray(ids)[0, :4], [300, 301, 517, 999])
        assert len(set(np.asarray(vals)[0, :4].tolist())) == 1
        rvals, rids = fused_topk_reference(h_bd, w_vd, k)
        np.testing.assert_array_equal(np.asarray(rids)[0, :4], [300, 301, 517, 999])
        assert_close(vals, rvals, TOL[dtype], "values vs reference")

    def test_poisoned_partials_all_written(self):
        batch, vocab, d_model, k = 5, 1000, 100, 5
        h_bd, w_vd = random_hw(8, batch, vocab, d_model, jnp.float32)
        blocks = TopKBlocks(block_v=128, block_b=16, block_d=32)
        vals, ids = _topk_partials(
            h_bd, w_vd, k, blocks=blocks, interpret=self.INTERPRET, poison=True
        )
        vals, ids = np.asarray(vals), np.asarray(ids)
        assert not np.isnan(vals).any() and (ids >= 0).all()
        assert np.isfinite(vals[:, :, :k]).all()  # every tile holds >= k tokens here
        np.testing.assert_array_equal(vals[:, :, k:], -np.inf)  # k_pad = 8 > k

    def test_bad_k(self):
        h_bd, w_vd = random_hw(0, 2, 30, 16, jnp.float32)
        with pytest.raises(ValueError, match="k=31"):
            self.topk(h_bd, w_vd, 31)
        with pytest.raises(ValueError, match="k=0"):
            self.topk(h_bd, w_vd, 0)


def test_reference_matches_float64():
    h_bd, w_vd = random_hw(3, 4, 300, 32, jnp.float32)
    vals, ids = fused_topk_reference(h_bd, w_vd, 9)
    check_topk(vals, ids, logits64(h_bd, w_vd), 9, TOL[jnp.float32])


def test_blocks_default_and_candidates():
    b = TopKBlocks.default(3, 50257, 768, jnp.bfloat16)
    assert (b.block_b, b.block_v) == (16, 256)
    cands = TopKBlocks.candidates(3, 50257, 768, jnp.bfloat16)
    assert cands[0] == b and len(set(cands)) == len(cands)


@pytest.mark.gpu
class TestFusedTopKGpu(FusedTopKTestBase):
    INTERPRET = False


class TestFusedTopKInterpret(FusedTopKTestBase):
    INTERPRET = True
