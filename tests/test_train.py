"""The training library: data windows and bytes, bits per byte against a hand computation, the
loss going down, resume equivalence, atomic checkpoints, NaN handling."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from vocab_testing import MAX_BYTES, heldout_texts, mixed_text, nested

from vocabjax.errors import UserError
from vocabjax.models import GPT
from vocabjax.shapes import ModelShape
from vocabjax.train import (
    IGNORE,
    CorpusSpec,
    HeadTokenizer,
    RunConfig,
    Windows,
    eval_windows,
    heldout_bpb,
    init_params,
    load_checkpoint,
    make_train_step,
    optimizer,
    save_checkpoint,
    tokenizers_from_nested,
    train,
)
from vocabjax.train import checkpoint as checkpoint_module
from vocabjax.train import run as run_module
from vocabjax.train.steps import Functional, time_step

MICRO = ModelShape("micro", d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, glu=True)
HEADS = (300, 500)


def config(tmp_path: Path | None = None, **kw) -> RunConfig:
    base = dict(
        shape=MICRO,
        heads=HEADS,
        tokenizer=None,
        corpus=CorpusSpec("builtin", max_bytes=MAX_BYTES),
        steps=6,
        seq_len=16,
        batch=2,
        lr=3e-3,
        warmup=2,
        eval_tokens=256,
        checkpoint_every=0,
        impl="chunked",
    )
    base.update(kw)
    return RunConfig(**base)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from vocabjax.vocab import save_nested

    out = tmp_path_factory.mktemp("tok") / "tok"
    save_nested(nested(), out, corpus="test")
    return out


# ---- data --------------------------------------------------------------------------------------


def test_windows_are_a_seeded_permutation_per_epoch():
    ids = np.arange(10 * 5, dtype=np.int32)
    w = Windows.cut(ids, 4, seed=3, head_index=0)
    assert w.count == 10 and w.windows.shape == (10, 5)
    first_epoch = np.concatenate([w.batch(s, 2) for s in range(5)])
    assert sorted(first_epoch[:, 0].tolist()) == list(range(0, 50, 5))  # each window once
    np.testing.assert_array_equal(w.batch(3, 2), w.batch(3, 2))  # a pure function of the step
    across = w.batch(2, 4)  # windows 8..11: two of epoch 0, two of epoch 1
    np.testing.assert_array_equal(across[:2], first_epoch[8:10])
    other = Windows.cut(ids, 4, seed=4, head_index=0)
    assert not np.array_equal(np.concatenate([other.batch(s, 2) for s in range(5)]), first_epoch)


def test_token_bytes_add_up_to_the_text_and_separators_count_zero():
    heads = tokenizers_from_nested(nested(), HEADS)
    texts = [mixed_text(1), heldout_texts()[0][:3000], "<|endoftext|> is text here"]
    for head in heads:
        assert head.separator == 0 and head.token_bytes[0] == 0
        for text, ids in zip(texts, head.encode(texts)):
            assert ids[-1] == head.separator and ids.max() < head.vocab
            assert int(head.token_bytes[ids].sum()) == len(text.encode("utf-8"))
            assert (ids[:-1] != head.separator).all()  # "<|endoftext|>" in the text is text


def test_eval_windows_predict_every_token_after_the_first_once():
    ids = np.arange(1, 40, dtype=np.int32)
    inputs, labels = eval_windows(ids, seq_len=8, batch=3)
    assert inputs.shape == labels.shape == (2, 3, 8)  # 38 predictions: 5 windows, padded to 6
    flat_labels = labels.reshape(-1, 8)
    flat_inputs = inputs.reshape(-1, 8)
    assert flat_labels[flat_labels != IGNORE].tolist() == ids[1:].tolist()
    for w in range(5):  # each label's input is the token before it
        keep = flat_labels[w] != IGNORE
        np.testing.assert_array_equal(flat_inputs[w][keep] + 1, flat_labels[w][keep])


@pytest.mark.slow
def test_heldout_bpb_equals_a_hand_computation():
    cfg = config(heads=(257, 300), seq_len=8)
    fn, params = init_params(cfg)
    model = fn.model(params)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 300, size=2 * 8 + 4).astype(np.int32)  # 19 predictions, 3 windows
    nbytes = rng.integers(0, 5, size=300)
    head = HeadTokenizer(300, None, None, nbytes)
    got = heldout_bpb(fn, params, head, ids, seq_len=8, batch=2, impl="chunked")
    nats = 0.0
    for start in range(0, len(ids) - 1, 8):
        window = ids[start : start + 9]
        logits = np.asarray(model.logits(model(jnp.asarray(window[None, :-1])), 300), np.float64)
        logp = logits[0] - np.log(np.exp(logits[0]).sum(-1, keepdims=True))
        nats -= logp[np.arange(len(window) - 1), window[1:]].sum()
    expected = nats / (math.log(2) * nbytes[ids[1:]].sum())
    assert got.tokens == int((nbytes[ids[1:]] > 0).sum())
    assert got.bpb == pytest.approx(expected, rel=1e-5)


# ---- training ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_loss_goes_down_on_a_repeated_batch_for_every_head():
    cfg = config(steps=30, warmup=3, lr=1e-2)
    fn, params = init_params(cfg)
    tx = optimizer(cfg)
    opt_state = tx.init(params)
    step = make_train_step(fn, cfg.heads, tx, cfg.impl)
    rng = np.random.default_rng(1)
    text = np.tile(rng.integers(0, 300, size=17), 2)[None, None, :17]  # one repeated window
    batch = jnp.asarray(np.concatenate([text, text], axis=0).repeat(2, axis=1), jnp.int32)
    first = None
    for _ in range(30):
        params, opt_state, losses = step(params, opt_state, batch)
        first = np.asarray(losses) if first is None else first
    last = np.asarray(losses)
    assert first.shape == (2,)
    assert np.all(last < 0.5 * first), (first, last)


@pytest.mark.slow
def test_the_step_donates_its_state_and_timing_leaves_the_callers_intact():
    cfg = config(steps=4)
    fn, params = init_params(cfg)
    tx = optimizer(cfg)
    opt_state = tx.init(params)
    batch = jnp.zeros((len(cfg.heads), 2, 9), jnp.int32)
    kept = {k: np.asarray(v) for k, v in params.items()}
    # Timing steps from copies: the caller's parameters stay live and unchanged.
    donating = make_train_step(fn, cfg.heads, tx, cfg.impl)
    assert time_step(donating, params, opt_state, batch, repeats=2) > 0
    for k, v in params.items():
        np.testing.assert_array_equal(np.asarray(v), kept[k])
    # The step itself consumes them (updated in place), unless asked not to.
    keeping = make_train_step(fn, cfg.heads, tx, cfg.impl, donate=False)
    new_params, new_opt, _ = keeping(params, opt_state, batch)
    assert not any(v.is_deleted() for v in params.values())
    donating(new_params, new_opt, batch)
    assert all(v.is_deleted() for v in new_params.values())


def _params(run_dir):
    return load_checkpoint(run_dir).params


@pytest.mark.slow
def test_half_then_resume_equals_straight(tmp_path, tok_dir):
    cfg = config(tokenizer=str(tok_dir), steps=6, checkpoint_every=2)
    straight = train(cfg, tmp_path / "a", measure=False)
    assert straight.step == 6
    half = train(cfg, tmp_path / "b", stop_after=3)
    assert half.step == 3 and half.heads == ()
    assert load_checkpoint(tmp_path / "b").step == 3
    assert not (tmp_path / "b" / "training.json").exists()
    mid = _params(tmp_path / "b")
    train(cfg, tmp_path / "b", resume=True, measure=False)
    assert load_checkpoint(tmp_path / "b").step == 6
    a, b = _params(tmp_path / "a"), _params(tmp_path / "b")
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-6, atol=1e-7, err_msg=name)
    assert any(np.abs(a[n] - mid[n]).max() > 1e-4 for n in a)  # steps 4..6 did change them


@pytest.mark.slow
def test_a_fresh_run_refuses_an_existing_run_and_resume_checks_the_config(tmp_path, tok_dir):
    cfg = config(tokenizer=str(tok_dir), steps=2)
    train(cfg, tmp_path / "r", measure=False)
    with pytest.raises(
        UserError,
        match="holds a training run .run.json.; pass resume to continue it, or choose another "
        "run_dir",
    ):
        train(cfg, tmp_path / "r")
    with pytest.raises(UserError, match="differs from .*: lr: 0.003 != 0.001"):
        train(dataclasses.replace(cfg, lr=1e-3), tmp_path / "r", resume=True)
    with pytest.raises(UserError, match="holds no run.json"):
        train(cfg, tmp_path / "nothing", resume=True)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(UserError, match="exists and is not empty"):
        train(cfg, tmp_path / "full")


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    params = {"w": np.ones((3, 2), np.float32)}
    opt = {"mu": np.zeros(2, np.float32), "count": np.int32(1)}
    save_checkpoint(tmp_path, 1, params, opt, {"note": "first"})

    def half_write(path, arrays):
        path.write_bytes(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module, "save_npz", half_write)
    with pytest.raises(UserError, match="cannot write .*checkpoint.*: disk full"):
        save_checkpoint(tmp_path, 2, {"w": 2 * params["w"]}, opt, {"note": "second"})
    ck = load_checkpoint(tmp_path)
    assert ck.step == 1 and ck.meta["note"] == "first"
    np.testing.assert_array_equal(ck.params["w"], params["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
    # A kill between the two renames leaves only the old directory: it is still found.
    (tmp_path / "checkpoint").rename(tmp_path / ".checkpoint.old")
    assert load_checkpoint(tmp_path).step == 1


def _poison_from(monkeypatch, bad_call: int) -> None:
    real = run_module.make_train_step

    def poisoned(*args, **kwargs):
        step = real(*args, **kwargs)
        calls = [0]

        def wrapped(params, opt_state, batch):
            params, opt_state, losses = step(params, opt_state, batch)
            calls[0] += 1
            if calls[0] >= bad_call:
                params = jax.tree.map(lambda x: x * jnp.nan, params)
                losses = losses * jnp.nan
            return params, opt_state, losses

        return wrapped

    monkeypatch.setattr(run_module, "make_train_step", poisoned)


@pytest.mark.slow
def test_a_nan_loss_stops_at_its_step_and_never_checkpoints_it(tmp_path, tok_dir, monkeypatch):
    _poison_from(monkeypatch, 3)
    cfg = config(tokenizer=str(tok_dir), steps=6, checkpoint_every=2)
    with pytest.raises(
        UserError, match=r"loss is not finite at step 3 .*the last checkpoint is at step 2"
    ):
        train(cfg, tmp_path / "r")
    ck = load_checkpoint(tmp_path / "r")
    assert ck.step == 2
    assert all(np.isfinite(v).all() for v in ck.params.values())


@pytest.mark.slow
def test_a_nan_at_the_first_step_writes_nothing(tmp_path, tok_dir, monkeypatch):
    _poison_from(monkeypatch, 1)
    with pytest.raises(UserError, match="loss is not finite at step 1 .*no checkpoint was written"):
        train(config(tokenizer=str(tok_dir)), tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()


def test_bad_configs_are_user_errors(tmp_path, tok_dir):
    with pytest.raises(UserError, match="steps=0 must be a positive integer"):
        config(steps=0)
    with pytest.raises(UserError, match=r"heads=\[500, 300\] must be distinct and increasing"):
        config(heads=(500, 300))
    with pytest.raises(UserError, match="head 4096 is larger than the tokenizer's largest level"):
        train(config(tokenizer=str(tok_dir), heads=(300, 4096)), tmp_path / "x")
    with pytest.raises(UserError, match="head 200 must be >= 257"):
        train(config(tokenizer=str(tok_dir), heads=(200, 300)), tmp_path / "x")
    with pytest.raises(
        UserError, match=r"only \d+ window\(s\) of 1025 tokens; one batch needs 512"
    ):
        train(config(tokenizer=str(tok_dir), batch=512, seq_len=1024), tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_a_head_between_levels_is_cut_from_the_largest(tok_dir):
    from vocabjax.train import tokenizers_from_dir

    (head,) = tokenizers_from_dir(tok_dir, [400])
    assert head.vocab == 400 and head.token_bytes.shape == (400,)
    text = heldout_texts()[0][:2000]
    ids = head.encode([text])[0]
    assert ids.max() < 400 and int(head.token_bytes[ids].sum()) == len(text.encode("utf-8"))


def test_gpt_params_are_f32_and_named_for_checkpoints():
    fn, params = Functional.of(GPT(config().model_config, rngs=nnx.Rngs(0)))
    assert all(v.dtype == jnp.float32 for v in params.values())
    assert "unembed.value" in params and params["unembed.value"].shape == (500, 32)


# ---- throughput and kept streams -----------------------------------------------------------


class _Clock:
    """A perf_counter that moves a quarter second per call."""

    def __init__(self) -> None:
        self.t = 0.0

    def perf_counter(self) -> float:
        self.t += 0.25
        return self.t


@pytest.mark.slow
def test_a_one_head_run_reads_tokens_per_s_from_its_own_steps(tmp_path, tok_dir, monkeypatch):
    import json
    import types

    clock = _Clock()
    monkeypatch.setattr(run_module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    steps = run_module.LOOP_TIMING_STEPS + 2
    cfg = config(tokenizer=str(tok_dir), heads=(300,), steps=steps)
    result = train(cfg, tmp_path / "one", timing_repeats=2)
    assert result.timing.startswith(f"the training loop: median of its {steps - 1} steps")
    # Every step takes a whole number of clock ticks; a timing pass (real seconds) would not.
    (head,) = result.heads
    ticks = cfg.batch * cfg.seq_len / head.tokens_per_s / 0.25
    assert ticks == pytest.approx(round(ticks)) and 1 <= round(ticks) <= 4
    data = json.loads((tmp_path / "one" / "training.json").read_text())
    assert data["tokens_per_s_from"] == result.timing


@pytest.mark.slow
def test_short_and_several_head_runs_time_each_head_alone(tmp_path, tok_dir):
    short = train(config(tokenizer=str(tok_dir), heads=(300,), steps=3), tmp_path / "short")
    several = train(config(tokenizer=str(tok_dir), steps=12), tmp_path / "several")
    assert short.timing.startswith("a timing pass") and "the head after" in short.timing
    assert several.timing.startswith("a timing pass") and "each head alone" in several.timing
    assert all(h.tokens_per_s > 0 for h in several.heads)


def test_corpus_streams_are_kept_until_the_corpus_or_tokenizer_changes(
    tmp_path, tok_dir, monkeypatch
):
    from vocabjax.corpus import open_corpus
    from vocabjax.train import data, tokenizers_from_dir

    monkeypatch.setattr(data, "_streams", type(data._streams)())
    encoded = []
    real = data.encode_streams
    monkeypatch.setattr(data, "encode_streams", lambda *a, **k: encoded.append(1) or real(*a, **k))
    path = tmp_path / "c.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    corpus = open_corpus(path, held_out=0.0)
    heads = tokenizers_from_dir(tok_dir, [300])
    first = data.corpus_streams(corpus, heads, "train")
    assert data.corpus_streams(corpus, tokenizers_from_dir(tok_dir, [300]), "train") is first
    assert len(encoded) == 1 and not first.ids[0].flags.writeable
    data.corpus_streams(corpus, tokenizers_from_dir(tok_dir, [500]), "train")  # another level
    assert len(encoded) == 2
    path.write_text("a different text, of another length\n" * 30)
    again = data.corpus_streams(corpus, heads, "train")
    assert len(encoded) == 3 and again.bytes != first.bytes


def test_eval_bytes_scores_every_level_on_one_text(tok_dir):
    from vocabjax.train import encode_streams, tokenizers_from_dir

    texts = list(heldout_texts())
    budget = 3000
    small, large = (
        encode_streams(tokenizers_from_dir(tok_dir, [v]), texts, max_bytes=budget)
        for v in (300, 500)
    )
    assert small.digest == large.digest and small.bytes == large.bytes
    assert budget - 3 <= small.bytes <= budget  # cut at a character boundary
    assert len(large.ids[0]) < len(small.ids[0])  # the larger level takes fewer tokens
    by_tokens = [
        encode_streams(tokenizers_from_dir(tok_dir, [v]), texts, max_tokens=800) for v in (300, 500)
    ]
    assert by_tokens[0].digest != by_tokens[1].digest  # a token budget reads more text at 500
    with pytest.raises(UserError, match="eval_bytes=0 must be a positive integer"):
        config(eval_bytes=0)


@pytest.mark.slow
def test_training_json_names_the_text_read(tmp_path, tok_dir):
    import json

    cfg = config(tokenizer=str(tok_dir), heads=(300,), steps=2, eval_bytes=2048)
    result = train(cfg, tmp_path / "r")
    data = json.loads((tmp_path / "r" / "training.json").read_text())
    assert data["corpus_digest"] == dict(result.corpus_digest)
    assert set(data["corpus_digest"]) == {"train", "heldout"}
    assert all(len(d) == 32 for d in data["corpus_digest"].values())
