"""The efficiency fit (vocabjax.calibration): it recovers known parameters from synthetic
timings, prices exactly as the cost model does, and round-trips through the profile JSON."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vocabjax.calibration import MIN_FIT_SAMPLES, Sample, fit_profile, is_held_out, predict_samples
from vocabjax.costmodel import CostModel, Settings
from vocabjax.errors import UserError
from vocabjax.hardware import OP_KINDS, TABLE_FIELDS, DeviceProfile, EfficiencyTable, load_device
from vocabjax.shapes import load_shape
from vocabjax.xp import PyMath

BASE = dataclasses.replace(load_device("a100-80gb-datasheet"), launch_overhead_s=4e-6)
TRUTH = dataclasses.replace(
    BASE,
    launch_overhead_s=9e-6,
    dispatch_overhead_s=2e-4,
    attention_efficiency=0.3,
    train_efficiency=0.5,
    elementwise_efficiency=0.6,
    optimizer_efficiency=1.5,
    sampling_efficiency=0.08,
    overlap=0.4,
    intensity_table=EfficiencyTable((0.1, 2.0, 50.0, 1000.0), (0.05, 0.3, 0.7, 0.8)),
    memory_table=EfficiencyTable((1e5, 1e7, 1e9, 1e11), (0.1, 0.45, 0.8, 0.85)),
    row_table=EfficiencyTable((256.0, 1024.0, 4096.0, 16384.0), (1.0, 1.3, 1.7, 1.8)),
)


def synthetic(n: int = 160, seed: int = 0) -> list[Sample]:
    """Points with 1-3 ops of sizes and arithmetic intensities spread over the tables' range,
    charged no host call (a kernel timing), one (an op called alone) or an eighth (a step of a
    decode loop); times from TRUTH."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.integers(1, 4))
        nbytes = tuple(float(10 ** rng.uniform(5, 11)) for _ in range(k))
        flops = tuple(float(y * 10 ** rng.uniform(-1, 3)) for y in nbytes)
        calls = (0.0, 1.0, 0.125)[i % 3]
        kinds = tuple(str(rng.choice(["matmul", "matmul", *OP_KINDS])) for _ in flops)
        # a third of the matmuls are matrix-vector products streaming rows of 256 B to 16 KiB
        rows = tuple(
            float(2 ** rng.uniform(8, 14)) if k == "matmul" and rng.random() < 1 / 3 else 0.0
            for k in kinds
        )
        s = Sample(
            f"p{i}", "decode", flops, nbytes, float(rng.integers(1, 40)), 1.0, calls=calls,
            kinds=kinds, row_bytes=rows,
        )  # fmt: skip
        out.append(s)
    times = predict_samples(TRUTH, out, dtype="bf16")
    return [dataclasses.replace(s, measured_s=float(t)) for s, t in zip(out, times)]


@pytest.fixture(scope="module")
def fitted():
    samples = synthetic()
    return samples, fit_profile(BASE, samples, dtype="bf16", source="synthetic")


@pytest.mark.slow
def test_the_fit_recovers_synthetic_timings(fitted):
    samples, fit = fitted
    held = [s for s in samples if s.key in fit.held_keys]
    assert held and len(held) + len(fit.fit_keys) == len(samples)
    truth = np.array([s.measured_s for s in held])
    before = predict_samples(BASE, held, dtype="bf16")
    after = predict_samples(fit.profile, held, dtype="bf16")
    err_before = np.abs(before / truth - 1)
    err_after = np.abs(after / truth - 1)
    assert np.median(err_before) > 0.15  # the datasheet is far off these timings
    assert np.median(err_after) < 0.05 and err_after.max() < 0.3
    assert fit.log_residual_sd < 0.1
    assert fit.profile.launch_overhead_s == pytest.approx(9e-6, rel=0.3)
    assert fit.profile.dispatch_overhead_s == pytest.approx(2e-4, rel=0.3)
    assert fit.profile.attention_efficiency == pytest.approx(0.3, rel=0.2)
    assert fit.profile.train_efficiency == pytest.approx(0.5, rel=0.2)
    assert fit.profile.elementwise_efficiency == pytest.approx(0.6, rel=0.2)
    assert fit.profile.optimizer_efficiency == pytest.approx(1.5, rel=0.2)
    assert fit.profile.sampling_efficiency == pytest.approx(0.08, rel=0.2)
    assert fit.profile.overlap == pytest.approx(0.4, abs=0.1)
    for row in (1024.0, 4096.0):  # a matrix-vector product's rate by its rows' bytes
        assert float(fit.profile.row_table.at(row, xp=np)) == pytest.approx(
            float(TRUTH.row_table.at(row, xp=np)), rel=0.2
        )
    cal = fit.profile.calibration
    assert cal["base_dispatch_overhead_s"] == 0.0
    assert cal["fit_points"] == len(fit.fit_keys) and cal["held_out_points"] == len(held)


def test_the_cost_model_prices_with_the_fitted_tables(fitted):
    """A decode step priced by CostModel equals the fit's own pricing of its ops."""
    _, fit = fitted
    cm = CostModel(fit.profile, load_shape("llama-8b"), Settings(steps_per_call=8))
    for b in (16.0, 1.0):  # a GEMM, and matrix-vector products (their one-row table)
        _prices_alike(cm, fit.profile, 32768.0, b, 1024.0)
    # and a cache that holds a step's bytes (the loop's later steps read them from it)
    cached = dataclasses.replace(fit.profile, cache_bytes=2.0**40, cached_time=0.25)
    _prices_alike(CostModel(cached, cm.shape, cm.settings), cached, 32768.0, 1.0, 1024.0)


def _prices_alike(cm: CostModel, profile: DeviceProfile, v: float, b: float, t: float) -> None:
    ops = cm.decode_ops(v, b, t)
    assert any(o.row_bytes > 0 for o in ops.values()) == (b == 1)
    launches = cm.shape.n_layers * cm.settings.launches_per_layer + 3
    sample = Sample(
        "x",
        "decode",
        tuple(float(o.flops) for o in ops.values()),
        tuple(float(o.bytes) for o in ops.values()),
        float(launches),
        1.0,
        kernels=tuple(float(o.kernels) for o in ops.values()),
        calls=1 / 8,
        kinds=tuple(o.kind for o in ops.values()),
        row_bytes=tuple(float(o.row_bytes) for o in ops.values()),
    )
    ours = predict_samples(profile, [sample], dtype="bf16")[0]
    assert cm.decode_step(v, b, t, xp=PyMath) == pytest.approx(ours, rel=1e-9)
    import jax.numpy as jnp

    assert float(cm.decode_step(jnp.float32(v), b, t)) == pytest.approx(ours, rel=1e-5)


CACHED = dataclasses.replace(TRUTH, cache_bytes=2.0**23, cached_time=0.3)  # 8 MiB: a CACHE_SIZE
# memory time worth a cache, at a rate the fit's table can draw
CPU_LIKE = {"hbm_bandwidth": 50e9, "launch_overhead_s": 1e-6}


@pytest.mark.slow
def test_the_fit_finds_the_decode_loops_cache_and_the_fresh_memorys_rate():
    """Memory-bound steps of decode loops over working sets of 0.25-256 MiB, and single calls
    beside them, some mapping 64-512 MiB afresh, timed by a profile with an 8 MiB cache and
    fresh memory at 3 GB/s: the scan finds the cache's size, the fit its cached time and the
    fresh memory's rate."""
    rng = np.random.default_rng(1)
    out = []
    for i in range(120):
        nbytes = tuple(float(2 ** rng.uniform(18, 28)) for _ in range(int(rng.integers(1, 3))))
        flops = tuple(y * float(rng.uniform(0.1, 2.0)) for y in nbytes)
        calls = 0.125 if i % 3 else 1.0
        fresh = float(2 ** rng.uniform(26, 29)) if i % 6 == 0 else 0.0
        out.append(
            Sample(f"c{i}", "decode", flops, nbytes, 10.0, 1.0, calls=calls, fresh_bytes=fresh)
        )
    truth = dataclasses.replace(
        CACHED, memory_table=None, memory_efficiency=0.5, fresh_bandwidth=3e9, **CPU_LIKE
    )
    times = predict_samples(truth, out, dtype="bf16")
    samples = [dataclasses.replace(s, measured_s=float(t)) for s, t in zip(out, times)]
    fit = fit_profile(
        dataclasses.replace(BASE, **CPU_LIKE), samples, dtype="bf16", source="synthetic"
    )
    assert 2.0**22.5 <= fit.profile.cache_bytes <= 2.0**23.5  # a step of the scan either way
    assert fit.profile.cached_time == pytest.approx(0.3, rel=0.2)
    assert fit.profile.fresh_bandwidth == pytest.approx(3e9, rel=0.2)
    assert fit.log_residual_sd < 0.05


def test_a_decode_loop_reads_what_fits_the_cache_faster():
    """A step after the first of a call reads the bytes that fit the cache at cached_time of
    their memory time; without a cache (datasheet profiles) nothing changes."""
    shape = load_shape("tiny")
    cached = dataclasses.replace(CACHED, cache_bytes=2.0**28)  # 256 MiB
    small, large = 1024.0, 2.0**24  # V: 0.5 MiB of f32 head weights, and 8 GiB
    f32 = Settings(weight_dtype="f32", kv_dtype="f32", act_dtype="f32")

    def memory_time(device, steps, vocab):
        cm = CostModel(device, shape, dataclasses.replace(f32, steps_per_call=steps))
        return sum(t.t_mem for t in cm.decode_times(vocab, 1.0, 64.0, xp=PyMath).values())

    for vocab in (small, large):  # no cache: one memory time however many steps a call runs
        assert memory_time(BASE, 8, vocab) == pytest.approx(memory_time(BASE, 1, vocab), rel=1e-12)
    # a call of one step starts cold; of 8, seven steps find a small step's bytes in cache
    assert memory_time(cached, 1, small) == pytest.approx(memory_time(TRUTH, 1, small), rel=1e-12)
    expected = 1.0 / 8 + 7.0 / 8 * 0.3  # a small step's bytes all fit
    ratio = memory_time(cached, 8, small) / memory_time(cached, 1, small)
    assert ratio == pytest.approx(expected, rel=1e-3)
    ratio = memory_time(cached, 8, large) / memory_time(cached, 1, large)
    assert ratio == pytest.approx(1.0, rel=1e-3)  # a large one's do not


@pytest.mark.slow
def test_kernel_timings_leave_the_dispatch_overhead_as_it_was():
    """Samples charged no host call and holding no attention or training op (GPU kernel
    timings) carry no information on those terms: the fit keeps the profile's values rather
    than inventing them."""
    samples = [
        dataclasses.replace(
            s, calls=0.0, kinds=("matmul",) * len(s.flops), row_bytes=(0.0,) * len(s.flops)
        )
        for s in synthetic(n=60)
    ]
    fit = fit_profile(BASE, samples, dtype="bf16", source="kernels")
    assert fit.profile.row_table is None  # no matrix-vector product: no one-row table
    assert fit.profile.dispatch_overhead_s == BASE.dispatch_overhead_s == 0.0
    assert fit.profile.attention_efficiency == fit.profile.train_efficiency == 1.0
    method = fit.profile.calibration["method"]
    assert "dispatch" not in method and "attention" not in method


@pytest.mark.slow
def test_a_calibrated_profile_round_trips_and_sweeps(fitted, tmp_path):
    from click.testing import CliRunner

    import cli
    from vocabjax.hardware import save_device

    _, fit = fitted
    path = save_device(fit.profile, tmp_path / "cal.json")
    back = load_device(str(path))
    assert back == fit.profile and back.calibrated
    args = ["sweep", "--vocab", "8k,32k", "--batch", "1,64", "--lam", "0,100", "--format", "json"]
    a = CliRunner().invoke(cli.main, [*args, "--device", str(path)])
    b = CliRunner().invoke(cli.main, [*args, "--device", "a100-80gb-datasheet"])
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    assert a.stdout != b.stdout  # the tables change the costs


def test_too_few_points_is_one_clear_error():
    samples = synthetic(n=10)
    with pytest.raises(UserError, match=f"at least {MIN_FIT_SAMPLES} points in the fit split"):
        fit_profile(BASE, samples, dtype="bf16", source="x")


def test_the_split_is_by_content():
    keys = [f"point {i}" for i in range(3000)]
    share = np.mean([is_held_out(k) for k in keys])
    assert 0.3 < share < 0.37
    assert [is_held_out(k) for k in keys[:50]] == [is_held_out(k) for k in keys[:50]]


@pytest.mark.parametrize(
    "table, message",
    [
        ([[1e6, 0.5], [1e5, 0.6]], "sizes must increase"),
        ([[1e6, 0.0]], "efficiency must be > 0"),
        ([[1e6, 65.0]], r"efficiency must be in \(0, 64\]"),
        ([[1e6]], "must be \\[size, efficiency\\]"),
        ([], "must be a non-empty list"),
    ],
)
def test_bad_tables_are_one_error(table, message):
    data = BASE.to_json()
    data["efficiency"]["memory_by_bytes"] = table
    with pytest.raises(UserError, match=message):
        DeviceProfile.from_json(data, where="p.json")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("cache_bytes", -1.0, "cache_bytes must be >= 0"),
        ("cache_bytes", float("nan"), "cache_bytes"),
        ("cached_time", 0.0, "cached_time must be > 0"),
        ("cached_time", 1.5, r"cached_time must be in \(0, 1\]"),
    ],
)
def test_a_bad_cache_is_one_error(field, value, message):
    data = CACHED.to_json()
    assert data["efficiency"]["cache_bytes"] == 2.0**23  # written where there is one
    data["efficiency"][field] = value
    with pytest.raises(UserError, match=message):
        DeviceProfile.from_json(data, where="p.json")
    assert "cache_bytes" not in BASE.to_json()["efficiency"]  # none: nothing written


@pytest.mark.parametrize("value", [-1.0, float("inf"), "fast"])
def test_a_bad_fresh_bandwidth_is_one_error(value):
    data = dataclasses.replace(BASE, fresh_bandwidth=2e9).to_json()
    assert data["ceilings"]["fresh_bandwidth"] == 2e9  # written where there is one
    data["ceilings"]["fresh_bandwidth"] = value
    with pytest.raises(UserError, match="ceilings.fresh_bandwidth"):
        DeviceProfile.from_json(data, where="p.json")
    assert "fresh_bandwidth" not in BASE.to_json()["ceilings"]  # none: nothing written


def test_the_builtin_calibrated_gpu_profiles():
    for name in ("a100-80gb", "h100-sxm"):
        cal, sheet = load_device(name), load_device(f"{name}-datasheet")
        assert cal.calibrated and not sheet.calibrated
        assert cal.name == name and sheet.name == f"{name}-datasheet"
        assert (sheet.compute_efficiency, sheet.memory_efficiency) == (1.0, 1.0)
        assert all(getattr(sheet, f) is None for f in TABLE_FIELDS)
        assert cal.peak_flops == sheet.peak_flops and cal.hbm_bandwidth == sheet.hbm_bandwidth
        assert "vidur" in cal.calibration["source"] and "vidur" in cal.source
        err = cal.calibration["held_out_median_abs_error_pct"]
        assert err["after"] < err["before"]


@pytest.mark.slow
def test_the_committed_gpu_tables_are_what_the_fit_gives(monkeypatch):
    """vocabjax/gpu_calibrations.py is reproduced by fitting sims/data (sims/calibrate_gpu.py)."""
    import importlib.util
    from pathlib import Path

    from vocabjax.gpu_calibrations import GPU_CALIBRATIONS

    path = Path(__file__).resolve().parents[1] / "sims" / "calibrate_gpu.py"
    monkeypatch.syspath_prepend(str(path.parent))  # its `import _common`
    spec = importlib.util.spec_from_file_location("calibrate_gpu", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    # The fit is float32 Adam: another host's kernels (or XLA's optimisation level) round
    # differently and move the fit's flattest directions by about 1% (0.99% measured at
    # --xla_backend_optimization_level=0), while its residual spread agrees to 1e-5. So the
    # parameters are held to 3% (a hand edit still shows) and the fit's quality to 1e-3.
    for name, file in script.FILES.items():
        samples, source = script.read(path.parent / "data" / file)
        fit = fit_profile(load_device(f"{name}-datasheet"), samples, dtype="bf16", source=source)
        committed = GPU_CALIBRATIONS[name]
        efficiency = committed["efficiency"]
        for field, key in TABLE_FIELDS.items():
            table = getattr(fit.profile, field)
            assert (table is None) == (key not in efficiency), key
            if table is not None:
                np.testing.assert_allclose(table.to_json(), efficiency[key], rtol=0.03)
        for kind in OP_KINDS:
            assert fit.profile.kind_efficiency(kind) == pytest.approx(efficiency[kind], rel=0.03)
        assert fit.profile.overlap == pytest.approx(efficiency["overlap"], rel=0.03)
        assert fit.profile.launch_overhead_s == pytest.approx(
            committed["launch_overhead_s"], rel=0.03
        )
        recorded = committed["calibration"]["log_residual_sd"]
        assert fit.log_residual_sd == pytest.approx(recorded, rel=1e-3)
