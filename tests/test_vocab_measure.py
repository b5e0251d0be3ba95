"""Measuring compression: exact counts, the interval over documents, notes, the profile, and
the errors a user meets first (a corpus checked before any tokenizer, a tokenizer that cannot
encode)."""

from __future__ import annotations

import base64
import dataclasses
import json

import numpy as np
import pytest
from click.testing import CliRunner
from tokenizers import Tokenizer, models, pre_tokenizers
from vocab_testing import LEVELS, heldout_texts, nested

import cli
from vocabjax.compression import CompressionCurve
from vocabjax.errors import UserError
from vocabjax.vocab import (
    LoadedTokenizer,
    compression_profile,
    curve_notes,
    load_tokenizer,
    measure,
    ratio_ci95,
)
from vocabjax.vocab import load as load_module
from vocabjax.vocab.bpe import from_json
from vocabjax.vocab.measure import read_ahead


@pytest.fixture(scope="module")
def tokenizers():
    n = nested()
    return [
        LoadedTokenizer(from_json(n.level(v), where=str(v)), path=f"level-{v}", kind="hf")
        for v in reversed(LEVELS)  # measure sorts by vocab
    ]


def test_counts_are_exact(tokenizers):
    texts = list(heldout_texts())
    points = measure(tokenizers, texts)
    assert [p.vocab for p in points] == list(LEVELS)
    n_bytes = sum(len(t.encode()) for t in texts)
    n_chars = sum(len(t) for t in texts)
    for p, tok in zip(points, reversed(tokenizers), strict=True):
        tokens = sum(len(tok.tokenizer.encode(t, add_special_tokens=False).ids) for t in texts)
        assert (p.tokens, p.bytes, p.documents) == (tokens, n_bytes, len(texts))
        assert p.bytes_per_token == pytest.approx(n_bytes / tokens, rel=1e-12)
        assert p.chars_per_token == pytest.approx(n_chars / tokens, rel=1e-12)
        assert p.ci95[0] < p.bytes_per_token < p.ci95[1]
    bpt = [p.bytes_per_token for p in points]
    assert bpt == sorted(bpt) and not curve_notes(points)


def test_ratio_interval():
    # every document compresses alike: no spread
    lo, hi = ratio_ci95(np.array([10, 20, 30]), np.array([5, 10, 15]))
    assert lo == pytest.approx(2.0) and hi == pytest.approx(2.0)
    # the delta-method formula by hand
    num, den = np.array([10.0, 30.0, 14.0, 9.0]), np.array([4.0, 10.0, 7.0, 3.0])
    r = num.sum() / den.sum()
    se = np.sqrt(4 / 3 * np.sum((num - r * den) ** 2)) / den.sum()
    assert ratio_ci95(num, den) == pytest.approx((r - 1.96 * se, r + 1.96 * se), rel=1e-3)
    # more documents of the same mix, a narrower interval
    lo4, hi4 = ratio_ci95(np.tile(num, 4), np.tile(den, 4))
    assert hi4 - lo4 < (ratio_ci95(num, den)[1] - ratio_ci95(num, den)[0]) / 1.9


def test_too_few_documents(tokenizers):
    with pytest.raises(UserError, match="at least 2 documents for a confidence interval, got 1"):
        measure(tokenizers, ["one document"])


def test_notes_report_a_falling_curve_and_repeated_sizes(tokenizers):
    points = measure(tokenizers[:2], list(heldout_texts())[:4])
    swapped = [dataclasses.replace(points[0], vocab=points[1].vocab + 1), points[1]]
    [note] = curve_notes(swapped)
    assert "bytes_per_token falls" in note and "left as measured" in note
    [note] = curve_notes([points[0], points[0]])
    assert "two tokenizers have vocab=" in note


def test_profile_is_what_the_simulator_reads(tokenizers):
    points = measure(tokenizers, list(heldout_texts()))
    profile = compression_profile(points, corpus="test corpus", source="tokenizer measure test")
    assert profile["schema"] == 1 and profile["kind"] == "compression"
    assert profile["unit"] == "bytes_per_token"
    assert set(profile["points"][0]) == {
        "vocab",
        "bytes_per_token",
        "chars_per_token",
        "ci95",
        "tokens",
        "bytes",
        "documents",
        "tokenizer",
    }
    curve = CompressionCurve.from_json(profile, where="test")
    assert curve.vocab == LEVELS
    assert curve.bytes_per_token == tuple(p.bytes_per_token for p in points)


def test_read_ahead_reads_two_documents_and_keeps_them():
    read = []

    def docs():
        for i in range(5):
            read.append(i)
            yield f"document {i}"

    texts = read_ahead(docs())
    assert read == [0, 1]  # read now, the rest later
    assert list(texts) == [f"document {i}" for i in range(5)]
    with pytest.raises(UserError, match="at least 2 documents for a confidence interval, got 1"):
        read_ahead(["one"])


# Tokenizers that load but cannot encode: the unknown token they fall back on is missing.
def _bpe_without_its_unk():
    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[], unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok, "Unk token `[UNK]` not found in the vocabulary"


def _wordlevel_without_unk():
    tok = Tokenizer(models.WordLevel(vocab={"a": 0, "b": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok, "WordLevel error: Missing [UNK] token from the vocabulary"


@pytest.mark.parametrize("make", [_bpe_without_its_unk, _wordlevel_without_unk])
def test_a_tokenizer_that_cannot_encode_is_a_user_error(tmp_path, make):
    tok, reason = make()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    loaded = load_tokenizer(path)  # it loads
    assert measure([loaded], ["a b", "b a"])[0].tokens == 4  # and encodes what it knows
    with pytest.raises(UserError) as err:
        measure([loaded], ["a b", "b c"])
    assert str(err.value) == f"{path} cannot encode the corpus ({reason})"
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a b", "b c"]))
    measure_it = ("tokenizer", "measure", "--tokenizer", str(path), "--corpus", str(corpus))
    line = _error_line(*measure_it, "--split", "all")
    assert line == f"Error: {path} cannot encode the corpus ({reason})"


def _error_line(*args: str) -> str:
    """The one ``Error:`` line of a command that must fail with exit code 1, no traceback."""
    result = CliRunner().invoke(cli.main, list(args), catch_exceptions=False)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [result.stderr.strip().splitlines()[-1]]
    return errors[0]


def test_the_corpus_is_checked_before_any_tokenizer_is_converted(tmp_path, monkeypatch):
    ranks = tmp_path / "cl100k_base.tiktoken"
    ranks.write_text(
        "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)),
        encoding="utf-8",
    )

    def too_early(*args, **kwargs):
        raise AssertionError("a rank file was converted before the corpus was checked")

    monkeypatch.setattr(load_module, "tiktoken_to_hf", too_early)
    monkeypatch.setattr(load_module, "parse_ranks", too_early)
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "one.txt").write_text("only one document\n", encoding="utf-8")
    (tmp_path / "binary.txt").write_bytes(bytes(range(128, 256)) * 16)
    measure_with = ("tokenizer", "measure", "--tokenizer", str(ranks), "--split", "all")
    cases = {
        "missing": f"Error: corpus '{tmp_path}/missing' does not exist (give a file, "
        "directory, glob or builtin)",
        "empty.txt": f"Error: corpus '{tmp_path}/empty.txt' holds no text",
        "one.txt": "Error: measuring needs at least 2 documents for a confidence interval, "
        "got 1; give more text or another split",
        "binary.txt": f"Error: corpus '{tmp_path}/binary.txt' holds no text (1 file(s) skipped",
    }
    for name, want in cases.items():
        line = _error_line(*measure_with, "--corpus", str(tmp_path / name))
        assert line.startswith(want), line


def test_pattern_option(tmp_path):
    # a rank file no known one begins like: refused without --pattern, measured with it
    data = nested().level(300)
    decode = {ch: b for b, ch in enumerate(load_module.bytes_to_unicode())}
    lines = [
        f"{base64.b64encode(bytes(decode[c] for c in token)).decode()} {i - 1}"
        for token, i in data["model"]["vocab"].items()
        if token != "<|endoftext|>"
    ]
    ranks = tmp_path / "mine.tiktoken"
    ranks.write_text("\n".join(lines) + "\n", encoding="utf-8")
    measure_with = ("tokenizer", "measure", "--tokenizer", str(ranks), "--corpus", "builtin")
    small = ("--max-bytes", "256k", "--format", "json")
    line = _error_line(*measure_with, *small)
    assert line.startswith(f"Error: {ranks}: a rank file of 299 tokens that is none of ")
    assert line.endswith("give --pattern NAME|REGEX (names: cl100k, gpt2, llama3, o200k, tekken)")
    assert _error_line(*measure_with, *small, "--pattern", "o200") == (
        "Error: unknown pattern 'o200': give one of cl100k, gpt2, llama3, o200k, tekken, or a regex"
    )
    for pattern in ("gpt2", r" ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+"):
        result = CliRunner().invoke(
            cli.main, [*measure_with, *small, "--pattern", pattern], catch_exceptions=False
        )
        assert result.exit_code == 0, result.output
        profile = json.loads(result.stdout)
        assert profile["points"][0]["vocab"] == 299
        assert f"--pattern {pattern}" in profile["source"]
    # prune reads rank files the same way
    prune = ("tokenizer", "prune", "--tokenizer", str(ranks), "--corpus", "builtin", *small[:2])
    line = _error_line(*prune, "--vocab", "280", "--out", str(tmp_path / "p"))
    assert line.endswith("give --pattern NAME|REGEX (names: cl100k, gpt2, llama3, o200k, tekken)")
    assert not (tmp_path / "p").exists()
    result = CliRunner().invoke(
        cli.main,
        [*prune, "--vocab", "280", "--out", str(tmp_path / "p"), "--pattern", "gpt2"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert len(json.loads((tmp_path / "p" / "id_map.json").read_text())["new_to_old"]) == 280
