"""Nested byte-level BPE: one training at the largest requested V, every smaller level cut from
it by token id, so that each level's merges and ids are a prefix of the largest's.

    nested = train_nested(corpus.texts("train"), [8192, 32768, 262144])
    manifest = save_nested(nested, "tok/", corpus=corpus.describe("train"))
    # tok/manifest.json, tok/v8192/tokenizer.json, tok/v32768/tokenizer.json, ...
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import pre_tokenizers, trainers

import vocabjax
from vocabjax.errors import UserError
from vocabjax.outputs import SCHEMA, atomic_directory, atomic_write_json, check_output_dir
from vocabjax.vocab.bpe import (
    BYTE_ALPHABET,
    DEFAULT_SPECIALS,
    bpe_model,
    byte_alphabet,
    cut_level,
    empty_byte_level,
    id_to_token,
    merges,
    to_json,
    write_level,
)

MANIFEST = "manifest.json"
MANIFEST_KIND = "tokenizer_levels"


def level_dirname(vocab: int) -> str:
    return f"v{vocab}"


def minimum_vocab(specials: Sequence[str]) -> int:
    """The smallest level: the byte alphabet plus the special tokens, with no merge."""
    return BYTE_ALPHABET + len(specials)


def check_vocab_sizes(vocab_sizes: Iterable[int], specials: Sequence[str]) -> list[int]:
    """Sorted, distinct sizes, each at least the byte alphabet plus the specials."""
    sizes = sorted(set(int(v) for v in vocab_sizes))
    if not sizes:
        raise UserError("give at least one vocabulary size")
    if len(set(specials)) != len(specials) or not all(specials):
        raise UserError(f"special tokens must be distinct and non-empty, got {list(specials)}")
    floor = minimum_vocab(specials)
    if sizes[0] < floor:
        raise UserError(
            f"vocab={sizes[0]} must be >= {floor} (the {BYTE_ALPHABET}-token byte alphabet "
            f"+ {len(specials)} special token(s))"
        )
    return sizes


@dataclasses.dataclass(frozen=True)
class TrainStats:
    """What the training read."""

    documents: int  # documents fed to the trainer
    bytes: int  # their UTF-8 bytes
    seconds: float  # wall time of the one training


@dataclasses.dataclass(frozen=True)
class NestedBPE:
    """The largest trained level and the sizes to cut from it."""

    largest: Mapping[str, Any]  # tokenizer.json dict at the largest size
    vocab_sizes: tuple[int, ...]  # sorted level sizes; the last is the largest
    specials: tuple[str, ...]  # special tokens, ids 0..len-1 of every level
    stats: TrainStats
    unreached: tuple[int, ...] = ()  # requested sizes the corpus could not reach (stop_short)

    def level(self, vocab: int) -> dict[str, Any]:
        """The tokenizer.json dict of the level of size ``vocab`` (any size up to the largest)."""
        return cut_level(self.largest, vocab, where=f"level {vocab}")


def _counting(texts: Iterable[str], counts: list[int]) -> Iterator[str]:
    for text in texts:
        counts[0] += 1
        counts[1] += len(text.encode("utf-8"))
        yield text


def train_nested(
    texts: Iterable[str],
    vocab_sizes: Iterable[int],
    *,
    specials: Sequence[str] = DEFAULT_SPECIALS,
    progress: Callable[[str], None] | None = None,
    stop_short: bool = False,
) -> NestedBPE:
    """Train one byte-level BPE at the largest of ``vocab_sizes`` on ``texts``.

    Fails with a UserError when the text cannot reach the largest size (the trainer ran out of
    pairs to merge), saying how far it got; with ``stop_short`` the sizes it could not reach are
    dropped instead and listed in ``unreached``.
    """
    specials = tuple(specials)
    sizes = check_vocab_sizes(vocab_sizes, specials)
    largest = sizes[-1]
    tokenizer = empty_byte_level()
    trainer = trainers.BpeTrainer(
        vocab_size=largest,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(specials),
        show_progress=False,
    )
    if progress:
        progress(f"training one byte-level BPE at vocab={largest} (levels {sizes})")
    counts = [0, 0]
    start = time.perf_counter()
    tokenizer.train_from_iterator(_counting(texts, counts), trainer=trainer)
    seconds = time.perf_counter() - start
    data = to_json(tokenizer)
    reached = tokenizer.get_vocab_size(with_added_tokens=True)
    unreached = tuple(v for v in sizes if v > reached)
    if unreached and stop_short and len(unreached) < len(sizes):
        sizes = [v for v in sizes if v <= reached]
    elif unreached:
        raise UserError(
            f"the corpus reaches only vocab={reached} of the requested {largest}: BPE ran out of "
            f"pairs to merge after {reached - minimum_vocab(specials)} merges "
            f"({counts[1]} bytes, {counts[0]} documents); ask for {{vocab}} <= {reached} "
            "or give more text",
            settings=["vocab"],
        )
    _check_layout(data, specials)
    if progress:
        progress(
            f"trained in {seconds:.1f} s on {counts[1] / 2**20:.1f} MiB, {counts[0]} documents"
        )
    return NestedBPE(
        largest=data,
        vocab_sizes=tuple(sizes),
        specials=specials,
        stats=TrainStats(documents=counts[0], bytes=counts[1], seconds=seconds),
        unreached=unreached,
    )


def _check_layout(data: Mapping[str, Any], specials: Sequence[str]) -> None:
    """Specials first, then the byte alphabet, then one token per merge in merge order: the
    layout that makes cutting by id sound. Checked, not assumed."""
    model = bpe_model(data, where="trained tokenizer")
    tokens = id_to_token(model)
    n = len(specials)
    if tokens[:n] != list(specials) or sorted(tokens[n : n + BYTE_ALPHABET]) != byte_alphabet():
        raise RuntimeError("the BPE trainer did not put specials and the byte alphabet first")
    ids = model["vocab"]
    made = list(dict.fromkeys(ids[a + b] for a, b in merges(model)))  # first maker of each
    if made != list(range(n + BYTE_ALPHABET, len(tokens))):
        raise RuntimeError("the BPE trainer's merges do not add one token each, in id order")


def check_nested_out(
    out: str | os.PathLike, *, force: bool = False, inputs: Iterable[str | os.PathLike] = ()
) -> Path:
    """Refuse, before training, an ``out`` that holds anything but earlier levels (unless
    ``force``) or that is one of the ``inputs`` (the corpus)."""
    return check_output_dir(
        out, marker=MANIFEST, kind=MANIFEST_KIND, what="tokenizer", force=force, inputs=inputs
    )


def save_nested(
    nested: NestedBPE,
    out: str | os.PathLike,
    *,
    corpus: str,
    source: str = "",
    force: bool = False,
) -> dict[str, Any]:
    """Write every level and ``manifest.json`` into ``out`` atomically; returns the manifest.
    ``out`` is checked as ``check_nested_out`` does."""
    check_nested_out(out, force=force)
    levels = []
    with atomic_directory(out) as tmp:
        for vocab in nested.vocab_sizes:
            data = nested.level(vocab)
            name = level_dirname(vocab)
            write_level(Path(tmp) / name, data, where=f"level {vocab}")
            levels.append(
                {
                    "vocab": vocab,
                    "merges": len(data["model"]["merges"]),
                    "path": f"{name}/tokenizer.json",
                }
            )
        manifest = {
            "schema": SCHEMA,
            "kind": MANIFEST_KIND,
            "corpus": corpus,
            "source": source,
            "specials": list(nested.specials),
            "train_documents": nested.stats.documents,
            "train_bytes": nested.stats.bytes,
            "train_seconds": round(nested.stats.seconds, 3),
            "levels": levels,
            "vocabjax": vocabjax.__version__,
        }
        atomic_write_json(Path(tmp) / MANIFEST, manifest)
    return manifest
