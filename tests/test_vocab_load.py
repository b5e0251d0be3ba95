"""Loading tokenizers: level directories, tokenizer.json files, tiktoken rank files, bad files."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from vocab_testing import heldout_texts, mixed_text, nested

from vocabjax.errors import UserError
from vocabjax.vocab import load_tokenizer, load_tokenizers
from vocabjax.vocab.bpe import from_json
from vocabjax.vocab.load import bytes_to_unicode, guess_pattern

LEVEL = 1000


def _rank_file(path, data):
    """A tiktoken-style rank file holding the tokens of an HF byte-level BPE (rank = id - 1)."""
    decode = {ch: b for b, ch in enumerate(bytes_to_unicode())}
    lines = []
    for token, i in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1]):
        if token == "<|endoftext|>":
            continue
        raw = bytes(decode[ch] for ch in token)
        lines.append(f"{base64.b64encode(raw).decode()} {i - 1}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def hf_and_tiktoken(tmp_path_factory):
    data = nested().level(LEVEL)
    path = _rank_file(tmp_path_factory.mktemp("tik") / "small.tiktoken", data)
    return from_json(data, where="hf"), load_tokenizer(path, pattern="gpt2")


@given(st.text(max_size=200))
def test_a_rank_file_encodes_as_the_bpe_it_came_from(hf_and_tiktoken, text):
    hf, tik = hf_and_tiktoken
    assert tik.kind == "tiktoken" and tik.vocab == LEVEL - 1
    want = [i - 1 for i in hf.encode(text.replace("<|endoftext|>", "")).ids]
    assert tik.tokenizer.encode(text.replace("<|endoftext|>", "")).ids == want


def test_rank_file_on_real_text_and_patterns(hf_and_tiktoken, tmp_path):
    hf, tik = hf_and_tiktoken
    for text in [*heldout_texts()[:3], mixed_text(2)]:
        assert tik.tokenizer.encode(text).ids == [i - 1 for i in hf.encode(text).ids]
        assert tik.tokenizer.decode(tik.tokenizer.encode(text).ids) == text
    # the cl100k and o200k pre-tokenizers load and round-trip too
    src = _rank_file(tmp_path / "cl100k_like.tiktoken", nested().level(LEVEL))
    for name, pattern in (("cl100k_like.tiktoken", "cl100k"), ("o200k_x.tiktoken", "o200k")):
        path = tmp_path / name
        if not path.exists():
            path.write_bytes(src.read_bytes())
        assert guess_pattern(path) == pattern
        tok = load_tokenizer(path).tokenizer
        text = mixed_text(3) + " Don't STOP 2024!!\n\n  x"
        assert tok.decode(tok.encode(text).ids) == text


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
        (b"\xff\xfe\x00junk", "is neither a tokenizer.json nor a BPE rank file"),
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
