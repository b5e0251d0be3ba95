"""Mixed heads: rows at different nested heads in one decode step pick exactly what each head's
own step picks (the masked pick against per-head picks of the same rows; a running batch
holding two heads against serving each request alone; a served trace mixed against one served
in separate groups), and the cost model's choice between one mixed step and separate groups."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from serving_testing import MICRO, scrambled_engine

from vocabjax.costmodel import CostModel, Settings
from vocabjax.errors import UserError
from vocabjax.hardware import load_device
from vocabjax.models import GPT, GPTConfig
from vocabjax.serving import Engine, Request, Sampling, ServeConfig, serve
from vocabjax.serving import decode as dec
from vocabjax.serving.batching import Joining, RunningBatch, solo_key
from vocabjax.serving.mixing import Group, Placer, Pricer
from vocabjax.shapes import load_shape
from vocabjax.train import Functional

SAMPLINGS = [Sampling(), Sampling(temperature=0.7), Sampling(temperature=1.3, top_k=5)]
SAMPLING_IDS = ["greedy", "sampled", "top_k"]


# ---- the masked pick ----------------------------------------------------------------------------


# settings of one batch's rows: greedy, sampled, top k in the smallest bucket and in the next
SETTINGS = [Sampling(), Sampling(0.7), Sampling(1.3, top_k=5), Sampling(1.0, top_k=20)]


@pytest.mark.slow
def test_rows_of_every_sampling_and_head_in_one_pick_pick_as_each_alone():
    """One per-row pick over rows of four settings at three heads: each row's token is its own
    head and setting's pick alone (``per_row=None``, the setting static), compiled for the
    bucket (sampled, top k <= 64) and not per setting."""
    heads = (31, 64, 97)
    model = GPT(GPTConfig(MICRO, max_vocab=97, max_seq=8), rngs=nnx.Rngs(3))
    rows = 24
    kh, kk = jax.random.split(jax.random.key(12))
    h_bd = 3.0 * jax.random.normal(kh, (rows, MICRO.d_model), jnp.float32)
    h_bd = h_bd.at[5].set(jnp.inf)  # a non-finite state: -1 whatever its setting
    keys_b = jax.random.split(kk, rows)
    j_b = jnp.arange(rows, dtype=jnp.int32) % 5
    setting_b = np.arange(rows) % len(SETTINGS)
    vocab_b = np.asarray(heads)[(np.arange(rows) // len(SETTINGS)) % len(heads)]
    temp_b = jnp.asarray([SETTINGS[i].temperature for i in setting_b], jnp.float32)
    topk_b = jnp.asarray([SETTINGS[i].top_k or 0 for i in setting_b], jnp.int32)
    picks = dec.RowPicks.of(SETTINGS)
    assert picks == dec.RowPicks(True, 64)  # top k 20: the bucket of 64
    config = dec.DecodeConfig(None, 8, 97, per_row=picks)
    fn = jax.jit(lambda *a: dec.pick(config, model, h_bd, keys_b, j_b, *a))
    got = np.asarray(fn(jnp.asarray(vocab_b, jnp.int32), temp_b, topk_b))

    def alone(head: int, s: Sampling) -> np.ndarray:
        own = dec.DecodeConfig(None, 8, head, s)
        return np.asarray(jax.jit(lambda: dec.pick(own, model, h_bd, keys_b, j_b))())

    want = [alone(int(v), SETTINGS[i])[r] for r, (v, i) in enumerate(zip(vocab_b, setting_b))]
    np.testing.assert_array_equal(got, want)
    assert got[5] == -1 and (np.delete(got, 5) >= 0).all() and (got < vocab_b).all()
    # the teeth: greedy for every row picks otherwise, and so does the widest head for all
    greedy = np.asarray(fn(jnp.asarray(vocab_b, jnp.int32), temp_b * 0, topk_b * 0))
    assert (greedy != got).sum() >= 6
    unmasked = np.asarray(fn(jnp.full(rows, 97, jnp.int32), temp_b, topk_b))
    assert (unmasked >= vocab_b).any()


def test_row_picks_bucket_the_largest_top_k():
    of = dec.RowPicks.of
    assert of([Sampling()]) == (False, 0) and of([]) == (False, 0)
    assert of([Sampling(), Sampling(0.5)]) == (True, 0)
    assert of([Sampling(0.5, top_k=1)]) == (True, 16)
    assert of([Sampling(0.5, top_k=16), Sampling(2.0, top_k=3)]) == (True, 16)
    assert of([Sampling(0.5, top_k=17)]) == (True, 64)
    assert of([Sampling(0.5, top_k=300)]) == (True, 1024)


def test_a_temperature_whose_inverse_overflows_is_refused():
    with pytest.raises(UserError, match="temperature=1e-09 is below 1e-06: give 0"):
        Sampling(1e-9)
    assert Sampling(1e-6).temperature == 1e-6


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
def test_a_nan_weight_stops_the_heads_that_hold_it_alone(sampling):
    """Token 50's weights NaN: its logit is NaN in every row, so every row at a head that holds
    it (64, 97) picks -1, as each head's own pick does, and rows at head 31 never see it."""
    heads = (31, 64, 97)
    model = GPT(GPTConfig(MICRO, max_vocab=97, max_seq=8), rngs=nnx.Rngs(3))
    w = model.embed if model.config.tie_embeddings else model.unembed
    w[...] = w[...].at[50].set(jnp.nan)
    rows = 9
    h_bd = jax.random.normal(jax.random.key(5), (rows, MICRO.d_model), jnp.float32)
    keys_b = jax.random.split(jax.random.key(6), rows)
    j_b = jnp.zeros((rows,), jnp.int32)
    vocab_b = jnp.asarray(np.repeat(heads, 3), jnp.int32)

    def picks(head: int, mask=None) -> np.ndarray:
        config = dec.DecodeConfig(
            None,
            8,
            head,
            sampling,
            per_row=dec.RowPicks.of([sampling]) if mask is not None else None,
        )
        return np.asarray(jax.jit(lambda h: dec.pick(config, model, h, keys_b, j_b, mask))(h_bd))

    mixed = picks(97, vocab_b)
    want = np.concatenate([picks(v)[3 * i : 3 * i + 3] for i, v in enumerate(heads)])
    np.testing.assert_array_equal(mixed, want)
    assert (mixed[:3] >= 0).all() and (mixed[3:] == -1).all()


@pytest.mark.slow
def test_a_mixed_decode_loop_equals_each_heads_loop():
    """The same carry of rows at two heads, run by the loop once mixed and once per head."""
    heads = (40, 97)
    fn, params = Functional.of(GPT(GPTConfig(MICRO, max_vocab=97, max_seq=24), rngs=nnx.Rngs(5)))
    ids_bt = jax.random.randint(jax.random.key(2), (4, 16), 4, 40, dtype=jnp.int32)
    lengths_b = jnp.asarray([5, 9, 3, 7], jnp.int32)
    limits_b = jnp.asarray([6, 4, 9, 8], jnp.int32)
    vocab_b = jnp.asarray([40, 97, 97, 40], jnp.int32)
    rng = jax.random.key(0)

    def run(head: int, mixed: bool):
        config = dec.DecodeConfig(
            fn, 24, head=head, per_row=dec.RowPicks(False, 0) if mixed else None
        )
        caches, _, _ = jax.jit(functools.partial(dec.prefill, config))(
            params, ids_bt, lengths_b, rng
        )
        first_b = ids_bt[:, 0]  # any first tokens, the same for both
        state = dec.start(config, caches, first_b, lengths_b, limits_b, jnp.ones(4, bool))
        state = state._replace(vocab_b=vocab_b)
        some = jax.jit(functools.partial(dec.decode_some, config))
        while dec.running(state).any():  # each call ends where a row stops
            state = some(params, state, rng, jnp.int32(100))
        return state

    mixed = run(97, True)
    for head in heads:
        alone = run(head, False)
        rows = np.asarray(vocab_b) == head
        np.testing.assert_array_equal(
            np.asarray(mixed.out_bs)[rows], np.asarray(alone.out_bs)[rows]
        )
    np.testing.assert_array_equal(mixed.n_b, limits_b)


# ---- a running batch and a served trace ---------------------------------------------------------


@pytest.fixture(scope="module")
def engine(served_run_dir) -> Engine:
    return scrambled_engine(served_run_dir)


PROMPTS = ("def main(argv):\n    return argv[0]", "import os", "x = 1", "for i in range(10):")
LIMITS = (9, 12, 6, 10)
AT = (300, 500, 300, 500)  # the head each request runs at


@pytest.mark.slow
@pytest.mark.parametrize(
    "sampling",
    [Sampling(), pytest.param(Sampling(temperature=1.0, top_k=7), marks=pytest.mark.slow)],
    ids=["greedy", "top_k"],
)
def test_rows_at_two_heads_in_one_batch_get_their_solo_tokens(engine, sampling):
    batch = RunningBatch(engine, 300, max_rows=4)
    got: dict[int, tuple[int, ...]] = {}
    mixed_calls = []

    def keep(done, calls):
        got.update({f.tag: f.tokens for f in done})
        mixed_calls.extend(c.mixed for c in calls if c.kind == "steps")

    def joining(i: int) -> list[Joining]:
        return [
            Joining(i, engine.encode([PROMPTS[i]], AT[i])[0], LIMITS[i], solo_key(50 + i), sampling)
        ]

    keep(*batch.join(joining(0))[1:])
    keep(*batch.advance(2))
    keep(*batch.join(joining(1), head=500)[1:])  # a row at 500 joins rows at 300
    assert batch.mixed and batch.vocab == 500 and batch.mix == {300: 1, 500: 1}
    keep(*batch.advance(3))
    keep(*batch.join(joining(2), head=300)[1:])
    keep(*batch.join(joining(3), head=500)[1:])
    while batch.live:
        keep(*batch.advance(4))
    for i, prompt in enumerate(PROMPTS):
        alone = Sampling(sampling.temperature, sampling.top_k, seed=50 + i)
        want = engine.generate([prompt], head=AT[i], max_new_tokens=LIMITS[i], sampling=alone)
        assert got[i] == want.completions[0].tokens, f"request {i} at head {AT[i]}"
    assert any(t >= 300 for i in (1, 3) for t in got[i])  # the 500 rows used their larger head
    assert True in mixed_calls and False in mixed_calls  # mixed steps, and one head's alone


# Arrivals: a alone (B = 1: head 300), then three while it runs (B = 4: head 500), then one more
# alone later (the clock jumps).
TRACE = (
    Request("a", 0.0, PROMPTS[0], 12),
    Request("b", 1e-9, PROMPTS[1], 9),
    Request("c", 1e-9, PROMPTS[2], 5),
    Request("d", 1e-9, PROMPTS[3], 7),
    Request("e", 50.0, "y", 4),
)
ROUTES = [(1, 300), (None, 500)]


@pytest.mark.slow
@pytest.mark.parametrize("mixing", ["mixed", "separate", "auto"])
def test_a_trace_served_mixed_or_apart_gives_each_request_its_own_heads_tokens(engine, mixing):
    lines: list[str] = []
    config = ServeConfig(max_batch=8, mixing=mixing, device=load_device("a100-80gb"))
    result = serve(engine, TRACE, ROUTES, config, progress=lines.append)
    served = {r.id: r for r in result.requests}
    heads = {r.id: r.head for r in result.requests}
    assert heads == {"a": 300, "b": 500, "c": 500, "d": 500, "e": 300}
    for r in TRACE:
        want = engine.generate([r.prompt], head=heads[r.id], max_new_tokens=r.max_new_tokens)
        assert served[r.id].text == want.completions[0].text, r.id
    s = result.summary()
    joined = result.batches[1]  # b, c and d, admitted while a runs at 300
    if mixing == "separate":
        assert s["mixed_steps"] == 0 and not joined.mixed and joined.group == 1
        assert "no mixed step (--mixing separate)" in joined.grouping
    else:  # the a100's launches outweigh a 500-row head's extra logits: auto mixes too
        assert s["mixed_steps"] > 0 and joined.mixed and joined.group == 0
        assert joined.grouping.startswith("heads 300+500 share one step at 500 (4 rows)")
        assert any(c.mixed and c.head == 500 for c in result.chunks)
    if mixing == "auto":
        assert "per step predicted on a100-80gb, against" in joined.grouping
        assert sum("heads 300+500 share one step" in x for x in lines) == 1  # said once
    assert result.to_json()["config"]["mixing"] == mixing


# ---- the cost model's choice --------------------------------------------------------------------


def pricer(max_rows: int, **kwargs) -> Pricer:
    model = CostModel(
        load_device("a100-80gb"), load_shape("tiny"), Settings(attention="materialized")
    )
    return Pricer(model, context=128, max_rows=max_rows, **kwargs)


def test_mixing_is_chosen_where_the_cost_model_prices_it_cheaper():
    p = pricer(256)
    # one row at 1k running, one at 4k joining: two steps' launches outweigh 4k logits
    place = p.place([Group({1024: 1}, 1)], head=4096, joining=1)
    mixed, apart = p.step_seconds(4096, 2), p.step_seconds(1024, 1) + p.step_seconds(4096, 1)
    assert mixed < apart and place.mixed and place.group == 0
    assert (place.seconds, place.other) == (mixed, apart)
    # 255 rows at 1k and one joining at 1M: the mixed step's 256 x 1M logits cost more than a
    # second step
    big = 2**20
    place = p.place([Group({1024: 255}, 256)], head=big, joining=1)
    mixed, apart = p.step_seconds(big, 256), p.step_seconds(1024, 256) + p.step_seconds(big, 1)
    assert apart < mixed and not place.mixed and place.group is None
    assert place.reason.startswith(f"head {big} runs in its own group (1 rows): ")
    assert place.choice and (place.seconds, place.other) == (apart, mixed)
    # forced either way, and a group without room is no option
    assert p.place([Group({1024: 255}, 256)], head=big, joining=1, mixing="mixed").mixed
    assert not p.place([Group({1024: 1}, 1)], head=4096, joining=1, mixing="separate").mixed
    full = p.place([Group({1024: 256}, 256)], head=4096, joining=1)
    assert full.group is None and not full.mixed and not full.choice
    # a pure group of the joining head is joined rather than a new one started
    place = p.place([Group({1024: 3}, 4), Group({4096: 2}, 2)], head=4096, joining=1)
    assert place.group in (0, 1) and (place.group == 1) == (not place.mixed)


def test_drained_groups_merge_where_one_step_is_priced_cheaper():
    p = pricer(8)
    # two half-empty groups at one head: one step of 8 rows against two of 4 and 2
    merge = p.merge([Group({4096: 3}, 4), Group({4096: 2}, 2)])
    assert merge is not None and (merge.into, merge.other) == (0, 1)
    assert merge.seconds == p.step_seconds(4096, 8)
    assert merge.apart == p.step_seconds(4096, 4) + p.step_seconds(4096, 2) > merge.seconds
    assert merge.reason.startswith("groups of 3 and 2 rows at heads 4096 merge into one of 8 ")
    # the smaller absorbed by the larger; the pair that saves most of three
    three = [Group({4096: 1}, 1), Group({4096: 6}, 8), Group({4096: 1}, 1)]
    merge = p.merge(three)
    assert merge is not None and merge.into == 1 and merge.other in (0, 2)
    assert p.merge([Group({4096: 5}, 8), Group({4096: 4}, 4)]) is None  # 9 rows do not fit
    assert p.merge([Group({4096: 5}, 8)]) is None
    # rows at two heads merge only where they may mix
    two_heads = [Group({1024: 3}, 4), Group({4096: 2}, 2)]
    assert p.merge(two_heads, mixing="separate") is None
    assert p.merge(two_heads) is not None
    refused = pricer(8, cannot_mix="the run's heads are separate matrices, with no shared prefix")
    assert refused.merge(two_heads) is None
    # a merge that would cost more than the two apart is not made
    big = pricer(256)
    assert big.merge([Group({1024: 128}, 128), Group({2**20: 1}, 1)]) is None


@pytest.mark.slow
def test_consolidate_merges_two_running_groups_and_says_so(engine):
    def groups(*which: int) -> list[RunningBatch]:
        out = []
        for i in which:  # each request in a group of its own, at its head
            batch = RunningBatch(engine, AT[i], max_rows=4)
            batch.join([Joining(i, engine.encode([PROMPTS[i]], AT[i])[0], LIMITS[i], solo_key(i))])
            out.append(batch)
        return out

    lines: list[str] = []
    running = groups(0, 1)  # 300 and 500
    calls = Placer(pricer(4), "auto", lines.append).consolidate(running)
    assert [(c.kind, c.rows, c.running, c.mixed) for c in calls] == [("merge", 2, 2, True)]
    assert len(running) == 1 and running[0].mix == {300: 1, 500: 1}
    assert len(lines) == 1 and lines[0].startswith(
        "  groups of 1 and 1 rows at heads 300+500 merge into one of 2 rows: "
    )
    assert Placer(pricer(4), "auto", lines.append).consolidate(running) == []  # one group left
    apart = groups(0, 1)
    assert Placer(pricer(4), "separate", lines.append).consolidate(apart) == []
    assert len(apart) == 2 and len(lines) == 1
    same = groups(0, 2)  # both at 300: no mixing needed
    calls = Placer(pricer(4), "separate", lines.append).consolidate(same)
    assert [(c.kind, c.mixed) for c in calls] == [("merge", False)] and same[0].mix == {300: 2}


def test_mixing_refused_says_why():
    p = pricer(8, cannot_mix="the run's heads are separate matrices, with no shared prefix")
    place = p.place([Group({1024: 1}, 1)], head=4096, joining=1, mixing="mixed")
    assert not place.mixed and place.choice
    assert place.reason.endswith("no mixed step (the run's heads are separate matrices, with no "
                                 "shared prefix)")  # fmt: skip
    fused = pricer(8, impl=lambda vocab, rows: ("pallas", "profile"))
    place = fused.place([Group({1024: 1}, 1)], head=4096, joining=1)
    assert not place.mixed and "impl auto picks pallas for head 4096 at 2 rows" in place.reason


def test_the_command_takes_mixing_and_a_device(served_run_dir, tmp_path):
    import json

    from click.testing import CliRunner

    import cli

    (tmp_path / "policy.json").write_text(
        json.dumps({"schema": 1, "kind": "policy", "batch_routes": [{"head": 500}]})
    )
    args = ["serve", "--run", str(served_run_dir), "--policy", str(tmp_path / "policy.json")]
    bad = CliRunner().invoke(cli.main, [*args, "--device", "nope"])
    assert bad.exit_code == 1
    assert bad.stderr.strip().splitlines()[-1].startswith("Error: unknown device 'nope'")
    bad = CliRunner().invoke(cli.main, [*args, "--mixing", "sometimes"])
    assert bad.exit_code == 2 and "'sometimes' is not one of 'auto', 'mixed', 'separate'" in (
        bad.stderr
    )
