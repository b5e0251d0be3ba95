"""``python cli.py autotune`` through click's CliRunner: the profile it writes, exact errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import cli
from vocabjax import autotune as at
from vocabjax.hardware import load_device

SMALL = ["--vocab", "1000,3000", "--batch", "1,5", "--d-model", "64", "--dtype", "f32", "--quick"]


def invoke(*args):
    return CliRunner().invoke(cli.main, list(args))


@pytest.mark.slow
def test_writes_a_profile_and_prints_json(tmp_path):
    out = tmp_path / "dev.json"
    result = invoke("autotune", *SMALL, "--ops", "greedy", "--out", str(out), "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data == json.loads(out.read_text())
    assert set(data["ceilings"]) == {
        "hbm_bandwidth",
        "peak_flops",
        "ridge_point",
        "launch_overhead_s",
        "dispatch_overhead_s",
    }
    assert data["ceilings"]["dispatch_overhead_s"] == 0.0  # measured by validate --fit only
    assert {(r["vocab"], r["batch"]) for r in data["best"]} == {
        (1000, 1),
        (1000, 5),
        (3000, 1),
        (3000, 5),
    }
    assert all(r["op"] == "greedy" for r in data["kernels"])
    assert "[1/4] greedy V=1000 B=1 D=64 f32 xla:" in result.stderr
    assert f"wrote {out}" in result.stderr
    assert load_device(out).measured


@pytest.mark.slow
def test_table_shows_ceilings_and_roofline_fractions(tmp_path):
    out = tmp_path / "dev.json"
    result = invoke("autotune", *SMALL, "--ops", "logsumexp", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "ceilings of " in result.stdout and "ridge_point[f32]" in result.stdout
    header = [line for line in result.stdout.splitlines() if "roofline_fraction" in line]
    assert header and "time_us" in header[0]


@pytest.mark.slow
def test_a_killed_run_leaves_the_previous_profile(tmp_path, monkeypatch):
    out = tmp_path / "dev.json"
    assert invoke("autotune", *SMALL, "--ops", "greedy", "--out", str(out)).exit_code == 0
    before = out.read_text()
    calls = {"n": 0}
    real = at.time_interleaved

    def dying(*args, **kw):
        calls["n"] += 1
        if calls["n"] > 2:  # the ceilings and two points are timed, then the run is killed
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(at, "time_interleaved", dying)
    result = invoke("autotune", *SMALL, "--ops", "greedy,top_k", "--out", str(out))
    assert result.exit_code != 0 and calls["n"] == 3
    assert out.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["dev.json"]  # no temporary left behind


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["--ops", "beam"],
            "Error: Invalid value for '--ops': beam (choose from greedy, logsumexp, top_k, "
            "sample, linear_cross_entropy)",
        ),
        (["--vocab", "0"], "Error: Invalid value for '--vocab': vocab must be positive, got '0'"),
        (
            ["--batch", "x"],
            "Error: Invalid value for '--batch': batch 'x' is not a size "
            "(examples: 8k, 65536, 262k, 1m)",
        ),
        (
            ["--dtype", "fp8"],
            "Error: Invalid value for '--dtype': 'fp8' is not one of 'bf16', 'f32'.",
        ),
    ],
)
def test_bad_options_are_one_error_line(args, line):
    result = invoke("autotune", *args)
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1] == line


def test_help_has_an_example():
    result = invoke("autotune", "--help")
    assert result.exit_code == 0 and "python cli.py autotune --quick" in result.stdout
