"""``validate --anchor``: a profile scaled to the machine's speed now prices every point that many
times as long, keeps its fit's shape, records the anchor, and composes with an earlier one.
The timing is replaced by a known machine (``measure`` patched), so no test times anything."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest
from click.testing import CliRunner

import cli
from vocabjax.costmodel import CostModel, Settings
from vocabjax.errors import UserError
from vocabjax.hardware import DeviceProfile, EfficiencyTable, KernelTiming, load_device, save_device
from vocabjax.shapes import BUILTIN_SHAPES
from vocabjax.validation import get_grid, predict, validate
from vocabjax.validation import run as validation_run
from vocabjax.validation.anchor import anchor_of, anchored
from vocabjax.validation.timing import Timed

CALIBRATED = DeviceProfile(
    name="cpu",
    peak_flops={"f32": 1.0e11},
    hbm_bandwidth=2.0e10,
    memory_bytes=16e9,
    launch_overhead_s=2e-6,
    dispatch_overhead_s=3e-4,
    source="autotune 2026-01-01 00:00 UTC on cpu (cpu, jax 0.10.2, 2 host cores)",
    measured=True,
    intensity_table=EfficiencyTable((0.5, 5.0, 50.0, 500.0), (0.05, 0.2, 0.5, 0.7)),
    memory_table=EfficiencyTable((1e4, 1e6, 1e8, 1e10), (3.0, 1.5, 0.8, 0.6)),
    row_table=EfficiencyTable((512.0, 1024.0, 2048.0), (1.0, 1.3, 1.6)),
    attention_efficiency=0.3,
    train_efficiency=0.5,
    cache_bytes=8 * 2**20,
    cached_time=0.4,
    fresh_bandwidth=5e9,
    overlap=0.2,
    calibration={"log_residual_sd": 0.1, "fit_points": 40},
)
FRESH = 64 * 2**20


def _machine(monkeypatch, device: DeviceProfile, factors):
    """Timings of a machine that runs each point ``factors[i % len]`` times ``device``'s price."""

    def measure(points, grid, **kw):
        out = []
        for i, p in enumerate(points):
            fresh = float(FRESH) if p.family == "prefill" and p.batch > 1 else 0.0
            t = predict(p, device, decode_steps=grid.decode_steps, fresh_bytes=fresh).predicted_s
            out.append(Timed(t * factors[i % len(factors)], 0.1, None, fresh))
        return out

    monkeypatch.setattr(validation_run, "measure", measure)


def test_an_anchored_profile_prices_every_point_its_factor_times():
    """Every family of the quick grid, with fresh memory, and the sweep's per-byte costs: all
    scale by the factor exactly; the fit's tables and cache stay; the record says it."""
    v = 1.37
    kernel = KernelTiming("greedy", 8192, 4, 128, "f32", "xla", {}, 1e-4, 0.5)
    base = dataclasses.replace(CALIBRATED, kernels=(kernel,), best=(kernel,))
    speed = dataclasses.replace(anchor_of_factor(v), date="2026-12-07 03:00 UTC")
    slow = anchored(base, speed)
    for p in get_grid("quick").points():
        for fresh in (0.0, float(FRESH)):
            a = predict(p, base, fresh_bytes=fresh).predicted_s
            b = predict(p, slow, fresh_bytes=fresh).predicted_s
            assert b == pytest.approx(v * a, rel=1e-9), p.label()
    shape = BUILTIN_SHAPES["paper-100m"]
    for vocab, batch in ((8192.0, 1.0), (131072.0, 64.0)):
        before = CostModel(base, shape, Settings(weight_dtype="f32"))
        after = CostModel(slow, shape, Settings(weight_dtype="f32"))
        assert float(after.c_infer(vocab, batch)) == pytest.approx(
            v * float(before.c_infer(vocab, batch)), rel=1e-5
        )
        assert float(after.c_train(vocab)) == pytest.approx(
            v * float(before.c_train(vocab)), rel=1e-5
        )
    assert slow.best[0].time_s == pytest.approx(v * 1e-4)
    assert slow.intensity_table == base.intensity_table and slow.cache_bytes == base.cache_bytes
    assert slow.memory_bytes == base.memory_bytes and slow.residual_sd == base.residual_sd
    assert slow.calibration["fit_points"] == 40  # the fit's record stays beside the anchor's
    assert slow.calibration["anchor"]["factor"] == v == slow.calibration["anchor"]["total_factor"]
    assert "anchored 2026-12-07 03:00 UTC: times x1.370" in slow.source


def anchor_of_factor(factor: float):
    """An anchor of three points whose median ratio is ``factor``."""
    from vocabjax.validation.anchor import Anchor

    return Anchor(factor, (factor * 0.9, factor, factor * 1.2), ("a", "b", "c"), "now")


def test_the_factor_is_the_median_ratio_and_anchors_compose(monkeypatch, tmp_path):
    """A machine running 1.3x (and scattered about it) the profile's prices: the anchor grid's
    median ratio is the factor, the saved profile prices the machine's steps, and a second
    anchor on a machine 1.5x slower again multiplies into the record's total, with one note."""
    factors = (1.25, 1.3, 1.35, 1.3, 1.2, 1.4, 1.3)
    _machine(monkeypatch, CALIBRATED, factors)
    first = tmp_path / "today.json"
    base = save_device(CALIBRATED, tmp_path / "cal.json")
    result = CliRunner().invoke(
        cli.main,
        ["validate", "--device", str(base), "--anchor", "--save-profile", str(first),
         "--format", "json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["grid"]["name"] == "anchor"  # --anchor's default grid
    expected = statistics.median(doc["anchor"]["ratios"])
    assert doc["anchor"]["factor"] == pytest.approx(expected) == pytest.approx(1.3)
    assert len(doc["anchor"]["ratios"]) == doc["anchor"]["points"] >= 20
    assert "anchored" in result.stderr and "times x1.300" in result.stderr
    today = load_device(str(first))
    assert today.calibration["anchor"]["total_factor"] == pytest.approx(1.3)
    # anchored again, on a machine 1.5x slower than the anchored profile prices
    _machine(monkeypatch, today, (1.5,))
    second = tmp_path / "later.json"
    args = ["validate", "--device", str(first), "--anchor", "--save-profile", str(second)]
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 0, result.output
    later = load_device(str(second))
    assert later.calibration["anchor"]["factor"] == pytest.approx(1.5)
    assert later.calibration["anchor"]["total_factor"] == pytest.approx(1.95)
    assert later.source.count("anchored") == 1 and "x1.950 in all since the fit" in later.source
    swept = CliRunner().invoke(cli.main, ["sweep", "--device", str(second), "--vocab", "8k"])
    assert swept.exit_code == 0 and "anchored" in swept.output


def test_too_few_steps_clashing_flags_and_no_profile_written(monkeypatch, tmp_path):
    _machine(monkeypatch, CALIBRATED, (1.0,))
    run = validate(CALIBRATED, "test")
    ops_only = dataclasses.replace(
        run, results=tuple(r for r in run.results if r.point.kind == "op")
    )
    with pytest.raises(UserError, match="at least 3 step points"):
        anchor_of(ops_only)
    out = tmp_path / "p.json"
    base = str(save_device(CALIBRATED, tmp_path / "cal.json"))
    for args, message in (
        (["--anchor", "--fit"], "--fit and --anchor clash"),
        (["--save-profile", str(out)], "--save-profile needs --fit or --anchor"),
    ):
        result = CliRunner().invoke(cli.main, ["validate", "--device", base, *args])
        assert result.exit_code == 2 and message in result.output, result.output
    assert not out.exists()
