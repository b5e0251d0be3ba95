"""Continuous batching in the engine: requests that join a running batch between decode steps,
leave when they stop, and move between row buckets get exactly the tokens they get served
alone (greedy, and sampled with their own key); the loop that yields to the host stops at k
steps or at the first row that stops."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from serving_testing import scrambled_engine

from vocabjax.serving import Engine, Sampling, bucket_length
from vocabjax.serving import decode as dec
from vocabjax.serving.batching import Call, Joining, RunningBatch, prefill, solo_key

HEAD = 500
# Prompts of different lengths (two prompt buckets) and limits (1: it stops at the token its
# prefill picks, inside the join).
PROMPTS = (
    "def main(argv):\n    return argv[0]",
    "import os",
    "x = 1",
    "class A:\n    pass\n\n\nclass B(A):\n    value = 3\n",
    "for i in range(10):",
    "y",
)
LIMITS = (7, 12, 1, 9, 5, 11)


@pytest.fixture(scope="module")
def engine(served_run_dir) -> Engine:
    return scrambled_engine(served_run_dir)


def solo(engine: Engine, i: int, sampling: Sampling) -> tuple[int, ...]:
    """Request i served alone by ``Engine.generate`` with its own seed."""
    alone = Sampling(sampling.temperature, sampling.top_k, seed=100 + i)
    out = engine.generate([PROMPTS[i]], head=HEAD, max_new_tokens=LIMITS[i], sampling=alone)
    return out.completions[0].tokens


# each request's sampling: all greedy, or a mix of settings in one batch (greedy, sampled, top k)
GREEDY = (Sampling(),) * 6
MIXED = (Sampling(), Sampling(0.7), Sampling(1.3, top_k=5), Sampling(), Sampling(1.0, top_k=20),
         Sampling(0.9))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("settings", [GREEDY, MIXED], ids=["greedy", "mixed"])
def test_joining_and_leaving_rows_change_no_request_tokens(engine, settings):
    """Requests join a batch and leave it, each with its own sampling: each gets its solo
    tokens, and the batch's decode calls compile per how its rows pick (greedy at one head, or
    per row for the sampling bucket), never per temperature or top k."""
    ids = engine.encode(PROMPTS, HEAD)
    before = set(engine._functions)
    assert {bucket_length(len(x), engine.run.max_seq) for x in ids} == {16, 32}

    def joining(*which: int) -> list[Joining]:
        return [Joining(i, ids[i], LIMITS[i], solo_key(100 + i), settings[i]) for i in which]

    batch = RunningBatch(engine, HEAD, max_rows=4)
    got: dict[int, tuple[int, ...]] = {}
    kinds: list[tuple[str, int, int]] = []  # (call, rows, requests running when it started)

    def keep(done, calls):
        got.update({f.tag: f.tokens for f in done})
        kinds.extend((c.kind, c.rows, c.running) for c in calls)

    joined, done, calls = batch.join(joining(0, 1))
    keep(done, calls)
    assert [j.prompt_tokens for j in joined] == [len(ids[0]), len(ids[1])]
    keep(*batch.advance(3))
    joined, done, calls = batch.join(joining(2, 3))  # 4 rows now; 2 stops at its first token
    keep(done, calls)
    assert [f.tag for f in done] == [2] and batch.live == 3
    while batch.room < 2:
        keep(*batch.advance(2))
    running = batch.live
    keep(*batch.join(joining(4, 5))[1:])
    while batch.live:
        keep(*batch.advance(2))
    assert sorted(got) == list(range(6))
    for i in range(6):
        want = solo(engine, i, settings[i])
        assert got[i] == want, f"request {i}"
        assert len(want) == LIMITS[i]  # every request ran to its own limit
    assert len({t for ts in got.values() for t in ts}) > 10  # varied tokens: the check has teeth
    assert ("regroup", 4, 2) in kinds  # grew from 2 rows to 4 with two running
    assert any(k == "regroup" and rows < 4 for k, rows, _ in kinds)  # and shrank when it drained
    assert running == 2 and ("join", 4, 2) in kinds  # 4 and 5 joined while two ran
    assert batch.rows == 0  # empty: dropped
    picks = {key[3] for key in set(engine._functions) - before if key[0] == "steps"}
    assert picks <= {None, dec.RowPicks(False, 0), dec.RowPicks(True, 0), dec.RowPicks(True, 64)}
    assert (dec.RowPicks(True, 64) in picks) == (settings == MIXED)


@pytest.mark.slow
def test_prompts_prefilled_ahead_join_a_few_at_a_time_with_their_solo_tokens(engine):
    """Four prompts prefilled together, staged, and joined into a batch of two rows one or two
    at a time as its rows free, one of them cancelled while staged: it never joins, the rows
    after it join in its place, and every other request's tokens are its solo tokens."""
    sampling = Sampling(temperature=1.0)
    ids = engine.encode(PROMPTS, HEAD)
    which = (0, 1, 3, 4)
    joining = [Joining(i, ids[i], LIMITS[i], solo_key(100 + i), sampling) for i in which]
    staged, call = prefill(engine, joining, HEAD, score=True)
    assert (call.kind, call.rows, call.joined, staged.rows, staged.left) == ("prefill", 4, 4, 4, 4)
    assert all(j.prompt_nats is not None for j in staged.joined)
    batch = RunningBatch(engine, HEAD, max_rows=2, score=True)
    got: dict[int, tuple[int, ...]] = {}
    with pytest.raises(ValueError, match="room for 2"):
        batch.join_staged(staged, 3)
    joined, done, calls = batch.join_staged(staged, 1)
    assert [j.tag for j in joined] == [0] and staged.left == 3 and calls[-1].kind == "join"
    with pytest.raises(ValueError, match="1 requests are held"):  # it would lose request 0
        batch.compile_shapes([staged], [None])
    assert staged.cancel(3) and not staged.cancel(3) and not staged.cancel(0)  # 0 has joined
    assert [j.tag for j in staged.waiting] == [1, 4]
    while batch.live or staged.left:
        if staged.left and batch.room:
            joined, done, _ = batch.join_staged(staged, min(batch.room, staged.left))
            got.update({f.tag: f.tokens for f in done})
        done, _ = batch.advance(3)
        got.update({f.tag: f.tokens for f in done})
    assert sorted(got) == [0, 1, 4]
    for i in got:
        assert got[i] == solo(engine, i, sampling), f"request {i}"


@pytest.mark.slow
def test_decode_some_stops_at_k_steps_or_when_a_row_stops():
    from flax import nnx
    from serving_testing import MICRO

    from vocabjax.models import GPT, GPTConfig
    from vocabjax.train import Functional

    fn, params = Functional.of(GPT(GPTConfig(MICRO, max_vocab=97, max_seq=24), rngs=nnx.Rngs(5)))
    config = dec.DecodeConfig(fn, 24, head=97)
    ids_bt = jax.random.randint(jax.random.key(2), (3, 16), 4, 97, dtype=jnp.int32)
    lengths_b = jnp.asarray([5, 9, 1], jnp.int32)
    rng = jax.random.key(0)
    caches, first_b, _ = jax.jit(functools.partial(dec.prefill, config))(
        params, ids_bt, lengths_b, rng
    )
    limits_b = jnp.asarray([4, 10, 1], jnp.int32)
    state = dec.start(config, caches, first_b, lengths_b, limits_b, jnp.asarray([True] * 3))
    assert dec.running(state).tolist() == [True, True, False]  # row 2: its limit at once
    some = jax.jit(functools.partial(dec.decode_some, config))
    two = some(params, state, rng, jnp.int32(2))
    assert int(two.steps) == 2 and two.n_b.tolist() == [3, 3, 1]
    on = some(params, two, rng, jnp.int32(100))
    assert int(on.steps) == 3 and on.n_b.tolist() == [4, 4, 1]  # row 0 stopped: back to the host
    assert dec.running(on).tolist() == [False, True, False]
    rest = some(params, on, rng, jnp.int32(100))
    assert rest.n_b.tolist() == [4, 10, 1] and int(rest.steps) == 9
    # waiting for two stops: the loop runs on past row 0's stop to row 1's
    both = some(params, state, rng, jnp.int32(100), jnp.int32(2))
    assert int(both.steps) == 9 and both.n_b.tolist() == [4, 10, 1]
    np.testing.assert_array_equal(both.out_bs, rest.out_bs)
    whole = jax.jit(functools.partial(dec.decode, config))(
        params, caches, first_b, lengths_b, limits_b, jnp.asarray([True] * 3), rng
    )
    np.testing.assert_array_equal(rest.out_bs, whole.out_bs)  # the loop, cut in three


@pytest.mark.slow
def test_two_batches_merged_give_each_request_its_solo_tokens(engine):
    """A batch at 500 absorbs one at 300 mid-generation: one mixed group, every request's
    tokens its own head's, alone."""
    sampling = Sampling(temperature=1.0)
    at = {0: HEAD, 1: HEAD, 4: 300}
    ids = {i: engine.encode([PROMPTS[i]], head)[0] for i, head in at.items()}

    def joining(i: int) -> list[Joining]:
        return [Joining(i, ids[i], LIMITS[i], solo_key(100 + i), sampling)]

    a = RunningBatch(engine, HEAD, max_rows=4)
    b = RunningBatch(engine, 300, max_rows=4)
    got: dict[int, tuple[int, ...]] = {}

    def keep(done, calls):
        got.update({f.tag: f.tokens for f in done})

    keep(*a.join(joining(0) + joining(1))[1:])
    keep(*a.advance(2))
    keep(*b.join(joining(4))[1:])
    keep(*b.advance(1))
    assert (a.live, b.live) == (2, 1)
    with pytest.raises(ValueError, match="max_rows cannot merge"):
        RunningBatch(engine, HEAD, max_rows=1).absorb(b)
    call = a.absorb(b)
    assert call.kind == "merge" and call.rows == 4 and call.running == 3 and call.mixed
    assert a.mix == {HEAD: 2, 300: 1} and (b.live, b.rows) == (0, 0)
    while a.live:
        keep(*a.advance(3))
    for i, head in at.items():
        alone = Sampling(sampling.temperature, seed=100 + i)
        want = engine.generate([PROMPTS[i]], head=head, max_new_tokens=LIMITS[i], sampling=alone)
        assert got[i] == want.completions[0].tokens, f"request {i} at head {head}"


def test_a_compiled_call_says_its_shape():
    join = Call("join", 500, 4, 1, 0.01, 1.2, joined=2, bucket=16)
    assert join.compiled_line() == (
        "compiled head 500: join at 4 rows, prompts of 16 tokens, in 1.20 s"
    )
    steps = Call("steps", 500, 8, 3, 0.01, 0.5, 4, 12, window=64)
    assert steps.compiled_line() == (
        "compiled head 500: steps at 8 rows, attending to 64 positions, in 0.50 s"
    )
    whole = Call("steps", 500, 8, 3, 0.01, 0.5, 4, 12, mixed=True)
    assert whole.compiled_line() == "compiled head 500 (heads mixed): steps at 8 rows, in 0.50 s"


@pytest.mark.parametrize("seed", [0, 7, 2**31 - 1, 2**31, 2**32 - 1, -3])
def test_solo_key_is_the_seeds_row_0_key(seed):
    """The compiled key of a seed in [0, 2^32) (and the eager one outside it) is fold_in(key(seed),
    0), the key Engine.generate gives a request's row 0, bit for bit."""
    want = jax.random.fold_in(jax.random.key(seed), 0)
    assert np.array_equal(jax.random.key_data(solo_key(seed)), jax.random.key_data(want))
