"""``validate``: the cost model beside timings of the project's own model on this machine.

One real run of the test grid through the command line (seconds, no timing assertions): the
JSON's structure, finite positive figures, the summary against a recomputation, the output
file, progress on stderr. The predictions against a hand computation of the roofline from
DESIGN.md's equations, so a wrong mapping of a point's shape to the cost model fails. Bad
inputs as one ``Error:`` line with no file written. Other runs replace the timing with fixed
figures (``measure`` patched), so rendering, warnings and the plot cost no timing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner

import cli
from vocabjax import render, validation
from vocabjax.calibration import MIN_FIT_SAMPLES
from vocabjax.errors import UserError
from vocabjax.hardware import BUILTIN_DEVICES, DeviceProfile, save_device
from vocabjax.shapes import BUILTIN_SHAPES, ModelShape
from vocabjax.validation import FAMILIES, Grid, Point, get_grid, predict, timing
from vocabjax.validation import run as validation_run
from vocabjax.validation.fit import sample
from vocabjax.validation.grid import OP_FAMILIES, STEP_FAMILIES, W512_GQA

PEAK, BANDWIDTH, LAUNCH = 1.0e11, 2.0e10, 1.0e-5  # a CPU-like profile: ridge 5 FLOP/byte
CPU_PROFILE = DeviceProfile(
    name="cpu",
    peak_flops={"f32": PEAK},
    hbm_bandwidth=BANDWIDTH,
    memory_bytes=16e9,
    launch_overhead_s=LAUNCH,
    source="autotune 2026-01-01 00:00 UTC on cpu (cpu, jax 0.10.2, 2 host cores)",
    measured=True,
)
POINT_KEYS = {
    "family", "kind", "shape", "vocab", "batch", "context", "flops", "bytes", "launches",
    "launch_s", "calls", "dispatch_s", "predicted_s", "measured_s", "compile_s", "error_pct",
    "bound", "ops", "faults_per_call", "fresh_bytes", "repeat_spread_pct",
}  # fmt: skip
SUMMARY_KEYS = {"n", "median_abs_error_pct", "max_abs_error_pct"}


def invoke(*args):
    return CliRunner().invoke(cli.main, ["validate", *args])


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory) -> Path:
    return save_device(CPU_PROFILE, tmp_path_factory.mktemp("profile") / "cpu.json")


@pytest.fixture(scope="module")
def real_run(tmp_path_factory, profile_path):
    """The test grid timed once through the command line: (result, JSON, out path, the
    Validation the library returned)."""
    out_dir = tmp_path_factory.mktemp("out")
    out = out_dir / "validation.json"
    seen = []
    with pytest.MonkeyPatch.context() as mp:
        real = validation.validate
        mp.setattr(validation, "validate", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
        result = invoke(
            "--grid", "test", "--device", str(profile_path), "--format", "json", "--out", str(out)
        )
    assert result.exit_code == 0, result.output
    return result, json.loads(result.stdout), out, seen[0]


FRESH = 64 * 2**20  # the fresh memory fake_times gives every third point's call


def fake_times(monkeypatch, measured_s: float = 1e-3):
    """Skip the timing: every point takes ``measured_s`` (times 1, 2 or 3), compiles in 0.5 s,
    faults ``1000 measured_s`` pages per call, every third maps ``FRESH`` bytes afresh, and its
    timed calls spread by ``1e4 measured_s`` %."""

    def fake(points, grid, **kw):
        return [
            timing.Timed(
                measured_s * (1 + i % 3),
                0.5,
                1e3 * measured_s,
                0.0 if i % 3 else float(FRESH),
                1e4 * measured_s,
            )  # fmt: skip
            for i in range(len(points))
        ]

    monkeypatch.setattr(validation_run, "measure", fake)


# ---- one real run ------------------------------------------------------------------------------


@pytest.mark.slow
def test_json_has_every_family_with_finite_positive_figures(real_run):
    _, doc, _, _ = real_run
    assert doc["schema"] == 1 and doc["kind"] == "validation"
    assert doc["device"]["name"] == "cpu" and doc["device"]["mismatch"] is None
    assert doc["device"]["running_on"] == "cpu"
    assert {p["family"] for p in doc["points"]} == set(FAMILIES)
    assert len({p["context"] for p in doc["points"] if p["family"] == "decode"}) >= 2
    for p in doc["points"]:
        assert set(p) == POINT_KEYS
        for key in ("predicted_s", "measured_s", "flops"):
            assert math.isfinite(p[key]) and p[key] > 0, (key, p)
        assert math.isfinite(p["compile_s"]) and p["compile_s"] >= 0
        # counted around each timed call: a whole number of pages, the median of the rounds
        assert p["faults_per_call"] >= 0 and 2 * p["faults_per_call"] == int(
            2 * p["faults_per_call"]
        )
        # XLA's temporaries when glibc maps them afresh (32 MiB or more), else none
        assert p["fresh_bytes"] == 0 or p["fresh_bytes"] >= timing.FRESH_THRESHOLD
        assert math.isfinite(p["repeat_spread_pct"]) and p["repeat_spread_pct"] >= 0
        assert p["error_pct"] == pytest.approx(
            100 * (p["predicted_s"] - p["measured_s"]) / p["measured_s"], rel=1e-12
        )
        assert p["bound"] in ("compute", "memory", "launch")
        assert p["ops"] and all(o["flops"] >= 0 for o in p["ops"])
        assert p["flops"] == pytest.approx(sum(o["flops"] for o in p["ops"]), rel=1e-12)
        assert p["bytes"] == pytest.approx(sum(o["bytes"] for o in p["ops"]), rel=1e-12)
        assert p["predicted_s"] == pytest.approx(
            sum(o["t"] for o in p["ops"]) + p["launches"] * LAUNCH, rel=1e-12
        )
        if p["family"] == "train":  # its ops (CostModel.train_ops); no launches
            assert [o["op"] for o in p["ops"]] == [
                "train", "train_elementwise", "loss", "optimizer", "train_attention"
            ] and p["launches"] == 0  # fmt: skip


@pytest.mark.slow
def test_summary_equals_a_recomputation_from_the_points(real_run):
    _, doc, _, _ = real_run
    before = doc["summary"]["before"]
    assert set(before) == SUMMARY_KEYS | {"by_kind", "by_family", "by_bound"}

    def check(summary, points):
        errors = [abs(p["error_pct"]) for p in points]
        assert summary["n"] == len(errors)
        assert summary["median_abs_error_pct"] == pytest.approx(statistics.median(errors))
        assert summary["max_abs_error_pct"] == pytest.approx(max(errors))

    check(before, doc["points"])
    assert set(before["by_family"]) == set(FAMILIES)
    for family, s in before["by_family"].items():
        check(s, [p for p in doc["points"] if p["family"] == family])
    for bound, s in before["by_bound"].items():
        check(s, [p for p in doc["points"] if p["bound"] == bound])
    assert set(before["by_kind"]) == {"step", "op"}
    for kind, s in before["by_kind"].items():
        check(s, [p for p in doc["points"] if p["kind"] == kind])


@pytest.mark.slow
def test_out_is_the_printed_json_written_whole(real_run):
    _, doc, out, _ = real_run
    assert json.loads(out.read_text()) == doc
    assert sorted(x.name for x in out.parent.iterdir()) == [out.name]  # no temporary left


@pytest.mark.slow
def test_progress_goes_to_stderr(real_run):
    result, _, out, _ = real_run
    assert "validate: compiled 1/" in result.stderr
    assert "timing " in result.stderr and "round-robin" in result.stderr
    assert f"wrote {out}" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["table", "markdown", "csv"])
def test_formats_render_the_points_and_the_summary(real_run, monkeypatch, fmt):
    _, doc, _, measured = real_run
    monkeypatch.setattr(validation, "validate", lambda *a, **k: measured)
    result = invoke("--grid", "test", "--format", fmt)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    if fmt == "csv":
        assert lines[0].split(",") == [
            *validation.report.COLUMNS, "faults_per_call", "fresh_bytes", "repeat_spread_pct"
        ]  # fmt: skip
        assert len(lines) == 1 + len(doc["points"])
        return
    assert lines[0].startswith("validate on cpu (")
    header = next(i for i, ln in enumerate(lines) if "predicted_s" in ln)
    for name in ("family", "bound", "measured_s", "error_pct", "compile_s"):
        assert name in lines[header]
    assert any("median_abs_error_pct" in ln for ln in lines)
    assert any(ln.lstrip("| ").startswith("all ") for ln in lines)  # the overall summary row
    if fmt == "markdown":
        assert lines[header].startswith("| family |")


# ---- the predictions by hand ---------------------------------------------------------------------


def _hand(shape: ModelShape, family: str, vocab: int, batch: int, context: int) -> float:
    """The roofline of DESIGN.md written out: f32 weights, KV and activations (4 bytes),
    t = sum over ops of max(flops / peak, bytes / bandwidth) plus launches. Attention as the
    model computes it: every query against every cache position, the f32 scores written once,
    read twice by the softmax, its probabilities written and read (5 passes)."""
    d, n_layers, f = shape.d_model, shape.n_layers, shape.d_ff
    h, k, dh = shape.n_heads, shape.n_kv_heads, shape.dh
    n_nv = n_layers * (2 * d * h * dh + 2 * d * k * dh + (3 if shape.glu else 2) * d * f)
    act = 4 * d + 2 * (h + k) * dh + (3 if shape.glu else 2) * f  # per token per layer
    elementwise = 10 * d + (3 if shape.glu else 2) * f  # norms, activation, residual adds
    w = kv = a = 4
    b, v, t = batch, vocab, context

    def roof(flops, nbytes):
        return max(flops / PEAK, nbytes / BANDWIDTH)

    def layers(tokens):
        return roof(2 * tokens * n_nv, w * n_nv + tokens * n_layers * act * a) + roof(
            4 * tokens * n_layers * d, tokens * n_layers * elementwise * a
        )

    def attention(queries):
        pairs = b * queries * t
        kv_read = b * t * 2 * k * dh * kv * n_layers
        return roof(4 * pairs * h * dh * n_layers, kv_read + 5 * pairs * h * 4 * n_layers)

    layer_launches = n_layers * 8
    if family == "decode":
        ops = [
            roof(0, b * d * w),  # embedding gather
            layers(b),
            attention(1),
            roof(2 * b * v * d, w * v * d + 4 * b * v),  # unembedding, logits written
            roof(4 * b * v, 4 * b * v),  # sampling reads the logits
        ]
        return sum(ops) + (layer_launches + 3) * LAUNCH
    if family == "prefill":
        ops = [
            roof(0, b * t * d * w),
            layers(b * t),
            attention(t),
            roof(2 * b * v * d, w * v * d + 4 * b * v),
            roof(4 * b * v, 4 * b * v),  # the first token picked from the last logits
        ]
        return sum(ops) + (layer_launches + 2) * LAUNCH
    if family == "train":
        # forward and backward, each three times the forward: the matmuls' passes over the
        # weights (the head's included) and their activations, the windows' attention, the
        # elementwise kernels; the loss's six f32 passes over the logits; AdamW, f32: 8 passes
        # of 4 bytes over every parameter
        tokens = b * t
        passes = 3 * (w * (n_nv + v * d) + tokens * (n_layers * act + 2 * d) * a)
        train = roof(tokens * 6 * (n_nv + v * d), passes)
        norms = 3 * roof(4 * tokens * n_layers * d, tokens * n_layers * elementwise * a)
        loss = roof(4 * tokens * v, 6 * tokens * v * 4)
        return train + norms + loss + 3 * attention(t) + 32 * (n_nv + 2 * v * d) / BANDWIDTH
    if family == "backbone":
        return layers(b) + layer_launches * LAUNCH
    if family == "attention":
        return attention(1) + n_layers * LAUNCH
    if family == "unembedding":
        return roof(2 * b * v * d, w * v * d + 4 * b * v) + LAUNCH
    raise AssertionError(family)


HAND_CASES = [
    ("decode", 50257, 3, 200),
    ("decode", 1024, 64, 64),
    ("prefill", 4096, 5, 48),
    ("train", 65536, 4, 64),
    ("backbone", None, 1, None),
    ("backbone", None, 64, None),
    ("attention", None, 16, 256),
    ("unembedding", 65536, 1, None),
    ("unembedding", 8192, 64, None),
]


@pytest.mark.parametrize("shape", [BUILTIN_SHAPES["tiny"], W512_GQA], ids=lambda s: s.name)
@pytest.mark.parametrize(("family", "vocab", "batch", "context"), HAND_CASES)
def test_prediction_is_the_roofline_by_hand(shape, family, vocab, batch, context):
    q = predict(Point(family, shape, batch, vocab, context), CPU_PROFILE)
    expected = _hand(shape, family, vocab or 1, batch, context or 1)
    assert q.predicted_s == pytest.approx(expected, rel=1e-12)


@pytest.mark.slow
def test_the_real_runs_predictions_match_the_hand_roofline(real_run):
    _, doc, _, _ = real_run
    tiny = BUILTIN_SHAPES["tiny"]
    for p in doc["points"]:
        expected = _hand(tiny, p["family"], p["vocab"] or 1, p["batch"], p["context"] or 1)
        assert p["predicted_s"] == pytest.approx(expected, rel=1e-12), p["family"]


def test_bounds_follow_the_roofline():
    tiny = BUILTIN_SHAPES["tiny"]
    b1 = predict(Point("unembedding", W512_GQA, 1, 65536), CPU_PROFILE)
    b64 = predict(Point("unembedding", W512_GQA, 64, 65536), CPU_PROFILE)
    assert (b1.bound, b64.bound) == ("memory", "compute")  # intensity ~B/2 against ridge 5
    assert predict(Point("attention", tiny, 1, None, 16), CPU_PROFILE).bound == "launch"
    assert predict(Point("train", tiny, 4, 1024, 64), CPU_PROFILE).bound == "compute"


def test_a_measured_unembedding_table_prices_the_decode_step():
    rows = [
        {"op": "greedy", "vocab": v, "batch": b, "d_model": 128, "dtype": "f32", "impl": "xla",
         "time_s": 1e-3 * v / 1024 * b, "roofline_fraction": 0.5}
        for v in (1024, 4096) for b in (1, 4)
    ]  # fmt: skip
    data = {**CPU_PROFILE.to_json(), "best": rows}
    device = DeviceProfile.from_json(data)
    q = predict(Point("decode", BUILTIN_SHAPES["tiny"], 4, 4096, 64), device)
    by_op = {o.op: o for o in q.ops}
    assert by_op["unembedding"].bound == "measured"
    assert by_op["unembedding"].t == pytest.approx(16e-3)
    assert by_op["sampling"].t == 0
    assert q.launches == 2 * 8 + 1  # a measured head is one launch


# ---- the grids ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["full", "quick"])
def test_presets_cover_the_issue_grid(name):
    grid = get_grid(name)
    assert BUILTIN_SHAPES["tiny"] in grid.shapes and len(grid.shapes) >= 3
    assert min(grid.vocabs) <= 1024 and max(grid.vocabs) >= 65536
    points = [
        p
        for p in grid.points()
        if validation.call_flops(p, predict(p, CPU_PROFILE), grid.decode_steps) <= grid.max_flops
    ]
    assert {p.family for p in points} == set(FAMILIES)
    assert {p.batch for p in points} >= {1, 4, 16, 64}
    assert len({p.context for p in points if p.family == "decode"}) >= 2
    bounds = {predict(p, CPU_PROFILE).bound for p in points}
    assert {"memory", "compute"} <= bounds  # on a CPU-like roofline, both occur
    if name == "full":
        assert {p.batch for p in points if p.family == "decode"} >= {1, 4, 16, 64}


def test_a_grid_refuses_contexts_inside_the_timed_steps():
    with pytest.raises(UserError, match="must exceed decode_steps=8"):
        Grid(**{**vars(get_grid("test")), "contexts": (8,), "decode_steps": 8})
    with pytest.raises(UserError, match="must exceed decode_steps=32"):  # the longest loop
        Grid(**{**vars(get_grid("test")), "loop_steps": (1, 32)})
    for bad, message in (((4,), "repeat a length"), ((0,), "positive integers")):
        with pytest.raises(UserError, match=message):
            Grid(**{**vars(get_grid("test")), "loop_steps": bad})


def test_the_loops_grid_times_each_decode_configuration_at_three_lengths():
    grid = get_grid("loops")
    decode = [p for p in grid.points() if p.family == "decode"]
    assert {p.family for p in grid.points()} == {"decode", "attention"}
    by_config: dict[str, set[int]] = {}
    for p in decode:
        by_config.setdefault(p.configuration(), set()).add(p.per_call(grid.decode_steps))
    assert set(map(frozenset, by_config.values())) == {frozenset({1, 8, 32})}
    p = decode[1]
    assert p.label() == f"{p.configuration()} S={p.steps}" and decode[0].label() == (
        decode[0].configuration()
    )
    # priced per step of its own loop: one host call shared by its steps
    assert predict(p, CPU_PROFILE, decode_steps=8).calls == 1 / p.steps


def test_points_over_the_flop_cap_are_left_out(monkeypatch):
    fake_times(monkeypatch)
    grid = Grid(**{**vars(get_grid("test")), "max_flops": 2e6})
    v = validation.validate(CPU_PROFILE, grid)
    cap = grid.max_flops
    assert v.skipped and v.results
    for r in v.results:
        assert validation.call_flops(r.point, r.prediction, grid.decode_steps) <= cap
    assert len(v.results) + len(v.skipped) == len(grid.points())


# ---- devices -----------------------------------------------------------------------------------


def test_another_device_kind_is_a_warning_and_is_said_in_the_output(monkeypatch):
    fake_times(monkeypatch)
    result = invoke("--grid", "test", "--device", "a100-80gb", "--format", "json")
    assert result.exit_code == 0, result.output
    note = (
        "device profile 'a100-80gb' is a datasheet profile of 'a100-80gb', not this machine's "
        "'cpu': the predictions are for that device, the timings for this one"
    )
    assert f"warning: {note}" in result.stderr
    assert json.loads(result.stdout)["device"]["mismatch"] == note
    table = invoke("--grid", "test", "--device", "a100-80gb")
    assert f"note: {note}" in table.stdout


def test_profile_kind_reads_a_measured_profiles_source():
    source = "autotune 2026-01-01 00:00 UTC on NVIDIA H200 (gpu, jax 0.10.2, 16 host cores)"
    gpu = DeviceProfile(**{**vars(CPU_PROFILE), "name": "nvidia-h200", "source": source})
    assert validation.profile_kind(gpu) == "NVIDIA H200"
    assert validation.device_mismatch(gpu, "NVIDIA H200") is None
    assert "was measured on 'NVIDIA H200'" in validation.device_mismatch(gpu, "cpu")
    assert validation.device_mismatch(CPU_PROFILE, "cpu") is None
    assert validation.profile_kind(BUILTIN_DEVICES["h100-sxm"]) == "h100-sxm"


def test_measure_default_measures_this_machine():
    device = validation.load_validation_device("measure")
    assert device.measured and device.name == "cpu"
    assert device.flops("f32") > 0 and device.hbm_bandwidth > 0
    assert validation.device_mismatch(device, "cpu") is None


def test_plot_is_written(monkeypatch, tmp_path, profile_path):
    fake_times(monkeypatch)
    out = tmp_path / "v.png"
    result = invoke("--grid", "test", "--device", str(profile_path), "--plot", str(out))
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- bad input ---------------------------------------------------------------------------------


def _corrupt(tmp_path: Path) -> str:
    path = tmp_path / "broken.json"
    path.write_text('{"schema": 1, "kind": "device", "name": ')
    return str(path)


def _no_f32(tmp_path: Path) -> str:
    data = CPU_PROFILE.to_json()
    data["ceilings"] = {**data["ceilings"], "peak_flops": {"bf16": 1e12}, "ridge_point": {}}
    path = tmp_path / "bf16.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize(
    ("args", "code", "line"),
    [
        (
            lambda tmp: ["--device", "nope"],
            1,
            f"Error: unknown device 'nope' (builtin: {', '.join(BUILTIN_DEVICES)}; "
            "or a profile .json)",
        ),
        (lambda tmp: ["--device", _corrupt(tmp)], 1, None),
        (
            lambda tmp: ["--device", _no_f32(tmp)],
            1,
            "Error: device 'cpu' has no peak FLOP/s for dtype 'f32'",
        ),
        (
            lambda tmp: ["--plot", str(tmp / "v.txt")],
            2,
            "Error: Invalid value for '--plot': plot file '{tmp}/v.txt' must end in .png, "
            ".svg or .pdf",
        ),
        (lambda tmp: ["--quick"], 2, "Error: --quick and --grid test clash: give one"),
    ],
    ids=["unknown", "corrupt", "no-f32", "plot-suffix", "quick-and-grid"],
)
def test_bad_input_is_one_error_line_and_no_file(tmp_path, monkeypatch, args, code, line):
    fake_times(monkeypatch)
    out = tmp_path / "v.json"
    result = invoke("--grid", "test", *args(tmp_path), "--out", str(out))
    assert result.exit_code == code, result.output
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in result.output
    if line is not None:
        assert errors[0] == line.replace("{tmp}", str(tmp_path))
    else:
        assert "broken.json" in errors[0]
    assert not out.exists()


def test_a_grid_that_does_not_fit_in_memory_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(validation_run.at, "_memory_bytes", lambda device: 1e6)
    timed = []
    monkeypatch.setattr(validation_run, "measure", lambda *a, **k: timed.append(a))
    out = tmp_path / "v.json"
    result = invoke("--grid", "test", "--device", "a10g", "--out", str(out))
    assert result.exit_code == 1
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("Error: grid 'test': its points hold about ")
    assert "(the tiny points " in line
    assert line.endswith("above 70% of this machine's 0.0 GB; use --quick or a grid with fewer, "
                         "smaller points")  # fmt: skip
    assert not timed and not out.exists()


def test_help_has_an_example():
    result = invoke("--help")
    assert result.exit_code == 0
    assert "python cli.py validate --quick" in result.stdout
    assert "--grid" in result.stdout and "loops" in result.stdout  # the loops grid, named


@pytest.mark.slow
def test_render_module_formats_every_row(real_run):
    _, _, _, measured = real_run
    for fmt in ("table", "markdown", "csv"):
        text = render.rows(validation.point_rows(measured), fmt)
        assert text.count("\n") >= len(measured.results)


# ---- --fit -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fit_recovers_a_machine_and_prices_as_the_fit_does(monkeypatch, tmp_path):
    """Timings made by a known 'machine' (efficiency tables, launch and dispatch overheads,
    attention and training scales): the fit on the quick grid's points finds it, and the
    re-priced held-out points match."""
    import dataclasses

    from vocabjax.calibration import predict_samples
    from vocabjax.hardware import EfficiencyTable, load_device
    from vocabjax.validation.fit import calibrate, sample

    truth = dataclasses.replace(
        CPU_PROFILE,
        launch_overhead_s=2e-5,
        dispatch_overhead_s=3e-4,
        attention_efficiency=0.2,
        train_efficiency=0.4,
        elementwise_efficiency=0.5,
        sampling_efficiency=0.1,
        intensity_table=EfficiencyTable((0.5, 5.0, 50.0, 500.0), (0.05, 0.2, 0.5, 0.7)),
        memory_table=EfficiencyTable((1e4, 1e6, 1e8, 1e10), (3.0, 1.5, 0.8, 0.6)),
        row_table=EfficiencyTable((512.0, 1024.0, 2048.0), (1.0, 1.3, 1.6)),
        fresh_bandwidth=2e9,
    )

    def fresh(p):  # the larger prefills and training steps map 64-512 MiB afresh per call
        big = p.family in ("prefill", "train") and p.batch >= 4
        return float(FRESH * p.batch // 2) if big else 0.0

    def machine(points, grid, **kw):
        return [
            timing.Timed(
                predict(p, truth, decode_steps=grid.decode_steps, fresh_bytes=fresh(p)).predicted_s,
                0.1, None, fresh(p),
            )
            for p in points
        ]  # fmt: skip

    monkeypatch.setattr(validation_run, "measure", machine)
    v = validation.validate(CPU_PROFILE, "quick")
    cal = calibrate(v, FAMILIES)
    held = cal.held_out(cal.after)
    assert len(held) >= 10 and len(cal.fit.fit_keys) >= 12
    before = validation.summary(cal.held_out(v.results))["median_abs_error_pct"]
    after = validation.summary(held)["median_abs_error_pct"]
    assert before > 30 and after < 10, (before, after)
    fitted = cal.fit.profile
    assert fitted.dispatch_overhead_s == pytest.approx(3e-4, rel=0.3)
    assert fitted.attention_efficiency == pytest.approx(0.2, rel=0.3)
    assert fitted.train_efficiency == pytest.approx(0.4, rel=0.3)
    assert fitted.sampling_efficiency == pytest.approx(0.1, rel=0.3)  # the pick of a token
    assert fitted.fresh_bandwidth == pytest.approx(2e9, rel=0.3)  # page faults of fresh memory
    assert fitted.row_table is not None  # the grid's decode steps at B = 1 are one-row matmuls
    # by default only the steps are fitted: every op point is then one the fit never saw
    steps_only = calibrate(v)
    assert steps_only.fit.profile.calibration["fitted_families"] == list(STEP_FAMILIES)
    unseen = steps_only.held_out(steps_only.after)
    assert {r.point.family for r in unseen} >= set(OP_FAMILIES)
    held_steps = [r for r in unseen if r.point.family in STEP_FAMILIES]
    assert validation.summary(held_steps)["median_abs_error_pct"] < 10
    # the cost model and the fit price every point alike
    priced = predict_samples(cal.fit.profile, [sample(r) for r in v.results], dtype="f32")
    for r, ours in zip(cal.after, priced):
        assert r.prediction.predicted_s == pytest.approx(ours, rel=1e-9), r.point.label()
    # the command line writes the calibrated profile, which sweep then reads
    profile, out = tmp_path / "cal.json", tmp_path / "v.json"
    figure = tmp_path / "v.png"
    result = invoke("--quick", "--device", "a100-80gb", "--fit", "--save-profile", str(profile),
                    "--out", str(out), "--plot", str(figure))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "the calibrated profile" in result.stdout  # its fitted parameters, one row each
    assert "dispatch overhead (one host call)" in result.stdout
    assert figure.stat().st_size > 0  # two panels: before, and the points the fit never saw
    doc = json.loads(out.read_text())
    assert set(doc["summary"]) == {"before", "before_held_out", "after"}
    assert doc["summary"]["after"]["n"] == sum(p["held_out"] for p in doc["points"])
    assert load_device(str(profile)).calibrated and doc["calibration"]["fit_points"] >= 12
    swept = CliRunner().invoke(cli.main, ["sweep", "--device", str(profile), "--vocab", "8k"])
    assert swept.exit_code == 0 and "calibrated on validate --grid quick" in swept.output


def test_fit_on_too_few_points_is_one_error_and_no_file(tmp_path, monkeypatch):
    fake_times(monkeypatch)
    profile = tmp_path / "cal.json"
    result = invoke("--grid", "test", "--device", "a100-80gb", "--fit", "--save-profile",
                    str(profile))  # fmt: skip
    assert result.exit_code == 1 and "Traceback" not in result.output
    errors = [x for x in result.output.splitlines() if x.startswith("Error:")]
    assert (
        len(errors) == 1
        and f"needs at least {MIN_FIT_SAMPLES} points in the fit split" in errors[0]
    )
    assert not profile.exists()
    bad = invoke("--grid", "test", "--save-profile", str(profile))
    assert bad.exit_code == 2 and "--save-profile needs --fit" in bad.output


def test_fit_on_an_unknown_family_is_one_error_before_any_work():
    result = invoke("--grid", "test", "--fit", "--fit-on", "decode,nope")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "Error: --fit-on 'nope' is not one of steps, ops, all, decode" in result.output
    assert "validate [" not in result.output  # nothing was timed


# ---- a saved run read back (--from) -------------------------------------------------------------


@pytest.mark.slow
def test_a_saved_run_prices_again_as_it_was_priced(real_run, tmp_path):
    """``--from`` reads the saved run's measurements and prices them on the profile the run
    used: the same points and figures; on another profile, the same measurements priced anew."""
    _, doc, out, v = real_run
    back = validation.read_validation(out)
    assert [r.point for r in back.results] == [r.point for r in v.results]
    assert [r.measured_s for r in back.results] == [r.measured_s for r in v.results]
    assert back.device == v.device and back.grid == v.grid
    again = invoke("--from", str(out), "--format", "json")
    assert again.exit_code == 0, again.output
    redo = json.loads(again.stdout)
    for a, b in zip(doc["points"], redo["points"], strict=True):
        assert a["predicted_s"] == b["predicted_s"] and a["measured_s"] == b["measured_s"]
    slim = tmp_path / "slim.json"
    slim.write_text(json.dumps(validation.measured_fields(doc)))
    assert slim.stat().st_size < out.stat().st_size / 2
    other = validation.read_validation(slim, "a100-80gb-datasheet")
    assert other.device.name == "a100-80gb-datasheet" and other.mismatch
    assert [r.measured_s for r in other.results] == [r.measured_s for r in v.results]
    assert [r.prediction.predicted_s for r in other.results] != [
        r.prediction.predicted_s for r in v.results
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(kind="device"), "expected a 'validation' profile"),
        (lambda d: d["points"][0].pop("measured_s"), "points[0]: missing field(s) measured_s"),
        (lambda d: d["points"][0].update(measured_s=-1.0), "points[0].measured_s"),
        (lambda d: d["points"][0].update(shape="gpt9"), "points[0].shape"),
        (lambda d: d["points"].append(dict(d["points"][0])), "a point is listed twice"),
    ],
    ids=["kind", "missing", "negative", "shape", "twice"],
)
def test_a_bad_saved_run_is_one_error_line(real_run, tmp_path, edit, message):
    _, doc, _, _ = real_run
    data = json.loads(json.dumps(doc))
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    result = invoke("--from", str(path))
    assert result.exit_code == 1 and "Traceback" not in result.output
    errors = [x for x in result.output.splitlines() if x.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], result.output
    clash = invoke("--from", str(path), "--quick")
    assert clash.exit_code == 2 and "--from prices a saved run's points" in clash.output


def test_a_busy_machine_is_a_warning_and_its_load_is_recorded(monkeypatch, profile_path):
    fake_times(monkeypatch)
    monkeypatch.setattr(validation_run.os, "getloadavg", lambda: (7.5, 7.0, 6.0))
    monkeypatch.setattr(validation_run.os, "cpu_count", lambda: 2)
    result = invoke("--grid", "test", "--device", str(profile_path), "--format", "json")
    assert result.exit_code == 0, result.output
    assert "warning: load average 7.5 on 2 cores: other work shares this machine" in result.stderr
    assert json.loads(result.stdout)["load_average"] == 7.5
    monkeypatch.setattr(validation_run.os, "getloadavg", lambda: (0.2, 0.2, 0.2))
    quiet = invoke("--grid", "test", "--device", str(profile_path), "--format", "json")
    assert "load average" not in quiet.stderr and json.loads(quiet.stdout)["load_average"] == 0.2


# ---- several runs of one grid combined (--from, repeated) ---------------------------------------


def _runs(monkeypatch, tmp_path, profile_path, scales=(1e-3, 3e-3, 2e-3)) -> list[Path]:
    paths = []
    for i, scale in enumerate(scales):
        fake_times(monkeypatch, scale)
        path = tmp_path / f"run{i}.json"
        result = invoke("--grid", "test", "--device", str(profile_path), "--out", str(path))
        assert result.exit_code == 0, result.output
        paths.append(path)
    return paths


def test_runs_combine_into_each_points_median(monkeypatch, tmp_path, profile_path):
    """Each point's time is its median over the runs, its spread (max - min) / median; the
    document says how many runs, and a combined run saved and read back stays combined."""
    paths = _runs(monkeypatch, tmp_path, profile_path)
    single = [json.loads(p.read_text())["points"] for p in paths]
    args = [a for p in paths for a in ("--from", str(p))]
    result = invoke(*args, "--format", "json", "--out", str(tmp_path / "all.json"))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["runs"] == 3 and "3 runs combined" in result.stderr
    for i, p in enumerate(doc["points"]):
        times = [run[i]["measured_s"] for run in single]
        assert p["measured_s"] == statistics.median(times)
        spread = 100 * (max(times) - min(times)) / p["measured_s"]
        assert p["runs_spread_pct"] == pytest.approx(spread)
        assert p["predicted_s"] == single[0][i]["predicted_s"]  # priced as the first run
        assert p["faults_per_call"] == statistics.median(r[i]["faults_per_call"] for r in single)
        spreads = [r[i]["repeat_spread_pct"] for r in single]
        assert p["repeat_spread_pct"] == statistics.median(spreads) == pytest.approx(20.0)
        assert p["fresh_bytes"] == single[0][i]["fresh_bytes"] == (0.0 if i % 3 else FRESH)
    back = validation.read_validation(tmp_path / "all.json")
    assert back.runs == 3 and back.results[0].runs_spread_pct == pytest.approx(100.0)
    assert back.results[0].faults_per_call == pytest.approx(2.0)
    table = invoke(*args, "--format", "csv")
    assert {"runs_spread_pct", "faults_per_call"} <= set(table.stdout.splitlines()[0].split(","))
    assert validation.read_validations(paths[:1]).runs == 1  # one run is itself


def test_combined_runs_span_their_earliest_to_their_latest_date(
    monkeypatch, tmp_path, profile_path
):
    paths = _runs(monkeypatch, tmp_path, profile_path)
    for path, date in zip(
        paths, ["2026-12-07 04:54 UTC", "2026-12-06 02:31 UTC", "2026-12-07 04:07 UTC"]
    ):
        doc = json.loads(path.read_text())
        path.write_text(json.dumps({**doc, "date": date}))
    assert validation.read_validations(paths).date == "2026-12-06 02:31 UTC .. 2026-12-07 04:54 UTC"


@pytest.mark.parametrize(
    ("edit", "message"),
    [("loops", "only runs that loop alike combine"), ("points", "combine only alike")],
)
def test_runs_that_disagree_do_not_combine(monkeypatch, tmp_path, profile_path, edit, message):
    """Runs whose decode loops run other lengths, or runs of one grid with other points."""
    a, b = _runs(monkeypatch, tmp_path, profile_path, (1e-3, 2e-3))
    data = json.loads(b.read_text())
    if edit == "loops":
        data["grid"]["decode_steps"] += 1
    else:
        data["points"].pop()
    b.write_text(json.dumps(data))
    result = invoke("--from", str(a), "--from", str(b))
    assert result.exit_code == 1 and "Traceback" not in result.output
    errors = [x for x in result.output.splitlines() if x.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], result.output


def test_runs_of_two_grids_combine_into_their_union(monkeypatch, tmp_path, profile_path):
    """A run of the test grid and one of the same grid with decode loops of 1 and 8 steps too
    (``loop_steps``): the union of their points, the shared ones the median of both runs, a
    loop of its own length its ratio to the grid's loop timed beside it times that loop's
    median; the loops priced at their own steps per call, each configuration's loops fitted
    or held out together."""

    def timed(scale):  # each point's time by its label, so the runs' shared points agree
        def fake(points, grid, **kw):
            return [timing.Timed(scale * (1 + len(p.label()) % 3), 0.5, 10.0, 0.0) for p in points]

        monkeypatch.setattr(validation_run, "measure", fake)

    a, b = tmp_path / "test.json", tmp_path / "loops.json"
    timed(1e-3)
    assert invoke("--grid", "test", "--device", str(profile_path), "--out", str(a)).exit_code == 0
    loops = dataclasses.replace(get_grid("test"), name="test-loops", loop_steps=(1, 8))
    monkeypatch.setattr(validation_run, "get_grid", lambda name: loops)
    timed(3e-3)
    assert invoke("--grid", "test", "--device", str(profile_path), "--out", str(b)).exit_code == 0
    runs = [validation.read_validation(p) for p in (a, b)]
    both = validation.read_validations([a, b])
    labels = [r.point.label() for r in both.results]
    assert len(labels) == len(set(labels)) == len(runs[1].results) > len(runs[0].results)
    first = {r.point.label(): r.measured_s for r in runs[0].results}
    second = {r.point.label(): r.measured_s for r in runs[1].results}
    for r in both.results:
        label, base = r.point.label(), r.point.configuration()
        times = [t[label] for t in (first, second) if label in t]
        if r.point.steps is None:
            assert r.measured_s == statistics.median(times) and both.runs == 2
        else:  # its ratio to the loop timed beside it, on that loop's median over both runs
            anchor = statistics.median([first[base], second[base]])
            assert r.measured_s == pytest.approx(anchor * second[label] / second[base])
        if r.point.family == "decode":
            steps = r.point.steps or loops.decode_steps
            assert r.prediction.calls == pytest.approx(1 / steps)
    one = [r for r in both.results if r.point.steps == 1]
    assert one and all(r.point.label().endswith(" S=1") for r in one)
    # the split goes by configuration: a decode configuration's loops are fitted or held out
    # together, and every other point splits as before (its configuration is its label)
    for r in both.results:
        s = sample(r)
        assert s.key == r.point.label() and s.split_key == r.point.configuration()
        assert (s.split_key == s.key) == (r.point.steps is None)


def test_by_shape_measures_each_shape_as_its_own_set(monkeypatch):
    """``measure(by_shape=True)`` builds and times one set per model shape, in the grid's
    order of shapes, and hands back every point's figures in the order of the points."""
    other = ModelShape("other", d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64)
    grid = get_grid("test")
    points = [*grid.points(), *dataclasses.replace(grid, shapes=(other,)).points()]
    points = points[::2] + points[1::2]  # the two shapes' points mixed
    sets = []

    def fake_set(chosen, g, **kw):
        sets.append([p.shape.name for p in chosen])
        return [timing.Timed(float(points.index(p)), 0.0, None, None) for p in chosen]

    monkeypatch.setattr(timing, "_measure_set", fake_set)
    times = timing.measure(points, grid, by_shape=True)
    assert [t.seconds for t in times] == [float(i) for i in range(len(points))]
    shapes = list(dict.fromkeys(p.shape.name for p in points))
    assert len(shapes) == 2 and [set(s) for s in sets] == [{n} for n in shapes]
    assert sum(len(s) for s in sets) == len(points)
    sets.clear()
    timing.measure(points, grid)  # one set of every point
    assert len(sets) == 1 and len(sets[0]) == len(points)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flag", "key", "said"),
    [("--by-shape", "by_shape", "validate: timing"), ("--warm", "warm", "called back to back")],
)
def test_a_timing_mode_times_every_point_says_so_and_combines_only_alike(
    tmp_path, profile_path, flag, key, said
):
    """``--by-shape`` (each shape's points alone) and ``--warm`` (each point's calls back to
    back): every point of the test grid timed, the run says how (in its JSON and read back),
    a run timed the other way does not combine with it, and ``--from`` refuses the flag."""
    out = tmp_path / "mode.json"
    result = invoke("--grid", "test", "--device", str(profile_path), flag, "--format", "json",
                    "--out", str(out))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert said in result.stderr
    doc = json.loads(result.stdout)
    assert doc[key] is True and all(p["measured_s"] > 0 for p in doc["points"])
    assert getattr(validation.read_validation(out), key)
    data = json.loads(out.read_text())
    data[key] = False
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    assert not getattr(validation.read_validation(other), key)
    mixed = invoke("--from", str(out), "--from", str(other))
    assert mixed.exit_code == 1 and "only runs timed alike combine" in mixed.output
    refit = invoke("--from", str(out), flag)
    assert refit.exit_code == 2 and "--from prices a saved run" in refit.output


@pytest.mark.parametrize("warm", [False, True])
def test_warm_calls_each_point_back_to_back_without_eviction(monkeypatch, warm):
    """``measure(warm=True)`` times each point's calls in a row of their own, nothing between
    them; the default times every point in one round-robin with the cache evicted before every
    call. Either way each point gets its own median, spread and faults."""
    grid = get_grid("test")
    points = grid.points()
    built = {}

    class FakeGroup:
        def __init__(self, shape, grid, points, seed):
            pass

        def build(self, p):
            built[p.label()] = lambda: None
            return timing.Built(built[p.label()], 0.5, 0.0)

    sets = []

    def fake_rounds(calls, arg_sets, settings, *, between=None, tally=None):
        sets.append((list(calls), between))
        for j in range(len(calls)):
            tally.add(j, 0.0, 2.0)
        return [[1.0 + len(sets), 2.0 + len(sets), 3.0 + len(sets)] for _ in calls]

    def evict():
        return None

    monkeypatch.setattr(timing, "Group", FakeGroup)
    monkeypatch.setattr(timing, "time_rounds", fake_rounds)
    monkeypatch.setattr(timing, "cache_evictor", lambda: evict)
    times = timing.measure(points, grid, warm=warm)
    calls = [built[p.label()] for p in points]
    if warm:
        assert sets == [([c], None) for c in calls]
    else:
        assert sets == [(calls, evict)]
    for i, (p, t) in enumerate(zip(points, times, strict=True)):
        n = 1 + (i + 1 if warm else 1)
        assert t.seconds == pytest.approx((1.0 + n) / p.per_call(grid.decode_steps))
        assert t.repeat_spread_pct == pytest.approx(100 * 2.0 / (1.0 + n))
        assert t.faults_per_call == 2.0 and t.compile_s == 0.5


def test_fresh_bytes_are_xlas_temporaries_that_glibc_maps_afresh():
    """A call whose temporary buffer is 32 MiB or more maps it afresh (every page faults on
    every call); a smaller one is served from the heap: none."""
    import jax
    import jax.numpy as jnp

    def twice(x_nk):  # x x^T is a temporary (N x N f32), reduced back to N x K
        return (x_nk @ x_nk.T) @ x_nk

    def compiled(n):
        return jax.jit(twice).lower(jax.ShapeDtypeStruct((n, 8), jnp.float32)).compile()

    big = timing.fresh_bytes(compiled(4096))  # a 64 MiB temporary
    assert big >= 4096 * 4096 * 4 and big >= timing.FRESH_THRESHOLD
    assert timing.fresh_bytes(compiled(512)) == 0.0  # 1 MiB: from the heap
