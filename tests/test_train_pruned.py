"""Pruned initialisation: a run started from another run's parameters through a pruned
tokenizer's id map (the rows gathered, the rest copied), resumed, and refused when the pruned
tokenizer does not come from that run or is larger than it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_train import config
from vocab_testing import mixed_text

from vocabjax.corpus import open_corpus
from vocabjax.errors import UserError
from vocabjax.train import load_checkpoint, resume_config, tokenizers_from_dir, train
from vocabjax.train.pruned import vocab_tables
from vocabjax.vocab import LoadedTokenizer, prune_to_dir, read_id_map, save_nested, train_nested


@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    """A run at heads (300, 500) with its own tokenizer: the source every test prunes from."""
    out = tmp_path_factory.mktemp("source") / "run"
    train(config(steps=3), out, measure=False)
    return out


def pruned_config(source_run, **kw):
    base = dict(heads=(400,), init_from=str(source_run), steps=4, checkpoint_every=2)
    return config(**{**base, **kw})


@pytest.mark.slow
def test_the_gathered_rows_are_the_source_rows_by_id_map(source_run, tmp_path):
    out = tmp_path / "pruned"
    train(pruned_config(source_run), out, stop_after=0)  # the checkpoint holds the start
    start = load_checkpoint(out).params
    source = load_checkpoint(source_run).params
    id_map = read_id_map(out / "tokenizer")
    assert id_map.vocab == 400 and id_map.source_vocab == 500 and len(id_map.new_to_old) == 400
    assert id_map.new_to_old != tuple(range(400))  # pruning by use is not the prefix cut
    tables = vocab_tables(pruned_config(source_run), config(steps=3))
    assert tables == {"embed.value": "embed.value", "unembed.value": "unembed.value"}
    assert set(start) == set(source)
    for name in start:
        want = source[name][list(id_map.new_to_old)] if name in tables else source[name]
        np.testing.assert_array_equal(start[name], want, err_msg=name)
    # Each pruned id stands for the token the source's gathered row stood for.
    (pruned,) = tokenizers_from_dir(out / "tokenizer", [400])
    (level,) = tokenizers_from_dir(source_run / "tokenizer", [500])
    for new in (0, 1, 256, 300, 399):
        old = id_map.new_to_old[new]
        assert pruned.tokenizer.id_to_token(new) == level.tokenizer.id_to_token(old)


@pytest.mark.slow
def test_a_pruned_run_resumes_as_a_straight_one(source_run, tmp_path):
    cfg = pruned_config(source_run)
    straight = train(cfg, tmp_path / "a", measure=False)
    assert straight.step == 4
    train(cfg, tmp_path / "b", stop_after=2)
    train(resume_config(tmp_path / "b", {}), tmp_path / "b", resume=True, measure=False)
    a, b = load_checkpoint(tmp_path / "a").params, load_checkpoint(tmp_path / "b").params
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.slow
def test_a_pruned_tokenizer_given_must_come_from_the_run(source_run, tmp_path):
    (level,) = tokenizers_from_dir(source_run / "tokenizer", [500])
    texts = [mixed_text(i) for i in range(20)]
    right = tmp_path / "right"
    loaded = LoadedTokenizer(level.tokenizer, path="source level 500", kind="hf")
    prune_to_dir(loaded, texts, 400, right, corpus="mixed")
    cfg = pruned_config(source_run, tokenizer=str(right), steps=1)
    assert train(cfg, tmp_path / "ok", stop_after=0).step == 0
    # The same size pruned from a tokenizer trained on other text: its tokens differ.
    prose = open_corpus("builtin-prose", max_bytes=128 * 1024).documents()
    other = train_nested(prose, [500])
    save_nested(other, tmp_path / "other", corpus="mixed")
    wrong = tmp_path / "wrong"
    prune_to_dir(
        LoadedTokenizer(tokenizers_from_dir(tmp_path / "other", [500])[0].tokenizer, "o", "hf"),
        texts, 400, wrong, corpus="mixed",
    )  # fmt: skip
    with pytest.raises(
        UserError,
        match=r"init_from .*: its tokenizer is not the source of the pruned tokenizer "
        r"tokenizer .*wrong \(its token \d+ is .*, the run's token \d+ .*\)",
    ):
        train(dataclasses.replace(cfg, tokenizer=str(wrong)), tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_bad_pruned_starts_are_user_errors(source_run, tmp_path):
    with pytest.raises(
        UserError,
        match=r"prune_to 1000 is larger than the largest head of init_from .* \(500\); pruning "
        "only removes tokens",
    ):
        train(pruned_config(source_run, heads=(1000,)), tmp_path / "x")
    with pytest.raises(UserError, match="seq_len 32 differs from 16 of init_from"):
        train(pruned_config(source_run, seq_len=32), tmp_path / "x")
    with pytest.raises(UserError, match="init_from .* holds no run.json"):
        train(pruned_config(tmp_path / "nothing"), tmp_path / "x")
    with pytest.raises(UserError, match="trains one head, the pruned size"):
        pruned_config(source_run, heads=(300, 400))
    assert not (tmp_path / "x").exists()
