"""Small tokenizers shared by the tokenizer tests, trained once per test session."""

from __future__ import annotations

import base64
import functools
import random
from collections.abc import Mapping

from vocabjax.corpus import open_corpus
from vocabjax.vocab import NestedBPE, train_nested
from vocabjax.vocab.load import bytes_to_unicode

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


def level_ranks(level: int) -> dict[bytes, int]:
    """Level ``level`` of ``nested()`` as a rank file holds it: rank = HF id - 1, the special
    token left out."""
    decode = {ch: b for b, ch in enumerate(bytes_to_unicode())}
    vocab = nested().level(level)["model"]["vocab"]
    return {
        bytes(decode[ch] for ch in token): i - 1
        for token, i in vocab.items()
        if token != "<|endoftext|>"
    }


def rank_file_text(ranks: Mapping[bytes, int]) -> str:
    """``ranks`` as a tiktoken rank file: ``<base64 token> <rank>`` per line, in rank order."""
    ordered = sorted(ranks.items(), key=lambda kv: kv[1])
    return "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ordered)
