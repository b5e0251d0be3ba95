"""Production tokenizer formats beside tokenizer.json and plain rank files: Mistral's Tekken
files, rank files cut to a smaller V, Whisper's rank file quirk, and SentencePiece models; each
checked against the library that defines the format, on text of several scripts."""

from __future__ import annotations

import base64
import builtins
import json

import pytest
from vocab_testing import (
    heldout_texts,
    level_ranks,
    mixed_text,
    nested,
    rank_file_text,
    train_texts,
)

from vocabjax.errors import UserError
from vocabjax.vocab import cut_ranks, load_tokenizer, measure
from vocabjax.vocab.load import PATTERNS
from vocabjax.vocab.prune import prune_texts

SPECIALS = 5


def _tekken(path, ranks: dict[bytes, int], size: int):
    """A Tekken file as mistral-common writes it: every rank in ``vocab``, of which the first
    ``size - SPECIALS`` are used, and ``SPECIALS`` special ids."""
    entries = [
        {"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": None}
        for t, r in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    config = {
        "pattern": PATTERNS["tekken"],
        "num_vocab_tokens": len(ranks),
        "default_vocab_size": size,
        "default_num_special_tokens": SPECIALS,
        "version": "v3",
    }
    path.write_text(json.dumps({"config": config, "vocab": entries}), encoding="utf-8")
    return path


def _documents() -> list[str]:
    return [*heldout_texts()[:20], mixed_text(1), mixed_text(2)]


def _tiktoken_counts(ranks, keep: int, docs) -> list[int]:
    tiktoken = pytest.importorskip("tiktoken")
    used = {t: r for t, r in ranks.items() if r < keep}
    enc = tiktoken.Encoding("test", pat_str=PATTERNS["tekken"], mergeable_ranks=used,
                            special_tokens={})  # fmt: skip
    return [len(ids) for ids in enc.encode_ordinary_batch(docs)]


def test_a_tekken_file_counts_as_tiktoken_does(tmp_path):
    ranks = level_ranks(2000)
    loaded = load_tokenizer(_tekken(tmp_path / "tekken.json", ranks, size=1500))
    assert (loaded.kind, loaded.vocab, loaded.specials, loaded.pattern) == (
        "tekken",
        1500,
        SPECIALS,
        "tekken",
    )
    docs = _documents()
    assert loaded.token_counts(docs) == _tiktoken_counts(ranks, 1500 - SPECIALS, docs)


def test_a_rank_file_cut_is_the_same_training_at_a_smaller_v(tmp_path):
    ranks = level_ranks(2000)
    loaded = load_tokenizer(_tekken(tmp_path / "tekken.json", ranks, size=1500))
    docs = _documents()
    cut = cut_ranks(loaded, 600)
    assert cut.vocab == 600 and cut.specials == SPECIALS and "cut to 600" in cut.path
    assert cut.token_counts(docs) == _tiktoken_counts(ranks, 600 - SPECIALS, docs)
    # a smaller V packs fewer bytes into a token
    small, large = sorted(measure([cut, loaded], docs), key=lambda p: p.vocab)
    assert small.bytes_per_token < large.bytes_per_token
    for bad in (SPECIALS + 255, 1501):
        with pytest.raises(UserError, match="cannot cut to"):
            cut_ranks(loaded, bad)


def test_only_rank_files_cut(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(nested().level(500)), encoding="utf-8")
    with pytest.raises(UserError, match="only rank files can be cut"):
        cut_ranks(load_tokenizer(path), 300)


def test_a_corrupt_tekken_file_is_one_error(tmp_path):
    path = _tekken(tmp_path / "tekken.json", level_ranks(500), size=400)
    data = json.loads(path.read_text())
    data["vocab"][3]["rank"] = 7  # two tokens at rank 7, none at 3
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match="ranks are not 0..394"):
        load_tokenizer(path)
    data["vocab"][3]["token_bytes"] = "not base64!"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match="not a Tekken file"):
        load_tokenizer(path)


def test_a_rank_file_may_end_with_whispers_empty_token(tmp_path):
    ranks = level_ranks(500)
    path = tmp_path / "multilingual.tiktoken"
    path.write_text(rank_file_text(ranks) + f"= {len(ranks)}\n", encoding="utf-8")
    loaded = load_tokenizer(path, pattern="gpt2")
    assert loaded.vocab == len(ranks) and loaded.kind == "tiktoken"


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    path = tmp_path_factory.mktemp("spm") / "sp"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(line for text in train_texts()[:200] for line in text.splitlines()
                               if line.strip()),
        model_prefix=str(path), vocab_size=400, model_type="bpe", byte_fallback=True,
        minloglevel=2,
    )  # fmt: skip
    return path.with_suffix(".model"), spm.SentencePieceProcessor(model_file=f"{path}.model")


def test_a_sentencepiece_model_is_measured_as_sentencepiece_encodes(sentencepiece_model):
    path, processor = sentencepiece_model
    loaded = load_tokenizer(path)
    assert loaded.kind == "sentencepiece" and loaded.vocab == 400
    docs = _documents()
    assert loaded.token_counts(docs) == [len(processor.encode(d)) for d in docs]
    (point,) = measure([loaded], docs)
    assert point.vocab == 400 and point.tokens == sum(len(processor.encode(d)) for d in docs)


def test_a_sentencepiece_model_is_not_pruned(sentencepiece_model):
    with pytest.raises(UserError, match="can be measured, not pruned"):
        prune_texts(load_tokenizer(sentencepiece_model[0]), ["text"], 300, corpus="x")


def test_without_sentencepiece_a_model_file_says_what_to_install(sentencepiece_model, monkeypatch):
    real_import = builtins.__import__

    def no_sentencepiece(name, *args, **kwargs):
        if name == "sentencepiece":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sentencepiece)
    with pytest.raises(UserError, match="install the sentencepiece package"):
        load_tokenizer(sentencepiece_model[0])


def test_binary_junk_is_one_error(tmp_path):
    pytest.importorskip("sentencepiece")
    (tmp_path / "junk.model").write_bytes(b"\xff\xfe\x00junk")
    with pytest.raises(UserError, match="nor a SentencePiece model"):
        load_tokenizer(tmp_path / "junk.model")


def test_measure_cuts_a_rank_file_into_a_curve(tmp_path):
    from click.testing import CliRunner

    import cli

    path = _tekken(tmp_path / "tekken.json", level_ranks(2000), size=1500)
    args = ["tokenizer", "measure", "--tokenizer", str(path), "--corpus", "builtin",
            "--max-bytes", "256k", "--format", "json"]  # fmt: skip
    result = CliRunner().invoke(cli.main, [*args, "--cut", "600,1000,4000"])
    assert result.exit_code == 0, result.output
    profile = json.loads(result.stdout)
    points = profile["points"]
    assert [p["vocab"] for p in points] == [600, 1000, 1500]  # 4000 is past the file: left out
    packed = [p["bytes_per_token"] for p in points]
    assert packed == sorted(packed) and packed[0] < packed[-1]
    assert "--cut 600,1000,4000" in profile["source"]
    level = tmp_path / "tokenizer.json"
    level.write_text(json.dumps(nested().level(500)), encoding="utf-8")
    refused = CliRunner().invoke(cli.main, [*args[:2], "--tokenizer", str(level), *args[4:],
                                            "--cut", "300"])  # fmt: skip
    assert refused.exit_code != 0
    assert refused.output.strip().splitlines()[-1] == (
        "Error: --cut cuts rank files (tiktoken, Tekken); no tokenizer given is one"
    )
