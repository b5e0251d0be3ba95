"""vocabjax.autotune on a tiny grid: ceilings, candidate checks, timing, the profile it writes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vocabjax import autotune as at
from vocabjax import unembed
from vocabjax.errors import UserError
from vocabjax.hardware import KernelTiming, load_device, save_device
from vocabjax.timing import TimingSettings

TINY = dataclasses.replace(
    TimingSettings.quick(),
    repeats=3,
    rotate_bytes=2 * 2**20,
    copy_bytes=16 * 2**20,
    matmul_n={"f32": 256, "bf16": 256},
)
VOCABS, BATCHES, D = (3000,), (1, 5), 64


@pytest.fixture(scope="module")
def ceilings():
    return at.measure_ceilings(("f32", "bf16"), TINY)


@pytest.fixture(scope="module")
def run(ceilings):
    return at.autotune(VOCABS, BATCHES, D, "f32", settings=TINY, ceilings=ceilings)


def test_ceilings_are_measured(ceilings):
    assert ceilings.hbm_bandwidth > 1e8  # any machine moves more than 100 MB/s
    assert set(ceilings.peak_flops) == {"f32", "bf16"} and min(ceilings.peak_flops.values()) > 1e8
    assert 0 < ceilings.launch_overhead_s < 0.1
    assert ceilings.ridge_point("f32") == ceilings.peak_flops["f32"] / ceilings.hbm_bandwidth


@pytest.mark.slow
def test_every_point_has_a_checked_best_row(run):
    prof = run.profile
    assert prof.measured and not run.failures
    points = {(op, v, b) for op in unembed.OPS for v in VOCABS for b in BATCHES}
    assert {(r.op, r.vocab, r.batch) for r in prof.best} == points
    assert len(prof.best) == len(points)
    for best in prof.best:
        same = [
            r for r in prof.kernels if (r.op, r.vocab, r.batch) == (best.op, best.vocab, best.batch)
        ]
        assert {r.impl for r in same} >= {"xla", "chunked"}
        xla = next(r for r in same if r.impl == "xla")
        fastest = min(r.time_s for r in same)
        unconfirmed = [r for r in run.unconfirmed if r.batch == best.batch and r.op == best.op]
        if best.impl == "xla" and unconfirmed:  # a first-pass winner that lost the re-timing
            assert unconfirmed[0].time_s == fastest < xla.time_s * (1 - TINY.baseline_margin)
        elif best.impl == "xla":  # the baseline keeps points that no candidate beats by 5%
            assert fastest >= xla.time_s * (1 - TINY.baseline_margin)
        else:
            assert best.time_s == fastest < xla.time_s * (1 - TINY.baseline_margin)
    for r in prof.kernels:
        floor = run.ceilings.floor_s(r.op, r.vocab, r.batch, r.d_model, r.dtype)
        assert r.roofline_fraction == pytest.approx(floor / r.time_s)
        assert r.d_model == D and r.dtype == "f32" and r.time_s > 0
        if r.impl == "chunked":  # cross-entropy's loss-and-gradient rows name their row tile
            want = {"block_v", "block_n"} if r.op == "linear_cross_entropy" else {"block_v"}
            assert set(r.blocks) - {"min_rows"} == want


@pytest.mark.slow
def test_profile_round_trips_and_drives_the_selector(run, tmp_path):
    path = save_device(run.profile, tmp_path / "dev.json")
    loaded = load_device(path)
    assert loaded.best == run.profile.best and loaded.kernels == run.profile.kernels
    for best in loaded.best:
        choice = unembed.select(
            best.op, vocab=best.vocab, batch=best.batch, d_model=D, dtype="f32", profile=loaded
        )
        assert choice.impl == best.impl, (best, choice)
        if best.impl == "chunked":
            assert choice.blocks == best.blocks
    rows = run.table_rows()
    assert len(rows) == len(run.profile.kernels) and sum(r["best"] for r in rows) == len(
        run.profile.best
    )


def test_a_wrong_candidate_is_reported_and_never_timed(monkeypatch, ceilings):
    real = at._op_fn

    def broken(op, cand):
        fn = real(op, cand)
        if cand.impl != "chunked":
            return fn
        return lambda *args: fn(*args) + 1  # every greedy id off by one

    monkeypatch.setattr(at, "_op_fn", broken)
    run = at.autotune((1000,), (3,), D, "f32", ops=("greedy",), settings=TINY, ceilings=ceilings)
    assert run.failures and all(f.impl == "chunked" for f in run.failures)
    assert "max abs error" in run.failures[0].error or "out of range" in run.failures[0].error
    assert {r.impl for r in run.profile.kernels} == {"xla"}
    assert [r.impl for r in run.profile.best] == ["xla"]


def test_candidates_skip_pallas_on_cpu_and_start_with_the_baseline():
    cands = at.candidates("greedy", 50257, 8, 768, "bf16", backend="cpu")
    assert cands[0].impl == "xla" and {c.impl for c in cands} == {"xla", "chunked"}
    sizes = [c.blocks.block_v for c in cands if c.impl == "chunked"]
    assert len(sizes) == len(set(sizes)) and all(s & (s - 1) == 0 for s in sizes)


def test_bad_grids_are_user_errors():
    with pytest.raises(UserError, match=r"unknown op\(s\) beam"):
        at.autotune((1000,), (1,), D, "f32", ops=("beam",), settings=TINY)
    with pytest.raises(UserError, match=r"dtype 'fp8' is not one of bf16, f32"):
        at.autotune((1000,), (1,), D, "fp8", settings=TINY)
    with pytest.raises(UserError, match=r"batch sizes must be positive integers, got 0"):
        at.autotune((1000,), (0,), D, "f32", settings=TINY)


def test_default_grid_covers_the_cost_model_grid():
    """The cost model interpolates greedy over (V, B): the default grid is the full product."""
    assert at.DEFAULT_VOCABS[0] == 8192 and at.DEFAULT_VOCABS[-1] == 524288
    assert at.DEFAULT_BATCHES[0] == 1 and at.DEFAULT_BATCHES[-1] == 512
    assert np.all(np.diff(at.DEFAULT_VOCABS) > 0)
    assert at.default_out("NVIDIA H200").endswith("profiles/nvidia-h200.json")


def test_best_keeps_xla_unless_a_candidate_beats_it_by_the_margin():
    def row(impl, t):
        return KernelTiming("greedy", 4096, 1, 64, "f32", impl, {}, t, 0.5)

    xla, near, far = row("xla", 1.0), row("chunked", 0.96), row("chunked", 0.90)
    assert at._best([near, xla], 0.05) is xla
    assert at._best([xla, near, far], 0.05) is far
    assert at._best([near, xla], 0.0) is near
    assert at._best([near, far], 0.05) is far  # no baseline timed: the fastest


@pytest.mark.slow
@pytest.mark.parametrize("confirmed", [True, False])
def test_a_winner_over_xla_must_win_again_in_the_confirming_rounds(monkeypatch, confirmed):
    """The first pass puts chunked 40% ahead; the confirming rounds (winner against xla only)
    either agree, or do not, and then xla is the point's best and the winner is reported."""
    calls = []

    def scripted(fns, sets, settings):
        calls.append((len(fns), settings.repeats))
        if len(fns) > 2:  # the first pass: xla first, then the chunked candidates
            return [1.0] + [0.6] + [0.8] * (len(fns) - 2)
        return [1.0, 0.6 if confirmed else 0.99]

    monkeypatch.setattr(at, "time_interleaved", scripted)
    settings = dataclasses.replace(TINY, confirm_repeats=7)
    run = at.autotune((3000,), (4,), D, "f32", ops=("greedy",), settings=settings)
    (best,) = run.profile.best
    assert calls[1] == (2, 7)
    assert best.impl == ("chunked" if confirmed else "xla")
    assert run.unconfirmed == (() if confirmed else (run.profile.kernels[1],))
    off = dataclasses.replace(settings, confirm_repeats=0)
    run = at.autotune((3000,), (4,), D, "f32", ops=("greedy",), settings=off)
    assert run.profile.best[0].impl == "chunked" and len(calls) == 3  # no confirming rounds


def test_cross_entropy_candidates_vary_the_gradient_row_tile():
    base = unembed.ChunkBlocks.default_block_n(1000, 32768, 768, "f32")
    assert base == 256  # 2^floor(log2(768 * 4 / 8)) rows
    found = unembed.ChunkBlocks.candidates(
        1000, 32768, 768, "f32", quick=True, op="linear_cross_entropy"
    )
    assert [b.block_n for b in found] == [256, 64, 1000]
    assert len({b.block_v for b in found}) == 1
    assert all(b.block_n is None for b in unembed.ChunkBlocks.candidates(1000, 32768, 768, "f32"))
