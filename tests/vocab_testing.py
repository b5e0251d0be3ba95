"""Small tokenizers shared by the tokenizer tests, trained once per test session."""

from __future__ import annotations

import functools
import random

from vocabjax.corpus import open_corpus
from vocabjax.vocab import NestedBPE, train_nested

LEVELS = (300, 500, 1000, 2000)
MAX_BYTES = 256 * 1024


@functools.cache
def small_corpus():
    return open_corpus("builtin", max_bytes=MAX_BYTES)


@functools.cache
def train_texts() -> tuple[str, ...]:
    return tuple(small_corpus().texts("train"))


@functools.cache
def heldout_texts() -> tuple[str, ...]:
    return tuple(small_corpus().texts("heldout"))


@functools.cache
def nested() -> NestedBPE:
    return train_nested(train_texts(), LEVELS)


def mixed_text(seed: int, n: int = 400) -> str:
    """Text that is not Python: words from several scripts, digits, emoji, odd whitespace."""
    rng = random.Random(seed)
    words = ["hello", "Grüße", "naïve", "日本語", "テキスト", "данные", "🙂", "12345", "\t", "\r\n"]
    return " ".join(rng.choice(words) for _ in range(n))
