"""`serve` with continuous batching on the virtual clock: a trace whose requests arrive while
others run gives every request the tokens it gets served alone (greedy and sampled), and KV-aware
admission never holds more than the memory budget allows, admitting more at a larger head whose
shorter sequences need less cache."""

from __future__ import annotations

import dataclasses

import pytest
from serving_testing import scrambled_engine

from vocabjax.errors import UserError
from vocabjax.hardware import DeviceProfile
from vocabjax.serving import (
    Engine,
    Request,
    Sampling,
    ServeConfig,
    admit_count,
    request_seed,
    serve,
)

# Arrivals: two at once, three more an instant later (they join while the first two run; the
# fifth waits for a row: max_batch 4), one long after (the clock jumps, the batch restarted).
TRACE = (
    Request("a", 0.0, "def main(argv):\n    return argv[0]", 9),
    Request("b", 0.0, "import os", 4),
    Request("c", 1e-9, "def f(x):\n    return x + 1", 6),
    Request("d", 1e-9, "x = 1", 1),
    Request("e", 1e-9, "for i in range(10):", 7),
    Request("f", 100.0, "y", 5),
)


@pytest.fixture(scope="module")
def engine(served_run_dir) -> Engine:
    return scrambled_engine(served_run_dir)


GREEDY_AND_SAMPLED = pytest.mark.parametrize(
    "sampling",
    [Sampling(), pytest.param(Sampling(temperature=1.0, seed=3), marks=pytest.mark.slow)],
    ids=["greedy", "sampled"],
)


def served_as_alone(engine, trace, result, sampling) -> dict:
    """The served requests by id, each checked to have the tokens it gets served alone (and
    to have run to its limit)."""
    served = {r.id: r for r in result.requests}
    assert sorted(served) == sorted(r.id for r in trace)
    for i, r in enumerate(trace):
        alone = Sampling(sampling.temperature, sampling.top_k, request_seed(sampling.seed, i))
        want = engine.generate([r.prompt], head=500, max_new_tokens=r.max_new_tokens,
                               sampling=alone)  # fmt: skip
        got = served[r.id]
        assert got.text == want.completions[0].text, r.id
        assert got.new_tokens == len(want.completions[0].tokens) == r.max_new_tokens
    return served


@pytest.mark.slow
@GREEDY_AND_SAMPLED
def test_every_request_gets_the_tokens_it_gets_alone(engine, sampling):
    # no prefill ahead: each admission prefills the requests that get a row (staging: below)
    config = ServeConfig(max_batch=4, sampling=sampling, prefill_ahead=0)
    result = serve(engine, TRACE, [(None, 500)], config)
    served = served_as_alone(engine, TRACE, result, sampling)
    joins = result.batches
    assert [b.batch for b in joins[:2]] == [2, 2]  # a, b; then c, d while a, b run
    assert joins[1].running == 4 and joins[1].start_s > 0
    assert served["e"].start_s > served["d"].finish_s  # e waited for a row (d stopped first)
    assert served["e"].running <= 4 and served["f"].start_s == 100.0  # the clock jumped
    assert (joins[0].rows, joins[1].rows) == (2, 4)  # the batch grew to take c and d
    s = result.summary()
    assert s["batching"] == "continuous" and s["running_max"] == 3  # d stopped as it joined
    assert s["generated_tokens"] == sum(r.max_new_tokens for r in TRACE)
    assert s["memory_waits"] == 0 and s["kv_peak_bytes"] <= result.memory.kv_budget


# Two arrive first, then nine short prompts (one padded length) an instant later while they
# run: more wait than rows are free.
STAGED_TRACE = (
    Request("a", 0.0, "def main(argv):\n    return argv[0]", 9),
    Request("b", 0.0, "import os", 4),
    *(Request(f"w{i}", 1e-9, p, n) for i, (p, n) in enumerate([
        ("x = 1", 6), ("y", 1), ("for i in x:", 7), ("y = 2", 3), ("import sys", 5), ("z", 2),
        ("return None", 8), ("pass", 4), ("a = b", 6),
    ])),
)  # fmt: skip


@pytest.mark.slow
@GREEDY_AND_SAMPLED
def test_requests_prefilled_ahead_get_the_tokens_they_get_alone(engine, sampling):
    """With more requests waiting than rows free, an admission prefills more of them than join
    (a power of two of rows, of the same padded length): the rest are staged and join as rows
    free, and every request still gets what it gets alone."""
    config = ServeConfig(max_batch=4, sampling=sampling)
    assert config.prefill_ahead > 4
    result = serve(engine, STAGED_TRACE, [(None, 500)], config)
    served_as_alone(engine, STAGED_TRACE, result, sampling)
    assert {len(engine.encode([r.prompt], 500)[0]) <= 16 for r in STAGED_TRACE[2:]} == {True}
    joins = result.batches
    staged_joins = [c for c in result.chunks if c.kind == "join"]
    # two rows free for nine waiting: eight prefilled (a power of two: no padding rows), six
    # of them staged, joining later
    assert joins[1].batch == 8 and joins[1].running == 4 and staged_joins
    assert len(joins) < len(STAGED_TRACE) - 2  # fewer prefills than one per free row
    assert all(x.running <= 4 for x in [*joins, *result.chunks])
    s = result.summary()
    assert s["generated_tokens"] == sum(r.max_new_tokens for r in STAGED_TRACE)
    assert s["kv_peak_bytes"] <= result.memory.kv_budget


@pytest.mark.slow
def test_decode_calls_wait_for_the_stops_a_round_trip_is_worth(engine):
    """Priced on a device whose every host call costs a second, a decode call waits for as
    many stops as requests want rows: fewer calls, fewer joins, and every request still gets
    what it gets alone; the same trace with --first-stop ends each call at the first stop."""
    slow_host = DeviceProfile(name="slow-host", peak_flops={"f32": 1e11}, hbm_bandwidth=1e10,
                              memory_bytes=1e9, launch_overhead_s=1e-6, dispatch_overhead_s=1.0,
                              source="test")  # fmt: skip
    config = ServeConfig(max_batch=4, device=slow_host)
    waited = serve(engine, STAGED_TRACE, [(None, 500)], config)
    served_as_alone(engine, STAGED_TRACE, waited, Sampling())
    at_first = dataclasses.replace(config, priced_stops=False)
    first = serve(engine, STAGED_TRACE, [(None, 500)], at_first)
    served_as_alone(engine, STAGED_TRACE, first, Sampling())

    def calls(result, kind):
        return sum(c.kind == kind for c in result.calls)

    assert calls(waited, "steps") < calls(first, "steps")
    assert calls(waited, "join") < calls(first, "join")
    assert waited.summary()["generated_tokens"] == first.summary()["generated_tokens"]


# ---- KV-aware admission -------------------------------------------------------------------------


def test_admission_is_first_come_first_served_within_rows_and_memory():
    def admitted(held_bytes, running, max_batch, b_max):
        need = [10, 10, 30, 10]  # each waiting request's cache, in arrival order
        return admit_count(
            need, held_bytes=held_bytes, running=running, max_batch=max_batch, b_max=b_max,
            kv_budget=100,
        )  # fmt: skip

    assert admitted(0, 0, max_batch=8, b_max=8) == (4, None)
    # the third does not fit beside 60 held, and the fourth, which would, may not overtake it
    assert admitted(60, 2, max_batch=8, b_max=8) == (2, "memory")
    assert admitted(0, 3, max_batch=4, b_max=9) == (1, "rows")  # max_batch binds
    assert admitted(0, 1, max_batch=4, b_max=2) == (1, "memory")  # the KV plan's b_max binds


PROMPT = "return self.value"  # more tokens at head 300 than at 500 (15 and 9 here)


def burst(n: int, limit: int) -> list[Request]:
    return [Request(f"r{i}", 0.0, PROMPT, limit) for i in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("head", [300, 500])
def test_admission_never_holds_more_than_the_budget(engine, head):
    """A burst of eight equal requests under a budget that holds four sequences at head 500:
    the larger head's shorter sequences fit more than the smaller head's."""
    per_position = engine.run.config.shape.kv_elements_per_token * 4  # float32 cache
    weights = sum(x.size * x.dtype.itemsize for x in engine.run.params.values())
    limit = 3
    positions = {v: len(engine.encode([PROMPT], v)[0]) + limit - 1 for v in (300, 500)}
    room = 4 * positions[500] + 1  # cache positions the budget leaves beside the weights
    fits = {v: room // n for v, n in positions.items()}
    assert fits[500] == 4 > fits[300] >= 1  # the test has teeth: the heads differ
    budget = weights + room * per_position
    lines: list[str] = []
    config = ServeConfig(max_batch=8, memory_bytes=budget)
    result = serve(engine, burst(8, limit), [(None, head)], config, progress=lines.append)
    plan = result.memory
    assert plan.weight_bytes == weights and plan.kv_bytes_per_token == per_position
    assert plan.kv_budget == budget - weights
    assert plan.b_max == fits  # the plan's sequences are these ones: it agrees
    records = [*result.batches, *result.chunks]
    assert all(x.kv_bytes <= plan.kv_budget for x in records)
    assert all(x.running <= plan.b_max[head] for x in records)
    most = max(x.running for x in records)
    assert most == plan.b_max[head]
    s = result.summary()
    assert s["memory_waits"] == 8 - most and s["requests"] == 8
    assert s["kv_peak_bytes"] == most * positions[head] * per_position
    assert any(f"{8 - most} request(s) wait for memory at head {head}" in x for x in lines)


@pytest.mark.slow
def test_staged_caches_count_against_the_budget(engine):
    """Requests prefilled ahead hold their cache from their prefill: a burst under a budget of
    four sequences, two rows, and a prefill ahead of up to 16 stages two more and no further,
    and nothing ever holds more than the budget or b_max."""
    per_position = engine.run.config.shape.kv_elements_per_token * 4  # float32 cache
    weights = sum(x.size * x.dtype.itemsize for x in engine.run.params.values())
    limit = 3
    positions = len(engine.encode([PROMPT], 500)[0]) + limit - 1
    budget = weights + (4 * positions + 1) * per_position
    config = ServeConfig(max_batch=2, memory_bytes=budget, prefill_ahead=16)
    result = serve(engine, burst(8, limit), [(None, 500)], config)
    plan = result.memory
    assert plan.b_max[500] == 4
    sequence = positions * per_position
    records = [*result.batches, *result.chunks]
    assert all(x.kv_bytes <= plan.kv_budget for x in records)
    assert max(x.kv_bytes for x in records) == 4 * sequence  # two running, two staged
    assert result.batches[0].batch == 4 and result.batches[0].running == 2
    assert any(c.kind == "join" for c in result.chunks)  # the staged two joined later
    want = engine.generate([PROMPT], head=500, max_new_tokens=limit).completions[0].text
    assert all(r.text == want for r in result.requests) and len(result.requests) == 8


def test_a_budget_that_cannot_hold_a_request_is_one_error(engine):
    weights = sum(x.size * x.dtype.itemsize for x in engine.run.params.values())
    with pytest.raises(UserError, match=r"memory 1,024 bytes does not hold the run's weights"):
        serve(engine, burst(1, 3), [(None, 500)], ServeConfig(memory_bytes=1024))
    with pytest.raises(UserError, match=r"request 'r0' needs .* of KV cache at head 500"):
        serve(engine, burst(1, 3), [(None, 500)], ServeConfig(memory_bytes=weights + 256))


# ---- the command line ---------------------------------------------------------------------------


@pytest.mark.slow
def test_the_command_serves_continuously_by_default_and_statically_on_request(
    served_run_dir, tmp_path
):
    import json

    from click.testing import CliRunner

    import cli

    (tmp_path / "policy.json").write_text(
        json.dumps({"schema": 1, "kind": "policy", "batch_routes": [{"head": 500}]})
    )
    (tmp_path / "t.jsonl").write_text(json.dumps({"arrival_s": 0, "prompt": PROMPT}) + "\n")
    args = ["serve", "--run", str(served_run_dir), "--policy", str(tmp_path / "policy.json"),
            "--trace", str(tmp_path / "t.jsonl"), "--max-new-tokens", "2"]  # fmt: skip

    def invoke(*more: str):
        return CliRunner().invoke(cli.main, [*args, *more], catch_exceptions=False)

    result = invoke("--memory", "1m", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["config"]["batching"] == "continuous" and data["summary"]["running_max"] == 1
    assert data["memory"]["memory_bytes"] == 1024**2 and data["chunks"]
    assert "memory 1.0 MiB (given): weights " in result.stderr
    static = invoke("--batching", "static", "--format", "json")
    assert static.exit_code == 0, static.output
    data = json.loads(static.stdout)
    assert data["summary"]["batching"] == "static" and data["memory"] is None
    error = invoke("--memory", "1k")
    assert error.exit_code == 1
    assert (
        error.stderr.strip()
        .splitlines()[-1]
        .startswith("Error: --memory 1,024 bytes does not hold the run's weights (")
    )
