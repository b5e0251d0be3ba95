"""`generate` through click: the text per prompt in each format, a batch, the policy's route,
and one exact `Error:` line with a non-zero exit for each bad input."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from serving_testing import HEADS, SEQ_LEN

import cli


def run(*args: str):
    return CliRunner().invoke(cli.main, ["generate", *args], catch_exceptions=False)


@pytest.fixture(scope="module")
def run_dir(served_run_dir) -> str:
    return str(served_run_dir)


@pytest.mark.slow
def test_json_output_for_a_batch(run_dir):
    result = run(
        "--run", run_dir, "--prompt", "def main(", "--prompt", "import os", "--head", "300",
        "--max-new-tokens", "5", "--format", "json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # JSON alone on stdout
    assert data["schema"] == 1 and data["kind"] == "generate" and data["head"] == 300
    assert [c["prompt"] for c in data["completions"]] == ["def main(", "import os"]
    for c in data["completions"]:
        assert c["head"] == 300 and 1 <= len(c["tokens"]) <= 5 and isinstance(c["text"], str)
        assert all(0 <= t < 300 for t in c["tokens"])
        assert c["stop"] in ("eos", "max_new_tokens")
    timing = data["timing"]
    assert timing["batch"] == 2 and timing["prefill_ms"] > 0 and timing["bucket"] == 16
    assert "head 300 (asked for)" in result.stderr and "tokens/s" in result.stderr


@pytest.mark.slow
def test_table_csv_and_markdown(run_dir):
    result = run("--run", run_dir, "--prompt", "x = ", "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("[1] head 500: ")  # auto: the largest head
    assert lines[1].startswith("x = ")
    assert lines[-1].startswith("prefill ") and "(B=1, after compiling)" in lines[-1]
    assert "head auto: the largest of the run's heads (300, 500)" in result.stderr
    csv = run("--run", run_dir, "--prompt", "x = ", "--max-new-tokens", "3", "--format", "csv")
    assert csv.stdout.splitlines()[0] == (
        "prompt,head,prompt_tokens,new_tokens,stop,text,prefill_ms,decode_tokens_per_s"
    )
    md = run("--run", run_dir, "--prompt", "a|b", "--max-new-tokens", "3", "--format", "markdown")
    assert md.stdout.splitlines()[2].startswith("| a\\|b | 500 | ")


@pytest.mark.slow
def test_the_policy_route_picks_the_head(run_dir, tmp_path):
    policy = tmp_path / "policy.json"
    routes = [{"max_batch": 1, "head": 300}, {"max_batch": None, "head": 4096}]
    policy.write_text(json.dumps({"schema": 1, "kind": "policy", "batch_routes": routes}))
    one = run("--run", run_dir, "--prompt", "a", "--policy", str(policy), "--max-new-tokens",
              "2", "--format", "json")  # fmt: skip
    assert one.exit_code == 0, one.output
    assert json.loads(one.stdout)["head"] == 300
    assert "the policy routes B=1 (B <= 1) to 300: serving 300" in one.stderr
    two = run("--run", run_dir, "--prompt", "a", "--prompt", "b", "--policy", str(policy),
              "--max-new-tokens", "2", "--format", "json")  # fmt: skip
    assert json.loads(two.stdout)["head"] == 500
    assert "routes B=2 (B > 1) to 4096: serving 500, the run's nearest head" in two.stderr


def _error(*args: str, code: int = 1) -> str:
    result = run(*args)
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_errors_are_one_line(run_dir, tmp_path):
    assert _error("--run", run_dir, "--prompt", "a", "--head", "1k") == (
        f"Error: --head 1024 is not one of the run's heads ({', '.join(map(str, HEADS))})"
    )
    missing = tmp_path / "missing"
    assert _error("--run", str(missing), "--prompt", "a") == (
        f"Error: run directory '{missing}' does not exist"
    )
    corrupt = tmp_path / "corrupt"
    shutil.copytree(run_dir, corrupt)
    state = corrupt / "checkpoint" / "state.npz"
    state.write_bytes(b"not a checkpoint")
    assert _error("--run", str(corrupt), "--prompt", "a").startswith(
        f"Error: {state} is not a readable checkpoint ("
    )
    assert _error("--run", run_dir, "--prompt", "") == (
        "Error: prompt 1 is empty: give the text to continue"
    )
    line = _error("--run", run_dir, "--prompt", "word " * 100, "--head", "300")
    assert line.startswith("Error: prompt 1 is ") and line.endswith(
        f"tokens at head 300 (separator included), above the run's max_seq={SEQ_LEN}; shorten it"
    )
    assert _error("--run", run_dir, "--prompt", "a", "--top-k", "3") == (
        "Error: top_k applies to sampling: give a temperature > 0 with it"
    )
    line = _error("--run", run_dir, "--prompt", "a", "--head", "big", code=2)
    assert line == "Error: Invalid value for '--head': head 'big' is not a size (examples: 8k, " \
        "65536, 262k, 1m)"  # fmt: skip
    assert "Missing option '--prompt'" in _error("--run", run_dir, code=2)


def test_help_has_an_example():
    text = CliRunner().invoke(cli.main, ["generate", "--help"]).output
    assert "Example:" in text and "python cli.py generate --run" in text
    assert "generate" in CliRunner().invoke(cli.main, ["--help"]).output
