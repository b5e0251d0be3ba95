"""The serving engine: the KV-cache path against the full forward (hidden states and greedy
tokens, batched prompts of different lengths, two heads), the decode functions without an
engine (stop codes, the loop against host-driven steps), reproducible sampling, head choice
by --head and by a policy's batch routes, and each bad run or prompt as one UserError."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from serving_testing import HEADS, MICRO, SEQ_LEN, scramble

from vocabjax.errors import UserError
from vocabjax.models import GPT, GPTConfig
from vocabjax.serving import (
    STOP_CODES,
    DecodeConfig,
    Engine,
    LoadedRun,
    Sampling,
    attention_window,
    bucket_length,
    choose_head,
    load_policy,
    load_run,
    route_batch,
)
from vocabjax.serving import decode as dec
from vocabjax.train import Functional

PROMPTS = ["def main(argv):\n    return", "import os"]  # different lengths: one batch


@pytest.fixture(scope="module")
def run_dir(served_run_dir) -> Path:
    return served_run_dir


@pytest.fixture(scope="module")
def run(run_dir) -> LoadedRun:
    return load_run(run_dir)


@pytest.fixture(scope="module")
def scrambled(run) -> LoadedRun:
    return scramble(run)


# ---- the cache path of the model ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fresh", "window"), [(False, None), (True, 15)], ids=["whole-cache", "fresh-and-window"]
)
def test_cached_forward_equals_the_full_forward(fresh, window):
    """Prefill right-padded prompts of lengths 5 and 9 (over the whole cache, or ``fresh``:
    among themselves alone), then decode 6 tokens each at its own position (attending to the
    whole cache of 24 positions, or to a ``window`` of the first 15, past which no position
    reaches): every hidden state equals the full forward's (causal, so one forward of the
    whole sequences gives every prefix's states)."""
    config = GPTConfig(MICRO, max_vocab=97, max_seq=24)
    fn, params = Functional.of(GPT(config, rngs=nnx.Rngs(3)))
    full = jax.jit(lambda p, ids: fn.model(p)(ids))
    cached = jax.jit(
        lambda p, ids, caches, start: fn.model(p).cached(ids, caches, start, window=window)
    )
    prefill = jax.jit(
        lambda p, ids, caches, start: fn.model(p).cached(ids, caches, start, fresh=fresh)
    )
    seqs = np.asarray(jax.random.randint(jax.random.key(1), (2, 16), 0, 97, dtype=jnp.int32))
    want = np.asarray(full(params, jnp.asarray(seqs)))
    lengths = np.asarray([5, 9], dtype=np.int32)
    padded = np.where(np.arange(16)[None, :] < lengths[:, None], seqs, 7)
    caches = fn.model(params).init_cache(2)
    h, caches = prefill(params, jnp.asarray(padded), caches, jnp.zeros(2, jnp.int32))
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(h[b, :n]), want[b, :n], atol=2e-5, rtol=2e-4)
    pos = lengths.copy()
    for _ in range(6):
        feed = seqs[np.arange(2), pos]
        h1, caches = cached(params, jnp.asarray(feed[:, None]), caches, jnp.asarray(pos))
        np.testing.assert_allclose(
            np.asarray(h1[:, 0]), want[np.arange(2), pos], atol=2e-5, rtol=2e-4
        )
        pos += 1
    assert caches[0].k_bskd.shape == (2, 24, MICRO.n_kv_heads, MICRO.dh)


def test_cache_arguments_are_checked():
    model = GPT(GPTConfig(MICRO, max_vocab=97, max_seq=8), rngs=nnx.Rngs(0))
    with pytest.raises(UserError, match="must be in 1..max_seq=8"):
        model.init_cache(1, 9)
    with pytest.raises(UserError, match="start"):
        model.cached(jnp.zeros((2, 3), jnp.int32), model.init_cache(2), jnp.zeros(3, jnp.int32))


# ---- the decode functions, without an engine ----------------------------------------------------


def tiny_config(max_seq: int = 24, **options) -> tuple[DecodeConfig, dict]:
    """A DecodeConfig of a random micro model with 97 tokens, and its parameters."""
    model = GPT(GPTConfig(MICRO, max_vocab=97, max_seq=max_seq), rngs=nnx.Rngs(5))
    fn, params = Functional.of(model)
    return DecodeConfig(fn, max_seq, head=97, **options), params


def test_take_appends_running_rows_and_gives_each_stop_its_code():
    config, _ = tiny_config(max_seq=8, separator=3)
    codes = STOP_CODES
    # rows: separator, non-finite, at its limit, at max_seq, running on, padding (not real)
    state = dec.start(
        config,
        caches=None,
        first_b=jnp.asarray([5, 6, 7, 8, 9, 5], jnp.int32),
        start_b=jnp.asarray([2, 2, 2, 8, 2, 1], jnp.int32),
        limits_b=jnp.asarray([4, 4, 2, 4, 4, 1], jnp.int32),
        real_b=jnp.asarray([True] * 5 + [False]),
    )
    assert state.n_b.tolist() == [1, 1, 1, 1, 1, 0]  # the first tokens, real rows only
    assert state.stop_b.tolist() == [0, 0, 0, codes["max_seq"], 0, 0]
    run_b = dec.running(state)
    assert run_b.tolist() == [True, True, True, False, True, False]
    tokens_b = jnp.asarray([3, -1, 11, 12, 13, 14], jnp.int32)
    after = dec.take(config, state, tokens_b, run_b)
    stops = [codes["eos"], codes["nonfinite"], codes["max_new_tokens"], codes["max_seq"], 0, 0]
    assert after.stop_b.tolist() == stops
    assert after.n_b.tolist() == [1, 1, 2, 1, 2, 0]  # the separator and -1 are not text
    assert after.out_bs[:, :2].tolist() == [[5, 0], [6, 0], [7, 11], [8, 0], [9, 13], [0, 0]]
    assert after.last_b.tolist() == [5, 6, 11, 8, 13, 0]
    assert dec.running(after).tolist() == [False, False, False, False, True, False]


@pytest.mark.slow
def test_the_decode_loop_equals_host_driven_steps():
    """``decode`` (one jitted while_loop) against ``start`` then ``step`` called from the host
    one at a time, on prompts of different lengths, limits and a padding row; sampled, so the
    per-step keys must line up too (no separator: every real row runs to its limit)."""
    config, params = tiny_config(sampling=Sampling(temperature=1.0, seed=0))
    ids_bt = jax.random.randint(jax.random.key(2), (3, 16), 4, 97, dtype=jnp.int32)
    lengths_b = jnp.asarray([5, 11, 1], jnp.int32)
    limits_b = jnp.asarray([6, 9, 1], jnp.int32)
    real_b = jnp.asarray([True, True, False])
    rng = jax.random.key(1)
    caches, first_b, nats_b = jax.jit(functools.partial(dec.prefill, config))(
        params, ids_bt, lengths_b, rng
    )
    assert nats_b is None  # score=False
    args = (first_b, lengths_b, limits_b, real_b)
    looped = jax.jit(functools.partial(dec.decode, config))(params, caches, *args, rng)
    state = dec.start(config, caches, *args)
    step = jax.jit(functools.partial(dec.step, config))
    while bool(dec.running(state).any()):
        state = step(params, state, rng)
    for name in ("out_bs", "n_b", "stop_b", "pos_b", "steps", "produced"):
        np.testing.assert_array_equal(getattr(looped, name), getattr(state, name), err_msg=name)
    assert looped.n_b.tolist() == [6, 9, 0] and int(looped.steps) == 8
    assert looped.stop_b.tolist()[:2] == [STOP_CODES["max_new_tokens"]] * 2
    assert len(set(looped.out_bs[1, :9].tolist())) > 3  # varied tokens: sampled, not stuck


# ---- the engine ---------------------------------------------------------------------------------


def reference_greedy(run: LoadedRun, prompt: str, head: int, n: int) -> list[int]:
    """Greedy decoding by recomputing the full (training) forward on the growing sequence, no
    cache; the sequence is right-padded to max_seq so one compiled forward serves every step
    (causal: padding after the last token cannot change it). Checks that no step is a near
    tie, so agreement is not luck."""

    @jax.jit
    def last_logits(params, ids_t, n_t):
        model = run.fn.model(params)
        h_td = model(ids_t[None])[0]
        return model.logits(h_td[n_t - 1][None, None], head)[0, 0]

    ids = list(Engine(run).encode([prompt], head)[0])
    sep = run.level(head).separator
    out = []
    for _ in range(n):
        if len(ids) > run.max_seq:
            break
        padded = np.zeros(run.max_seq, np.int32)
        padded[: len(ids)] = ids
        logits = np.asarray(last_logits(run.params, jnp.asarray(padded), len(ids)))
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 1e-4, "a near tie: the comparison would be fragile"
        token = int(np.argmax(logits))
        if token == sep:
            break
        out.append(token)
        ids.append(token)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("head", HEADS)
def test_greedy_tokens_equal_recomputing_the_full_forward(scrambled, head):
    engine = Engine(scrambled)
    out = engine.generate(PROMPTS, head=head, max_new_tokens=8)
    for prompt, c in zip(PROMPTS, out.completions, strict=True):
        want = reference_greedy(scrambled, prompt, head, 8)
        assert list(c.tokens) == want
        assert len(set(want)) > 2  # varied tokens: the check has teeth
        assert c.text == scrambled.level(head).tokenizer.decode(want, skip_special_tokens=False)
    alone = engine.generate(PROMPTS[1:], head=head, max_new_tokens=8)  # B = 1 gives the same
    assert alone.completions[0].tokens == out.completions[1].tokens
    assert out.bucket == 32 and out.batch == 2 and out.head == head


@pytest.mark.slow
def test_the_trained_run_agrees_with_its_full_forward_too(run):
    out = Engine(run).generate(PROMPTS[:1], head=HEADS[0], max_new_tokens=5)
    assert list(out.completions[0].tokens) == reference_greedy(run, PROMPTS[0], HEADS[0], 5)


@pytest.mark.slow
def test_one_compiled_prefill_serves_every_decode_window(scrambled):
    engine = Engine(scrambled)
    ids = jnp.zeros((1, 16), jnp.int32)
    example = (scrambled.params, ids, jnp.full((1,), 4, jnp.int32), jax.random.key(0))
    whole = engine.compile(500, 1, 16, Sampling(), False, example)
    short = engine.compile(500, 1, 16, Sampling(), False, example, window=16)
    again = engine.compile(500, 1, 16, Sampling(), False, example, window=16)
    assert short.prefill is whole.prefill and short.decode is not whole.decode
    assert again == (short.prefill, short.decode, 0.0)


def test_generation_stops_at_max_seq(scrambled):
    prompt = "def f(x):\n    return x\n" * 2  # about half of the 40 positions
    n_prompt = len(Engine(scrambled).encode([prompt], 500)[0])
    out = Engine(scrambled).generate([prompt], head=500, max_new_tokens=64).completions[0]
    assert out.stop == "max_seq" and n_prompt + len(out.tokens) == SEQ_LEN + 1


def _with_params(run: LoadedRun, **changes) -> LoadedRun:
    params = {**run.params, **changes}
    return dataclasses.replace(run, params=params, model=run.fn.model(params))


@pytest.mark.slow
def test_generation_stops_at_the_separator_and_on_a_non_finite_state(scrambled):
    # W = 0: every logit ties, the lowest id wins, and id 0 is the separator: stop at once.
    assert scrambled.level(300).separator == 0
    w = scrambled.params["unembed.value"]
    silent = _with_params(scrambled, **{"unembed.value": jnp.zeros_like(w)})
    out = Engine(silent).generate(PROMPTS, head=300, max_new_tokens=8)
    assert [(c.stop, c.tokens, c.text) for c in out.completions] == [("eos", (), "")] * 2
    assert (out.decode_steps, out.decode_tokens) == (0, 0)
    # A NaN in the final norm: every hidden state is NaN, greedy says -1, one error line.
    scale = scrambled.params["final_norm.scale.value"]
    broken = _with_params(scrambled, **{"final_norm.scale.value": scale * jnp.nan})
    with pytest.raises(UserError, match="hidden state or its logits are not finite"):
        Engine(broken).generate(PROMPTS[:1], head=300, max_new_tokens=4)
    # A NaN in one row of the unembedding: a finite state, but that token's logit is NaN in
    # every row; the pick says -1 (it used to pick the NaN's id), so the same error.
    poisoned = _with_params(scrambled, **{"unembed.value": w.at[200].set(jnp.nan)})
    with pytest.raises(UserError, match="hidden state or its logits are not finite"):
        Engine(poisoned).generate(PROMPTS[:1], head=300, max_new_tokens=4)


@pytest.mark.slow
def test_sampling_is_reproducible_by_seed(scrambled):
    engine = Engine(scrambled)

    def draw(seed, top_k=None):
        s = Sampling(temperature=1.0, top_k=top_k, seed=seed)
        out = engine.generate(PROMPTS, head=500, max_new_tokens=12, sampling=s)
        return [c.tokens for c in out.completions]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)
    greedy = engine.generate(PROMPTS, head=500, max_new_tokens=12)
    assert draw(5, top_k=1) == [c.tokens for c in greedy.completions]


def test_prompts_pad_to_a_power_of_two_bucket():
    assert [bucket_length(n, 40) for n in (1, 16, 17, 33, 40)] == [16, 16, 32, 40, 40]
    assert bucket_length(3, 8) == 8


def test_decode_attends_to_the_bucket_that_holds_every_row_end():
    assert attention_window([5 + 6, 9 + 6], 64) == 16
    assert attention_window([9 + 8], 64) == 32
    assert attention_window([30, 33], 40) is None  # the bucket would be the whole cache
    assert attention_window([], 64) == 16
    assert attention_window(np.asarray([20, 9], np.int64), 64) == 32  # numpy ends too


def test_sampling_arguments_are_checked():
    with pytest.raises(UserError, match="must be a finite number >= 0"):
        Sampling(temperature=-1.0)
    with pytest.raises(UserError, match="give a temperature > 0"):
        Sampling(top_k=3)


# ---- loading and errors -------------------------------------------------------------------------


def test_load_run_rebuilds_the_checkpointed_model(run, run_dir):
    from vocabjax.train import load_checkpoint

    assert run.heads == HEADS and run.step == 6 and run.max_seq == SEQ_LEN
    assert [lv.vocab for lv in run.levels] == list(HEADS)
    saved = load_checkpoint(run_dir).params
    assert set(saved) == set(run.params)
    for name, value in saved.items():
        np.testing.assert_array_equal(np.asarray(run.params[name]), value)


def test_bad_runs_are_one_user_error(tmp_path, run_dir):
    with pytest.raises(UserError, match="run directory '.*missing' does not exist"):
        load_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no run.json"):
        load_run(tmp_path / "empty")
    import shutil

    copy = tmp_path / "corrupt"
    shutil.copytree(run_dir, copy)
    state = copy / "checkpoint" / "state.npz"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    with pytest.raises(UserError, match="state.npz is not a readable checkpoint"):
        load_run(copy)


def test_bad_prompts_are_user_errors(run):
    engine = Engine(run)
    with pytest.raises(UserError, match="prompt 2 is empty"):
        engine.generate(["a", ""], head=300)
    with pytest.raises(UserError, match=f"above the run's max_seq={SEQ_LEN}"):
        engine.generate(["word " * 100], head=300)
    with pytest.raises(UserError, match=r"head 400 is not one of the run's heads \(300, 500\)"):
        engine.generate(["a"], head=400)


# ---- head choice --------------------------------------------------------------------------------


def test_head_choice_by_option_and_by_policy(tmp_path):
    assert choose_head(HEADS, "auto", batch=1).vocab == 500
    assert choose_head(HEADS, 300, batch=64).vocab == 300
    with pytest.raises(UserError, match=r"head 1024 is not one of the run's heads"):
        choose_head(HEADS, 1024, batch=1)
    routes = [(1, 256), (16, 300), (None, 4096)]
    picks = {b: choose_head(HEADS, "auto", batch=b, routes=routes) for b in (1, 2, 16, 17)}
    assert {b: c.vocab for b, c in picks.items()} == {1: 300, 2: 300, 16: 300, 17: 500}
    assert "routes B=1 (B <= 1) to 256: serving 300, the run's nearest head" in picks[1].reason
    assert "nearest" not in picks[2].reason
    assert "routes B=17 (B > 16) to 4096: serving 500" in picks[17].reason
    assert choose_head((256, 1024), "auto", batch=1, routes=[(None, 512)]).vocab == 1024  # tie
    path = tmp_path / "policy.json"
    path.write_text('{"schema": 1, "kind": "policy", "batch_routes": [{"max_batch": 4, '
                    '"head": 300}, {"max_batch": null, "head": 500}]}')  # fmt: skip
    assert load_policy(path) == [(4, 300), (None, 500)]
    path.write_text('{"schema": 1, "kind": "policy", "batch_routes": [{"head": "x"}]}')
    with pytest.raises(UserError, match=r"batch_routes\[0\].head must be a positive integer"):
        load_policy(path)


def test_a_batch_route_is_the_policy_head_shifted_by_the_offset():
    heads, routes = (300, 500, 800), [(1, 300), (None, 800)]
    one = route_batch(heads, routes, batch=1, offset=1)
    assert (one.routed.vocab, one.offset, one.head) == (300, 1, 500)
    assert one.reason == (
        "head auto: the policy routes B=1 (B <= 1) to 300: serving 300; offset +1: serving 500"
    )
    many = route_batch(heads, routes, batch=9, offset=2)
    assert (many.routed.vocab, many.head) == (800, 800)  # clamped at the largest head
    assert route_batch(heads, routes, batch=9, offset=-5).head == 300  # and at the smallest
    plain = route_batch(heads, routes, batch=9, offset=0)
    assert plain.reason == choose_head(heads, "auto", batch=9, routes=routes).reason


def test_a_policy_plan_writes_loads_with_its_fit_flags(tmp_path):
    from vocabjax.api import plan

    dep = plan(workload="e:b=1:share=0.5,dc:b=1024:share=0.5", lam=100, device="l4",
               model="llama-8b")  # fmt: skip
    assert any(not r["fits"] for r in dep.policy["batch_routes"])  # 1024 rows of 8B on 24 GB
    path = dep.save(tmp_path / "policy.json")
    routes = load_policy(path)
    assert routes == [(r["max_batch"], r["head"]) for r in dep.policy["batch_routes"]]
    bad = json.loads(path.read_text())
    bad["batch_routes"][0]["fits"] = "yes"
    path.write_text(json.dumps(bad))
    with pytest.raises(UserError, match=r"batch_routes\[0\].fits must be true or false"):
        load_policy(path)


def test_policy_schema_1_still_loads_and_an_unknown_schema_is_refused(tmp_path):
    path = tmp_path / "policy.json"
    old = {"schema": 1, "kind": "policy", "break_even": [{"vocab": 512, "lam": "never"}],
           "batch_routes": [{"max_batch": None, "head": 500}]}  # fmt: skip
    path.write_text(json.dumps(old))
    assert load_policy(path) == [(None, 500)]
    path.write_text(json.dumps({**old, "schema": 3}))
    with pytest.raises(UserError, match="schema 3 is not supported .vocabjax reads 1 or 2."):
        load_policy(path)
