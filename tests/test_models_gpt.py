"""The NNX GPT: causality, grouped-query attention, nested heads, and its loss through the
project's cross-entropy kernels (xla and chunked agree in value and gradient)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from vocabjax.errors import UserError
from vocabjax.models import GPT, GPTConfig
from vocabjax.shapes import ModelShape
from vocabjax.train.steps import Functional

GQA = ModelShape("t-gqa", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, glu=True)
MHA = ModelShape("t-mha", d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=48, glu=True)
GELU = ModelShape("t-gelu", d_model=24, n_layers=1, n_heads=3, n_kv_heads=1, d_ff=40)
VOCAB, SEQ = 301, 13  # odd sizes on purpose
TOL = {jnp.float32: (2e-5, 2e-4)}  # dtype -> (atol, rtol)


def model(shape=GQA, *, seed=0, **kw) -> GPT:
    return GPT(GPTConfig(shape, max_vocab=VOCAB, max_seq=SEQ, **kw), rngs=nnx.Rngs(seed))


def ids(key, batch=2, seq=SEQ, vocab=VOCAB):
    return jax.random.randint(jax.random.key(key), (batch, seq), 0, vocab, dtype=jnp.int32)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [GQA, GELU], ids=lambda s: s.name)
def test_changing_a_later_token_never_changes_earlier_states(shape):
    m = model(shape)
    x = ids(1)
    y = x.at[:, 7:].set((x[:, 7:] + 5) % VOCAB)
    hx, hy = np.asarray(m(x)), np.asarray(m(y))
    assert hx.shape == (2, SEQ, shape.d_model) and hx.dtype == np.float32
    np.testing.assert_allclose(hx[:, :7], hy[:, :7], atol=1e-6, rtol=1e-6)
    assert np.abs(hx[:, 7:] - hy[:, 7:]).max() > 1e-3  # the change does reach later positions


@pytest.mark.slow
def test_gqa_shapes_and_equivalence_to_mha_with_repeated_kv_heads():
    g = model(GQA)
    attn = g.blocks[0].attn
    dh = GQA.dh
    assert attn.w_q[...].shape == (32, 4 * dh)
    assert attn.w_k[...].shape == attn.w_v[...].shape == (32, 2 * dh)
    assert attn.w_o[...].shape == (4 * dh, 32)
    # The same attention as multi-head attention whose query heads 2k and 2k+1 share K/V head k.
    fn_g, pg = Functional.of(g)
    fn_m, pm = Functional.of(model(MHA, seed=1))
    assert set(pg) == set(pm)
    group = GQA.n_heads // GQA.n_kv_heads
    for name, value in pg.items():
        if name.endswith(("w_k.value", "w_v.value")):
            value = jnp.repeat(value.reshape(32, 2, dh), group, axis=1).reshape(32, 4 * dh)
        assert pm[name].shape == value.shape, name
        pm[name] = value
    x = ids(2)
    np.testing.assert_allclose(fn_g.model(pg)(x), fn_m.model(pm)(x), atol=1e-5, rtol=1e-5)


def test_nested_heads_are_prefixes_of_the_largest():
    m = model()
    h = m(ids(3))
    full = np.asarray(m.logits(h, VOCAB))
    assert full.shape == (2, SEQ, VOCAB)
    # Each V compiles its own matmul, whose blocking (so the float32 rounding) depends on V: allow
    # a few ulp of the dot products' magnitude, far below any wrong row or column (O(1)).
    magnitude = np.abs(np.asarray(h, np.float64)) @ np.abs(np.asarray(m.head(VOCAB), np.float64)).T
    for v in (257, 300):
        err = np.abs(np.asarray(m.logits(h, v), np.float64) - full[..., :v])
        assert (err <= 4 * np.finfo(np.float32).eps * magnitude[..., :v]).all(), (v, err.max())
        np.testing.assert_array_equal(np.asarray(m.head(v)), np.asarray(m.unembed[...])[:v])
    with pytest.raises(UserError, match="must be in 1..max_vocab=301"):
        m.head(VOCAB + 1)
    tied = model(tie_embeddings=True)
    assert not hasattr(tied, "unembed")
    np.testing.assert_array_equal(np.asarray(tied.head(257)), np.asarray(tied.embed[...])[:257])


def _reference_loss(m: GPT, x, labels, vocab):
    logp = jax.nn.log_softmax(m.logits(m(x), vocab), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


@pytest.mark.slow
@pytest.mark.parametrize("vocab", [VOCAB, 263])
def test_loss_xla_and_chunked_agree_in_value_and_gradient(vocab):
    m = model()
    fn, params = Functional.of(m)
    x = ids(4, vocab=vocab)
    labels = ids(5, vocab=vocab)

    def loss(p, impl):
        return fn.model(p).loss(x, labels, vocab, impl=impl)

    atol, rtol = TOL[jnp.float32]
    ref = float(_reference_loss(m, x, labels, vocab))
    values, grads = {}, {}
    for impl in ("xla", "chunked"):  # jitted: one compile, not one per eager op
        values[impl], grads[impl] = jax.jit(jax.value_and_grad(loss), static_argnums=1)(
            params, impl
        )
        np.testing.assert_allclose(float(values[impl]), ref, atol=atol, rtol=rtol)
    ref_grads = jax.jit(jax.grad(lambda p: _reference_loss(fn.model(p), x, labels, vocab)))(params)
    for name in params:
        for impl in ("xla", "chunked"):
            np.testing.assert_allclose(
                grads[impl][name], ref_grads[name], atol=atol, rtol=rtol, err_msg=name
            )
    # Rows of W beyond the head get no gradient; the head's rows do.
    g_w = np.asarray(grads["chunked"]["unembed.value"])
    assert np.all(g_w[vocab:] == 0) and np.abs(g_w[:vocab]).max() > 0


@pytest.mark.slow
def test_bf16_compute_stays_close_to_f32_and_params_stay_f32():
    x, labels = ids(6), ids(7)
    f32 = float(model().loss(x, labels, VOCAB, impl="xla"))
    m16 = model(compute_dtype="bf16")
    assert m16.blocks[0].attn.w_q[...].dtype == jnp.float32
    b16 = float(m16.loss(x, labels, VOCAB, impl="chunked"))
    assert np.isfinite(b16) and abs(b16 - f32) < 0.02 * f32


def test_bad_shapes_are_user_errors():
    m = model()
    with pytest.raises(UserError, match="above max_seq=13"):
        m(ids(8, seq=SEQ + 1))
    with pytest.raises(UserError, match="must be a positive integer"):
        GPTConfig(GQA, max_vocab=0, max_seq=4)


def test_the_small_preset_builds_with_the_weights_its_shape_counts():
    from vocabjax.shapes import load_shape

    small = load_shape("small")
    assert 4e6 < small.n_nonembedding < 2e7 and small.source
    config = GPTConfig(small, max_vocab=512, max_seq=16)
    abstract = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    _, params = Functional.of(abstract)
    assert sum(int(np.prod(p.shape)) for p in params.values()) == config.n_params()


SEPARATE = (257, 280, VOCAB)


def test_separate_heads_are_their_own_matrices_and_nested_stays_the_default():
    m = model(heads_kind="separate", heads=SEPARATE)
    fn, params = Functional.of(m)
    names = {n for n in params if n.startswith("heads.")}
    assert names == {"heads.0.value", "heads.1.value", "heads.2.value"}
    assert "unembed.value" not in params
    for j, v in enumerate(SEPARATE):
        assert params[f"heads.{j}.value"].shape == (v, GQA.d_model)
        np.testing.assert_array_equal(np.asarray(m.head(v)), np.asarray(params[f"heads.{j}.value"]))
    assert sum(int(np.prod(p.shape)) for p in params.values()) == m.config.n_params()
    with pytest.raises(UserError, match=r"head vocab=263 is not one of the separate heads"):
        m.head(263)
    with pytest.raises(UserError, match="cannot be tied"):
        GPTConfig(GQA, max_vocab=VOCAB, max_seq=SEQ, heads_kind="separate", heads=SEPARATE,
                  tie_embeddings=True)  # fmt: skip
    with pytest.raises(UserError, match=r"must be increasing and end at max_vocab=301"):
        GPTConfig(GQA, max_vocab=VOCAB, max_seq=SEQ, heads_kind="separate", heads=(257, 300))
    # Nested is the default, and its parameters are what they were: one W, no per-head matrix.
    nested = model()
    assert nested.config.heads_kind == "nested" and nested.config.heads == ()
    _, nested_params = Functional.of(nested)
    assert "unembed.value" in nested_params and not any(
        n.startswith("heads.") for n in nested_params
    )
    assert float(nested.alignment()) == 0.0


@pytest.mark.slow
def test_alignment_measures_the_shared_rows_and_its_gradient_reaches_every_head():
    m = model(heads_kind="separate", heads=SEPARATE)
    fn, params = Functional.of(m)
    w = [np.asarray(params[f"heads.{j}.value"], np.float64) for j in range(3)]
    expected = []
    for i in range(3):
        for j in range(i + 1, 3):
            shared = w[j][: SEPARATE[i]]
            size = 0.5 * ((shared**2).sum() + (w[i] ** 2).sum())
            expected.append(((shared - w[i]) ** 2).sum() / size)
    assert float(m.alignment()) == pytest.approx(np.mean(expected), rel=1e-5)
    assert 1.8 < float(m.alignment()) < 2.2  # independent draws: about 2
    grads = jax.grad(lambda p: fn.model(p).alignment())(params)
    for j in range(len(SEPARATE)):
        g = np.asarray(grads[f"heads.{j}.value"])
        assert np.abs(g).max() > 0, j
        if j < 2:  # the largest head shares its first rows only; a smaller head, every row
            assert (np.abs(g).max(axis=1) > 0).all(), j
    # Heads whose shared rows agree are aligned: the nested limit.
    aligned = dict(params)
    for j in range(2):
        aligned[f"heads.{j}.value"] = params["heads.2.value"][: SEPARATE[j]]
    assert float(fn.model(aligned).alignment()) == pytest.approx(0.0, abs=1e-12)
