"""Measuring compression: exact counts, the interval over documents, notes, the profile."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from vocab_testing import LEVELS, heldout_texts, nested

from vocabjax.compression import CompressionCurve
from vocabjax.errors import UserError
from vocabjax.vocab import (
    LoadedTokenizer,
    compression_profile,
    curve_notes,
    measure,
    ratio_ci95,
)
from vocabjax.vocab.bpe import from_json


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
