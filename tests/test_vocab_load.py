"""Loading tokenizers: level directories, tokenizer.json files, tiktoken rank files, bad files."""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
from vocab_testing import (
    heldout_texts,
    level_ranks,
    mixed_text,
    nested,
    rank_file_text,
    train_texts,
)

import cli
from vocabjax.errors import UserError
from vocabjax.vocab import load as load_module
from vocabjax.vocab import load_tokenizer, load_tokenizers
from vocabjax.vocab.bpe import from_json
from vocabjax.vocab.load import (
    KNOWN_RANK_FILES,
    PATTERNS,
    _bpe_parts,
    bytes_to_unicode,
    detect_pattern,
    pattern_names,
    pattern_regex,
)

LEVEL = 1000


def _rank_file(path):
    """A tiktoken-style rank file holding the tokens of ``nested()``'s level ``LEVEL``."""
    path.write_text(rank_file_text(level_ranks(LEVEL)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def hf_and_tiktoken(tmp_path_factory):
    data = nested().level(LEVEL)
    path = _rank_file(tmp_path_factory.mktemp("tik") / "small.tiktoken")
    return from_json(data, where="hf"), load_tokenizer(path, pattern="gpt2")


@given(st.text(max_size=200))
def test_a_rank_file_encodes_as_the_bpe_it_came_from(hf_and_tiktoken, text):
    hf, tik = hf_and_tiktoken
    assert tik.kind == "tiktoken" and tik.vocab == LEVEL - 1
    want = [i - 1 for i in hf.encode(text.replace("<|endoftext|>", "")).ids]
    assert tik.tokenizer.encode(text.replace("<|endoftext|>", "")).ids == want


def test_rank_file_on_real_text(hf_and_tiktoken):
    hf, tik = hf_and_tiktoken
    for text in [*heldout_texts()[:3], mixed_text(2)]:
        assert tik.tokenizer.encode(text).ids == [i - 1 for i in hf.encode(text).ids]
        assert tik.tokenizer.decode(tik.tokenizer.encode(text).ids) == text


def test_every_pattern_loads_and_round_trips(tmp_path):
    src = _rank_file(tmp_path / "small.tiktoken")
    text = mixed_text(3) + " Don't STOP 2024!!\n\n  x"
    for name in pattern_names():
        tok = load_tokenizer(src, pattern=name)
        assert tok.pattern == name
        assert tok.tokenizer.decode(tok.tokenizer.encode(text).ids) == text


def test_an_hf_tokenizer_made_here_loads(tmp_path):
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[UNK]"], show_progress=False
    )
    tok.train_from_iterator(["some words and more words"] * 5, trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    [loaded] = load_tokenizers(tmp_path)  # a directory holding tokenizer.json
    assert loaded.kind == "hf" and loaded.vocab == tok.get_vocab_size()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            b'{"model": {"type": "BPE", "vocab": 3}}',
            "is not a tokenizer.json HF tokenizers can load",
        ),
        (b'{"truncated": ', "is not a tokenizer.json HF tokenizers can load"),
        (b"\xff\xfe\x00junk", "is neither a tokenizer.json"),
        (b"hello world\n", r":1 is not '<base64 token> <rank>'"),
        (b"YQ== 0\nYg== 0\n", "two tokens share a rank"),
        (b"YQ== 0\nYg== 1\n", "254 of the 256 single-byte tokens are missing"),
        (b"", "is empty"),
    ],
)
def test_corrupt_tokenizer_files(tmp_path, content, message):
    (tmp_path / "bad.json").write_bytes(content)
    with pytest.raises(UserError, match=message):
        load_tokenizer(tmp_path / "bad.json")


def test_missing_paths_and_bad_manifest(tmp_path):
    with pytest.raises(UserError, match="tokenizer '.*nope' does not exist"):
        load_tokenizers(tmp_path / "nope")
    with pytest.raises(UserError, match="holds neither manifest.json nor tokenizer.json"):
        load_tokenizers(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"schema": 1, "kind": "tokenizer_levels"}))
    with pytest.raises(UserError, match="'levels' must be a non-empty list"):
        load_tokenizers(tmp_path)


# ---- ids as tiktoken's --------------------------------------------------------------------------

# The split regexes as their owners publish them, to check that PATTERNS, written for HF
# tokenizers' Oniguruma, splits alike: tiktoken 0.14's tiktoken_ext/openai_public.py (possessive
# quantifiers, ``$``), Meta's llama3 tokenizer.py pat_str, mistral-common's tekken.json pattern.
PUBLISHED_PATTERNS = {
    "gpt2": r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""",
    "cl100k": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+|"""
    r""" ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""",
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "o200k": "|".join(
        [
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
            r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
            r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""\p{N}{1,3}""",
            r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
            r"""\s*[\r\n]+""",
            r"""\s+(?!\S)""",
            r"""\s+""",
        ]
    ),
    "tekken": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# Characters for random documents: every class the regexes treat apart (cases, digits, marks,
# contractions, punctuation, and whitespace of all kinds, in runs).
ALPHABET = [
    *"abzAZ09 \t\n\r\x0b\x0c'’-_/.,!?(){}#",
    *["\u00a0", "\u3000", "\u2028", "\u0085", "\u200b", "\ufeff", "  ", "\n\n", "\r\n", " \n"],
    *["é", "e\u0301", "ß", "Ǆ", "ǅ", "ﬁ", "Ⅻ", "١٢٣", "日本", "語", "данные", "🙂", "👍🏽"],
    *["'s", "'LL", "'ve", "Don't", "camelCase", "HTTPServer", "12345678", " the", "\tdef"],
]


def _trained_ranks(regex: str, vocab: int) -> dict[bytes, int]:
    """Ranks of a byte-level BPE trained here on the Python standard library, split by
    ``regex``: rank = HF id, the 256 bytes first and then one token per merge."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(train_texts(), trainer=trainer)
    decode = {ch: b for b, ch in enumerate(bytes_to_unicode())}
    return {bytes(decode[c] for c in t): i for t, i in tok.get_vocab().items()}


def _with_whole_piece_tokens(ranks, regex, n, seed):
    """``ranks`` plus the ``n`` most frequent held-out pieces that no merging reaches (as Llama
    3's file has), half at random ranks among the merges and half at the end."""
    split = pre_tokenizers.Split(Regex(regex), behavior="isolated")
    counts: dict[bytes, int] = {}
    for text in heldout_texts():
        for piece, _ in split.pre_tokenize_str(text):
            data = piece.encode()
            if data not in ranks and len(_bpe_parts(ranks, data, len(ranks))) > 2:
                counts[data] = counts.get(data, 0) + 1
    extra = sorted(counts, key=lambda t: (-counts[t], t))[:n]
    order = sorted(ranks, key=ranks.get)
    rng = random.Random(seed)
    for i, token in enumerate(extra):
        order.insert(rng.randint(300, len(order)) if i % 2 else len(order), token)
    return {t: r for r, t in enumerate(order)}, extra


def _sample_documents(seed):
    """Documents of every kind: held-out stdlib text, lines of stdlib modules, mixed scripts,
    and random strings of ALPHABET."""
    docs = list(heldout_texts())
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]:
        docs += path.read_text(encoding="utf-8", errors="replace").splitlines()
    docs += [mixed_text(s) for s in range(4)]
    rng = random.Random(seed)
    docs += ["".join(rng.choices(ALPHABET, k=rng.randint(1, 40))) for _ in range(3000)]
    return docs


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PUBLISHED_PATTERNS))
def test_ids_are_tiktokens_on_sampled_documents(tmp_path, name):
    tiktoken = pytest.importorskip("tiktoken")
    regex = pattern_regex(name)
    ranks, extra = _with_whole_piece_tokens(_trained_ranks(regex, 2000), regex, n=60, seed=14)
    not_merges = [t for t, r in ranks.items() if len(t) > 1 and len(_bpe_parts(ranks, t, r)) != 2]
    assert len(extra) == 60 and set(extra) <= set(not_merges)  # what the loader once refused
    path = tmp_path / "ranks.tiktoken"
    path.write_text(rank_file_text(ranks), encoding="utf-8")
    ours = load_tokenizer(path, pattern=name)
    assert ours.vocab == len(ranks)
    theirs = tiktoken.Encoding(
        f"test-{name}",
        pat_str=PUBLISHED_PATTERNS[name],
        mergeable_ranks=ranks,
        special_tokens={},
    )
    docs = _sample_documents(seed=9)
    want = theirs.encode_ordinary_batch(docs)
    got = [e.ids for e in ours.encode_batch(docs)]
    differ = [d for d, g, w in zip(docs, got, want) if g != w]
    assert not differ, f"{len(differ)} of {len(docs)} documents differ, first {differ[0]!r}"
    used = {i for ids in want for i in ids}
    assert used & {ranks[t] for t in extra}  # the whole-piece tokens were met, and matched


# ---- the split regex: named, given, or recognized ----------------------------------------------


def test_pattern_names_and_regexes():
    assert pattern_regex("llama3") == pattern_regex("cl100k") == PATTERNS["cl100k"]
    assert set(pattern_names()) == {"cl100k", "gpt2", "llama3", "o200k", "tekken"}
    assert pattern_regex(r"\s+|\S+") == r"\s+|\S+"
    with pytest.raises(UserError, match="unknown pattern 'cl100': give one of cl100k, gpt2,"):
        pattern_regex("cl100")
    with pytest.raises(UserError, match=r"pattern '\(a' is neither one of .* nor a regex HF"):
        pattern_regex("(a")
    with pytest.raises(UserError, match="unknown pattern 'nope'"):
        load_tokenizers("/no/such/file", pattern="nope")  # before the missing file is noticed


def _known_like(known, n=None):
    """Ranks that begin as ``known`` does: the 256 bytes, its first merges, then filler."""
    ranks = {bytes([b]): b for b in range(256)}
    for token in known.first_merges:
        ranks[token] = len(ranks)
    while len(ranks) < (known.ranks if n is None else n):
        ranks[b"~%d~" % len(ranks)] = len(ranks)
    return ranks


@pytest.mark.parametrize("known", KNOWN_RANK_FILES, ids=lambda k: k.name)
def test_known_rank_files_are_recognized_by_content(known):
    assert detect_pattern(_known_like(known), where="f") == known
    cut = detect_pattern(_known_like(known, n=1000), where="f")  # a file cut from a known one
    assert pattern_regex(cut.pattern) == pattern_regex(known.pattern)  # llama3 cut: cl100k's


def test_the_file_name_does_not_decide(tmp_path):
    [cl100k] = [k for k in KNOWN_RANK_FILES if k.name == "cl100k_base"]
    path = tmp_path / "o200k_base.tiktoken"  # named like o200k, begins like cl100k
    ranks = _known_like(cl100k, n=400)
    path.write_text(rank_file_text(ranks))
    assert load_tokenizer(path).pattern == "cl100k"
    assert load_tokenizer(path, pattern="o200k").pattern == "o200k"
    _rank_file(tmp_path / "cl100k_base.tiktoken")  # named, not begun, so
    with pytest.raises(UserError) as err:
        load_tokenizer(tmp_path / "cl100k_base.tiktoken")
    assert str(err.value) == (
        f"{tmp_path}/cl100k_base.tiktoken: a rank file of {LEVEL - 1} tokens that is none of "
        "r50k_base, p50k_base, cl100k_base, llama3, o200k_base, whisper multilingual (by its "
        "first merges), so its "
        "split regex is unknown; give pattern NAME|REGEX (names: cl100k, gpt2, llama3, o200k, "
        "tekken)"
    )


# ---- a manifest's level paths stay inside its directory ----------------------------------------


def _manifest(directory, *paths):
    directory.mkdir(parents=True, exist_ok=True)
    levels = [{"vocab": 300 + i, "path": p} for i, p in enumerate(paths)]
    manifest = {"schema": 1, "kind": "tokenizer_levels", "levels": levels}
    (directory / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return directory


def _escapes(tmp_path):
    """(level path, why) pairs a manifest must not name; the symlink is made here."""
    tok = tmp_path / "tok"
    (tok / "v1").mkdir(parents=True)
    (tmp_path / "secret.json").write_text("{}", encoding="utf-8")
    (tok / "v1" / "tokenizer.json").symlink_to(tmp_path / "secret.json")
    return [
        ("../../../../etc/passwd", "resolves outside the tokenizer directory"),
        ("v1/../../secret.json", "resolves outside the tokenizer directory"),
        ("/etc/passwd", "must be relative to"),
        ("v1/tokenizer.json", "resolves outside the tokenizer directory"),  # the symlink
    ]


def test_manifest_paths_outside_the_directory_are_refused_before_any_read(tmp_path, monkeypatch):
    def no_read(*args, **kwargs):
        raise AssertionError("a tokenizer was read")

    monkeypatch.setattr(load_module, "load_tokenizer", no_read)
    (tmp_path / "tok" / "v0").mkdir(parents=True)
    (tmp_path / "tok" / "v0" / "tokenizer.json").write_text("{}", encoding="utf-8")
    for bad, why in _escapes(tmp_path):
        tok = _manifest(tmp_path / "tok", "v0/tokenizer.json", bad)  # the good level comes first
        with pytest.raises(UserError) as err:
            load_tokenizers(tok)
        assert str(err.value).startswith(f"{tok}/manifest.json: levels[1]: path {bad!r} ")
        assert why in str(err.value)


def test_manifest_paths_that_stay_inside_load(tmp_path):
    data = nested().level(300)
    tok = tmp_path / "tok"
    (tok / "real").mkdir(parents=True)
    (tok / "real" / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    (tok / "link").symlink_to(tok / "real")  # a symlink that stays inside
    _manifest(tok, "real/tokenizer.json", "link/../real/tokenizer.json", "link/tokenizer.json")
    assert [t.vocab for t in load_tokenizers(tok)] == [300, 300, 300]


def test_manifest_escape_through_the_command_line(tmp_path):
    escapes = _escapes(tmp_path)
    for bad, why in escapes:
        tok = _manifest(tmp_path / "tok", bad)
        result = CliRunner().invoke(
            cli.main,
            ["tokenizer", "measure", "--tokenizer", str(tok), "--corpus", "builtin"]
            + ["--max-bytes", "256k"],
            catch_exceptions=False,
        )
        assert result.exit_code == 1, result.output
        assert "Traceback" not in result.output
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
        assert errors == [result.stderr.strip().splitlines()[-1]]
        assert errors[0].startswith(f"Error: {tok}/manifest.json: levels[0]: path {bad!r} ")
        assert why in errors[0]
