"""Both decode kernels (fused, tiled) against float64 ground truth and the jnp reference.

One test base runs either kernel: a concrete class names the kernel, its partials function, its
blocks and its shapes; each kernel has a ``gpu`` class and an interpret-mode class.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_testing import (
    D_GPT2,
    assert_argmax_exact,
    assert_close,
    logits64,
    lse64,
    random_hw,
    tied_w,
)

from pallas_kernels import noise
from pallas_kernels._common import DecodeStats
from pallas_kernels.fused_decode import (
    DecodeBlocks,
    _decode_partials,
    fused_decode,
    fused_decode_reference,
)
from pallas_kernels.tiled_decode import TiledBlocks, _tiled_partials, tiled_decode

# Max and logsumexp against float64 logits of the same (rounded) inputs: float32 accumulation
# over up to d_model = 768 terms. bf16 has more room for tensor-core accumulation order on GPU.
TOL = {jnp.float32: (1e-5, 1e-5), jnp.bfloat16: (1e-4, 1e-4)}
ARGMAX_GAP = 1e-3  # top-2 gaps below this may flip in float32; such rows are checked by value

F32, BF16 = jnp.float32, jnp.bfloat16


def pytest_generate_tests(metafunc):
    """Each concrete class lists its own (shape, dtype) cases."""
    if "case" in metafunc.fixturenames:
        cases = metafunc.cls.CASES
        ids = [f"{b}x{v}x{d}-{jnp.dtype(t).name}" for (b, v, d), t in cases]
        metafunc.parametrize("case", cases, ids=ids)


class DecodeKernelTestBase:
    INTERPRET = False
    CASES: list = []  # ((B, V, D), dtype) for test_matches_float64

    def kernel(self, *args, **kw):
        raise NotImplementedError

    def partials(self, *args, **kw):
        raise NotImplementedError

    def blocks(self, batch, vocab, d_model, dtype):
        raise NotImplementedError

    def tilings(self) -> list:
        """Three different tilings of the (5, 1000, 100) shape (every dot dim >= 16 for GPU)."""
        raise NotImplementedError

    def rows_per_partial(self, blocks) -> int:
        """How many token ids one partial (one row of the partial outputs) covers."""
        raise NotImplementedError

    def decode(self, h_bd, w_vd, seeds=None, blocks=None, **kw):
        if blocks is None:
            blocks = self.blocks(h_bd.shape[0], w_vd.shape[0], w_vd.shape[1], h_bd.dtype)
        return self.kernel(h_bd, w_vd, seeds, blocks=blocks, interpret=self.INTERPRET, **kw)

    @pytest.mark.slow
    def test_matches_float64(self, case):
        (batch, vocab, d_model), dtype = case
        shape = (batch, vocab, d_model)
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

    @pytest.mark.slow
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

    @pytest.mark.slow
    def test_sample_independent_of_blocks(self):
        batch, vocab, d_model = 5, 1000, 100
        h_bd, w_vd = random_hw(3, batch, vocab, d_model, jnp.float32)
        seeds = noise.seeds_from_key(jax.random.key(11))
        ref = fused_decode_reference(h_bd, w_vd, seeds, inv_temperature=1.3)
        for blocks in self.tilings():
            out = self.decode(h_bd, w_vd, seeds, blocks=blocks, inv_temperature=1.3)
            np.testing.assert_array_equal(out.sample_b, ref.sample_b, err_msg=str(blocks))
            np.testing.assert_array_equal(out.argmax_b, ref.argmax_b, err_msg=str(blocks))
        other = self.decode(
            h_bd, w_vd, noise.seeds_from_key(jax.random.key(12)), inv_temperature=1.3
        )
        assert not np.array_equal(other.sample_b, ref.sample_b)  # the seeds matter

    def test_non_finite_logits_rank_as_jnp_argmax(self):
        """Token 700 (a later tile in every tiling) gets an infinity in column 3: rows with
        h[:, 3] = 0 see inf * 0 = NaN (max NaN, argmax its id, lse NaN), rows with h[:, 3] > 0
        see +inf (argmax its id, lse +inf), the rest -inf (never picked). NaN ranks first as in
        jnp.argmax, for the greedy and the sampled pick, whatever the merge of the tiles."""
        h_bd, w_vd = random_hw(4, 5, 1000, 100, jnp.float32)
        h_bd = h_bd.at[:, 3].set(jnp.asarray([0.0, 1.0, -1.0, 0.0, 1.0]))
        # Token 900: -inf for every row but row 3, whose second NaN it is.
        w_vd = w_vd.at[700, 3].set(jnp.inf).at[900, 7].set(jnp.inf)
        h_bd = h_bd.at[:, 7].set(jnp.asarray([-1.0, -1.0, -1.0, 0.0, -1.0]))
        seeds = noise.seeds_from_key(jax.random.key(2))
        finite = fused_decode_reference(h_bd, w_vd.at[700].set(0.0).at[900].set(0.0), seeds)
        for blocks in self.tilings():
            out = DecodeStats(*map(np.asarray, self.decode(h_bd, w_vd, seeds, blocks=blocks)))
            what = str(blocks)
            np.testing.assert_array_equal(out.argmax_b[[0, 1, 3, 4]], 700, err_msg=what)
            np.testing.assert_array_equal(out.sample_b[[0, 1, 3, 4]], 700, err_msg=what)
            assert np.isnan(out.max_b[[0, 3]]).all() and np.isnan(out.lse_b[[0, 3]]).all(), what
            assert (out.max_b[[1, 4]] == np.inf).all() and (out.lse_b[[1, 4]] == np.inf).all()
            assert out.argmax_b[2] == finite.argmax_b[2] and out.sample_b[2] != 700, what
            assert np.isfinite(out.lse_b[2]), what

    def test_sample_distribution_is_tempered_softmax(self):
        """Chi-square over 8,192 rows sharing one h: counts follow softmax(logits * inv_t)."""
        from jax.scipy.special import gammaincc

        vocab, d_model, n, inv_t = 13, 16, 8192, 0.5
        h1, w_vd = random_hw(5, 1, vocab, d_model, jnp.float32, scale=1.5)
        h_bd = jnp.tile(h1, (n, 1))
        seeds = noise.seeds_from_key(jax.random.key(6))
        # Wide batch tiles for speed; V = 13 leaves a ragged vocabulary tile.
        blocks = dataclasses.replace(
            self.tilings()[0],
            block_b=1024 if self.INTERPRET else 64,
            block_v=8 if self.INTERPRET else 16,
        )
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
        blocks = self.tilings()[0]
        parts = self.partials(
            h_bd, w_vd, seeds, 1.0, blocks=blocks, interpret=self.INTERPRET, poison=True
        )
        for name in ("max", "lse", "score"):
            assert np.isfinite(np.asarray(parts[name])).all(), name
        for name in ("argmax", "sample"):
            ids = np.asarray(parts[name])
            assert ((ids >= 0) & (ids < vocab)).all(), name
        # Partial j's ids lie in its own part of the vocabulary.
        tile_of = np.asarray(parts["argmax"]) // self.rows_per_partial(blocks)
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
            type(self.tilings()[0])(block_v=100)
        with pytest.raises(ValueError, match="seeds"):
            self.decode(h_bd, w_vd, jnp.zeros((3,), jnp.uint32))


def test_blocks_default_and_candidates():
    b = DecodeBlocks.default(1, 50257, 768, BF16)
    assert b.block_b == 16 and b.block_v == 128
    assert DecodeBlocks.default(40, 50257, 768, BF16).block_b == 64
    t = TiledBlocks.default(512, 50257, 768, BF16)
    assert (t.block_b, t.block_v, t.tiles_per_program) == (128, 128, 8)
    for cls in (DecodeBlocks, TiledBlocks):
        cands = cls.candidates(3, 50257, 768, BF16)
        assert cands[0] == cls.default(3, 50257, 768, BF16)
        assert len(set(cands)) == len(cands) and all(isinstance(c, cls) for c in cands)


class FusedDecodeTestBase(DecodeKernelTestBase):
    # The odd shape at B = 1 and 3, and a small shape where B straddles batch tiles.
    CASES = [
        (s, t)
        for s in [(1, 50257, D_GPT2), (3, 50257, D_GPT2), (37, 1000, 100)]
        for t in (F32, BF16)
    ]

    def kernel(self, *args, **kw):
        return fused_decode(*args, **kw)

    def partials(self, *args, **kw):
        return _decode_partials(*args, **kw)

    def blocks(self, batch, vocab, d_model, dtype):
        if self.INTERPRET:
            # Interpret mode pays per grid step: few, large tiles (still ragged in V and B).
            block_b = 16 if batch > 16 else 4
            block_v = 8192 if vocab > 8192 else 128
            return DecodeBlocks(block_v=block_v, block_b=block_b, block_d=64)
        return DecodeBlocks.default(batch, vocab, d_model, dtype)

    def tilings(self):
        return [
            DecodeBlocks(block_v=128, block_b=16, block_d=32),
            DecodeBlocks(block_v=256, block_b=16, block_d=64),
            DecodeBlocks(block_v=64, block_b=32, block_d=128),
        ]

    def rows_per_partial(self, blocks):
        return blocks.block_v


class TiledDecodeTestBase(DecodeKernelTestBase):
    # Large batch (B = 513 straddles batch tiles) at GPT-2's V = 50,257, plus B = 3 and small.
    CASES = [
        ((513, 50257, D_GPT2), F32),
        ((3, 50257, D_GPT2), BF16),
        ((37, 1000, 100), F32),
        ((37, 1000, 100), BF16),
    ]

    def kernel(self, *args, **kw):
        return tiled_decode(*args, **kw)

    def partials(self, *args, **kw):
        return _tiled_partials(*args, **kw)

    def blocks(self, batch, vocab, d_model, dtype):
        if self.INTERPRET:
            if vocab > 8192:
                block_b = 256 if batch > 16 else 4
                return TiledBlocks(block_b=block_b, block_v=4096, block_d=1024, tiles_per_program=2)
            return TiledBlocks(block_b=16, block_v=128, block_d=32, tiles_per_program=3)
        return TiledBlocks.default(batch, vocab, d_model, dtype)

    def tilings(self):
        return [
            TiledBlocks(block_b=16, block_v=128, block_d=32, tiles_per_program=3),
            TiledBlocks(block_b=16, block_v=64, block_d=64, tiles_per_program=5),
            TiledBlocks(block_b=32, block_v=256, block_d=128, tiles_per_program=1),
        ]

    def rows_per_partial(self, blocks):
        return blocks.block_v * blocks.tiles_per_program


@pytest.mark.gpu
class TestFusedDecodeGpu(FusedDecodeTestBase):
    INTERPRET = False


class TestFusedDecodeInterpret(FusedDecodeTestBase):
    INTERPRET = True


@pytest.mark.gpu
class TestTiledDecodeGpu(TiledDecodeTestBase):
    INTERPRET = False


class TestTiledDecodeInterpret(TiledDecodeTestBase):
    INTERPRET = True
