"""sweep and plan through click's CliRunner: outputs, options, exact errors."""

import csv
import io
import json

import pytest
from click.testing import CliRunner

import cli
from vocabjax.hardware import load_device, save_device

SMALL = ["--vocab", "8k,32k,262k", "--batch", "1,64", "--lam", "0,100"]
# The default device's datasheet profile, for tests that do not read the ensemble's share:
# without a calibration the grid function has no ensemble and compiles several times faster.
DATASHEET = ("--device", "a100-80gb-datasheet")


def run(*args):
    result = CliRunner().invoke(cli.main, list(args))
    return result


def test_help_lists_the_commands_and_version():
    out = run("--help")
    assert out.exit_code == 0
    for name in ("sweep", "plan"):
        assert name in out.output
    assert "Example" in out.output
    assert run("-h").exit_code == 0
    assert "vocabjax, version" in run("--version").output
    assert "python cli.py sweep" in run("sweep", "-h").output


@pytest.mark.slow
def test_default_sweep_prints_a_v_star_table():
    out = run("sweep")
    assert out.exit_code == 0, out.output
    assert "V* on a100-80gb" in out.output and "paper-1.5b" in out.output
    lines = out.output.splitlines()
    header = next(line for line in lines if line.strip().startswith("B"))
    assert "lam=0" in header and "lam=1000" in header and "infer-only" in header
    for b in ("1", "4", "16", "64", "256"):
        assert any(line.split()[0] == b for line in lines if line.strip()), b


@pytest.mark.slow
def test_sweep_json_is_json_alone():
    out = CliRunner().invoke(cli.main, ["sweep", *SMALL, "--format", "json"])
    assert out.exit_code == 0
    data = json.loads(out.stdout)
    assert data["schema"] == 1
    assert len(data["table"]) == 4
    for row in data["table"]:
        assert {"device", "model", "batch", "lam", "v_star", "cost_per_byte"} <= set(row)
        assert row["v_star"] in (8192, 32768, 262144)
    assert len(data["break_even"]) == 6


def test_sweep_csv_and_markdown():
    out = run("sweep", *SMALL, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    assert len(rows) == 4 and rows[0]["device"] == "a100-80gb"
    md = run("sweep", *SMALL, "--format", "markdown", "--break-even")
    assert md.exit_code == 0 and "| B | lam=0 | lam=100 | infer-only |" in md.output
    assert "break-even lambda" in md.output


@pytest.mark.slow
def test_sweep_several_devices_and_models():
    out = run(
        "sweep",
        *SMALL,
        "--device",
        "a10g",
        "--device",
        "h200",
        "--model",
        "llama-1b",
        "--model",
        "gpt2-small",
        "--format",
        "json",
    )
    data = json.loads(out.stdout)
    assert {(r["device"], r["model"]) for r in data["table"]} == {
        ("a10g", "llama-1b"),
        ("a10g", "gpt2-small"),
        ("h200", "llama-1b"),
        ("h200", "gpt2-small"),
    }


@pytest.mark.slow
def test_sweep_options_change_the_answer():
    def v_star(*extra):
        data = json.loads(
            run(
                "sweep",
                "--batch",
                "256",
                "--lam",
                "1000",
                "--model",
                "paper-100m",
                "--device",
                "a10g",
                "--format",
                "json",
                *extra,
            ).stdout
        )
        return data["table"][0]["v_star"]

    assert v_star("--cost-model", "full") > v_star("--cost-model", "weights-only")
    assert v_star("--cost-model", "weights-only", "--fused-logits") >= v_star(
        "--cost-model", "weights-only"
    )


def test_sweep_with_a_compression_profile(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(
        json.dumps(
            {
                "schema": 1,
                "kind": "compression",
                "corpus": "flat",
                "points": [
                    {"vocab": 8192, "bytes_per_token": 4.0},
                    {"vocab": 524288, "bytes_per_token": 4.0},
                ],
            }
        )
    )
    args = ("--compression", str(path), *DATASHEET, "--format", "json")
    data = json.loads(run("sweep", *SMALL, *args).stdout)
    # no compression gain from a larger vocabulary: the smallest V always wins
    assert {r["v_star"] for r in data["table"]} == {8192}
    assert data["compression"] == "flat"


def test_sweep_with_training_profile_and_quality(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(
        json.dumps(
            {
                "schema": 1,
                "kind": "training",
                "points": [
                    {"vocab": 8192, "tokens_per_s": 2000.0, "bpb": 1.20},
                    {"vocab": 32768, "tokens_per_s": 1500.0, "bpb": 1.00},
                    {"vocab": 262144, "tokens_per_s": 800.0, "bpb": 1.01},
                ],
            }
        )
    )
    args = ("--training", str(path), "--bpb-tolerance", "0.05", *DATASHEET, "--format", "json")
    out = run("sweep", *SMALL, *args)
    assert out.exit_code == 0, out.output
    assert {r["v_star"] for r in json.loads(out.stdout)["table"]} <= {32768, 262144}


@pytest.mark.slow
def test_sweep_with_a_profile_file_and_a_plot(tmp_path):
    prof = save_device(load_device("l4"), tmp_path / "l4.json")
    png = tmp_path / "fig.png"
    out = run("sweep", *SMALL, "--device", str(prof), "--plot", str(png))
    assert out.exit_code == 0, out.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_plot_where_no_batch_fits(tmp_path):
    # llama-70b's weights alone overflow an L4: every c_infer is inf, the log axis has no data
    png = tmp_path / "none.png"
    args = ("--vocab", "8k,32k", "--batch", "1,64", "--lam", "0,100", "--cap-batch")
    out = run("sweep", *args, "--device", "l4", "--model", "llama-70b", "--plot", str(png))
    assert out.exit_code == 0, out.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, code, line",
    [
        (
            ["--vocab", "0"],
            2,
            "Error: Invalid value for '--vocab': vocab must be positive, got '0'",
        ),
        (
            ["--vocab", "-8k"],
            2,
            "Error: Invalid value for '--vocab': vocab '-8k' is not a size "
            "(examples: 8k, 65536, 262k, 1m)",
        ),
        (
            ["--batch", "0"],
            2,
            "Error: Invalid value for '--batch': batch must be positive, got '0'",
        ),
        (["--lam", "-1"], 2, "Error: Invalid value for '--lam': lam must be >= 0, got '-1'"),
        (["--lam", "nan"], 2, "Error: Invalid value for '--lam': lam must be finite, got 'nan'"),
        (
            ["--device", "tpu9"],
            1,
            "Error: unknown device 'tpu9' (builtin: a10g, a100-40gb, a100-80gb, "
            "a100-80gb-datasheet, a100-paper, h100-sxm, h100-sxm-datasheet, h200, l4; or a "
            "profile .json)",
        ),
        (
            ["--model", "gpt5"],
            1,
            "Error: unknown model 'gpt5' (builtin: paper-100m, paper-1.5b, "
            "paper-2.3b, tiny, small, gpt2-small, gpt2-medium, llama-1b, llama-8b, llama-70b; "
            "or a .json/.toml shape file)",
        ),
        (["--cost-model", "magic"], 2, None),
        (
            ["--bpb-tolerance", "0.1"],
            1,
            "Error: --bpb-tolerance needs --training with measured bpb",
        ),
        (["--output-bytes", "0"], 1, "Error: output_bytes must be > 0, got 0.0"),
        (
            ["--plot", "x.gif"],
            2,
            "Error: Invalid value for '--plot': plot file 'x.gif' must end in .png, .svg or .pdf",
        ),
    ],
)
def test_sweep_errors(args, code, line):
    out = run("sweep", *args)
    assert out.exit_code == code
    assert "Traceback" not in out.output
    if line:
        assert out.output.strip().splitlines()[-1] == line


def test_corrupt_profiles_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    out = run("sweep", "--device", str(bad))
    assert out.exit_code == 1 and out.output.startswith(
        f"Error: device profile '{bad}' is not valid JSON"
    )
    assert len(out.output.strip().splitlines()) == 1
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": 7, "kind": "device"}))
    out = run("sweep", "--device", str(other))
    assert out.output.strip() == f"Error: {other}: schema 7 is not supported (vocabjax reads 1)"
    missing = tmp_path / "m.json"
    missing.write_text(json.dumps({"schema": 1, "kind": "device", "name": "m"}))
    out = run("sweep", "--device", str(missing))
    assert out.output.strip() == f"Error: {missing}: missing field(s) ceilings, memory_bytes"
    out = run("sweep", "--compression", str(other))
    assert out.exit_code == 1 and "schema 7 is not supported" in out.output


def test_grid_too_large():
    many = ",".join(str(v) for v in range(1000, 3000))
    out = run("sweep", "--vocab", many, "--batch", many, "--lam", many)
    assert out.exit_code == 1
    assert out.output.startswith("Error: a grid of 8,000,000,000 points needs about")
    assert len(out.output.splitlines()) == 1


@pytest.mark.slow
def test_plan_writes_a_policy(tmp_path):
    pol = tmp_path / "policy.json"
    out = run(
        "plan",
        "--workload",
        "edge:b=1:share=0.5,dc:b=256:share=0.5",
        "--lam",
        "100",
        "--out",
        str(pol),
    )
    assert out.exit_code == 0, out.output
    assert "best single V" in out.output and "best nested heads" in out.output
    data = json.loads(pol.read_text())
    assert data["kind"] == "policy" and data["heads"] and data["batch_routes"]
    js = run("plan", "--workload", "dc:b=64:share=1", "--lam", "10", "--format", "json")
    data = json.loads(js.stdout)
    assert {"break_even", "kv_plan", "single", "heads", "routes"} <= set(data)


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["--workload", "edge:b=1:share=0.4", "--lam", "1"],
            "Error: workload shares sum to 0.4; they must sum to 1",
        ),
        (
            ["--workload", "e:b=1:share=1", "--lam", "1", "--device", "a10g", "--device", "l4"],
            "Error: plan takes one --device and one --model",
        ),
    ],
)
def test_plan_errors(args, line, tmp_path):
    out = run("plan", *args, "--out", str(tmp_path / "p.json"))
    assert out.exit_code == 1 and out.output.strip() == line
    assert not (tmp_path / "p.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "option",
    [
        ["--prompt-bytes", "100000"],
        ["--output-bytes", "64"],
        ["--dtype", "f32"],
        ["--fused-logits"],
        ["--include-prefill"],
        ["--no-cap-batch"],
        ["--cost-model", "weights-only"],
        ["--model", "llama-70b"],
        ["--device", "l4"],
    ],
)
def test_every_sweep_option_reaches_the_model(option):
    # An option naming one of these settings replaces it; any other is added.
    base = {"--model": "llama-8b", DATASHEET[0]: DATASHEET[1]}
    given = {**base, option[0]: option[1]} if option[0] in base else base
    added = [] if option[0] in base else option

    def table_row(settings: dict, *more: str) -> dict:
        args = [x for flag_value in settings.items() for x in flag_value]
        grid = ("--vocab", "32k,256k", "--batch", "512", "--lam", "10")
        return json.loads(run("sweep", *grid, *args, *more, "--format", "json").stdout)["table"][0]

    default, changed = table_row(base), table_row(given, *added)
    keys = ("cost_per_byte", "infer_cost_per_byte", "train_cost_per_byte", "batch_run")
    assert any(default[k] != changed[k] for k in keys), option


@pytest.mark.slow
def test_plan_options(tmp_path):
    one = json.loads(
        run(
            "plan",
            "--workload",
            "edge:b=1:share=0.5,dc:b=256:share=0.5",
            "--lam",
            "100",
            "--max-heads",
            "1",
            "--format",
            "json",
        ).stdout
    )
    assert len(one["heads"]) == 1 and one["heads"][0] == one["single"]["vocab"]
    capped = json.loads(
        run(
            "plan",
            "--workload",
            "dc:b=100000:share=1",
            "--lam",
            "100",
            "--device",
            "l4",
            "--model",
            "llama-8b",
            "--format",
            "json",
        ).stdout
    )
    uncapped = json.loads(
        run(
            "plan",
            "--workload",
            "dc:b=100000:share=1",
            "--lam",
            "100",
            "--no-cap-batch",
            "--device",
            "l4",
            "--model",
            "llama-8b",
            "--format",
            "json",
        ).stdout
    )
    assert capped["routes"][0]["infer_cost_per_byte"] > uncapped["routes"][0]["infer_cost_per_byte"]
    assert uncapped["routes"][0]["fits"] is False and capped["routes"][0]["fits"] is False
    assert capped["cap_batch"] is True and uncapped["cap_batch"] is False
    assert capped["routes"][0]["batch_run"] == capped["routes"][0]["b_max"] < 100000
    assert uncapped["routes"][0]["batch_run"] == 100000
    assert capped["batch_routes"][-1]["fits"] is False  # B up to 1024 of llama-8b on an L4
    md = run("plan", "--workload", "e:b=1:share=1", "--lam", "1", "--format", "markdown")
    assert md.exit_code == 0 and "| name | batch |" in md.output


# ---- out-of-range and unreadable inputs: one Error line, never a traceback -------------------

NINES = "9" * 400


def _one_error_line(out) -> str:
    """The output's single ``Error:`` line, after checking there is no traceback."""
    assert "Traceback" not in out.output
    assert out.exception is None or isinstance(out.exception, SystemExit), out.exception
    errors = [line for line in out.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, out.output
    return errors[0]


@pytest.mark.parametrize(
    "args, code, line",
    [
        (
            ["sweep", "--vocab", "1"],
            2,
            "Error: Invalid value for '--vocab': vocab 1 is out of range 2..2147483647",
        ),
        (
            ["sweep", "--vocab", "1" + "0" * 21],
            2,
            "Error: Invalid value for '--vocab': vocab 1000000000000000000000 is out of range "
            "2..2147483647",
        ),
        (
            ["sweep", "--vocab", "1000000000000g"],
            2,
            "Error: Invalid value for '--vocab': vocab 1073741824000000000000 is out of range "
            "2..2147483647",
        ),
        (
            ["sweep", "--vocab", "1e21"],
            2,
            "Error: Invalid value for '--vocab': vocab '1e21' is not a size "
            "(examples: 8k, 65536, 262k, 1m)",
        ),
        (
            ["sweep", "--vocab", f"8k,{NINES}"],
            2,
            "Error: Invalid value for '--vocab': vocab 999999...(400 digits) is out of range "
            "2..2147483647",
        ),
        (
            ["sweep", "--batch", str(2**24 + 1)],
            2,
            "Error: Invalid value for '--batch': batch 16777217 is out of range 1..16777216",
        ),
        (
            ["sweep", "--lam", "0,1e13"],
            2,
            "Error: Invalid value for '--lam': lam must be <= 1e+12, got '1e13'",
        ),
        (
            ["sweep", "--lam", NINES],
            2,
            "Error: Invalid value for '--lam': lam must be finite, got '9999999999999999'... "
            "(400 characters)",
        ),
        (
            ["sweep", "--prompt-bytes", "1e300"],
            2,
            "Error: Invalid value for '--prompt-bytes': prompt_bytes must be <= 1125899906842624, "
            "got '1e300'",
        ),
        (
            ["sweep", "--output-bytes", "nan"],
            2,
            "Error: Invalid value for '--output-bytes': output_bytes must be finite, got 'nan'",
        ),
        (
            ["plan", "--workload", "a:b=1:share=1", "--lam", "1", "--vocab", "1"],
            2,
            "Error: Invalid value for '--vocab': vocab 1 is out of range 2..2147483647",
        ),
        (
            ["plan", "--workload", "a:b=1:b=64:share=1", "--lam", "1"],
            1,
            "Error: workload class 'a' gives b= twice ('b=1' and 'b=64')",
        ),
        (
            ["plan", "--workload", f"a:b={NINES}:share=1", "--lam", "1"],
            1,
            "Error: workload 'a' batch 999999...(400 digits) is out of range 1..16777216",
        ),
        (
            ["plan", "--workload", "a:b=1:share=nan", "--lam", "1"],
            1,
            "Error: workload class 'a': share='nan' is out of range 0..1",
        ),
        (
            ["plan", "--workload", "a:b=1:share=1", "--lam", "1e13"],
            2,
            "Error: Invalid value for '--lam': lam must be <= 1e+12, got '1e13'",
        ),
        (
            ["plan", "--workload", "a:b=1:share=1", "--lam", "nan"],
            2,
            "Error: Invalid value for '--lam': lam must be finite, got 'nan'",
        ),
        (
            ["plan", "--workload", "a:b=1:share=1", "--lam", "-2"],
            2,
            "Error: Invalid value for '--lam': lam must be >= 0, got '-2'",
        ),
    ],
)
def test_out_of_range_inputs_are_one_error_line(args, code, line):
    out = run(*args)
    assert out.exit_code == code, out.output
    assert _one_error_line(out) == line


def test_a_corpus_that_fails_while_read_is_one_error_line(tmp_path, monkeypatch):
    import errno
    import os

    from vocabjax import corpus

    path = tmp_path / "x.txt"
    path.write_text("some text\n" * 100, encoding="utf-8")

    def failing_open(file, *args, **kwargs):
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(file))

    monkeypatch.setattr(corpus, "open", failing_open, raising=False)
    out = run(
        "tokenizer", "train", "--corpus", str(path), "--vocab", "300", "--out", str(tmp_path / "t")
    )
    assert out.exit_code == 1, out.output
    assert _one_error_line(out) == f"Error: cannot read '{path}': Input/output error"


@pytest.mark.slow
def test_sweep_marks_capped_cells_and_no_cap_marks_what_does_not_fit():
    args = ("--device", "l4", "--model", "llama-8b", "--vocab", "32k,128k", "--batch", "1,512",
            "--lam", "10")  # fmt: skip
    capped = run("sweep", *args)
    assert capped.exit_code == 0, capped.output
    row = next(line for line in capped.output.splitlines() if line.split()[:1] == ["512"])
    assert row.rstrip().split()[-2].endswith("*") and "!" not in row
    assert "*: B does not fit in device memory there" in capped.output
    uncapped = run("sweep", *args, "--no-cap-batch")
    row = next(line for line in uncapped.output.splitlines() if line.split()[:1] == ["512"])
    assert "!" in row and "*" not in row
    assert "!: B does not fit in device memory there" in uncapped.output
    table = json.loads(run("sweep", *args, "--format", "json").stdout)
    assert table["cap_batch"] is True
    big = [r for r in table["table"] if r["batch"] == 512][0]
    assert big["batch_capped"] and not big["fits"] and big["batch_run"] == big["b_max"] < 512
    free = json.loads(run("sweep", *args, "--no-cap-batch", "--format", "json").stdout)
    big = [r for r in free["table"] if r["batch"] == 512][0]
    assert free["cap_batch"] is False and not big["batch_capped"] and big["batch_run"] == 512


@pytest.mark.slow
def test_sweep_reports_the_band_and_the_share():
    out = json.loads(run("sweep", *SMALL, "--tolerance", "0.05", "--format", "json").stdout)
    assert out["tolerance"] == 0.05
    assert "256 profiles" in out["v_star_share_notes"][0]["note"]
    for r in out["table"]:
        assert r["v_low"] <= r["v_star"] <= r["v_high"]
        assert {s["vocab"] for s in r["v_star_share"]} <= {8192, 32768, 262144}
    text = run("sweep", *SMALL)
    assert "within 1% of J at V*" in text.output and "how sure: share of 256" in text.output
    assert "[" in text.output and ".." in text.output
    bare = run("sweep", *SMALL, *DATASHEET, "--format", "json")
    out = json.loads(bare.stdout)
    assert all(r["v_star_share"] is None for r in out["table"])
    assert "not calibrated" in out["v_star_share_notes"][0]["note"]
    text = run("sweep", *SMALL, *DATASHEET)
    assert "how sure: not known; a100-80gb-datasheet is not calibrated" in text.output
    bad = run("sweep", "--tolerance", "-1")
    assert bad.exit_code == 2 and "--tolerance" in bad.output


@pytest.mark.slow
def test_plan_flags_a_route_whose_batch_does_not_fit():
    args = ("plan", "--workload", "dc:b=100000:share=1", "--lam", "100", "--device", "l4",
            "--model", "llama-8b")  # fmt: skip
    out = run(*args)
    assert out.exit_code == 0, out.output
    assert "! dc: the class's batch does not fit" in out.output and "batch_run" in out.output
    assert "(! fits B<=" in out.output
    assert "costed uncapped" in run(*args, "--no-cap-batch").output


def test_corrupt_residual_spread_in_a_profile_is_one_error(tmp_path):
    data = load_device("a100-80gb").to_json()
    data["calibration"]["log_residual_sd"] = -1.0
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    out = run("sweep", "--device", str(path))
    assert out.exit_code == 1
    assert out.output.strip().endswith("calibration.log_residual_sd must be >= 0, got -1.0")
