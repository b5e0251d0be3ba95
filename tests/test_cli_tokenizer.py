"""`tokenizer train / measure / prune` through click: outputs, the sweep hand-off, exact errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import cli

SMALL = ["--corpus", "builtin", "--max-bytes", "256k"]


def run(*args: str):
    return CliRunner().invoke(cli.main, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tok"
    result = run(
        "tokenizer",
        "train",
        *SMALL,
        "--vocab",
        "300,1k,2000",
        "--out",
        str(out),
        "--format",
        "json",
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.stdout)
    assert "code-heavy" in manifest["corpus"] and "train part" in manifest["corpus"]
    assert "training one byte-level BPE at vocab=2000" in result.stderr
    return out, manifest


def test_train_writes_every_level(trained):
    out, manifest = trained
    assert [lv["vocab"] for lv in manifest["levels"]] == [300, 1024, 2000]
    assert all((out / lv["path"]).is_file() for lv in manifest["levels"])


@pytest.mark.slow
def test_measure_feeds_sweep_and_the_curve_changes_its_answer(trained, tmp_path):
    out, _ = trained
    profile_path = tmp_path / "compression.json"
    result = run(
        "tokenizer",
        "measure",
        "--tokenizer",
        str(out),
        *SMALL,
        "--out",
        str(profile_path),
        "--format",
        "json",
    )
    assert result.exit_code == 0, result.output
    profile = json.loads(result.stdout)  # JSON alone on stdout
    assert profile == json.loads(profile_path.read_text())
    assert [p["vocab"] for p in profile["points"]] == [300, 1024, 2000]
    assert "code-heavy" in profile["corpus"] and "held-out part" in profile["corpus"]
    assert "measured" in result.stderr

    def v_star(path):
        r = run(
            "sweep",
            "--device",
            "a10g",  # uncalibrated: no ensemble to compile, and the curve alone is under test
            "--compression",
            str(path),
            "--vocab",
            "300,1024,2000",
            "--batch",
            "256",
            "--lam",
            "100",
            "--format",
            "json",
        )
        assert r.exit_code == 0, r.output
        return [row["v_star"] for row in json.loads(r.stdout)["table"]]

    measured = v_star(profile_path)
    flat = dict(
        profile,
        points=[
            dict(p, bytes_per_token=profile["points"][0]["bytes_per_token"])
            for p in profile["points"]
        ],
    )
    flat_path = tmp_path / "flat.json"
    flat_path.write_text(json.dumps(flat))
    assert measured == [2000]  # compression grows fast with V on these tiny levels
    assert v_star(flat_path) == [300]  # no gain from a larger V: the smallest wins


def test_measure_table_and_an_hf_tokenizer_made_here(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]"], show_progress=False)
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20, trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    result = run("tokenizer", "measure", "--tokenizer", str(tmp_path / "tokenizer.json"), *SMALL)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("corpus: builtin (Python standard library: code-heavy text)")
    assert lines[1].split()[:4] == ["vocab", "bytes_per_token", "chars_per_token", "ci95_lo"]
    assert lines[3].split()[0] == str(tok.get_vocab_size())


def test_prune(trained, tmp_path):
    out, _ = trained
    result = run(
        "tokenizer",
        "prune",
        "--tokenizer",
        str(out),
        *SMALL,
        "--vocab",
        "700",
        "--out",
        str(tmp_path / "p"),
        "--format",
        "json",
    )
    assert result.exit_code == 0, result.output
    meta = json.loads(result.stdout)
    assert meta["vocab"] == 700 and meta["source_vocab"] == 2000
    id_map = json.loads((tmp_path / "p" / "id_map.json").read_text())
    assert len(id_map["new_to_old"]) == 700
    measured = run(
        "tokenizer", "measure", "--tokenizer", str(tmp_path / "p"), *SMALL, "--format", "csv"
    )
    assert measured.exit_code == 0 and measured.stdout.splitlines()[1].startswith("700,")


def _no_leftovers(directory):
    return [p.name for p in directory.iterdir() if p.name.startswith(".") or p.name == "out"]


@pytest.mark.parametrize(
    ("setup", "args", "line"),
    [
        (
            None,
            ["--corpus", "{d}/missing", "--vocab", "1k"],
            "Error: corpus '{d}/missing' does not exist (give a file, directory, glob or builtin)",
        ),
        (
            ("empty.txt", b""),
            ["--corpus", "{d}/empty.txt", "--vocab", "1k"],
            "Error: corpus '{d}/empty.txt' holds no text",
        ),
        (
            ("junk.txt", bytes(range(128, 256)) * 16),
            ["--corpus", "{d}/junk.txt", "--vocab", "1k"],
            "Error: corpus '{d}/junk.txt' holds no text (1 file(s) skipped, first: {d}/junk.txt is "
            "not UTF-8 text (invalid start byte); a corpus is UTF-8 .txt, .jsonl or .parquet)",
        ),
        (
            None,
            [*SMALL, "--vocab", "200,1k"],
            "Error: vocab=200 must be >= 257 (the 256-token byte alphabet + 1 special token(s))",
        ),
        (
            ("tiny.txt", b"hello hello world\n"),
            ["--corpus", "{d}/tiny.txt", "--vocab", "1k", "--split", "all"],
            "Error: the corpus reaches only vocab=267 of the requested 1024: BPE ran out of pairs "
            "to merge after 10 merges (18 bytes, 1 documents); ask for --vocab <= 267 or give more "
            "text",
        ),
    ],
)
def test_train_errors(tmp_path, setup, args, line):
    if setup:
        (tmp_path / setup[0]).write_bytes(setup[1])
    args = [a.format(d=tmp_path) for a in args]
    result = run("tokenizer", "train", *args, "--out", str(tmp_path / "out"))
    if "junk" in line and "invalid start byte" not in result.output:
        line = line.replace("invalid start byte", result.output.split("(")[1].split(")")[0])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == line.format(d=tmp_path)
    assert "Traceback" not in result.output
    assert _no_leftovers(tmp_path) == []


def _error_line(*args: str) -> str:
    """The last stderr line of a command that must fail with exit code 1."""
    result = run(*args)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    return result.stderr.strip().splitlines()[-1]


def test_measure_and_prune_errors(trained, tmp_path):
    out, _ = trained
    (tmp_path / "bad.json").write_text('{"model": {"type": "BPE"', encoding="utf-8")
    line = _error_line(
        "tokenizer",
        "measure",
        "--tokenizer",
        str(tmp_path / "bad.json"),
        *SMALL,
        "--out",
        str(tmp_path / "out"),
    )
    assert line.startswith(
        f"Error: {tmp_path}/bad.json is not a tokenizer.json HF tokenizers can load ("
    )
    prune = ("tokenizer", "prune", "--tokenizer", str(out), *SMALL, "--out", str(tmp_path / "out"))
    assert _error_line(*prune, "--vocab", "4k") == (
        f"Error: --vocab 4096 is above the source's 2000 tokens ({out}/v2000/tokenizer.json); "
        "pruning only removes tokens"
    )
    assert _error_line(*prune, "--vocab", "100") == (
        "Error: --vocab 100 must be >= 257 (the 256-token byte alphabet + 1 special token(s))"
    )
    line = _error_line(
        "tokenizer", "measure", "--tokenizer", str(out), "--corpus", "builtin", "--max-bytes", "2k"
    )
    assert line.startswith("Error: the heldout part of corpus 'builtin' is empty")
    assert _no_leftovers(tmp_path) == []


def test_usage_errors_and_help():
    result = run("tokenizer", "train", "--corpus", "builtin", "--vocab", "8q", "--out", "x")
    assert result.exit_code == 2 and "vocab '8q' is not a size" in result.output
    for command in ("train", "measure", "prune"):
        help_text = run("tokenizer", command, "--help").output
        assert "Example:" in help_text and f"python cli.py tokenizer {command}" in help_text


def test_the_prose_corpus_names_itself_in_what_it_writes(tmp_path):
    out = tmp_path / "prose"
    args = ["--corpus", "builtin-prose", "--max-bytes", "128k", "--vocab", "300", "--out"]
    result = run("tokenizer", "train", *args, str(out), "--format", "json")
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.stdout)
    assert manifest["corpus"].startswith("builtin-prose (English prose this machine ships")
    assert "not downloaded" in manifest["corpus"] and "corpus: builtin-prose" in result.stderr
