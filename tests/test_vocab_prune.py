"""Pruning: exact size, round trips, the merge closure, the id map, and the fill order."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from vocab_testing import LEVELS, heldout_texts, mixed_text, nested, train_texts

from vocabjax.errors import UserError
from vocabjax.vocab import count_usage, load_tokenizer, prune, prune_to_dir
from vocabjax.vocab.bpe import byte_alphabet, from_json, merges

SIZES = (257, 300, 777, 1500)


@pytest.fixture(scope="module")
def source():
    data = nested().level(LEVELS[-1])
    tok = from_json(data, where="source")
    counts = count_usage(tok, train_texts())
    return data, counts


@pytest.fixture(scope="module")
def pruned(source):
    data, counts = source
    return {n: prune(data, counts, n) for n in SIZES}


def test_exact_size_and_closure(source, pruned):
    data, _ = source
    src_tokens = {i: t for t, i in data["model"]["vocab"].items()}
    for n, p in pruned.items():
        vocab = p.data["model"]["vocab"]
        assert len(vocab) == n and sorted(vocab.values()) == list(range(n))
        assert from_json(p.data, where="pruned").get_vocab_size(with_added_tokens=True) == n
        assert set(byte_alphabet()) <= set(vocab) and vocab["<|endoftext|>"] == 0
        # re-indexed in source order, and new_to_old gathers the same tokens
        assert p.new_to_old == sorted(p.new_to_old) and len(p.new_to_old) == n
        assert all(src_tokens[old] == t for t, old in zip(vocab, p.new_to_old, strict=True))
        # every merge's parts and result are kept; every kept multi-byte token has its merge
        pairs = merges(p.data["model"])
        assert all(a in vocab and b in vocab and a + b in vocab for a, b in pairs)
        made = {a + b for a, b in pairs}
        base = set(byte_alphabet()) | {"<|endoftext|>"}
        assert set(vocab) - base <= made
        # merges keep the source's order
        src_rank = {m: r for r, m in enumerate(merges(data["model"]))}
        ranks = [src_rank[m] for m in pairs]
        assert ranks == sorted(ranks)


def test_the_most_used_tokens_are_kept(source, pruned):
    data, counts = source
    p = pruned[777]
    kept = set(p.new_to_old)
    top = [int(i) for i in np.argsort(-counts, kind="stable")[:50]]
    assert set(top) <= kept
    assert p.kept_by_use > 0


@given(st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("utf-8", "replace")))
def test_pruned_tokenizers_roundtrip_anything(pruned, text):
    for n, p in pruned.items():
        tok = from_json(p.data, where=str(n))
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert max(ids, default=0) < n


def test_pruned_compresses_between_the_byte_level_and_the_source(source, pruned):
    data, _ = source
    src = from_json(data, where="source")
    text = "".join(heldout_texts()[:3]) + mixed_text(1)
    src_tokens = len(src.encode(text).ids)
    counts = [len(from_json(pruned[n].data, where="p").encode(text).ids) for n in SIZES]
    assert counts[0] == len(text.encode())  # 257 tokens: the bytes and the special only
    # Not a theorem (the pruned sets are not nested), but what pruning is for: on held-out text
    # a larger pruned vocabulary uses fewer tokens, and none beats the source here.
    assert counts[0] > counts[1] > counts[2] > counts[3] >= src_tokens


def test_without_use_counts_pruning_is_the_nested_cut(source):
    data, counts = source
    p = prune(data, np.zeros_like(counts), 1000)
    assert p.kept_by_use == 0 and p.kept_to_fill == 1000 - 257
    assert p.data["model"] == nested().level(1000)["model"]


def test_pruning_to_the_full_size_is_the_identity(source):
    data, counts = source
    p = prune(data, counts, LEVELS[-1])
    assert p.new_to_old == list(range(LEVELS[-1]))
    assert p.data["model"]["merges"] == data["model"]["merges"]


def test_sizes_out_of_range(source):
    data, counts = source
    with pytest.raises(UserError, match=r"^vocab 2001 is above the source's 2000 tokens"):
        prune(data, counts, 2001)
    with pytest.raises(UserError, match=r"^vocab 256 must be >= 257"):
        prune(data, counts, 256)


def test_prune_to_dir_writes_tokenizer_and_id_map(tmp_path, source):
    data, _ = source
    (tmp_path / "src.json").write_text(json.dumps(data), encoding="utf-8")
    src = load_tokenizer(tmp_path / "src.json")
    meta = prune_to_dir(src, train_texts(), 600, tmp_path / "out", corpus="test")
    assert meta["vocab"] == 600 and meta["source_vocab"] == 2000
    out = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    id_map = json.loads((tmp_path / "out" / "id_map.json").read_text())
    assert out.vocab == 600 and len(id_map["new_to_old"]) == 600
    # gathering embedding rows by the map reproduces the source's rows for the same tokens
    w_old = np.arange(2000)[:, None] * np.ones((1, 3))
    w_new = w_old[id_map["new_to_old"]]
    new_vocab = out.tokenizer.get_vocab()
    old_vocab = src.tokenizer.get_vocab()
    for token in ("Ġ", "<|endoftext|>", next(iter(new_vocab))):
        assert w_new[new_vocab[token], 0] == old_vocab[token]
    with pytest.raises(UserError, match="above the source"):
        prune_to_dir(src, iter(()), 5000, tmp_path / "bad", corpus="test")
    assert not (tmp_path / "bad").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
