"""Whole-grid sweeps: V* against a brute-force evaluation, sharding, quality bound, limits."""

import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vocabjax.compression import DEFAULT_CURVE
from vocabjax.costmodel import CostModel, Settings
from vocabjax.errors import UserError
from vocabjax.hardware import load_device
from vocabjax.lifecycle import NO_VOCAB, Grid, Quality, check_grid_fits, sweep
from vocabjax.shapes import load_shape
from vocabjax.trainprofile import TrainingProfile
from vocabjax.xp import PyMath


def _model(device="a100-80gb", shape="paper-1.5b", **kw):
    return CostModel(load_device(device), load_shape(shape), Settings(**kw), DEFAULT_CURVE)


def test_sweep_matches_point_by_point_python():
    cm = _model()
    grid = Grid()
    res = sweep(cm, grid)
    for bi, b in enumerate(grid.batch):
        c_inf = [cm.c_infer(float(v), float(b), xp=PyMath) for v in grid.vocab]
        np.testing.assert_allclose(res.c_infer[:, bi], c_inf, rtol=1e-5)
        for li, lam in enumerate(grid.lam):
            j = [cm.c_train(float(v), xp=PyMath) + lam * c for v, c in zip(grid.vocab, c_inf)]
            assert res.v_star[bi, li] == grid.vocab[int(np.argmin(j))]
            assert res.j_star[bi, li] == pytest.approx(min(j), rel=1e-5)


def test_lambda_zero_is_training_only():
    res = sweep(_model(), Grid(lam=(0.0, 1.0)))
    assert len(set(res.v_star[:, 0].tolist())) == 1
    assert res.v_star[0, 0] == res.v_train == res.grid.vocab[int(np.argmin(res.c_train))]


@settings(max_examples=12)
@given(
    st.lists(st.integers(1000, 2**21), min_size=1, max_size=9, unique=True),
    st.lists(st.integers(1, 4096), min_size=1, max_size=6, unique=True),
    st.lists(st.floats(0, 1e5), min_size=1, max_size=5, unique=True),
    st.sampled_from(["a10g", "h200", "l4"]),
    st.sampled_from(["full", "weights-only"]),
)
def test_v_star_stays_in_grid_and_lambda_zero_ignores_batch(vocab, batch, lam, device, mode):
    grid = Grid(tuple(vocab), tuple(batch), tuple(lam) + (0.0,))
    res = sweep(_model(device, "llama-1b", mode=mode), grid)
    assert np.isin(res.v_star, grid.vocab).all() and res.found.all()
    assert len(set(res.v_star[:, grid.lam.index(0.0)].tolist())) == 1
    # a larger lambda never makes V* train cheaper than the training optimum
    c_star = res.c_train[res.index(res.v_star)]
    assert (c_star >= res.c_train[res.index(res.v_train)] - 1e-18).all()


def test_sharded_sweep_equals_one_device():
    devices = jax.devices()
    assert len(devices) == 4, "conftest forces 4 CPU devices"
    cm = _model("h100-sxm", "llama-8b", mode="full")
    grid = Grid(vocab=tuple(int(v) for v in np.geomspace(4096, 2**20, 37)), batch=(1, 3, 64, 500))
    one = sweep(cm, grid, devices=devices[:1])
    four = sweep(cm, grid, devices=devices)
    for field in ("b_max", "v_star", "v_infer"):
        np.testing.assert_array_equal(getattr(one, field), getattr(four, field), err_msg=field)
    # Each device count compiles its own program, so allow float rounding of a few ulp.
    for field in ("c_train", "c_infer", "j_star", "break_even"):
        a, b = getattr(one, field), getattr(four, field)
        np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b), err_msg=field)
        np.testing.assert_allclose(a, b, rtol=4 * np.finfo(np.float32).eps, err_msg=field)
    assert one.v_train == four.v_train


def test_break_even_lambda_against_training_optimum():
    cm = _model("a10g", "paper-100m", mode="weights-only")
    res = sweep(cm, Grid())
    t = res.index(res.v_train)
    for vi in range(len(res.grid.vocab)):
        for bi in range(len(res.grid.batch)):
            d_train = res.c_train[vi] - res.c_train[t]
            d_infer = res.c_infer[t, bi] - res.c_infer[vi, bi]
            be = res.break_even[vi, bi]
            if vi == t or d_train <= 0:
                assert be == 0
            elif d_infer <= 0:
                assert be == math.inf
            else:
                assert be == pytest.approx(d_train / d_infer, rel=1e-4)
                # at that lambda the two tie; above it V wins
                lam = be * 1.01
                assert res.c_train[vi] + lam * res.c_infer[vi, bi] < (
                    res.c_train[t] + lam * res.c_infer[t, bi]
                )


def test_kv_plan_larger_vocab_fits_more_sequences_until_weights_dominate():
    res = sweep(_model("a100-80gb", "llama-8b"), Grid(vocab=(32768, 262144)))
    # fewer tokens per sequence, so a smaller KV cache per sequence
    assert res.kv_bytes_per_seq[1] < res.kv_bytes_per_seq[0]
    assert res.b_max[1] >= res.b_max[0]


def test_cap_batch_limits_to_what_fits():
    cm = _model("l4", "llama-8b")
    res = sweep(cm, Grid(vocab=(32768,), batch=(1, 100000), lam=(1.0,)), cap_batch=True)
    assert res.batch_eff[0, 1] == res.b_max[0] < 100000
    assert res.c_infer[0, 1] == pytest.approx(
        cm.c_infer(32768.0, float(res.b_max[0]), xp=PyMath), rel=1e-5
    )


def test_cap_batch_when_weights_do_not_fit_gives_no_v_star():
    cm = _model("l4", "llama-70b")  # 140 GB of bf16 weights on a 24 GB card
    res = sweep(cm, Grid(vocab=(32768,), batch=(1,), lam=(0.0, 1.0)), cap_batch=True)
    assert res.b_max[0] == 0
    assert res.v_star[0, 0] == 32768  # lambda = 0: training alone
    assert res.v_star[0, 1] == NO_VOCAB and math.isinf(res.j_star[0, 1])
    assert res.found.tolist() == [[True, False]]
    with pytest.raises(UserError, match="no V is allowed or fits"):
        res.index(res.v_star)  # "no V" is never a grid index
    assert res.index(32768) == 0


def test_quality_bound_excludes_poor_and_unmeasured_vocab():
    prof = TrainingProfile("t", (8192, 32768, 131072), None, (1.00, 0.90, 0.95))
    grid = Grid(vocab=(8192, 32768, 131072, 524288), lam=(0.0, 1000.0))
    res = sweep(_model(), grid, quality=Quality(prof, 0.02))
    assert res.allowed.tolist() == [False, True, False, False]
    assert set(res.v_star.ravel().tolist()) == {32768}
    loose = sweep(_model(), grid, quality=Quality(prof, 0.2))
    assert loose.allowed.tolist() == [True, True, True, False]


def test_grid_too_large_is_a_user_error():
    grid = Grid(vocab=tuple(range(1, 2001)), batch=tuple(range(1, 2001)), lam=tuple(range(2000)))
    with pytest.raises(UserError, match=r"a grid of 8,000,000,000 points needs about"):
        check_grid_fits(grid)
    with pytest.raises(UserError, match="GiB"):
        check_grid_fits(Grid(), budget_bytes=100)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(vocab=(0, 8)), "vocab sizes must be positive"),
        (dict(batch=(0,)), "batch sizes must be positive"),
        (dict(lam=(-1.0,)), "lambda must be >= 0"),
        (dict(lam=(float("nan"),)), "must be a finite number"),
        (dict(vocab=()), "vocab grid is empty"),
    ],
)
def test_bad_grids(kw, message):
    with pytest.raises(UserError, match=message):
        Grid(**kw)
