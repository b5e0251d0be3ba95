"""Loading tokenizers to measure or prune: a vocabjax level directory (``manifest.json``), any HF
``tokenizer.json`` (or a directory holding one), and tiktoken-style BPE rank files
(``<base64 token> <rank>`` per line, as ``cl100k_base.tiktoken``), converted to an equivalent HF
byte-level BPE.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from vocabjax.errors import UserError
from vocabjax.profiles import load_json
from vocabjax.vocab.bpe import byte_alphabet, from_json, to_json
from vocabjax.vocab.nested import MANIFEST, MANIFEST_KIND

Pattern = Literal["gpt2", "cl100k", "o200k"]

# Pre-tokenization regexes of tiktoken's public encodings (tiktoken_ext/openai_public.py),
# written without possessive quantifiers as HF tokenizers' Split expects. A rank file does not
# say which one it was made with; the file name decides (see ``guess_pattern``).
PATTERNS: Mapping[str, str] = {
    "gpt2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    "cl100k": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
        r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    "o200k": "|".join(
        [
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
            r"\p{N}{1,3}",
            r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
            r"\s*[\r\n]+",
            r"\s+(?!\S)",
            r"\s+",
        ]
    ),
}


@dataclasses.dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer ready to encode, and where it came from."""

    tokenizer: Tokenizer
    path: str  # the file it was read from
    kind: Literal["hf", "tiktoken"]  # the file's format

    @property
    def vocab(self) -> int:
        """The vocabulary size: every token id, specials and added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> dict[str, Any]:
        return to_json(self.tokenizer)


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a level directory written by ``tokenizer train``."""
    path = Path(directory) / MANIFEST
    data = load_json(path, MANIFEST_KIND)
    levels = data.get("levels")
    if not isinstance(levels, list) or not levels:
        raise UserError(f"{path}: 'levels' must be a non-empty list")
    for i, level in enumerate(levels):
        if not isinstance(level, Mapping) or not isinstance(level.get("path"), str):
            raise UserError(f"{path}: levels[{i}] needs a 'path'")
    return data


def load_tokenizers(spec: str | os.PathLike) -> list[LoadedTokenizer]:
    """Every tokenizer ``spec`` names: each level of a level directory, the ``tokenizer.json``
    of a directory, or one file."""
    path = Path(spec)
    if not path.exists():
        raise UserError(f"tokenizer {str(path)!r} does not exist")
    if path.is_dir():
        if (path / MANIFEST).is_file():
            manifest = read_manifest(path)
            return [load_tokenizer(path / level["path"]) for level in manifest["levels"]]
        if (path / "tokenizer.json").is_file():
            return [load_tokenizer(path / "tokenizer.json")]
        raise UserError(f"directory {str(path)!r} holds neither {MANIFEST} nor tokenizer.json")
    return [load_tokenizer(path)]


def load_largest(spec: str | os.PathLike) -> LoadedTokenizer:
    """The largest tokenizer ``spec`` names (the source of a prune)."""
    return max(load_tokenizers(spec), key=lambda t: t.vocab)


def load_tokenizer(path: str | os.PathLike, *, pattern: Pattern | None = None) -> LoadedTokenizer:
    """One tokenizer file: HF ``tokenizer.json`` or a tiktoken BPE rank file (by content)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"tokenizer file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path} is neither a tokenizer.json nor a BPE rank file") from None
    if text.lstrip().startswith("{"):
        try:
            tokenizer = Tokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises a plain Exception for a bad file
            line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(
                f"{path} is not a tokenizer.json HF tokenizers can load ({line})"
            ) from None
        return LoadedTokenizer(tokenizer=tokenizer, path=str(path), kind="hf")
    ranks = parse_ranks(text, where=str(path))
    tokenizer = tiktoken_to_hf(ranks, pattern=pattern or guess_pattern(path), where=str(path))
    return LoadedTokenizer(tokenizer=tokenizer, path=str(path), kind="tiktoken")


def guess_pattern(path: Path) -> Pattern:
    """o200k for files named like ``o200k_base``, GPT-2's for ``r50k``/``p50k``/``gpt2``, else
    cl100k's (the most common rank file)."""
    name = path.name.lower()
    if "o200k" in name:
        return "o200k"
    if any(key in name for key in ("r50k", "p50k", "gpt2", "gpt-2")):
        return "gpt2"
    return "cl100k"


def parse_ranks(text: str, *, where: str) -> dict[bytes, int]:
    """``<base64 token> <rank>`` lines -> {token bytes: rank}."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error):
            raise UserError(
                f"{where}:{lineno} is not '<base64 token> <rank>'; the file is neither a "
                "tokenizer.json nor a BPE rank file"
            ) from None
        if not token or rank < 0 or token in ranks:
            raise UserError(f"{where}:{lineno}: empty, negative or repeated token")
        ranks[token] = rank
    if not ranks:
        raise UserError(f"{where} is empty")
    if len(set(ranks.values())) != len(ranks):
        raise UserError(f"{where}: two tokens share a rank")
    return ranks


def _bpe_parts(ranks: Mapping[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's merge rule restricted to ranks below ``max_rank``: repeatedly join the
    adjacent pair whose join has the lowest rank."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best, best_rank = i, rank
        if best < 0:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts


def tiktoken_to_hf(ranks: Mapping[bytes, int], *, pattern: Pattern, where: str) -> Tokenizer:
    """An HF byte-level BPE that encodes as the rank file does: vocab ids are the ranks, and
    each multi-byte token's merge is the last step of tiktoken's merging under lower ranks."""
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise UserError(f"{where}: {len(missing)} of the 256 single-byte tokens are missing")
    alphabet = bytes_to_unicode()
    vocab = {"".join(alphabet[b] for b in token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = _bpe_parts(ranks, token, rank)
        if len(parts) != 2:
            raise UserError(f"{where}: token of rank {rank} is not the merge of two lower ranks")
        merges.append(tuple("".join(alphabet[b] for b in p) for p in parts))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    if pattern == "gpt2":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PATTERNS[pattern]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return from_json(to_json(tokenizer), where=where)


def bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table, the one ByteLevel uses (checked)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    out = [table[b] for b in range(256)]
    assert sorted(out) == byte_alphabet(), "ByteLevel's alphabet changed"
    return out
