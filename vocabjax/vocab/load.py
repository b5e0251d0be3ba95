"""Loading tokenizers to measure or prune: a vocabjax level directory (``manifest.json``), any HF
``tokenizer.json`` (or a directory holding one), and tiktoken BPE rank files (``<base64 token>
<rank>`` per line: OpenAI's ``cl100k_base.tiktoken``, Meta's Llama 3 ``tokenizer.model``),
converted to an HF byte-level BPE that encodes with the same ids as tiktoken.

A rank file does not say how text is split into pieces before merging: its regex is a name or a
regex given by the caller, or recognized from the file's content (``detect_pattern``).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Literal

from tokenizers import Encoding, Regex, Tokenizer, decoders, models, pre_tokenizers

from vocabjax.errors import UserError
from vocabjax.profiles import load_json
from vocabjax.vocab.bpe import byte_alphabet, from_json, to_json
from vocabjax.vocab.nested import MANIFEST, MANIFEST_KIND

# Pre-tokenization regexes by name: each splits text into the pieces tiktoken encodes one at a
# time, written without possessive quantifiers or ``$`` (HF tokenizers' Split runs Oniguruma, where
# ``$`` ends a line, not the text; tiktoken's possessive forms split the same).
PATTERNS: Mapping[str, str] = {
    # r50k_base and p50k_base (GPT-2's release; tiktoken_ext/openai_public.py)
    "gpt2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    # cl100k_base (tiktoken_ext/openai_public.py, before possessives)
    "cl100k": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
        r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    # o200k_base (tiktoken_ext/openai_public.py)
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
    # Mistral's Tekken (the "pattern" of mistral-common's tekken.json config): o200k's words
    # without the contractions, and one digit per piece
    "tekken": "|".join(
        [
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
            r"\p{N}",
            r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
            r"\s*[\r\n]+",
            r"\s+(?!\S)",
            r"\s+",
        ]
    ),
}
# Other names for the same regexes: Meta's Llama 3 tokenizer.py has cl100k's as its pat_str.
PATTERN_ALIASES: Mapping[str, str] = {"llama3": "cl100k"}


@dataclasses.dataclass(frozen=True)
class KnownRanks:
    """A published tiktoken rank file, recognized by its content (see ``detect_pattern``)."""

    name: str  # what the file is called where it is published
    pattern: str  # its split regex: a name in PATTERNS or PATTERN_ALIASES
    ranks: int  # how many tokens the file ranks (special tokens are not in it)
    first_merges: tuple[bytes, ...]  # the tokens of ranks 256..263, its first eight merges
    source: str  # where it is published


FIRST_MERGES = range(256, 264)  # after the 256 single bytes: the ranks of the first 8 merges
_GPT2_FIRST = (b" t", b" a", b"he", b"in", b"re", b"on", b" the", b"er")  # GPT-2's vocab.bpe
_CL100K_FIRST = (b"  ", b"    ", b"in", b" t", b" " * 8, b"er", b"   ", b"on")
_O200K_FIRST = (b"  ", b"    ", b"in", b"er", b" t", b" a", b"en", b"on")
_OPENAI = "https://openaipublic.blob.core.windows.net/encodings/"
KNOWN_RANK_FILES: tuple[KnownRanks, ...] = (
    KnownRanks("r50k_base", "gpt2", 50_256, _GPT2_FIRST, _OPENAI + "r50k_base.tiktoken"),
    KnownRanks("p50k_base", "gpt2", 50_280, _GPT2_FIRST, _OPENAI + "p50k_base.tiktoken"),
    KnownRanks("cl100k_base", "cl100k", 100_256, _CL100K_FIRST, _OPENAI + "cl100k_base.tiktoken"),
    # Llama 3's file begins with cl100k_base's ranks, then Meta's own up to 128000
    KnownRanks("llama3", "llama3", 128_000, _CL100K_FIRST, "Meta-Llama-3 original/tokenizer.model"),
    KnownRanks("o200k_base", "o200k", 199_998, _O200K_FIRST, _OPENAI + "o200k_base.tiktoken"),
)


@dataclasses.dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer ready to encode, and where it came from."""

    tokenizer: Tokenizer
    path: str  # the file it was read from
    kind: Literal["hf", "tiktoken"]  # the file's format
    pattern: str | None = None  # a rank file's split regex: its PATTERNS name, or the regex

    @property
    def vocab(self) -> int:
        """The vocabulary size: every token id, specials and added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> dict[str, Any]:
        return to_json(self.tokenizer)

    def encode_batch(self, texts: list[str]) -> list[Encoding]:
        """Encode without adding special tokens. A tokenizer.json that loads but cannot encode
        (a BPE whose ``unk_token`` is not in its vocabulary, a WordLevel without its unknown
        token) fails here as a UserError naming the file, when a text needs the missing token."""
        try:
            return self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        except Exception as exc:  # tokenizers raises a plain Exception
            raise UserError(f"{self.path} cannot encode the corpus ({_reason(exc)})") from None


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a level directory written by ``tokenizer train``, every level's path
    checked to stay inside ``directory`` (see ``level_path``)."""
    path = Path(directory) / MANIFEST
    data = load_json(path, MANIFEST_KIND)
    levels = data.get("levels")
    if not isinstance(levels, list) or not levels:
        raise UserError(f"{path}: 'levels' must be a non-empty list")
    for i, level in enumerate(levels):
        if not isinstance(level, Mapping) or not isinstance(level.get("path"), str):
            raise UserError(f"{path}: levels[{i}] needs a 'path'")
        level_path(directory, level["path"], where=f"{path}: levels[{i}]")
    return data


def level_path(directory: str | os.PathLike, name: str, *, where: str) -> Path:
    """``directory / name`` for a manifest's level path ``name``, refused unless it is relative
    and resolves (``..`` and symbolic links followed) to a file inside ``directory``: a manifest
    names files by path, and one that names ``../../etc/passwd`` must not make us read it."""
    root = Path(directory)
    if not name or PurePosixPath(name).is_absolute() or PureWindowsPath(name).anchor:
        raise UserError(f"{where}: path {name!r} must be relative to {root}")
    try:
        inside = (root / name).resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError) as exc:  # a symlink loop is a RuntimeError before 3.13
        raise UserError(f"{where}: path {name!r} cannot be resolved ({exc})") from None
    if not inside:
        raise UserError(f"{where}: path {name!r} resolves outside the tokenizer directory {root}")
    return root / name


def load_tokenizers(
    spec: str | os.PathLike, *, pattern: str | None = None
) -> list[LoadedTokenizer]:
    """Every tokenizer ``spec`` names: each level of a level directory, the ``tokenizer.json``
    of a directory, or one file. ``pattern`` is the split regex of rank files (see
    ``pattern_regex``); by default it is recognized from each file's content."""
    if pattern is not None:
        pattern_regex(pattern)  # a bad --pattern fails before any file is read
    path = Path(spec)
    if not path.exists():
        raise UserError(f"tokenizer {str(path)!r} does not exist")
    if path.is_dir():
        if (path / MANIFEST).is_file():
            manifest = read_manifest(path)  # every level path checked before any is read
            return [
                load_tokenizer(path / level["path"], pattern=pattern)
                for level in manifest["levels"]
            ]
        if (path / "tokenizer.json").is_file():
            return [load_tokenizer(path / "tokenizer.json", pattern=pattern)]
        raise UserError(f"directory {str(path)!r} holds neither {MANIFEST} nor tokenizer.json")
    return [load_tokenizer(path, pattern=pattern)]


def load_largest(spec: str | os.PathLike, *, pattern: str | None = None) -> LoadedTokenizer:
    """The largest tokenizer ``spec`` names (the source of a prune)."""
    return max(load_tokenizers(spec, pattern=pattern), key=lambda t: t.vocab)


def load_tokenizer(path: str | os.PathLike, *, pattern: str | None = None) -> LoadedTokenizer:
    """One tokenizer file: HF ``tokenizer.json`` or a tiktoken BPE rank file (by content).
    ``pattern`` applies to a rank file only (see ``load_tokenizers``)."""
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
            raise UserError(
                f"{path} is not a tokenizer.json HF tokenizers can load ({_reason(exc)})"
            ) from None
        return LoadedTokenizer(tokenizer=tokenizer, path=str(path), kind="hf")
    ranks = parse_ranks(text, where=str(path))
    if pattern is None:
        pattern = detect_pattern(ranks, where=str(path)).pattern
    tokenizer = tiktoken_to_hf(ranks, regex=pattern_regex(pattern), where=str(path))
    return LoadedTokenizer(tokenizer=tokenizer, path=str(path), kind="tiktoken", pattern=pattern)


def pattern_names() -> list[str]:
    """Every name ``pattern_regex`` knows."""
    return sorted([*PATTERNS, *PATTERN_ALIASES])


def pattern_regex(pattern: str) -> str:
    """The split regex ``pattern`` stands for: a name in PATTERNS (or PATTERN_ALIASES), or a
    regex of its own, which must compile in HF tokenizers (Oniguruma syntax). A bare word that
    is no known name is refused as a misspelt name rather than taken as a regex."""
    name = PATTERN_ALIASES.get(pattern, pattern)
    if name in PATTERNS:
        return PATTERNS[name]
    names = ", ".join(pattern_names())
    if re.fullmatch(r"[\w-]*", pattern):
        raise UserError(f"unknown pattern {pattern!r}: give one of {names}, or a regex")
    try:
        Regex(pattern)
    except Exception as exc:  # tokenizers raises a plain Exception for a bad regex
        raise UserError(
            f"pattern {pattern!r} is neither one of {names} nor a regex HF tokenizers can "
            f"compile ({_reason(exc)})"
        ) from None
    return pattern


def detect_pattern(ranks: Mapping[bytes, int], *, where: str) -> KnownRanks:
    """Which published rank file ``ranks`` is, to know its split regex, which the file does not
    say; recognized by content, never by file name.

    The tokens of ranks 256..263 (the first eight merges of the training that made the file)
    must be those of an entry of KNOWN_RANK_FILES. They fix the training, and so the regex it
    split with; the number of ranks then tells apart files that begin alike (cl100k_base and
    Llama 3; r50k_base and p50k_base), which split alike. A file that begins like a known one
    but holds another number of ranks (one cut from it) is given that regex too. Anything else
    is a UserError that asks for ``--pattern``.
    """
    by_rank = {r: t for t, r in ranks.items() if r in FIRST_MERGES}
    head = tuple(by_rank.get(r) for r in FIRST_MERGES)
    family = [known for known in KNOWN_RANK_FILES if known.first_merges == head]
    if not family:
        raise UserError(
            f"{where}: a rank file of {len(ranks)} tokens that is none of "
            f"{', '.join(k.name for k in KNOWN_RANK_FILES)} (by its first merges), so its split "
            f"regex is unknown; give {{pattern}} NAME|REGEX (names: {', '.join(pattern_names())})",
            settings=["pattern"],
        )
    return next((k for k in family if k.ranks == len(ranks)), family[0])


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
    _check_bytes(ranks, where=where)
    return ranks


def _check_bytes(ranks: Mapping[bytes, int], *, where: str) -> None:
    """Byte-level BPE needs every byte as a token: tiktoken starts each piece from its bytes."""
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise UserError(f"{where}: {len(missing)} of the 256 single-byte tokens are missing")


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


def tiktoken_to_hf(ranks: Mapping[bytes, int], *, regex: str, where: str) -> Tokenizer:
    """An HF byte-level BPE that encodes as tiktoken does with these ranks and split regex.

    tiktoken encodes each piece the regex splits off by looking it up whole first, and only if
    it is not a token by merging byte pairs, lowest rank first. Vocab ids are the ranks; the
    merge of each multi-byte token is the last step of that merging of its own bytes under lower
    ranks; and ``ignore_merges=True`` is the whole-piece lookup. A token that is not the merge of
    two lower ranks (several hundred in Llama 3's file) gets no merge and stays in the
    vocabulary, where the lookup reaches it as tiktoken's does.
    """
    _check_bytes(ranks, where=where)
    alphabet = bytes_to_unicode()
    vocab = {"".join(alphabet[b] for b in token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = _bpe_parts(ranks, token, rank)
        if len(parts) == 2:
            merges.append(tuple("".join(alphabet[b] for b in p) for p in parts))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return from_json(to_json(tokenizer), where=where)


def _reason(exc: BaseException) -> str:
    """The first line of an exception's message (tokenizers' are long and multi-line)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


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
