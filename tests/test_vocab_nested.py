"""Nested BPE levels: round trips, the prefix property, monotone compression, saved files."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer
from vocab_testing import LEVELS, heldout_texts, mixed_text, nested, train_texts

from vocabjax.errors import UserError
from vocabjax.vocab import load_tokenizers, read_manifest, save_nested, train_nested
from vocabjax.vocab.bpe import byte_alphabet, from_json, merges


@pytest.fixture(scope="module")
def levels() -> dict[int, Tokenizer]:
    n = nested()
    return {v: from_json(n.level(v), where=str(v)) for v in LEVELS}


def _roundtrip(tok: Tokenizer, text: str) -> bool:
    ids = tok.encode(text, add_special_tokens=False).ids
    return tok.decode(ids, skip_special_tokens=False) == text


@given(st.text(max_size=300))
def test_every_level_roundtrips_unicode(levels, text):
    for v, tok in levels.items():
        assert _roundtrip(tok, text), v


@given(st.binary(max_size=300))
def test_every_level_roundtrips_random_bytes(levels, data):
    text = data.decode("utf-8", errors="replace")
    for v, tok in levels.items():
        assert _roundtrip(tok, text), v
        assert max(tok.encode(text).ids, default=0) < v


def test_levels_roundtrip_the_corpus_and_specials(levels):
    texts = [*heldout_texts()[:5], mixed_text(0), "a<|endoftext|>b"]
    for tok in levels.values():
        assert all(_roundtrip(tok, t) for t in texts)
        assert tok.encode("a<|endoftext|>b").ids[1] == 0


def test_prefix_property():
    n = nested()
    largest = n.level(LEVELS[-1])
    big_merges = merges(largest["model"])
    big_vocab = largest["model"]["vocab"]
    assert len(big_vocab) == LEVELS[-1]
    alphabet = set(byte_alphabet())
    for v in LEVELS:
        level = n.level(v)
        vocab = level["model"]["vocab"]
        assert len(vocab) == v
        assert sorted(vocab.values()) == list(range(v))
        assert all(big_vocab[t] == i for t, i in vocab.items())  # same token, same id
        level_merges = merges(level["model"])
        assert level_merges == big_merges[: len(level_merges)]
        assert len(level_merges) == v - 1 - 256  # one token per merge, after <|endoftext|> + bytes
        assert alphabet <= set(vocab) and vocab["<|endoftext|>"] == 0


def test_a_cut_level_equals_training_at_that_size():
    direct = train_nested(train_texts(), [1000])
    assert direct.level(1000)["model"] == nested().level(1000)["model"]


@given(st.integers(0, 10_000))
def test_bytes_per_token_never_falls_as_v_grows(levels, seed):
    texts = [mixed_text(seed, n=50), heldout_texts()[seed % len(heldout_texts())][:5000]]
    for text in texts:
        counts = [len(levels[v].encode(text).ids) for v in LEVELS]
        assert counts == sorted(counts, reverse=True), counts


def test_save_writes_loadable_levels_and_manifest(tmp_path):
    manifest = save_nested(nested(), tmp_path / "tok", corpus="test corpus", source="test")
    assert [lv["vocab"] for lv in manifest["levels"]] == list(LEVELS)
    assert read_manifest(tmp_path / "tok") == json.loads(
        (tmp_path / "tok/manifest.json").read_text()
    )
    for level in manifest["levels"]:
        path = tmp_path / "tok" / level["path"]
        tok = Tokenizer.from_file(str(path))  # what transformers' fast tokenizers call
        assert tok.get_vocab_size() == level["vocab"]
        config = json.loads((path.parent / "tokenizer_config.json").read_text())
        assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
        assert config["eos_token"] == "<|endoftext|>"
    loaded = load_tokenizers(tmp_path / "tok")
    assert [t.vocab for t in loaded] == list(LEVELS)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_vocab_below_the_alphabet_plus_specials():
    with pytest.raises(UserError, match=r"vocab=256 must be >= 257 \(the 256-token byte alphabet"):
        train_nested(["abc"], [256, 1000])
    with pytest.raises(UserError, match=r"vocab=258 must be >= 259"):
        train_nested(["abc"], [258], specials=["<s>", "</s>", "<pad>"])


def test_vocab_larger_than_the_corpus_can_reach():
    with pytest.raises(UserError, match=r"reaches only vocab=2\d\d of the requested 5000") as exc:
        train_nested(["hello hello world"] * 3, [300, 5000])
    assert "merges" in str(exc.value) and "vocab <= 2" in str(exc.value)
    assert "ask for --vocab <= 2" in exc.value.render(lambda name: "--" + name)


def test_stop_short_keeps_the_reachable_levels():
    n = train_nested(["hello hello world"] * 3, [260, 300, 5000], stop_short=True)
    assert n.vocab_sizes == (260,) and n.unreached == (300, 5000)
    assert len(n.level(260)["model"]["vocab"]) == 260
