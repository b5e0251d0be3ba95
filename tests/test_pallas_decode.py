"""Fused decode kernel against float64 ground truth and its jnp reference (GPU and interpret)."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_testing import (
    assert_argmax_exact,
    assert_close,
    logits64,
    lse64,
    random_hw,
    tied_w,
)

from pallas_kernels import noise
from pallas_kernels.fused_decode import (
    DecodeBlocks,
    _decode_partials,
    fused_decode,
    fused_decode_reference,
)

# Max and logsumexp against float64 logits of the same (rounded) inputs: float32 accumulation
# over d_model = 768 terms. bf16 has more room for tensor-core accumulation order on GPU.
TOL = {jnp.float32: (1e-5, 1e-5), jnp.bfloat16: (1e-4, 1e-4)}
ARGMAX_GAP = 1e-3  # top-2 gaps below this may flip in float32; such rows are checked by value

# (B, V, D): the odd shape at B = 1 and 3, and a small shape where B straddles tiles.
SHAPES = [(1, 50257, 768), (3, 50257, 768), (37, 1000, 100)]


class FusedDecodeTestBase:
    INTERPRET = False

    def blocks(self, batch, vocab, d_model, dtype):
        if self.INTERPRET:
            # Interpret mode pays per grid step: few, large tiles (still ragged in V and B).
            block_b = 16 if batch > 16 else 4
            block_v = 8192 if vocab > 8192 else 128
            return DecodeBlocks(block_v=block_v, block_b=block_b, block_d=256)
        return DecodeBlocks.default(batch, vocab, d_model, dtype)

    def decode(self, h_bd, w_vd, seeds=None, blocks=None, **kw):
        if blocks is None:
            blocks = self.blocks(h_bd.shape[0], w_vd.shape[0], w_vd.shape[1], h_bd.dtype)
        return fused_decode(h_bd, w_vd, seeds, blocks=blocks, interpret=self.INTERPRET, **kw)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("shape", SHAPES)
    def test_matches_float64(self, shape, dtype):
        batch, vocab, d_model = shape
        seed = zlib.crc32(repr(shape).encode())
        h_bd, w_vd = random_hw(seed, batch, vocab, d_model, dtype)
        seeds = noise.seeds_from_key(jax.random.key(seed))
        out = self.decode(h_bd, w_vd, seeds, inv_temperature=0.8)
        truth = logits64(h_bd, w_vd)
        assert out.max_b.dtype == jnp.float32 and out.lse_b.dtype == jnp.float32
        assert out.argmax_b.dtype == jnp.int32 and out.sample_b.dtype == jnp.int32
        assert_close(out.max_b, truth.max(axis=1), TOL[dtype], "max")
        assert_close(out.lse_b, lse64(truth), TOL[dtype], "logsumexp")
        assert_argmax_exact(out.argmax_b, truth, ARGMAX_GAP)
        ref = fused_decode_reference(h_bd, w_vd, seeds, inv_temperature=0.8)
        np.testing.assert_array_equal(out.sample_b, ref.sample_b)
        assert np.all((np.asarray(out.sample_b) >= 0) & (np.asarray(out.sample_b) < vocab))

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    def test_argmax_ties_take_lowest_id(self, dtype):
        batch, vocab, d_model = 3, 1000, 100
        h_bd, w_vd = random_hw(7, batch, vocab, d_model, dtype)
        # Tied rows in different tiles (block_v 128) and inside one tile, none at tile starts.
        tie_ids = [999, 517, 300, 301]
        w_vd = tied_w(w_vd, h_bd, tie_ids)
        out = self.decode(h_bd, w_vd)
        assert int(out.argmax_b[0]) == 300
        ref = fused_decode_reference(h_bd, w_vd)
        assert int(ref.argmax_b[0]) == 300
        np.testing.assert_array_equal(out.argmax_b, ref.argmax_b)

    def test_sample_independent_of_blocks(self):
        batch, vocab, d_model = 5, 1000, 100
        h_bd, w_vd = random_hw(3, batch, vocab, d_model, jnp.float32)
        seeds = noise.seeds_from_key(jax.random.key(11))
        ref = fused_decode_reference(h_bd, w_vd, seeds, inv_temperature=1.3)
        tilings = [
            DecodeBlocks(block_v=128, block_b=4, block_d=32),
            DecodeBlocks(block_v=256, block_b=8, block_d=64),
            DecodeBlocks(block_v=1024, block_b=16, block_d=128),
        ]
        for blocks in tilings:
            out = self.decode(h_bd, w_vd, seeds, blocks=blocks, inv_temperature=1.3)
            np.testing.assert_array_equal(out.sample_b, ref.sample_b, err_msg=str(blocks))
            np.testing.assert_array_equal(out.argmax_b, ref.argmax_b, err_msg=str(blocks))
        other = self.decode(
            h_bd, w_vd, noise.seeds_from_key(jax.random.key(12)), inv_temperature=1.3
        )
        assert not np.array_equal(other.sample_b, ref.sample_b)  # the seeds matter

    def test_sample_distribution_is_tempered_softmax(self):
        """Chi-square over 8,192 rows sharing one h: counts follow softmax(logits * inv_t)."""
        from jax.scipy.special import gammaincc

        vocab, d_model, n, inv_t = 13, 16, 8192, 0.5
        h1, w_vd = random_hw(5, 1, vocab, d_model, jnp.float32, scale=1.5)
        h_bd = jnp.tile(h1, (n, 1))
        seeds = noise.seeds_from_key(jax.random.key(6))
        blocks = DecodeBlocks(block_v=8, block_b=1024, block_d=16)  # V = 13: a ragged tile
        out = self.decode(h_bd, w_vd, seeds, blocks=blocks, inv_temperature=inv_t)
        counts = np.bincount(np.asarray(out.sample_b), minlength=vocab)
        assert counts.shape == (vocab,)
        logits = logits64(h1, w_vd)[0]

        def p_value(temp_inv):
            p = np.exp(logits * temp_inv - (logits * temp_inv).max())
            expected = n * p / p.sum()
            chi2 = ((counts - expected) ** 2 / expected).sum()
            return float(gammaincc((vocab - 1) / 2, chi2 / 2))

        assert p_value(inv_t) > 1e-3
        assert p_value(1.0) < 1e-3  # the test can tell a wrong temperature apart

    def test_poisoned_partials_all_written(self):
        batch, vocab, d_model = 5, 1000, 100
        h_bd, w_vd = random_hw(8, batch, vocab, d_model, jnp.float32)
        seeds = noise.seeds_from_key(jax.random.key(9))
        blocks = DecodeBlocks(block_v=128, block_b=4, block_d=64)
        parts = _decode_partials(
            h_bd, w_vd, seeds, 1.0, blocks=blocks, interpret=self.INTERPRET, poison=True
        )
        for name in ("max", "lse", "score"):
            assert np.isfinite(np.asarray(parts[name])).all(), name
        for name in ("argmax", "sample"):
            ids = np.asarray(parts[name])
            assert ((ids >= 0) & (ids < vocab)).all(), name
        # Tile j's ids lie in tile j.
        tile_of = np.asarray(parts["argmax"]) // blocks.block_v
        np.testing.assert_array_equal(
            tile_of, np.broadcast_to(np.arange(len(tile_of))[:, None], tile_of.shape)
        )

    def test_without_seeds_sample_is_minus_one(self):
        h_bd, w_vd = random_hw(1, 3, 300, 40, jnp.float32)
        out = self.decode(h_bd, w_vd)
        np.testing.assert_array_equal(out.sample_b, -1)

    def test_traced_inv_temperature(self):
        h_bd, w_vd = random_hw(2, 3, 300, 40, jnp.float32)
        seeds = noise.seeds_from_key(jax.random.key(4))
        blocks = self.blocks(3, 300, 40, jnp.float32)
        run = jax.jit(
            lambda t: (
                fused_decode(
                    h_bd, w_vd, seeds, inv_temperature=t, blocks=blocks, interpret=self.INTERPRET
                ).sample_b
            )
        )
        for t in (0.5, 2.0):
            ref = fused_decode_reference(h_bd, w_vd, seeds, inv_temperature=t)
            np.testing.assert_array_equal(run(jnp.float32(t)), ref.sample_b)

    def test_bad_arguments(self):
        h_bd, w_vd = random_hw(0, 2, 64, 32, jnp.float32)
        with pytest.raises(ValueError, match="d_model"):
            self.decode(h_bd, w_vd[:, :16])
        with pytest.raises(ValueError, match="dtype"):
            self.decode(h_bd, w_vd.astype(jnp.bfloat16))
        with pytest.raises(ValueError, match="block_v=100"):
            DecodeBlocks(block_v=100)
        with pytest.raises(ValueError, match="seeds"):
            self.decode(h_bd, w_vd, jnp.zeros((3,), jnp.uint32))


def test_blocks_default_and_candidates():
    b = DecodeBlocks.default(1, 50257, 768, jnp.bfloat16)
    assert b.block_b == 16 and b.block_v == 128
    assert DecodeBlocks.default(40, 50257, 768, jnp.bfloat16).block_b == 64
    cands = DecodeBlocks.candidates(3, 50257, 768, jnp.bfloat16)
    assert cands[0] == DecodeBlocks.default(3, 50257, 768, jnp.bfloat16)
    assert len(set(cands)) == len(cands) and all(isinstance(c, DecodeBlocks) for c in cands)


@pytest.mark.gpu
class TestFusedDecodeGpu(FusedDecodeTestBase):
    INTERPRET = False


class TestFusedDecodeInterpret(FusedDecodeTestBase):
    INTERPRET = True
