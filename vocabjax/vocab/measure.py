"""Compression of tokenizers on a corpus: bytes and characters per token, with a 95% confidence
interval over documents, written as the compression profile that ``sweep --compression`` reads.

The corpus is streamed once; each batch of documents is encoded by every tokenizer. Read its first
documents with ``read_ahead`` before loading the tokenizers: a bad corpus then fails at once,
not after a rank file's conversion (tens of seconds for the largest).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from vocabjax.corpus import batches
from vocabjax.errors import UserError
from vocabjax.profiles import SCHEMA
from vocabjax.vocab.load import LoadedTokenizer

COMPRESSION_KIND = "compression"
Z95 = 1.959963984540054  # two-sided 95% normal quantile
MIN_DOCUMENTS = 2  # the interval over documents needs two


@dataclasses.dataclass(frozen=True)
class CompressionPoint:
    """One tokenizer's compression on one corpus."""

    vocab: int  # the tokenizer's vocabulary size, specials included
    bytes_per_token: float  # total UTF-8 bytes / total tokens
    chars_per_token: float  # total characters (code points) / total tokens
    ci95: tuple[float, float]  # 95% interval of bytes_per_token over documents (ratio estimator)
    tokens: int  # tokens in all the documents measured
    bytes: int  # UTF-8 bytes of those documents
    documents: int  # how many documents
    tokenizer: str  # where the tokenizer came from

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["ci95"] = list(self.ci95)
        return out


def ratio_ci95(num: np.ndarray, den: np.ndarray) -> tuple[float, float]:
    """95% interval of sum(num) / sum(den) with documents as the sampled units.

    The linearized (delta-method) variance of a ratio estimator: with R = sum(num) / sum(den)
    and residuals e_i = num_i - R den_i, var(R) = n / (n - 1) * sum(e_i^2) / sum(den)^2.
    """
    n = len(num)
    if n < 2:
        raise ValueError("a confidence interval over documents needs at least 2 documents")
    num = num.astype(np.float64)
    den = den.astype(np.float64)
    ratio = num.sum() / den.sum()
    resid = num - ratio * den
    se = math.sqrt(n / (n - 1) * float(np.dot(resid, resid))) / den.sum()
    return (float(ratio - Z95 * se), float(ratio + Z95 * se))


def read_ahead(texts: Iterable[str]) -> Iterator[str]:
    """All of ``texts``, of which the first documents are read now: a corpus that is missing,
    unreadable, empty or of fewer than two documents fails here (a UserError), before the caller
    loads any tokenizer."""
    texts = iter(texts)
    head = list(itertools.islice(texts, MIN_DOCUMENTS))
    if len(head) < MIN_DOCUMENTS:
        raise UserError(_too_few_documents(len(head)))
    return itertools.chain(head, texts)


def _too_few_documents(n: int) -> str:
    return (
        f"measuring needs at least {MIN_DOCUMENTS} documents for a confidence interval, got {n}; "
        "give more text or another split"
    )


def measure(
    tokenizers: Sequence[LoadedTokenizer],
    texts: Iterable[str],
    *,
    progress: Callable[[str], None] | None = None,
) -> list[CompressionPoint]:
    """Encode every document with every tokenizer (no special tokens added) and summarize. A
    tokenizer that cannot encode a document is a UserError naming its file."""
    if not tokenizers:
        raise UserError("give at least one tokenizer to measure")
    doc_bytes: list[int] = []
    doc_chars: list[int] = []
    doc_tokens: list[list[int]] = [[] for _ in tokenizers]
    start = time.perf_counter()
    done = 0
    report = step = 16 * 2**20
    for batch in batches(texts, max_docs=256, max_chars=8 * 2**20):
        encoded = [t.encode("utf-8") for t in batch]
        doc_bytes += [len(b) for b in encoded]
        doc_chars += [len(t) for t in batch]
        for counts, tok in zip(doc_tokens, tokenizers, strict=True):
            counts += tok.token_counts(batch)
        done += sum(doc_bytes[-len(batch) :])
        if progress and done >= report:
            rate = done / 2**20 / max(time.perf_counter() - start, 1e-9)
            progress(
                f"  measured {done / 2**20:.1f} MiB x {len(tokenizers)} tokenizer(s), "
                f"{rate:.2f} MiB/s"
            )
            report += step
    n = len(doc_bytes)
    if n < MIN_DOCUMENTS:
        raise UserError(_too_few_documents(n))
    b = np.asarray(doc_bytes, dtype=np.int64)
    c = np.asarray(doc_chars, dtype=np.int64)
    points = []
    for counts, tok in zip(doc_tokens, tokenizers, strict=True):
        t = np.asarray(counts, dtype=np.int64)
        if t.sum() == 0:
            raise UserError(f"{tok.path} produced no tokens on this corpus")
        points.append(
            CompressionPoint(
                vocab=tok.vocab,
                bytes_per_token=float(b.sum() / t.sum()),
                chars_per_token=float(c.sum() / t.sum()),
                ci95=ratio_ci95(b, t),
                tokens=int(t.sum()),
                bytes=int(b.sum()),
                documents=n,
                tokenizer=tok.path,
            )
        )
    if progress:
        seconds = time.perf_counter() - start
        progress(
            f"  measured {b.sum() / 2**20:.1f} MiB, {n} documents, "
            f"{len(tokenizers)} tokenizer(s) in {seconds:.1f} s"
        )
    return sorted(points, key=lambda p: p.vocab)


def curve_notes(points: Sequence[CompressionPoint]) -> list[str]:
    """What a simulator user must know about a measured curve: repeated sizes, and bytes per
    token falling as V grows (the simulator requires a non-decreasing curve). Reported, never
    corrected."""
    notes = []
    ordered = sorted(points, key=lambda p: p.vocab)
    for lo, hi in zip(ordered, ordered[1:], strict=False):
        if lo.vocab == hi.vocab:
            notes.append(
                f"two tokenizers have vocab={lo.vocab} ({lo.tokenizer}, {hi.tokenizer}); "
                "the simulator expects one point per size"
            )
        elif hi.bytes_per_token < lo.bytes_per_token:
            notes.append(
                f"bytes_per_token falls from {lo.bytes_per_token:.4f} at vocab={lo.vocab} to "
                f"{hi.bytes_per_token:.4f} at vocab={hi.vocab}; the simulator requires a "
                "non-decreasing curve (numbers left as measured)"
            )
    return notes


def compression_profile(
    points: Sequence[CompressionPoint], *, corpus: str, source: str
) -> dict[str, Any]:
    """The compression profile JSON (``sweep --compression FILE``), points sorted by vocab."""
    return {
        "schema": SCHEMA,
        "kind": COMPRESSION_KIND,
        "unit": "bytes_per_token",
        "corpus": corpus,
        "source": source,
        "points": [p.to_json() for p in sorted(points, key=lambda p: p.vocab)],
    }
