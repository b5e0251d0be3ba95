"""Compression curves: bytes per token as a monotone function of the vocabulary size V.

A curve is a few measured points interpolated linearly in log V, held flat outside them. The
builtin default is the tokenizer sweep of Tao et al. 2024 on SlimPajama (sail-sg/scaling-with-
vocab), in characters per token; on that mostly-English corpus a character is taken as one byte.
``tokenizer measure`` writes a measured curve (``kind: compression``) that replaces it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from vocabjax.errors import UserError
from vocabjax.profiles import SCHEMA, load_json, one_of, positive_number, text, vocab_points
from vocabjax.xp import interp

# A token of more than a megabyte is no tokenizer's (the longest BPE tokens are tens of bytes);
# beta enters the float32 cost grids, where 1e300 is already infinite and every cell would be null.
MAX_BYTES_PER_TOKEN = 1e6


@dataclasses.dataclass(frozen=True)
class CompressionCurve:
    """Bytes per token at measured vocabulary sizes."""

    name: str  # label in tables ("default: Tao et al. 2024, SlimPajama", a corpus, a file)
    vocab: tuple[int, ...]  # measured V, strictly increasing
    bytes_per_token: tuple[float, ...]  # beta(V), non-decreasing in V
    source: str = ""  # where the points come from

    def __post_init__(self) -> None:
        if len(self.vocab) != len(self.bytes_per_token) or not self.vocab:
            raise UserError(f"compression curve {self.name!r}: needs matching, non-empty points")
        if any(b <= a for a, b in zip(self.vocab, self.vocab[1:], strict=False)):
            raise UserError(f"compression curve {self.name!r}: vocab sizes must increase")
        for v, beta in zip(self.vocab, self.bytes_per_token, strict=True):
            positive_number(
                beta,
                where=f"compression curve {self.name!r}: bytes_per_token at V={v}",
                maximum=MAX_BYTES_PER_TOKEN,
            )
        drops = [
            (a, b)
            for (a, x), (b, y) in zip(
                zip(self.vocab, self.bytes_per_token, strict=True),
                zip(self.vocab[1:], self.bytes_per_token[1:], strict=True),
                strict=False,
            )
            if y < x
        ]
        if drops:
            a, b = drops[0]
            raise UserError(
                f"compression curve {self.name!r}: bytes per token falls from V={a} to V={b}; "
                "a larger vocabulary should not compress worse (check the measurement)"
            )

    @property
    def log_vocab(self) -> tuple[float, ...]:
        import math

        return tuple(math.log(v) for v in self.vocab)

    def covers(self, vocab: int) -> bool:
        return self.vocab[0] <= vocab <= self.vocab[-1]

    def beta(self, vocab, *, xp=jnp):
        """Bytes per token at ``vocab`` (scalar; vmap to lift), linear in log V, flat outside."""
        return interp(xp.log(vocab), self.log_vocab, self.bytes_per_token, xp=xp)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "kind": "compression",
            "unit": "bytes_per_token",
            "corpus": self.name,
            "source": self.source,
            "points": [
                {"vocab": v, "bytes_per_token": b}
                for v, b in zip(self.vocab, self.bytes_per_token, strict=True)
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], *, where: str) -> CompressionCurve:
        """A ``kind: compression`` profile: ``points`` of ``vocab`` and ``bytes_per_token``
        (in (0, MAX_BYTES_PER_TOKEN]); other fields of a point (``tokenizer measure``'s counts
        and intervals) are the measurement's record and are not read."""
        one_of(data.get("unit", "bytes_per_token"), ("bytes_per_token",), where=f"{where}: unit")
        rows = [
            (
                p["vocab"],
                positive_number(
                    p["bytes_per_token"],
                    where=f"{at}.bytes_per_token",
                    maximum=MAX_BYTES_PER_TOKEN,
                ),
            )
            for at, p in vocab_points(data, ("bytes_per_token",), where=where)
        ]
        rows.sort()
        if len({v for v, _ in rows}) != len(rows):
            raise UserError(f"{where}: two points have the same vocab")
        return cls(
            name=text(data.get("corpus", where), where=f"{where}: corpus"),
            vocab=tuple(v for v, _ in rows),
            bytes_per_token=tuple(b for _, b in rows),
            source=text(data.get("source", where), where=f"{where}: source"),
        )


DEFAULT_CURVE = CompressionCurve(
    name="default (Tao et al. 2024, SlimPajama)",
    vocab=(8192, 16384, 32768, 64512, 128000, 256000, 512000, 1024000),
    # characters per token from sail-sg/scaling-with-vocab's tokenizer sweep; 1 char ~ 1 byte
    bytes_per_token=(3.39, 3.70, 3.94, 4.10, 4.20, 4.26, 4.32, 4.34),
    source="Tao et al. 2024, 'Scaling Laws with Vocabulary', SlimPajama chars/token",
)

BUILTIN_CURVES = {"default": DEFAULT_CURVE}


def load_compression(name_or_path: str | os.PathLike) -> CompressionCurve:
    """``default`` or a compression profile JSON written by ``tokenizer measure``."""
    key = str(name_or_path)
    if key.lower() in BUILTIN_CURVES:
        return BUILTIN_CURVES[key.lower()]
    path = Path(key)
    if path.suffix.lower() == ".json" or path.exists():
        return CompressionCurve.from_json(load_json(path, "compression"), where=str(path))
    raise UserError(f"unknown compression curve {key!r} (builtin: default; or a profile .json)")
