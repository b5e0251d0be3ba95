"""Whole-grid sweeps: V* against a brute-force evaluation, sharding, quality bound, limits.

Tests that do not read the ensemble's share sweep datasheet profiles (``*-datasheet``, ``l4``,
``a10g``): without a calibration the grid function has no ensemble and compiles several times
faster. Each grid shape and each model compiles its own grid function, so tests reuse ``Grid()``
where the property allows.
"""

import dataclasses
import itertools
import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vocabjax import render
from vocabjax.compression import DEFAULT_CURVE
from vocabjax.costmodel import CostModel, Settings
from vocabjax.errors import UserError
from vocabjax.hardware import load_device
from vocabjax.lifecycle import (
    FINE_PER_OCTAVE,
    N_DRAWS,
    NO_VOCAB,
    Grid,
    Quality,
    check_grid_fits,
    ensemble_draws,
    fine_vocab,
    share_note,
    sweep,
    sweep_json,
    sweep_rows,
    sweep_tables,
)
from vocabjax.shapes import load_shape
from vocabjax.trainprofile import TrainingProfile
from vocabjax.xp import PyMath


def _model(device="a100-80gb", shape="paper-1.5b", **kw):
    return CostModel(load_device(device), load_shape(shape), Settings(**kw), DEFAULT_CURVE)


@pytest.mark.slow
def test_sweep_matches_point_by_point_python():
    cm = _model()
    grid = Grid()
    res = sweep(cm, grid)  # capped by default: B costed at the largest batch that fits
    for bi, b in enumerate(grid.batch):
        runs = [min(float(b), cm.b_max(float(v), xp=PyMath)) for v in grid.vocab]
        assert (runs < np.float64(b)).any() == (bi == len(grid.batch) - 1)  # B=256 is capped
        c_inf = [cm.c_infer(float(v), r, xp=PyMath) for v, r in zip(grid.vocab, runs)]
        np.testing.assert_allclose(res.c_infer[:, bi], c_inf, rtol=1e-5)
        for li, lam in enumerate(grid.lam):
            j = [cm.c_train(float(v), xp=PyMath) + lam * c for v, c in zip(grid.vocab, c_inf)]
            assert res.v_star[bi, li] == grid.vocab[int(np.argmin(j))]
            assert res.j_star[bi, li] == pytest.approx(min(j), rel=1e-5)


def test_lambda_zero_is_training_only():
    res = sweep(_model(), Grid())  # the default grid's first lambda is 0
    assert res.grid.lam[0] == 0.0
    assert len(set(res.v_star[:, 0].tolist())) == 1
    assert res.v_star[0, 0] == res.v_train == res.grid.vocab[int(np.argmin(res.c_train))]


@pytest.mark.slow  # a new grid shape per example, so a compile each
@settings(max_examples=8)
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


@pytest.mark.slow
def test_sharded_sweep_equals_one_device():
    devices = jax.devices()
    assert len(devices) == 4, "conftest forces 4 CPU devices"
    cm = _model("h100-sxm-datasheet", "llama-8b", mode="full")
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
    res = sweep(_model("a100-80gb-datasheet", "llama-8b"), Grid(vocab=(32768, 262144)))
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


@pytest.mark.slow
def test_quality_bound_excludes_poor_and_unmeasured_vocab():
    prof = TrainingProfile("t", (8192, 32768, 131072), None, (1.00, 0.90, 0.95))
    grid = Grid(vocab=(8192, 32768, 131072, 524288), lam=(0.0, 1000.0))
    cm = _model("a100-80gb-datasheet")
    res = sweep(cm, grid, quality=Quality(prof, 0.02))
    assert res.allowed.tolist() == [False, True, False, False]
    assert set(res.v_star.ravel().tolist()) == {32768}
    loose = sweep(cm, grid, quality=Quality(prof, 0.2))
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


def test_cap_is_the_default_and_no_cap_costs_the_asked_batch():
    cm = _model("l4", "llama-8b")
    grid = Grid(vocab=(32768,), batch=(1, 100000), lam=(1.0,))
    default, uncapped = sweep(cm, grid), sweep(cm, grid, cap_batch=False)
    assert default.capped and not uncapped.capped
    assert default.batch_capped.tolist() == [[False, True]]
    assert not uncapped.batch_capped.any() and uncapped.batch_eff[0, 1] == 100000
    assert default.fits.tolist() == uncapped.fits.tolist() == [[True, False]]
    rows = sweep_rows(cm, default)
    assert [r["batch_capped"] for r in rows] == [False, True]
    assert [r["fits"] for r in sweep_rows(cm, uncapped)] == [True, False]


def test_fine_vocab_spans_the_grid_and_holds_its_sizes():
    fine = fine_vocab((8192, 65536, 524288))
    assert fine[0] == 8192 and fine[-1] == 524288
    assert {8192, 65536, 524288} <= set(fine) and list(fine) == sorted(set(fine))
    assert len(fine) == 6 * FINE_PER_OCTAVE + 1  # six octaves, 16 steps each
    assert fine_vocab((32768,)) == (32768,)
    steps = np.diff(np.log2(fine))
    assert steps.max() < 1.5 / FINE_PER_OCTAVE


@pytest.mark.slow
@pytest.mark.parametrize("device", ["a100-80gb", "l4"])
def test_band_holds_v_star_and_widens_with_tolerance(device):
    cm = _model(device, "llama-8b")
    bands = [sweep(cm, Grid(), tolerance=t) for t in (0.0, 0.01, 0.05, 0.2)]
    for res in bands:
        assert res.found.all()
        assert (res.v_low <= res.v_star).all() and (res.v_star <= res.v_high).all()
        assert np.isin(res.v_low, res.fine_vocab).all()
    for narrow, wide in itertools.pairwise(bands):
        assert (wide.v_low <= narrow.v_low).all() and (wide.v_high >= narrow.v_high).all()
    assert (bands[-1].v_high - bands[-1].v_low > bands[1].v_high - bands[1].v_low).any()


def test_band_is_every_fine_vocab_within_tolerance_of_j_star():
    cm = _model("a100-80gb-datasheet", "llama-8b")
    grid = Grid(vocab=(16384, 65536, 262144), batch=(1, 64), lam=(10.0,))
    res = sweep(cm, grid, tolerance=0.02)
    for bi, b in enumerate(grid.batch):
        runs = [min(float(b), cm.b_max(float(v), xp=PyMath)) for v in res.fine_vocab]
        j = [
            cm.c_train(float(v), xp=PyMath) + 10.0 * cm.c_infer(float(v), r, xp=PyMath)
            for v, r in zip(res.fine_vocab, runs)
        ]
        inside = [v for v, x in zip(res.fine_vocab, j) if x <= res.j_star[bi, 0] * 1.02]
        assert (res.v_low[bi, 0], res.v_high[bi, 0]) == (min(inside), max(inside))


def test_v_star_share_is_null_without_calibration_and_sums_to_one_with_it():
    bare = sweep(_model("a100-80gb-datasheet"), Grid())
    assert bare.v_star_share is None and "not calibrated" in bare.share_note
    assert all(r["v_star_share"] is None for r in sweep_rows(_model(), bare))
    res = sweep(_model("a100-80gb"), Grid())
    assert res.v_star_share.shape == (len(res.grid.vocab), len(res.grid.batch), len(res.grid.lam))
    np.testing.assert_allclose(res.v_star_share.sum(axis=0), 1.0, rtol=1e-5)
    assert f"{N_DRAWS} profiles" in res.share_note
    again = sweep(_model("a100-80gb"), Grid())
    np.testing.assert_array_equal(res.v_star_share, again.v_star_share)  # seeded draws
    assert (res.v_star_share < 1).any()  # a spread of 0.28 moves some V* somewhere
    rows = sweep_rows(_model(), res)
    assert all(abs(sum(s["share"] for s in r["v_star_share"]) - 1) < 1e-4 for r in rows)


@pytest.mark.slow
def test_v_star_share_without_spread_always_picks_v_star():
    device = load_device("a100-80gb")
    exact = dataclasses.replace(device, calibration={**device.calibration, "log_residual_sd": 0.0})
    cm = CostModel(exact, load_shape("paper-1.5b"), Settings(), DEFAULT_CURVE)
    res = sweep(cm, Grid())
    at_star = np.take_along_axis(res.v_star_share, res.index(res.v_star)[None], axis=0)[0]
    np.testing.assert_allclose(at_star, 1.0)


def test_the_ensembles_costs_are_the_scaled_models_costs():
    """Each draw's costs are read as base + sum of scale x part (``_FamilyParts``): they equal
    ``cost_grid`` of the model with those scales, also where nothing fits (inf: llama-8b's
    weights at 1M ids outgrow an L4) and for a measured training profile, which no scale
    reaches."""
    from vocabjax.costmodel import OP_FAMILIES
    from vocabjax.lifecycle import _costs_and_parts, cost_grid

    training = TrainingProfile("t", (8192, 262144), tokens_per_s=(2e5, 1e5), bpb=(1.0, 0.98))
    cm = CostModel(load_device("l4"), load_shape("llama-8b"), Settings(), DEFAULT_CURVE, training)
    v = jax.numpy.asarray([8192.0, 65536.0, 1048576.0])
    b = jax.numpy.asarray([1.0, 16.0, 256.0])
    _, parts = jax.jit(lambda v, b: _costs_and_parts(cm, v, b, cap_batch=True))(v, b)

    @jax.jit
    def scaled(s):
        c = cost_grid(cm.scaled(dict(zip(OP_FAMILIES, s))), v, b, cap_batch=True)
        return c.c_train, c.c_infer

    for seed in range(3):
        s = np.exp(0.3 * np.random.default_rng(seed).standard_normal(len(OP_FAMILIES)))
        want_train, want_infer = scaled(jax.numpy.asarray(s, jax.numpy.float32))
        c_train, c_infer = parts.at(jax.numpy.asarray(s, jax.numpy.float32))
        np.testing.assert_allclose(c_train, want_train, rtol=1e-5)
        np.testing.assert_allclose(c_infer, want_infer, rtol=1e-5)
    assert np.isinf(np.asarray(want_infer)).any() and np.isfinite(np.asarray(want_infer)).any()


def test_ensemble_shrinks_to_the_memory_budget():
    cm = _model("a100-80gb")
    grid = Grid()
    assert ensemble_draws(cm, grid) == N_DRAWS
    assert ensemble_draws(cm, grid, budget_bytes=1.0) == 0
    assert ensemble_draws(_model("a100-80gb-datasheet"), grid) == 0
    assert "too large" in share_note(cm, 3)


def test_bad_tolerance_is_a_user_error():
    with pytest.raises(UserError, match="tolerance must be a finite number >= 0"):
        sweep(_model(), Grid(), tolerance=-0.1)


@pytest.mark.parametrize("device", ["a100-80gb", "a10g"])  # calibrated, datasheet
def test_sweep_tables_and_json_are_made_of_the_rows(device):
    cm = _model(device)
    res = sweep(cm, Grid(vocab=(8192, 65536, 262144), batch=(1, 256), lam=(0.0, 100.0)))
    rows = sweep_rows(cm, res)
    tables = sweep_tables(cm, res)
    assert [list(r) for r in tables.v_star] == [["B", "lam=0", "lam=100", "infer-only"]] * 2
    for row in rows:
        at = tables.v_star[res.grid.batch.index(row["batch"])]
        assert at[f"lam={row['lam']:g}"] == render.v_star_cell(row)
        assert at["infer-only"] == render.human_size(row["v_infer_only"])
    if res.v_star_share is None:
        assert tables.share is None
    else:
        assert all(c.endswith("%") for r in tables.share for k, c in r.items() if k != "B")
    assert [r["vocab"] for r in tables.break_even] == list(res.grid.vocab)
    doc = sweep_json([(cm, res)])
    assert doc["table"] == rows and doc["tolerance"] == res.tolerance
    assert doc["v_star_share_notes"] == [
        {"device": cm.device.name, "model": cm.shape.name, "note": res.share_note}
    ]
