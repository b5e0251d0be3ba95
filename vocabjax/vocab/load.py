"""Loading tokenizers to measure or prune: a vocabjax level directory (``manifest.json``), any HF
``tokenizer.json`` (or a directory holding one), tiktoken BPE rank files (``<base64 token>
<rank>`` per line: OpenAI's ``cl100k_base.tiktoken``, Meta's Llama 3 ``tokenizer.model``,
Whisper's ``multilingual.tiktoken``) and Mistral's Tekken files (``tekken*.json``, ranks in JSON
with their own regex), converted to an HF byte-level BPE that encodes with the same ids as
tiktoken; and, with the ``sentencepiece`` package installed, SentencePiece models (Mistral's and
Llama 2's ``tokenizer.model``), which are measured only.

A rank file does not say how text is split into pieces before merging: its regex is a name or a
regex given by the caller, or recognized from the file's content (``detect_pattern``).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
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
    # Whisper's own multilingual BPE (openai-whisper's whisper/tokenizer.py splits with GPT-2's
    # regex), shipped in the package as whisper/assets/multilingual.tiktoken
    KnownRanks(
        "whisper multilingual",
        "gpt2",
        50_256,
        (b" t", b" a", b" th", b"in", b"er", b" w", b" s", b"ou"),
        "openai-whisper whisper/assets/multilingual.tiktoken",
    ),
)


@dataclasses.dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer ready to encode, and where it came from."""

    tokenizer: Any  # an HF Tokenizer; a SentencePieceProcessor for kind "sentencepiece"
    path: str  # the file it was read from
    kind: Literal["hf", "tiktoken", "tekken", "sentencepiece"]  # the file's format
    pattern: str | None = None  # a rank file's split regex: its PATTERNS name, or the regex
    ranks: Mapping[bytes, int] | None = None  # a rank file's ranks (see ``cut_ranks``)
    specials: int = 0  # ids a rank file reserves beside its ranks (Tekken's 1000)

    @property
    def vocab(self) -> int:
        """The vocabulary size: every token id, specials and added tokens included."""
        if self.kind == "sentencepiece":
            return self.tokenizer.get_piece_size()
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> dict[str, Any]:
        if self.kind == "sentencepiece":
            raise UserError(
                f"{self.path} is a SentencePiece model: it can be measured, not pruned or "
                "trained from (give a tokenizer.json or a BPE rank file)"
            )
        return to_json(self.tokenizer)

    def can_cut_to(self, vocab: int) -> bool:
        """Whether ``cut_ranks`` can cut this tokenizer to ``vocab`` ids: a rank file, cut to
        its specials and at least the 256 single bytes, and to no more ranks than it holds."""
        return self.ranks is not None and 256 <= vocab - self.specials <= len(self.ranks)

    def token_counts(self, texts: list[str]) -> list[int]:
        """How many tokens each text encodes to, without special tokens."""
        if self.kind == "sentencepiece":
            return [len(ids) for ids in self.tokenizer.encode(texts)]
        return [len(e.ids) for e in self.encode_batch(texts)]

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
        return load_sentencepiece(path)
    if text.lstrip().startswith("{"):
        tekken = _tekken_data(text)
        if tekken is not None:
            return load_tekken(tekken, path=path, pattern=pattern)
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
    return LoadedTokenizer(tokenizer, str(path), "tiktoken", pattern=pattern, ranks=ranks)


def _tekken_data(text: str) -> dict[str, Any] | None:
    """The parsed file when ``text`` is a Tekken file (a ``config`` and a ``vocab`` of
    ``token_bytes``), else None (it is read as a tokenizer.json, which then is not parsed twice:
    one without the word ``token_bytes`` is no Tekken file)."""
    if '"token_bytes"' not in text:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
        return None
    vocab = data.get("vocab")
    if not isinstance(vocab, list) or not vocab or not isinstance(vocab[0], dict):
        return None
    return data if "token_bytes" in vocab[0] else None


def load_tekken(
    data: Mapping[str, Any], *, path: str | os.PathLike, pattern: str | None = None
) -> LoadedTokenizer:
    """A Tekken file as mistral-common's Tekkenizer reads it: ``default_vocab_size`` ids, of
    which the first ``default_num_special_tokens`` are special and the rest are the first ranks
    of ``vocab``, split by ``config.pattern`` (or ``pattern``). The HF tokenizer puts the special
    tokens after the ranks (ids = ranks), so counts match Mistral's and ids are shifted."""
    where = str(path)
    config = data["config"]
    try:
        size = int(config["default_vocab_size"])
        specials = int(config["default_num_special_tokens"])
        entries = data["vocab"][: size - specials]
        ranks = {base64.b64decode(e["token_bytes"], validate=True): int(e["rank"]) for e in entries}
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise UserError(f"{where}: not a Tekken file mistral-common reads ({exc})") from None
    if len(ranks) != size - specials or sorted(ranks.values()) != list(range(len(ranks))):
        inner = size - specials
        raise UserError(f"{where}: the first {inner} ranks are not 0..{inner - 1}")
    if pattern is None:
        own = str(config.get("pattern", ""))
        pattern = next((name for name, rx in PATTERNS.items() if rx == own), own)
    tokenizer = tiktoken_to_hf(ranks, regex=pattern_regex(pattern), where=where)
    return _with_specials(
        LoadedTokenizer(tokenizer, where, "tekken", pattern=pattern, ranks=ranks), specials
    )


def _with_specials(loaded: LoadedTokenizer, specials: int) -> LoadedTokenizer:
    """``loaded`` with ``specials`` special tokens added after its ranks (never matched in text
    that does not spell them), so that its vocabulary size counts them."""
    if specials:
        names = [f"<SPECIAL_{i}>" for i in range(specials)]
        loaded.tokenizer.add_special_tokens(names)
    return dataclasses.replace(loaded, specials=specials)


def cut_ranks(loaded: LoadedTokenizer, vocab: int) -> LoadedTokenizer:
    """A rank file's tokenizer cut to ``vocab`` ids: its specials and its ranks below
    ``vocab - specials``. Ranks are in training order, so the cut is the tokenizer the same
    training would have made at that size: what V alone buys on the file's own data."""
    if loaded.ranks is None:
        raise UserError(f"{loaded.path} is not a rank file: only rank files can be cut")
    if not loaded.can_cut_to(vocab):
        raise UserError(
            f"{loaded.path}: cannot cut to {vocab} (it holds {loaded.vocab} ids, "
            f"{loaded.specials} of them special)"
        )
    keep = vocab - loaded.specials
    ranks = {t: r for t, r in loaded.ranks.items() if r < keep}
    where = f"{loaded.path} cut to {vocab}"
    tokenizer = tiktoken_to_hf(ranks, regex=pattern_regex(loaded.pattern), where=where)
    cut = LoadedTokenizer(tokenizer, where, loaded.kind, pattern=loaded.pattern, ranks=ranks)
    return _with_specials(cut, loaded.specials)


def load_sentencepiece(path: Path) -> LoadedTokenizer:
    """A SentencePiece model, read by the ``sentencepiece`` package (an optional dependency:
    ``pip install sentencepiece``); measured as SentencePiece encodes, not converted."""
    try:
        import sentencepiece
    except ImportError:
        raise UserError(
            f"{path} is neither a tokenizer.json nor a BPE rank file; if it is a SentencePiece "
            "model, install the sentencepiece package to measure it"
        ) from None
    try:
        processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
    except Exception as exc:  # sentencepiece raises RuntimeError or OSError for a bad file
        raise UserError(
            f"{path} is neither a tokenizer.json, a BPE rank file nor a SentencePiece model "
            f"({_reason(exc)})"
        ) from None
    return LoadedTokenizer(processor, str(path), "sentencepiece")


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
        if parts[0] == "=":  # an empty token (Whisper's multilingual.tiktoken ends with one)
            continue
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
