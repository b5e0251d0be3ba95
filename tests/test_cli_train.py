"""`train` through click: a small run with its own tokenizer, the sweep hand-off, resume, and
one exact `Error:` line (and nothing written) for each bad input."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from vocab_testing import nested

import cli
from vocabjax.trainprofile import load_training

SHAPE = {"d_model": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64}
SMALL = ["--max-bytes", "256k", "--seq-len", "16", "--batch", "2", "--eval-tokens", "256"]


def run(*args: str):
    return CliRunner().invoke(cli.main, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("shape") / "micro.json"
    path.write_text(json.dumps(SHAPE))
    return str(path)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from vocabjax.vocab import save_nested

    out = tmp_path_factory.mktemp("tok") / "tok"
    save_nested(nested(), out, corpus="test")
    return str(out)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, model_file):
    out = tmp_path_factory.mktemp("cli") / "run"
    args = ["train", "--model", model_file, "--heads", "300,400", "--steps", "4", *SMALL]
    result = run(*args, "--out", str(out), "--format", "json")
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout), result.stderr


@pytest.mark.slow
def test_train_writes_a_profile_that_sweep_reads(trained):
    out, data, log = trained
    assert "no tokenizer given: training a nested BPE at 300, 400" in log
    assert "step 4/4" in log and "tok/s" in log and "eta" in log
    assert (out / "tokenizer" / "manifest.json").is_file()
    assert data["kind"] == "train" and data["step"] == 4
    assert [h["vocab"] for h in data["heads"]] == [300, 400]
    for h in data["heads"]:
        assert 0 < h["bpb"] < 20 and h["tokens_per_s"] > 0 and h["bytes_per_token"] > 1
    profile = load_training(out / "training.json")
    assert profile.vocab == (300, 400)
    assert profile.bpb == tuple(h["bpb"] for h in data["heads"])
    assert "micro" in profile.source and "4 steps" in profile.source
    run_json = json.loads((out / "run.json").read_text())
    assert run_json["tokenizer"] == "tokenizer" and run_json["heads"] == [300, 400]
    sweep = run(
        "sweep", "--training", str(out / "training.json"), "--vocab", "300,400", "--batch", "1",
        "--lam", "0,100", "--format", "json",
    )  # fmt: skip
    assert sweep.exit_code == 0, sweep.output
    assert {row["v_star"] for row in json.loads(sweep.stdout)["table"]} <= {300, 400}


@pytest.mark.slow
def test_table_output_and_resume_to_more_steps(trained, tmp_path):
    out, _, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    result = run(
        "train", "--out", str(copy), "--steps", "6", "--eval-bytes", "2k", "--resume",
        "--format", "csv",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "resuming" in result.stderr and "at step 4 of 6" in result.stderr
    assert "decays over 6 steps (the run had 4)" in result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "vocab,train_loss,bpb,tokens_per_s,bytes_per_token,eval_tokens"
    assert [line.split(",")[0] for line in lines[1:]] == ["300", "400"]
    stored = json.loads((copy / "run.json").read_text())
    assert stored["steps"] == 6 and stored["eval_bytes"] == 2048  # evaluation may change
    assert "KiB" in result.stderr and "2.0 KiB" in result.stderr


def _error(*args: str, code: int = 1) -> str:
    result = run("train", *args)
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_errors_are_one_line_and_leave_nothing(tmp_path, trained, model_file, tok_dir):
    out, _, _ = trained
    new = str(tmp_path / "new")
    base = ["--model", model_file, *SMALL, "--out", new]
    assert _error("--model", "nope", "--out", new).startswith(
        "Error: unknown model 'nope' (builtin: paper-100m, "
    )
    assert _error(*base, "--tokenizer", str(tmp_path / "missing")) == (
        f"Error: tokenizer directory '{tmp_path}/missing' does not exist"
    )
    assert _error(*base, "--tokenizer", tok_dir, "--heads", "1k,4k") == (
        f"Error: head 4096 is larger than the tokenizer's largest level 2000 ({tok_dir}); "
        "give heads <= 2000 or a larger tokenizer"
    )
    line = _error(*base, "--tokenizer", tok_dir, "--steps", "0", code=2)
    assert "Invalid value for '--steps'" in line and "must be positive" in line
    (tmp_path / "empty.txt").write_text("")
    assert _error(*base, "--corpus", str(tmp_path / "empty.txt")) == (
        f"Error: corpus '{tmp_path}/empty.txt' holds no text"
    )
    assert _error(*base, "--tokenizer", tok_dir, "--heads", "300", "--batch", "64k").startswith(
        "Error: the corpus's train part gives head 300 only "
    )
    assert not (tmp_path / "new").exists()
    assert _error("--model", model_file, *SMALL, "--out", str(out)) == (
        f"Error: {out} holds a training run (run.json); pass --resume to continue it, "
        "or choose another --out"
    )
    assert _error("--out", str(out), "--resume", "--lr", "0.1") == (
        f"Error: --resume: --lr 0.1 differs from the run in {out} (0.003); drop the option or "
        "choose another --out"
    )
    assert _error("--out", str(out), "--resume", "--heads", "300") == (
        f"Error: --resume: --heads 300 differs from the run in {out} (300,400); drop the "
        "option or choose another --out"
    )


@pytest.mark.slow
def test_a_nan_loss_is_one_error_line(tmp_path, model_file, tok_dir, monkeypatch):
    from test_train import _poison_from

    _poison_from(monkeypatch, 2)
    line = _error(
        "--model", model_file, *SMALL, "--tokenizer", tok_dir, "--heads", "300",
        "--steps", "3", "--out", str(tmp_path / "nan"),
    )  # fmt: skip
    assert line.startswith("Error: the loss is not finite at step 2 (head 300: nan); stopped")
    assert line.endswith("(no checkpoint was written); lower --lr")
    assert not (tmp_path / "nan").exists()


def test_help_has_an_example():
    text = run("train", "--help").output
    assert "Example:" in text and "python cli.py train" in text
    assert "train" in run("--help").output


@pytest.mark.slow
def test_a_pruned_start_trains_at_the_small_vocabulary(trained, tmp_path):
    out, _, _ = trained
    new = tmp_path / "pruned"
    args = ["--init-from", str(out), "--prune-to", "350", "--steps", "2", *SMALL]
    result = run("train", *args, "--out", str(new), "--format", "json")
    assert result.exit_code == 0, result.output
    assert [h["vocab"] for h in json.loads(result.stdout)["heads"]] == [350]
    assert "embedding and head rows gathered by the pruned tokenizer's id map" in result.stderr
    run_json = json.loads((new / "run.json").read_text())
    assert run_json["init_from"] == str(out) and run_json["shape"]["name"] == "micro"
    assert json.loads((new / "tokenizer" / "id_map.json").read_text())["source_vocab"] == 400


@pytest.mark.slow
def test_bad_pruned_starts_are_one_error_line(trained, tmp_path, tok_dir):
    out, _, _ = trained
    new = str(tmp_path / "new")
    base = [*SMALL, "--init-from", str(out), "--out", new]
    assert _error(*base, "--prune-to", "4k") == (
        f"Error: --prune-to 4096 is larger than the largest head of --init-from {out} (400); "
        "pruning only removes tokens"
    )
    assert _error(*base) == (
        "Error: --init-from needs --prune-to: the vocabulary size to prune the run's to"
    )
    assert _error(*base, "--prune-to", "350", "--heads", "300,350") == (
        "Error: give --heads or --prune-to, not both (a pruned run trains one head)"
    )
    other = tmp_path / "other-pruned"  # pruned from another tokenizer: tok_dir's 2000 level
    pruning = ["tokenizer", "prune", "--tokenizer", tok_dir, "--vocab", "350", "--out", str(other)]
    assert run(*pruning, "--corpus", "builtin", "--max-bytes", "64k").exit_code == 0
    assert _error(*base, "--prune-to", "350", "--tokenizer", str(other)) == (
        f"Error: --init-from {out}: its tokenizer is not the source of the pruned tokenizer "
        f"--tokenizer {other} (it was pruned from 2000 tokens, the run's largest head has 400)"
    )
    assert not (tmp_path / "new").exists()


def test_an_alignment_weight_without_separate_heads_is_one_error_line(tmp_path, model_file):
    new = str(tmp_path / "new")
    assert _error("--model", model_file, *SMALL, "--align-weight", "0.5", "--out", new) == (
        "Error: --align-weight aligns separate heads; nested heads share their rows already "
        "(give --heads-kind separate)"
    )
    assert not (tmp_path / "new").exists()


def test_a_mesh_that_does_not_divide_is_one_error_line(tmp_path, model_file, tok_dir):
    new = str(tmp_path / "new")
    base = ["--model", model_file, *SMALL, "--tokenizer", tok_dir, "--heads", "300,500"]
    assert _error(*base, "--mesh", "data=3", "--out", new) == (
        "Error: --mesh data=3,model=1 (3 devices) does not divide the 4 devices"
    )
    assert _error(*base, "--mesh", "data=4", "--out", new) == (
        "Error: --mesh data=4,model=1 does not divide --batch 2: each of the 4 data devices "
        "takes an equal share of the windows"
    )
    line = _error(*base, "--mesh", "model=2", "--out", new, code=2)
    assert "Invalid value for '--mesh'" in line and "must read data=N or data=N,model=M" in line
    assert not (tmp_path / "new").exists()
