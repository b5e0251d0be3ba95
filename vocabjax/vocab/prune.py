"""Pruning a byte-level BPE to exactly N tokens for a deployment corpus.

Tokens are kept most-used first (counted by encoding the deployment corpus with the source), and
the merge closure holds: a kept token keeps the tokens and the merge that build it, recursively;
a dropped token takes every merge that makes or uses it. The specials and the 256 byte tokens are
always kept, so the result still encodes any byte string. Ids are re-indexed in the source's id
order, and ``new_to_old`` gathers the matching embedding rows: ``w_new = w_old[new_to_old]``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from vocabjax.corpus import batches
from vocabjax.errors import UserError
from vocabjax.outputs import SCHEMA, atomic_directory, atomic_write_json, check_output_dir
from vocabjax.profiles import a_list, integer, load_json, require, text
from vocabjax.vocab.bpe import (
    BYTE_ALPHABET,
    bpe_model,
    byte_alphabet,
    id_to_token,
    merges,
    with_vocab,
    write_level,
)
from vocabjax.vocab.load import LoadedTokenizer


@dataclasses.dataclass(frozen=True)
class Pruned:
    """A pruned tokenizer and how it maps to its source."""

    data: dict[str, Any]  # the pruned tokenizer.json dict
    new_to_old: list[int]  # new token id -> source token id (increasing)
    kept_by_use: int  # tokens chosen for their use on the corpus (with their closure)
    kept_to_fill: int  # tokens added in merge order to reach exactly N


def count_usage(
    tokenizer: Tokenizer, texts: Iterable[str], *, progress: Callable[[str], None] | None = None
) -> np.ndarray:
    """How often each token id occurs when ``tokenizer`` encodes ``texts``."""
    counts = np.zeros(tokenizer.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    done = 0
    for batch in batches(texts, max_docs=256, max_chars=8 * 2**20):
        for enc in tokenizer.encode_batch_fast(batch, add_special_tokens=False):
            ids = np.asarray(enc.ids, dtype=np.int64)
            counts += np.bincount(ids, minlength=len(counts))[: len(counts)]
        done += sum(len(t) for t in batch)
        if progress:
            progress(f"  counted tokens in {done / 2**20:.1f} MiB")
    return counts


def prune(
    data: Mapping[str, Any], counts: np.ndarray, vocab: int, *, where: str = "tokenizer"
) -> Pruned:
    """Keep exactly ``vocab`` tokens of the BPE tokenizer.json dict ``data``.

    ``counts[i]`` is the use of token id ``i`` on the deployment corpus.
    """
    model = bpe_model(data, where=where)
    tokens = id_to_token(model)
    ids: Mapping[str, int] = model["vocab"]
    source = len(tokens)
    base = _base_ids(data, ids, vocab, source=source, where=where)
    pairs = merges(model)
    closure = _Closure(source, base, _builders(pairs, ids, where), vocab)
    counts = np.asarray(counts, dtype=np.int64)
    if counts.ndim != 1 or counts.shape[0] < source:
        raise ValueError(f"counts has shape {counts.shape}; needs one entry per token ({source})")
    by_use = [int(t) for t in np.lexsort((np.arange(source), -counts[:source])) if counts[t] > 0]
    kept_by_use = closure.take(by_use)
    # Fill the rest in the source's merge order (what training at this size would have added);
    # in that order each token's parts come first, so one pass reaches exactly ``vocab``.
    closure.take(closure.builder)
    if closure.n_kept != vocab:
        raise UserError(f"{where}: could only reach {closure.n_kept} closed tokens, not {vocab}")
    new_to_old = [int(i) for i in np.flatnonzero(closure.kept)]
    kept_tokens = [tokens[i] for i in new_to_old]
    keep = set(kept_tokens)
    kept_merges = [(a, b) for a, b in pairs if a in keep and b in keep and a + b in keep]
    return Pruned(
        data=with_vocab(data, kept_tokens, kept_merges),
        new_to_old=new_to_old,
        kept_by_use=kept_by_use,
        kept_to_fill=closure.n_kept - len(base) - kept_by_use,
    )


def _base_ids(
    data: Mapping[str, Any], ids: Mapping[str, int], vocab: int, *, source: int, where: str
) -> list[int]:
    """The ids every pruning keeps (the byte alphabet and the specials), sorted, after checking
    that ``vocab`` is between their count and the ``source``'s size."""
    if vocab > source:
        raise UserError(
            f"{{vocab}} {vocab} is above the source's {source} tokens ({where}); "
            "pruning only removes tokens",
            settings=["vocab"],
        )
    alphabet = byte_alphabet()
    missing = [ch for ch in alphabet if ch not in ids]
    if missing:
        raise UserError(
            f"{where}: lacks {len(missing)} of the {BYTE_ALPHABET} byte tokens, so a pruned "
            "version could not encode every byte string (prune needs a byte-level BPE)"
        )
    specials = [t["content"] for t in data.get("added_tokens", []) if t["content"] in ids]
    base = sorted({ids[ch] for ch in alphabet} | {ids[s] for s in specials})
    if vocab < len(base):
        raise UserError(
            f"{{vocab}} {vocab} must be >= {len(base)} (the {BYTE_ALPHABET}-token byte alphabet "
            f"+ {len(base) - BYTE_ALPHABET} special token(s))",
            settings=["vocab"],
        )
    return base


def _builders(pairs, ids: Mapping[str, int], where: str) -> dict[int, tuple[int, int]]:
    """Token id -> the ids of the merge that first makes it (its parts must be kept with it),
    in merge order."""
    builder: dict[int, tuple[int, int]] = {}
    for a, b in pairs:
        made = ids.get(a + b)
        if made is None or a not in ids or b not in ids:
            raise UserError(f"{where}: merge {a!r} {b!r} names a token not in the vocabulary")
        if made not in builder:
            builder[made] = (ids[a], ids[b])
    return builder


class _Closure:
    """The tokens kept so far, closed under ``builder``: a token is kept only with the tokens
    that build it, and never beyond ``vocab`` tokens."""

    def __init__(
        self, source: int, base: list[int], builder: dict[int, tuple[int, int]], vocab: int
    ) -> None:
        self.kept = np.zeros(source, dtype=bool)
        self.kept[base] = True
        self.n_kept = len(base)
        self.builder = builder
        self.vocab = vocab

    def missing(self, t: int) -> list[int]:
        """``t`` and every not yet kept token that builds it, parts before wholes."""
        out: list[int] = []
        seen: set[int] = set()
        stack = [(t, False)]
        while stack:
            node, expanded = stack.pop()
            if self.kept[node] or (node in seen and not expanded):
                continue
            if expanded:
                out.append(node)
                continue
            seen.add(node)
            stack.append((node, True))
            for part in self.builder.get(node, ()):
                if not self.kept[part] and part not in seen:
                    stack.append((part, False))
        return out

    def take(self, order: Iterable[int]) -> int:
        """Keep each token of ``order`` with its closure while that fits; how many were kept."""
        before = self.n_kept
        for t in order:
            if self.n_kept == self.vocab:
                break
            need = self.missing(t)
            if need and self.n_kept + len(need) <= self.vocab:
                self.kept[need] = True
                self.n_kept += len(need)
        return self.n_kept - before


PRUNE_KIND = "vocab_prune"
ID_MAP = "id_map.json"


def check_prune_out(
    out: str | os.PathLike,
    *,
    source: str | os.PathLike,
    force: bool = False,
    inputs: Iterable[str | os.PathLike] = (),
) -> Path:
    """Refuse, before counting, an ``out`` that holds anything but an earlier pruned tokenizer
    (unless ``force``), or that is the ``source`` tokenizer or another of the ``inputs``."""
    return check_output_dir(
        out,
        marker=ID_MAP,
        kind=PRUNE_KIND,
        what="pruned tokenizer",
        force=force,
        inputs=(source, *inputs),
    )


def prune_texts(
    source: LoadedTokenizer,
    texts: Iterable[str],
    vocab: int,
    *,
    corpus: str,
    progress: Callable[[str], None] | None = None,
) -> tuple[Pruned, dict[str, Any]]:
    """Count use on ``texts`` and prune ``source`` to ``vocab`` tokens: the pruning and its id
    map's metadata (what ``write_pruned`` records beside ``new_to_old``)."""
    data = source.to_json()
    # Check sizes before reading the corpus, so a bad size fails at once.
    bpe_model(data, where=source.path)
    if vocab > source.vocab:
        raise UserError(
            f"{{vocab}} {vocab} is above the source's {source.vocab} tokens ({source.path}); "
            "pruning only removes tokens",
            settings=["vocab"],
        )
    counts = count_usage(source.tokenizer, texts, progress=progress)
    pruned = prune(data, counts, vocab, where=source.path)
    meta = {
        "schema": SCHEMA,
        "kind": PRUNE_KIND,
        "source": source.path,
        "source_vocab": source.vocab,
        "vocab": vocab,
        "corpus": corpus,
        "corpus_tokens": int(counts.sum()),
        "kept_by_use": pruned.kept_by_use,
        "kept_to_fill": pruned.kept_to_fill,
        "merges": len(pruned.data["model"]["merges"]),
    }
    return pruned, meta


def write_pruned(out: str | os.PathLike, pruned: Pruned, meta: Mapping[str, Any]) -> None:
    """``out/tokenizer.json`` (+ ``tokenizer_config.json``) and ``out/id_map.json``, atomically."""
    with atomic_directory(out) as tmp:
        tokenizer = write_level(Path(tmp), pruned.data, where=f"pruned {meta['source']}")
        if tokenizer.get_vocab_size(with_added_tokens=True) != meta["vocab"]:
            raise RuntimeError("the pruned tokenizer does not have the requested size")
        atomic_write_json(Path(tmp) / ID_MAP, {**meta, "new_to_old": pruned.new_to_old})


def prune_to_dir(
    source: LoadedTokenizer,
    texts: Iterable[str],
    vocab: int,
    out: str | os.PathLike,
    *,
    corpus: str,
    progress: Callable[[str], None] | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Count use on ``texts``, prune ``source`` to ``vocab`` tokens and write ``out`` atomically:
    ``tokenizer.json`` (+ ``tokenizer_config.json``) and ``id_map.json`` with ``new_to_old``.
    ``out`` is checked as ``check_prune_out`` does. Returns the id map's metadata (without the
    map)."""
    check_prune_out(out, source=source.path, force=force)
    pruned, meta = prune_texts(source, texts, vocab, corpus=corpus, progress=progress)
    write_pruned(out, pruned, meta)
    return meta


@dataclasses.dataclass(frozen=True)
class IdMap:
    """``id_map.json``: how a pruned tokenizer's ids map to its source's."""

    new_to_old: tuple[int, ...]  # pruned id -> source id, increasing
    vocab: int  # the pruned tokenizer's size (len(new_to_old))
    source: str  # the source tokenizer's file, as the pruning named it
    source_vocab: int  # the source's size: every source id is below it


def read_id_map(directory: str | os.PathLike) -> IdMap:
    """The id map of a directory ``tokenizer prune`` wrote; a missing or inconsistent one is
    one UserError naming the file."""
    path = Path(directory) / ID_MAP
    data = load_json(path, PRUNE_KIND)
    where = str(path)
    require(data, ("new_to_old", "vocab", "source", "source_vocab"), where=where)
    source_vocab = integer(data["source_vocab"], where=f"{where}: source_vocab", minimum=1)
    vocab = integer(data["vocab"], where=f"{where}: vocab", minimum=1)
    new_to_old = tuple(
        integer(v, where=f"{where}: new_to_old[{i}]", minimum=0, maximum=source_vocab - 1)
        for i, v in enumerate(a_list(data["new_to_old"], where=f"{where}: new_to_old"))
    )
    if len(new_to_old) != vocab or any(np.diff(new_to_old) <= 0):
        raise UserError(
            f"{where}: new_to_old must hold vocab={vocab} increasing source ids, "
            f"found {len(new_to_old)}"
        )
    return IdMap(new_to_old, vocab, text(data["source"], where=f"{where}: source"), source_vocab)
