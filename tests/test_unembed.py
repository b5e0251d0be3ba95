"""vocabjax.unembed against float64 numpy ground truth, for every implementation.

Shapes: an odd V = 20,011 (a prime: a multiple of no block size, ragged in every tiling, two to
21 vocabulary tiles), B in 1, 3, 513, and D = 128. GPT-2's V = 50,257 and D = 768 would only
scale the work: every tile, ragged edge and padded row these tests reach depends on V, B and the
tiles, and 128 still spans two d tiles where a kernel tiles D. (The kernels' own tests run
V = 50,257.)
Inputs are fresh draws from an explicit seed; the reference is computed in float64 from the very
inputs the op sees (bf16 inputs are exact in f32 and f64). One tolerance table, by the dtype of
the compared output; it is never loosened to make a test pass.

``TestXla``/``TestChunked`` run the plain implementations; ``TestPallas`` runs the same tests
through ``impl="pallas"`` with ``INTERPRET = True`` on CPU (``False`` on a GPU run).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from pallas_kernels import noise
from vocabjax import unembed
from vocabjax.errors import UserError
from vocabjax.hardware import DeviceProfile, KernelTiming

V, D = 20_011, 128
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}

# dtype of the compared output -> (atol, rtol); atol is a fraction of the largest |reference|
# value of the array (``scale``), so it means the same for logits and for small gradients.
# f32 outputs accumulate D products in f32: rtol 5e-5 is about D * 2**-24, the worst-case bound of a
# length-D f32 sum, at GPT-2's D = 768, so it holds for every D up to that. bf16 outputs
# (gradients in the weights' dtype) carry bf16 arithmetic: one rounding of the result (2**-8
# relative) and, in kernels that feed the second matmul bf16 dlogits as tensor-core kernels do,
# errors of 2**-8 of the array's scale.
TOL = {
    np.dtype(np.float32): (1e-5, 5e-5),
    np.dtype(jnp.bfloat16): (2**-8, 2**-8),
}

ON_CPU = jax.default_backend() == "cpu"


def assert_close(got, ref, *, dtype, scale=1.0, what=""):
    atol, rtol = TOL[np.dtype(dtype)]
    np.testing.assert_allclose(
        np.asarray(got, np.float64), ref, atol=atol * scale, rtol=rtol, err_msg=what
    )


@functools.cache
def weights(dtype: str) -> tuple[jax.Array, np.ndarray]:
    """(w, w64): fresh normal weights (numpy seed 1) scaled so that logits have a std of 2."""
    w_np = np.random.default_rng(1).standard_normal((V, D), dtype=np.float32)
    w = jnp.asarray(w_np * np.float32(2 / np.sqrt(D))).astype(DTYPES[dtype])
    return w, f64(w)


@functools.cache
def data(dtype: str, batch: int):
    """(h, w, logits64): fresh normal h for this batch, the shared w, float64 logits."""
    h_np = np.random.default_rng(batch).standard_normal((batch, D), dtype=np.float32)
    h = jnp.asarray(h_np).astype(DTYPES[dtype])
    w, w64 = weights(dtype)
    return h, w, f64(h) @ w64.T


_DECODE_FNS: dict[str, object] = {}


def decode_fn(kw: dict):
    """One jitted function computing greedy, logsumexp and top-7 with the options ``kw``."""
    key = repr(sorted(kw.items()))
    if key not in _DECODE_FNS:

        @jax.jit
        def run(h, w):
            vals, ids = unembed.top_k(h, w, 7, **kw)
            return unembed.greedy(h, w, **kw), unembed.logsumexp(h, w, **kw), vals, ids

        _DECODE_FNS[key] = run
    return _DECODE_FNS[key]


def f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def lse64(logits: np.ndarray) -> np.ndarray:
    m = logits.max(axis=1, keepdims=True)
    return (m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True)))[:, 0]


CE_Z = 1e-3  # z-loss weight in the cross-entropy tests


@functools.cache
def ce_reference(dtype: str, n: int) -> dict:
    """Float64 per-token loss and gradients for the N tokens of ``data(dtype, n)``."""
    h, w, logits = data(dtype, n)
    n = logits.shape[0]
    rng = np.random.default_rng(5)
    labels = rng.integers(0, V, size=n).astype(np.int32)
    labels[rng.random(n) < 0.2] = -100
    labels[0] = V - 1  # the last token, in the ragged final tile
    valid = labels != -100
    lse = lse64(logits)
    target = np.where(valid, logits[np.arange(n), np.where(valid, labels, 0)], 0.0)
    per_token = np.where(valid, lse - target + CE_Z * lse**2, 0.0)
    ct = np.where(valid, rng.standard_normal(n), 0.0)
    dh, dw = ce_gradients(dtype, n, labels, ct)
    return {
        "labels": labels,
        "per_token": per_token,
        "count": valid.sum(),
        "ct": ct,
        "dh": dh,
        "dw": dw,
    }


def ce_gradients(dtype: str, n: int, labels: np.ndarray, ct: np.ndarray):
    """Float64 dh, dW of sum(ct * per-token loss) (z-loss CE_Z; ct is 0 at ignored tokens)."""
    h, _, logits = data(dtype, n)
    lse = lse64(logits)
    valid = labels != -100
    dlogits = np.exp(logits - lse[:, None])
    dlogits *= (ct * (1 + 2 * CE_Z * lse))[:, None]
    dlogits[np.arange(n)[valid], labels[valid]] -= ct[valid]
    return dlogits @ weights(dtype)[1], dlogits.T @ f64(h)


@functools.cache
def ce_sum_gradients(dtype: str, n: int):
    """Float64 dh, dW of the sum loss over ``ce_reference``'s labels (every class reuses them)."""
    labels = ce_reference(dtype, n)["labels"]
    return ce_gradients(dtype, n, labels, (labels != -100).astype(np.float64))


# N = 513 (ragged row tiles, 10-20 s a test on two cores) runs in the full suite, not in the
# fast subset (-m "not slow"); N = 37 covers the same code paths in one tile.
SLOW_513 = pytest.param("f32", 513, marks=pytest.mark.slow, id="f32-513")


class Base:
    IMPL = "xla"
    INTERPRET: bool | None = None
    # Tilings every test runs with: None is the implementation's default.
    BLOCKS: tuple = (None,)
    # Tilings of the mean / sum cross-entropy gradient test.
    GRAD_BLOCKS: tuple = (None,)

    def kw(self, blocks="class default"):
        """Options for every op call; ``blocks`` defaults to the class's first tiling."""
        if isinstance(blocks, str):
            blocks = self.BLOCKS[0]
        out = {"impl": self.IMPL, "blocks": blocks}
        if self.IMPL == "pallas":
            out["interpret"] = self.INTERPRET
        return out

    # --- decode ops --------------------------------------------------------------------------
    @pytest.mark.slow
    @pytest.mark.parametrize(
        ("dtype", "batch"), [("f32", 1), ("bf16", 1), ("f32", 3), ("bf16", 3), SLOW_513]
    )
    def test_greedy_logsumexp_top_k(self, dtype, batch):
        h, w, logits = data(dtype, batch)
        atol, rtol = TOL[np.dtype(np.float32)]
        ref_max = logits.max(axis=1)
        for blocks in self.BLOCKS if batch < 100 else self.BLOCKS[:1]:
            ids, lse, vals, top_ids = map(np.asarray, decode_fn(self.kw(blocks))(h, w))
            assert ids.dtype == np.int32 and ids.shape == (batch,)
            assert ((ids >= 0) & (ids < V)).all(), ids
            # The chosen token's exact logit is the maximum, up to the f32 accumulation error.
            chosen = logits[np.arange(batch), ids]
            np.testing.assert_array_less(ref_max - chosen, atol + rtol * np.abs(ref_max))
            assert_close(lse, lse64(logits), dtype=np.float32)
            ref_vals = -np.sort(-logits, axis=1)[:, :7]
            assert_close(vals, ref_vals, dtype=np.float32, what="top-k values")
            assert_close(
                logits[np.arange(batch)[:, None], top_ids], vals, dtype=np.float32, what="ids"
            )
            assert (np.diff(vals, axis=1) <= 0).all()
            assert all(len(set(r)) == 7 for r in top_ids.tolist())

    @pytest.mark.slow
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_exact_ties_resolve_to_lowest_id(self, dtype):
        """Integer inputs make every logit exact, with many ties; ids must match exactly."""
        rng = np.random.default_rng(7)
        w_np = rng.integers(-1, 2, size=(V, D)).astype(np.float32)
        w_np[V - 3 :] = w_np[5]  # the largest-id rows copy an early one
        h_np = rng.integers(-1, 2, size=(3, D)).astype(np.float32)
        h_np[1] = 0.0  # every logit ties: the answer is token 0
        h, w = jnp.asarray(h_np, DTYPES[dtype]), jnp.asarray(w_np, DTYPES[dtype])
        logits = h_np.astype(np.float64) @ w_np.astype(np.float64).T
        order = np.argsort(-logits, axis=1, kind="stable")
        for blocks in self.BLOCKS:
            kw = self.kw(blocks)
            greedy = jax.jit(functools.partial(unembed.greedy, **kw))
            np.testing.assert_array_equal(greedy(h, w), order[:, 0])
            vals, ids = jax.jit(functools.partial(unembed.top_k, k=5, **kw))(h, w)
            np.testing.assert_array_equal(ids, order[:, :5])
            np.testing.assert_array_equal(vals, np.take_along_axis(logits, order[:, :5], 1))

    @pytest.mark.slow
    def test_sample_is_the_same_for_every_impl_and_tiling(self):
        h, w, logits = data("f32", 3)
        key = jax.random.key(42)
        for temperature, k in ((1.0, None), (0.7, None), (1.3, 40)):
            seeds = noise.seeds_from_key(key)
            rows = jnp.arange(3)[:, None]
            if k is None:
                toks = jnp.arange(V)[None, :]
                scores = logits / temperature + f64(noise.gumbel(seeds, rows, toks))
                want = scores.argmax(axis=1)
            else:
                top = np.argsort(-logits, axis=1, kind="stable")[:, :k]
                g = f64(noise.gumbel(seeds, rows, jnp.asarray(top)))
                scores = np.take_along_axis(logits, top, 1) / temperature + g
                want = np.take_along_axis(top, scores.argmax(axis=1)[:, None], 1)[:, 0]
            for blocks in self.BLOCKS:
                kw = self.kw(blocks)
                draw = jax.jit(
                    lambda h, w, kw=kw, t=temperature, k=k: unembed.sample(h, w, key, t, k, **kw)
                )
                got = draw(h, w)
                np.testing.assert_array_equal(got, want, err_msg=f"{temperature=} {k=} {blocks=}")

    @pytest.mark.slow
    @pytest.mark.parametrize(("temperature", "k"), [(1.0, None), (0.6, None), (1.0, 6)])
    def test_sample_distribution_matches_softmax(self, temperature, k):
        """Chi-square of 20,000 draws (one row each, same h) against softmax(logits / T)."""
        vocab, d, draws = 37, 16, 20_000
        kh, kw_ = jax.random.split(jax.random.key(3))
        h1 = jax.random.normal(kh, (1, d), jnp.float32)
        w = jax.random.normal(kw_, (vocab, d), jnp.float32) * 0.4
        h = jnp.broadcast_to(h1, (draws, d))
        logits = (f64(h1) @ f64(w).T)[0] / temperature
        if k is not None:
            logits = np.where(logits >= np.sort(logits)[-k], logits, -np.inf)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        kw = self.kw()
        if self.IMPL == "chunked":
            kw["blocks"] = {"block_v": 8}  # several tiles even at V = 37
        if self.INTERPRET:  # interpreting pays per grid step: 10 row tiles, not 313
            kw["blocks"] = {**kw["blocks"], "block_b": 2048}
        draw = jax.jit(lambda h, w: unembed.sample(h, w, jax.random.key(11), temperature, k, **kw))
        got = np.asarray(draw(h, w))
        counts = np.bincount(got, minlength=vocab)
        assert counts[p == 0].sum() == 0, "a token outside the top-k was drawn"
        keep = p * draws >= 5
        observed = np.append(counts[keep], counts[~keep].sum())
        expected = np.append(p[keep] * draws, p[~keep].sum() * draws)
        if expected[-1] == 0:
            observed, expected = observed[:-1], expected[:-1]
        chi2, pvalue = stats.chisquare(observed, expected)
        assert pvalue > 1e-3, (chi2, pvalue)

    # --- linear cross-entropy ----------------------------------------------------------------
    @pytest.mark.slow
    @pytest.mark.parametrize(("dtype", "n"), [SLOW_513, ("bf16", 37)])
    def test_linear_cross_entropy_and_gradients(self, dtype, n):
        """N tokens, 20% ignored, z-loss on: every reduction's loss, and the gradients for h and
        W of sum(c * per-token loss) with random cotangents c (mean and sum are the special
        cases c = 1/count and c = 1)."""
        if self.IMPL == "xla" and n > 100:
            pytest.skip(
                "the materialized baseline is checked at N = 37; N = 513 is for the tiled paths"
            )
        h, w, _ = data(dtype, n)
        ref = ce_reference(dtype, n)
        labels = jnp.asarray(ref["labels"])
        ct = jnp.asarray(ref["ct"], jnp.float32)
        for blocks in self.BLOCKS[:2]:
            kw = self.kw(blocks)

            @jax.jit
            def losses(h, w, kw=kw):
                ce = functools.partial(
                    unembed.linear_cross_entropy, h, w, labels, z_loss=CE_Z, **kw
                )
                return ce(reduction="mean"), ce(reduction="sum"), ce(reduction="none")

            mean, total, per_token = losses(h, w)
            assert_close(per_token, ref["per_token"], dtype=np.float32, what="none")
            assert_close(total, ref["per_token"].sum(), dtype=np.float32, what="sum")
            assert_close(mean, ref["per_token"].sum() / ref["count"], dtype=np.float32)

            def weighted(h, w, kw=kw):
                per = unembed.linear_cross_entropy(
                    h, w, labels, z_loss=CE_Z, reduction="none", **kw
                )
                return jnp.sum(per * ct)

            dh, dw = jax.jit(jax.grad(weighted, argnums=(0, 1)))(h, w)
            assert dh.dtype == h.dtype and dw.dtype == w.dtype
            assert_close(dh, ref["dh"], dtype=dh.dtype, scale=np.abs(ref["dh"]).max(), what="dh")
            assert_close(dw, ref["dw"], dtype=dw.dtype, scale=np.abs(ref["dw"]).max(), what="dw")

    @pytest.mark.slow
    @pytest.mark.parametrize(("dtype", "n"), [SLOW_513, ("bf16", 37)])
    def test_mean_and_sum_loss_and_gradients(self, dtype, n):
        """value_and_grad of the mean and sum losses (for chunked and pallas the path whose
        forward computes dh and dW as it goes), z-loss on, 20% ignored, on every gradient
        tiling of the class, against float64."""
        if self.IMPL == "xla" and n > 100:
            pytest.skip("the materialized baseline is checked at N = 37")
        h, w, _ = data(dtype, n)
        ref = ce_reference(dtype, n)
        labels = jnp.asarray(ref["labels"])
        valid = (ref["labels"] != -100).astype(np.float64)
        reductions = {"mean": valid / ref["count"], "sum": valid}
        sum_dh, sum_dw = ce_sum_gradients(dtype, n)
        for blocks in self.GRAD_BLOCKS:
            kw = self.kw(blocks)

            @jax.jit
            def both(h, w, kw=kw):
                return {
                    reduction: jax.value_and_grad(
                        lambda h, w, r=reduction: unembed.linear_cross_entropy(
                            h, w, labels, z_loss=CE_Z, reduction=r, **kw
                        ),
                        (0, 1),
                    )(h, w)
                    for reduction in reductions
                }

            for reduction, (value, (dh, dw)) in both(h, w).items():
                ct = reductions[reduction]
                scale = ct.max()  # the mean's gradient is the sum's over the count
                ref_dh, ref_dw = sum_dh * scale, sum_dw * scale
                what = f"{reduction} {blocks}"
                assert_close(value, np.sum(ct * ref["per_token"]), dtype=np.float32, what=what)
                assert dh.dtype == h.dtype and dw.dtype == w.dtype
                assert_close(dh, ref_dh, dtype=dh.dtype, scale=np.abs(ref_dh).max(), what=what)
                assert_close(dw, ref_dw, dtype=dw.dtype, scale=np.abs(ref_dw).max(), what=what)

    def test_cross_entropy_mean_gradient(self):
        h, w, logits = data("f32", 3)
        w64 = weights("f32")[1]
        labels = jnp.asarray([V - 1, -100, 17])
        p = np.exp(logits - lse64(logits)[:, None])
        dlogits = p * np.array([[0.5], [0.0], [0.5]])
        dlogits[0, V - 1] -= 0.5
        dlogits[2, 17] -= 0.5
        kw = self.kw()
        loss = lambda h, w: unembed.linear_cross_entropy(h, w, labels, **kw)  # noqa: E731
        dh, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(h, w)
        ref_dh, ref_dw = dlogits @ w64, dlogits.T @ f64(h)
        assert_close(dh, ref_dh, dtype=np.float32, scale=np.abs(ref_dh).max())
        assert_close(dw, ref_dw, dtype=np.float32, scale=np.abs(ref_dw).max())

    @pytest.mark.slow
    def test_cross_entropy_takes_leading_axes_and_all_ignored(self):
        h, w, logits = data("f32", 3)
        kw = self.kw()
        labels = jnp.asarray([[5, -100, 7]])
        ce = jax.jit(
            lambda h, w: unembed.linear_cross_entropy(h, w, labels, reduction="none", **kw)
        )
        got = ce(h[None], w)
        assert got.shape == (1, 3) and float(got[0, 1]) == 0.0
        ref = lse64(logits)[[0, 2]] - logits[[0, 2], [5, 7]]
        assert_close(np.asarray(got)[0, [0, 2]], ref, dtype=np.float32)
        none = jnp.full((3,), -100)
        loss, (dh, dw) = jax.jit(
            jax.value_and_grad(
                lambda h, w: unembed.linear_cross_entropy(h, w, none, **kw), argnums=(0, 1)
            )
        )(h, w)
        assert float(loss) == 0.0 and not np.asarray(dh).any() and not np.asarray(dw).any()

    # --- transformations and bad input -------------------------------------------------------
    @pytest.mark.slow
    def test_vmap_over_extra_axes(self):
        h, w, _ = data("f32", 3)
        hh = jnp.stack([h, h[::-1]])
        kw = self.kw()
        both = jax.jit(
            jax.vmap(
                lambda x, w: (unembed.greedy(x, w, **kw), unembed.logsumexp(x, w, **kw)),
                in_axes=(0, None),
            )
        )
        ids, lse = both(hh, w)
        one = decode_fn(kw)
        for i, x in enumerate((h, h[::-1])):
            want_ids, want_lse, _, _ = one(x, w)
            np.testing.assert_array_equal(ids[i], want_ids)
            assert_close(lse[i], np.asarray(want_lse, np.float64), dtype=np.float32)

    def test_nan_rows_give_id_minus_one(self):
        h, w, _ = data("f32", 3)
        h = h.at[1, 10].set(jnp.nan)
        kw = self.kw()

        @jax.jit
        def everything(h, w):
            return (
                unembed.greedy(h, w, **kw),
                unembed.logsumexp(h, w, **kw),
                *unembed.top_k(h, w, 3, **kw),
                unembed.sample(h, w, jax.random.key(0), **kw),
                unembed.linear_cross_entropy(h, w, jnp.asarray([1, 2, 3]), reduction="none", **kw),
            )

        ids, lse, vals, top, drawn, loss = map(np.asarray, everything(h, w))
        assert ids[1] == -1 and ids[0] >= 0 and ids[2] >= 0
        assert np.isnan(lse[1]) and np.isfinite(lse[[0, 2]]).all()
        assert (top[1] == -1).all() and np.isnan(vals[1]).all() and (top[[0, 2]] >= 0).all()
        assert drawn[1] == -1 and (drawn[[0, 2]] >= 0).all()
        assert np.isnan(loss[1]) and np.isfinite(loss[[0, 2]]).all()

    def test_non_finite_weights(self):
        """A finite h with an infinity in w: logits of inf * 0 = NaN (their rows get -1 and NaN,
        the same in every implementation and tiling), of +inf (the token wins, logsumexp is
        +inf) and of -inf (the token never wins). 16 rows: XLA's CPU max reduction drops NaN
        from eight rows on. The poisoned token sits past the first tiles, V = 4096 takes the
        CPU's blocked argmax and the NaNs are x86's default NaN, whose sign bit is set."""
        h, w, _ = data("f32", 16)
        sign = np.tile([0.0, 1.0, -1.0], 6)[:16]  # NaN, +inf, -inf logits by row
        h = h.at[:, 5].set(jnp.asarray(sign, h.dtype))
        w = w[:4096].at[3000, 5].set(jnp.inf)
        logits = f64(h) @ f64(w).T
        nan, pos, neg = sign == 0, sign > 0, sign < 0
        assert np.isnan(logits[nan, 3000]).all() and (logits[pos, 3000] == np.inf).all()
        want = np.argmax(np.where(np.isnan(logits), -np.inf, logits), axis=1)
        finite = np.where(np.isfinite(logits), logits, -np.inf)
        want_lse = np.log(np.exp(finite - finite.max(1, keepdims=True)).sum(1)) + finite.max(1)
        for blocks in self.BLOCKS:
            kw = self.kw(blocks)

            @jax.jit
            def everything(h, w, kw=kw):
                return (
                    unembed.greedy(h, w, **kw),
                    unembed.logsumexp(h, w, **kw),
                    *unembed.top_k(h, w, 3, **kw),
                    unembed.sample(h, w, jax.random.key(0), **kw),
                    unembed.sample(h, w, jax.random.key(0), top_k=5, **kw),
                )

            ids, lse, vals, top, drawn, drawn_k = map(np.asarray, everything(h, w))
            what = f"{self.IMPL} {blocks}"
            np.testing.assert_array_equal(ids[nan], -1, err_msg=what)
            np.testing.assert_array_equal(ids[~nan], want[~nan], err_msg=what)
            assert (ids[pos] == 3000).all() and np.isnan(lse[nan]).all(), what
            assert (lse[pos] == np.inf).all(), what
            assert_close(lse[neg], want_lse[neg], dtype=np.float32, scale=20.0, what=what)
            assert (top[nan] == -1).all() and np.isnan(vals[nan]).all(), what
            assert (top[pos, 0] == 3000).all() and (vals[pos, 0] == np.inf).all(), what
            np.testing.assert_array_equal(top[neg, 0], want[neg], err_msg=what)
            for picked in (drawn, drawn_k):
                assert (picked[nan] == -1).all() and (picked[pos] == 3000).all(), what
                assert ((picked[neg] >= 0) & (picked[neg] != 3000)).all(), what


class TestXla(Base):
    IMPL = "xla"


class TestChunked(Base):
    IMPL = "chunked"
    # The default tile, a power of two that leaves a ragged last tile (with h padded to four
    # rows), one that divides nothing, and one larger than V (a single tile, no loop).
    BLOCKS = (
        None,
        {"block_v": 4096, "min_rows": 4},
        unembed.ChunkBlocks(1000),
        unembed.ChunkBlocks(65536),
    )
    # The default row tile (64 rows at D = 128 in f32: ragged at N = 513; 32 rows in bf16: ragged
    # at N = 37) and a ragged one given alone in a dict.
    GRAD_BLOCKS = (None, {"block_n": 100})

    @pytest.mark.slow
    def test_cross_entropy_rows_padded_to_min_rows(self, n=1):
        """Rows padded up to ``min_rows`` carry ignore_index: every reduction's loss and the
        gradients are those of the given row alone."""
        h, w, _ = data("bf16", n)
        ref = ce_reference("bf16", n)
        labels = jnp.asarray(ref["labels"])
        blocks = {"block_v": 4096, "min_rows": 4}

        def loss(h, w, reduction):
            return unembed.linear_cross_entropy(
                h, w, labels, z_loss=CE_Z, reduction=reduction, impl="chunked", blocks=blocks
            )

        per = jax.jit(loss, static_argnums=2)(h, w, "none")
        assert per.shape == (n,)
        assert_close(per, ref["per_token"], dtype=np.float32, what="none")
        valid = (ref["labels"] != -100).astype(np.float64)
        ref_dh, ref_dw = ce_gradients("bf16", n, ref["labels"], valid)
        for reduction, scale in (("sum", 1.0), ("mean", 1.0 / ref["count"])):
            value, (dh, dw) = jax.jit(
                jax.value_and_grad(lambda h, w, r=reduction: loss(h, w, r), (0, 1))
            )(h, w)
            assert_close(value, ref["per_token"].sum() * scale, dtype=np.float32, what=reduction)
            assert dh.shape == h.shape and dw.shape == w.shape
            want_dh, want_dw = ref_dh * scale, ref_dw * scale
            assert_close(dh, want_dh, dtype=dh.dtype, scale=np.abs(want_dh).max(), what="dh")
            assert_close(dw, want_dw, dtype=dw.dtype, scale=np.abs(want_dw).max(), what="dw")


class TestPallas(Base):
    IMPL = "pallas"
    INTERPRET = ON_CPU
    # Interpreting costs per grid step, so CPU runs wide vocabulary tiles (still ragged at
    # V = 20,011) and two d tiles; a GPU run uses each kernel's default tiles.
    BLOCKS = ({"block_v": 4096, "block_d": 64, "block_b": 64},) if ON_CPU else (None,)
    GRAD_BLOCKS = BLOCKS

    @pytest.fixture(autouse=True)
    def _interpreted_513_rows_are_the_kernel_tests(self, request):
        """Interpreted, N = 513 costs 7-10 s a test; the kernels' own tests interpret it
        (test_pallas_decode, test_pallas_linear_ce: several row tiles, the last ragged), and
        N = 3 and 37 take these ops' Pallas dispatch. A GPU run keeps 513 here."""
        callspec = getattr(request.node, "callspec", None)
        if self.INTERPRET and callspec and 513 in callspec.params.values():
            pytest.skip("interpreted at N = 513 by the kernels' own tests")


# --- checks that do not depend on the implementation -------------------------------------------


def test_bad_input_is_a_clear_error():
    h, w, _ = data("f32", 3)
    with pytest.raises(UserError, match=rf"h has d_model={D - 1} but w has d_model={D}"):
        unembed.greedy(h[:, :-1], w)
    with pytest.raises(UserError, match=rf"k={V + 1} must be between 1 and V={V}"):
        unembed.top_k(h, w, V + 1)
    with pytest.raises(UserError, match=rf"k=0 must be between 1 and V={V}"):
        unembed.top_k(h, w, 0)
    for t in (0.0, -1.0, float("nan")):
        with pytest.raises(UserError, match=r"temperature=.* must be finite and > 0"):
            unembed.sample(h, w, jax.random.key(0), t)
    with pytest.raises(UserError, match=rf"label {V} is outside \[0, V={V}\)"):
        unembed.linear_cross_entropy(h, w, jnp.asarray([1, V, 2]))
    with pytest.raises(UserError, match=r"label -5 is outside"):
        unembed.linear_cross_entropy(h, w, jnp.asarray([1, -5, 2]), impl="chunked")
    with pytest.raises(UserError, match=r"unknown impl 'cuda'"):
        unembed.greedy(h, w, impl="cuda")
    with pytest.raises(UserError, match=r"unknown reduction 'avg'"):
        unembed.linear_cross_entropy(h, w, jnp.asarray([1, 2, 3]), reduction="avg")
    with pytest.raises(UserError, match=r"labels must match h"):
        unembed.linear_cross_entropy(h, w, jnp.asarray([1, 2]))
    with pytest.raises(UserError, match=r"must be bf16 or f32"):
        unembed.greedy(h, w.astype(jnp.float16))


@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_traced_bad_values_are_flagged_not_wrong(impl):
    """Under jit a label out of range makes its loss NaN; a temperature <= 0 gives -1."""
    h, w, _ = data("f32", 3)
    ce = jax.jit(
        lambda h, w, lab: unembed.linear_cross_entropy(h, w, lab, reduction="none", impl=impl)
    )
    loss = np.asarray(ce(h, w, jnp.asarray([1, V + 3, 2])))
    assert np.isnan(loss[1]) and np.isfinite(loss[[0, 2]]).all()
    mean = jax.jit(lambda h, w, lab: unembed.linear_cross_entropy(h, w, lab, impl=impl))
    assert np.isnan(float(mean(h, w, jnp.asarray([1, -7, 2]))))
    ids = jax.jit(lambda h, w, t: unembed.sample(h, w, jax.random.key(0), t, impl=impl))
    assert (np.asarray(ids(h, w, jnp.float32(0.0))) == -1).all()
    assert (np.asarray(ids(h, w, jnp.float32(-2.0))) == -1).all()
    assert (np.asarray(ids(h, w, jnp.float32(1.0))) >= 0).all()


MEM_N, MEM_V, MEM_D = 8192, 65536, 512


@functools.cache
def temp_bytes(op: str, impl: str) -> int:
    """Temporary bytes of the compiled op (greedy, or CE value and gradient), never run."""
    h = jax.ShapeDtypeStruct((MEM_N, MEM_D), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((MEM_V, MEM_D), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((MEM_N,), jnp.int32)
    if op == "greedy":
        fn, args = (lambda h, w: unembed.greedy(h, w, impl=impl)), (h, w)
    else:
        loss = lambda h, w, lab: unembed.linear_cross_entropy(h, w, lab, impl=impl)  # noqa: E731
        fn, args = jax.value_and_grad(loss, (0, 1)), (h, w, labels)
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
@pytest.mark.parametrize(
    ("op", "impl"),
    [
        ("greedy", "chunked"),
        ("linear_cross_entropy", "chunked"),
        ("greedy", "pallas"),
        ("linear_cross_entropy", "pallas"),
    ],
)
def test_temporary_memory_of_fused_paths_is_a_tenth_of_xla(op, impl):
    """Compiled, never run: B x T = 8,192, V = 65,536, d = 512, bf16."""
    baseline = temp_bytes(op, "xla")
    assert baseline >= MEM_N * MEM_V * 4  # the baseline holds the f32 logits
    assert temp_bytes(op, impl) <= baseline / 10, (op, impl, temp_bytes(op, impl), baseline)


def _profile(best):
    return DeviceProfile(
        name="test-gpu",
        peak_flops={"bf16": 100e12, "f32": 20e12},
        hbm_bandwidth=1e12,
        memory_bytes=1e10,
        launch_overhead_s=1e-6,
        source="test",
        best=tuple(best),
        measured=True,
    )


def _row(vocab, batch, impl, blocks=None, op="greedy"):
    return KernelTiming(op, vocab, batch, 768, "bf16", impl, blocks or {}, 1e-3, 0.5)


def test_selector_reads_the_nearest_best_row_then_the_roofline():
    prof = _profile(
        [
            _row(32768, 1, "chunked", {"block_v": 8192}),
            _row(32768, 256, "xla"),
            _row(131072, 1, "pallas", {"block_v": 512}),
        ]
    )
    pick = unembed.select(
        "greedy", vocab=30000, batch=2, d_model=768, dtype="bf16", profile=prof, backend="gpu"
    )
    assert pick.impl == "chunked" and pick.blocks == {"block_v": 8192}, pick
    assert "nearest V=32768, B=1" in pick.reason
    assert (
        unembed.select(
            "greedy", vocab=32768, batch=200, d_model=768, dtype="bf16", profile=prof, backend="gpu"
        ).impl
        == "xla"
    )
    big = unembed.select(
        "greedy", vocab=150000, batch=1, d_model=768, dtype="bf16", profile=prof, backend="gpu"
    )
    assert big.impl == "pallas" and big.blocks == {"block_v": 512}
    # On CPU, Pallas only interprets: its rows are skipped.
    assert (
        unembed.select(
            "greedy", vocab=150000, batch=1, d_model=768, dtype="bf16", profile=prof, backend="cpu"
        ).impl
        != "pallas"
    )
    # No rows for this op: the roofline rule against the profile's ridge point (100 FLOP/byte).
    low = unembed.select(
        "top_k", vocab=65536, batch=8, d_model=768, dtype="bf16", profile=prof, backend="gpu"
    )
    high = unembed.select(
        "top_k", vocab=65536, batch=512, d_model=768, dtype="bf16", profile=prof, backend="gpu"
    )
    assert (low.impl, high.impl) == ("pallas", "xla") and "ridge 100.0" in low.reason
    ce = unembed.select(
        "linear_cross_entropy",
        vocab=65536,
        batch=8192,
        d_model=768,
        dtype="bf16",
        profile=prof,
        backend="cpu",
    )
    assert ce.impl == "chunked"


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_without_a_measured_row_a_cpu_runs_xla_but_where_measured_otherwise(dtype):
    pick = functools.partial(unembed.select, d_model=768, dtype=dtype, backend="cpu")
    with unembed.using_device_profile(None):
        for op in ("greedy", "logsumexp", "top_k", "sample"):
            for batch in (2, 4, 16, 64, 256):
                assert pick(op, vocab=32768, batch=batch).impl == "xla", (op, batch)
            one = pick(op, vocab=50257, batch=1)
            if dtype == "bf16":  # one whole tile of W, h padded to two rows: no loop
                assert (one.impl, one.blocks) == ("chunked", {"block_v": 65536, "min_rows": 2})
            else:
                assert one.impl == "xla"
        # Cross-entropy: xla while the N x V f32 logits fit in W's bytes, fused beyond.
        w_rows = 768 * (2 if dtype == "bf16" else 4) // 4  # N at which 4 N V = V D w
        assert pick("linear_cross_entropy", vocab=32768, batch=w_rows).impl == "xla"
        assert pick("linear_cross_entropy", vocab=32768, batch=w_rows + 1).impl == "chunked"
        # A GPU without a profile keeps the roofline rule: memory-bound decode runs fused.
        assert (
            unembed.select(
                "greedy", vocab=32768, batch=1, d_model=768, dtype=dtype, backend="gpu"
            ).impl
            == "pallas"
        )


def test_an_xla_cross_entropy_row_is_not_stretched_to_larger_logits():
    prof = _profile([_row(32768, 256, "xla", op="linear_cross_entropy")])
    ce = functools.partial(unembed.select, "linear_cross_entropy", profile=prof, backend="cpu")
    assert ce(vocab=32768, batch=256, d_model=768, dtype="bf16").impl == "xla"
    assert (
        ce(vocab=8192, batch=64, d_model=768, dtype="bf16").impl == "xla"
    )  # smaller logits than measured
    big = ce(
        vocab=32768, batch=8192, d_model=768, dtype="bf16"
    )  # 32x the measured N x V: the fused path
    assert big.impl == "chunked" and big.reason.startswith("cpu rule")
    # Greedy's logits are B x V too, but greedy has no N of training tokens behind it.
    greedy = _profile([_row(32768, 256, "xla")])
    assert (
        unembed.select(
            "greedy", vocab=32768, batch=8192, d_model=768, dtype="bf16", profile=greedy
        ).impl
        == "xla"
    )


def test_gradient_row_tiles_fit_half_of_w_and_the_cap():
    rows = unembed.ChunkBlocks.default_block_n
    assert rows(513, 50257, 768, "f32") == 256
    assert rows(8192, 65536, 512, "bf16") == 128
    assert rows(37, 50257, 768, "bf16") == 37  # N below the tile: one tile of N rows
    # V = 1M at D = 8,192: half of W allows 2,048 rows, the 256 MiB cap 64.
    assert rows(8192, 2**20, 8192, "bf16") == 64
    assert rows(8192, 2**20, 64, "bf16") == 16
    with pytest.raises(UserError, match="block_n=0"):
        unembed.ChunkBlocks(1024, block_n=0)
    with pytest.raises(UserError, match="min_rows=0"):
        unembed.ChunkBlocks(1024, min_rows=0)
    h, w, _ = data("f32", 3)
    with pytest.raises(UserError, match="take block_n, block_v, min_rows, got \\['rows'\\]"):
        unembed.linear_cross_entropy(
            h, w, jnp.asarray([1, 2, 3]), impl="chunked", blocks={"rows": 4}
        )


def test_auto_follows_the_profile_set(tmp_path):
    h, w, _ = data("f32", 3)
    f32_row = KernelTiming("greedy", V, 3, D, "f32", "chunked", {"block_v": 2048}, 1e-3, 0.5)
    prof = _profile([f32_row])
    with unembed.using_device_profile(prof):
        assert unembed.device_profile() is prof
        choice = unembed.select("greedy", vocab=V, batch=3, d_model=D, dtype="f32")
        assert choice.impl == "chunked" and choice.blocks == {"block_v": 2048}
        got = jax.jit(lambda h, w: unembed.greedy(h, w))(h, w)
    np.testing.assert_array_equal(got, unembed.greedy(h, w, impl="xla"))
    assert unembed.device_profile() is not prof


def test_candidates_try_one_whole_tile_and_padding_at_one_row():
    found = unembed.ChunkBlocks.candidates(1, 131072, 768, "bf16", quick=True)
    assert found[0].min_rows == 2  # one bf16 row is padded to two by default
    assert {b.min_rows for b in found} == {1, 2}
    assert any(b.block_v >= 131072 for b in found)
    # 256 x 131,072 f32 logits (128 MiB) are beyond 8x TILE_BYTES: no whole tile, no padding.
    wide = unembed.ChunkBlocks.candidates(256, 131072, 768, "bf16", quick=True)
    assert all(b.block_v < 131072 and b.min_rows == 1 for b in wide)


def test_one_tile_of_all_of_w_runs_without_a_loop():
    h, w, _ = data("bf16", 1)
    one = unembed.ChunkBlocks(block_v=65536, min_rows=2)
    text = str(jax.make_jaxpr(lambda h, w: unembed.greedy(h, w, impl="chunked", blocks=one))(h, w))
    assert "scan" not in text and "while" not in text
    tiled = unembed.ChunkBlocks(block_v=4096)
    text = str(
        jax.make_jaxpr(lambda h, w: unembed.greedy(h, w, impl="chunked", blocks=tiled))(h, w)
    )
    assert "scan" in text
