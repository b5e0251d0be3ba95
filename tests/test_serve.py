"""`serve`: trace files and the demo trace, the quality controller on scripted bits per byte,
the router's level offset, the prompt bits per byte against a full forward, the virtual-clock
serving loop, and the command line (JSON shape, tables, one-line errors, help)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from serving_testing import HEADS, SEQ_LEN, scramble

import cli
from vocabjax.errors import UserError
from vocabjax.outputs import atomic_write_json
from vocabjax.serving import (
    DEMO_PHASES,
    Engine,
    LoadedRun,
    PromptRoom,
    QualityController,
    Request,
    ServeConfig,
    Thresholds,
    admit,
    demo_trace,
    derive_thresholds,
    load_run,
    load_trace,
    offset_bounds,
    prompt_room,
    serve,
    shift_head,
    training_bpb,
    write_trace,
)
from vocabjax.trainprofile import TrainingProfile

ROOT = Path(__file__).resolve().parents[1]

ROUTES = [(1, 300), (None, 500)]  # B = 1: the small head, larger batches: the large one
POLICY = {
    "schema": 1,
    "kind": "policy",
    "batch_routes": [{"max_batch": b, "head": h} for b, h in ROUTES],
}


# ---- traces -------------------------------------------------------------------------------------


def write_lines(path: Path, *lines: str | dict) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_a_trace_is_read_sorted_by_arrival_with_default_ids(tmp_path):
    path = write_lines(
        tmp_path / "t.jsonl",
        {"id": "late", "arrival_s": 2.5, "prompt": "b", "max_new_tokens": 3},
        "",
        {"arrival_s": 0, "prompt": "a", "phase": "warm"},
        {"arrival_s": 2.5, "prompt": "c"},
    )
    reqs = load_trace(path)
    assert [r.id for r in reqs] == ["r3", "late", "r4"]  # by arrival; ties keep file order
    assert reqs[0] == Request("r3", 0.0, "a", None, "warm")
    assert reqs[1].max_new_tokens == 3 and reqs[1].arrival_s == 2.5
    out = write_trace(tmp_path / "copy.jsonl", reqs)
    assert load_trace(out) == reqs


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "is not a JSON line"),
        ("[1, 2]", "is not a JSON object"),
        ({"arrival_s": 1.0}, "missing 'prompt'"),
        ({"prompt": "x"}, "missing 'arrival_s'"),
        ({"arrival_s": -1, "prompt": "x"}, "arrival_s must be finite and >= 0, got -1"),
        ({"arrival_s": "1", "prompt": "x"}, "arrival_s must be a number of seconds, got '1'"),
        ({"arrival_s": True, "prompt": "x"}, "arrival_s must be a number of seconds, got True"),
        ('{"arrival_s": NaN, "prompt": "x"}', "NaN is not a number vocabjax reads"),
        ({"arrival_s": 0, "prompt": ""}, "prompt must be non-empty text"),
        ({"arrival_s": 0, "prompt": 3}, "prompt must be non-empty text, got 3"),
        ({"arrival_s": 0, "prompt": "x", "max_new_tokens": 0}, "max_new_tokens must be a"),
        ({"arrival_s": 0, "prompt": "x", "max_new_tokens": 1.5}, "max_new_tokens must be a"),
        ({"arrival_s": 0, "prompt": "x", "id": 5}, "id must be non-empty text, got 5"),
        ({"arrival_s": 0, "prompt": "x", "arival": 1}, "unknown field(s) arival"),
        ({"arrival_s": 0, "prompt": "x", "id": "r1"}, "id 'r1' is already used on line 1"),
    ],
)
def test_each_bad_trace_line_is_one_error_naming_file_and_line(tmp_path, line, message):
    path = write_lines(tmp_path / "t.jsonl", {"arrival_s": 0, "prompt": "ok"}, "", line)
    with pytest.raises(UserError) as err:
        load_trace(path)
    assert str(err.value).startswith(f"{path}:3")
    assert message in str(err.value)


def test_a_missing_or_empty_trace_is_one_error(tmp_path):
    with pytest.raises(UserError, match=r"trace '.*nope.jsonl' does not exist"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(UserError, match="holds no requests"):
        load_trace(write_lines(tmp_path / "blank.jsonl", "", "   "))


@pytest.mark.slow
def test_the_demo_trace_is_deterministic_and_has_its_phases():
    room = PromptRoom(tokens=lambda text: len(text.encode()) // 3 + 1, max_tokens=75)
    reqs = demo_trace(3, room=room)
    assert reqs == demo_trace(3, room=room)
    assert [r.prompt for r in demo_trace(4, room=room)] != [r.prompt for r in reqs]
    assert len({r.prompt for r in reqs}) == len(reqs)  # no passage twice
    for phase in DEMO_PHASES:
        got = [r for r in reqs if r.phase == phase.name]
        assert len(got) == phase.requests
        times = [r.arrival_s for r in got]
        if phase.gap_s == 0:
            assert len(set(times)) == 1  # a burst: all at once
        else:
            gaps = np.diff(times)
            assert np.all(gaps >= 0.5 * phase.gap_s - 1e-6) and np.all(gaps <= 1.5 * phase.gap_s)
    assert all(128 <= len(r.prompt.encode()) <= 240 for r in reqs)
    assert all(room.tokens(r.prompt) <= room.max_tokens for r in reqs)
    prose = [r.prompt for r in reqs if r.phase.startswith("prose")]
    code = [r.prompt for r in reqs if not r.phase.startswith("prose")]
    assert sum("(" in p or "=" in p for p in code) > 0.9 * len(code)
    assert sum(p.count(" ") > len(p) / 10 and "=" not in p for p in prose) > len(prose) / 2
    small = PromptRoom(tokens=room.tokens, max_tokens=20)  # a run with few positions
    assert all(room.tokens(r.prompt) <= 20 for r in demo_trace(3, room=small))


# ---- the quality controller ---------------------------------------------------------------------


def feed(controller: QualityController, values) -> list[tuple[int, str]]:
    """(index, direction) of each move while observing ``values`` at the current offset."""
    moves = []
    for i, x in enumerate(values):
        move = controller.observe(x, controller.offset)
        if move is not None:
            moves.append((i, move.direction))
    return moves


def make_controller(window=4, lowest=-2, highest=2) -> QualityController:
    return QualityController(
        Thresholds(high=3.0, low=2.0, source="test"), window=window, lowest=lowest, highest=highest
    )


def test_a_sustained_rise_moves_up_and_the_window_refills_before_the_next_move():
    c = make_controller()
    # Window of 4: [2.5]*4, then 3.5 slides in: means 2.75, 3.0 (not > 3), 3.25 -> up.
    assert feed(c, [2.5] * 4 + [3.5] * 3) == [(6, "up")]
    assert c.offset == 1 and c.filled == 0  # the window was cleared
    assert feed(c, [3.5] * 3) == [] and c.filled == 3  # must refill: dwell
    assert feed(c, [3.5]) == [(0, "up")] and c.offset == 2
    assert feed(c, [9.0] * 12) == [] and c.offset == 2  # clamped at the highest offset


def test_a_sustained_fall_moves_down_to_the_lowest_offset_and_no_further():
    c = make_controller(lowest=-1)
    assert feed(c, [1.5] * 4) == [(3, "down")] and c.offset == -1
    assert feed(c, [0.5] * 20) == [] and c.offset == -1


def test_values_oscillating_inside_the_band_never_move():
    c = make_controller()
    assert feed(c, [2.1, 2.9] * 50) == []
    assert feed(c, [1.6, 3.4] * 50) == []  # each outside, their windowed mean inside
    assert c.offset == 0 and c.window_mean == pytest.approx(2.5)


def test_values_from_an_older_offset_do_not_count_and_weights_weigh():
    c = make_controller()
    assert c.observe(9.0, offset=1) is None and c.filled == 0  # served before a move
    c.observe(1.0, 0, weight=3.0)
    c.observe(5.0, 0, weight=1.0)
    assert c.window_mean == pytest.approx(2.0)  # sum of bits / sum of bytes
    with pytest.raises(UserError, match="window=0 must be a positive integer"):
        make_controller(window=0)


def test_thresholds_come_from_held_out_bpb_or_the_user(tmp_path):
    heldout = {300: 2.5, 500: 2.0}
    t = derive_thresholds(heldout, band=0.1)
    assert (t.high, t.low) == (pytest.approx(2.75), pytest.approx(1.8))
    assert "300: 2.500, 500: 2.000" in t.source
    t = derive_thresholds(heldout, high=4.0)
    assert (t.high, t.low) == (4.0, pytest.approx(1.8)) and t.source.startswith("high given")
    assert derive_thresholds(None) is None  # the controller is off
    assert derive_thresholds(None, high=3.0, low=1.0).source == "given"
    with pytest.raises(UserError, match="bpb_high given without bpb_low"):
        derive_thresholds(None, high=3.0)
    with pytest.raises(UserError, match="bpb low=3 must be below high=2"):
        derive_thresholds(heldout, high=2.0, low=3.0)
    with pytest.raises(UserError, match="must be > 0"):
        Thresholds(high=1.0, low=-1.0, source="x")
    # training.json of a run: its bpb per head, only the run's heads
    assert training_bpb(tmp_path, HEADS) is None
    profile = TrainingProfile("t", (300, 500, 1000), (1.0, 1.0, 1.0), (2.5, 2.0, 1.9))
    atomic_write_json(tmp_path / "training.json", profile.to_json())
    assert training_bpb(tmp_path, HEADS) == heldout


def test_the_router_offset_is_clamped_to_the_run_heads():
    heads = (300, 500, 800)
    assert [shift_head(heads, 300, k) for k in (-1, 0, 1, 2, 5)] == [300, 300, 500, 800, 800]
    assert [shift_head(heads, 800, k) for k in (-3, -1, 1)] == [300, 500, 800]
    # offsets beyond which no batch size's head changes
    assert offset_bounds(heads, [(1, 300), (None, 800)], max_batch=8) == (-2, 2)
    assert offset_bounds(heads, [(1, 300), (None, 800)], max_batch=1) == (0, 2)
    assert offset_bounds(heads, [(None, 500)], max_batch=8) == (-1, 1)


def test_admission_takes_arrived_requests_first_come_first_served():
    queue = [Request(f"r{i}", t, "x") for i, t in enumerate([0.0, 1.0, 1.0, 1.0, 2.0])]
    assert admit(queue, 0, 0.0, max_batch=4) == 1
    assert admit(queue, 1, 1.5, max_batch=2) == 3  # at most max_batch
    assert admit(queue, 3, 1.5, max_batch=4) == 4  # r4 arrives later
    assert admit(queue, 4, 2.0, max_batch=4) == 5


def test_a_prefill_takes_ahead_waiting_prompts_of_its_length_within_rows_memory_and_b_max():
    """``staging.ahead``: only while rows hold the next request back; only prompts of the
    joining ones' padded length; a power of two of rows, at most ``most``; within the budget
    and b_max beside what is held and running."""
    from vocabjax.serving.staging import ahead

    buckets = [16, 32, 16, 16, 16, 16, 16, 16, 16]  # the waiting requests past the joining
    roomy = dict(held_bytes=0, running=2, b_max=100, kv_budget=100)

    def picks(joining=2, wait="rows", most=16, need=1, **limits):
        limits = {**roomy, **limits}
        need_bytes = [need] * len(buckets)
        return ahead(16, buckets, need_bytes, joining=joining, wait=wait, most=most, **limits)

    assert picks() == [0, 2, 3, 4, 5, 6]  # 2 + 6 = 8 rows, the 32-token prompt left out
    assert picks(wait="memory") == [] and picks(wait=None) == []
    assert picks(most=4) == [0, 2] and picks(most=2) == [] and picks(most=0) == []
    assert picks(joining=3) == [0, 2, 3, 4, 5]  # 3 + 8 fit: 8 rows, the largest power of two
    assert picks(joining=3, most=6) == [0]  # 3 + 3: 4 rows
    assert picks(held_bytes=96) == [0, 2]  # four fit the budget beside what is held
    assert picks(b_max=6) == [0, 2]  # and b_max beside the running
    assert picks(b_max=2) == [] and picks(need=101) == []


def test_serve_config_pads_batches_to_powers_of_two():
    c = ServeConfig(max_batch=24)
    assert [c.rows(b) for b in (1, 2, 3, 5, 17, 24)] == [1, 2, 4, 8, 24, 24]
    assert ServeConfig(pad_batches=False).rows(3) == 3
    with pytest.raises(UserError, match="max_batch=0 must be a positive integer"):
        ServeConfig(max_batch=0)


def serve_option(monkeypatch, name: str, *args: str):
    """The value ``serve`` passes ``ServeConfig.from_options`` for option ``name`` given
    ``args`` (None where it stopped before), and the CLI's result."""
    seen = [None]

    def config_of(options):
        seen.append(options[name])
        raise UserError("stop here")

    monkeypatch.setattr(ServeConfig, "from_options", staticmethod(config_of))
    result = CliRunner().invoke(cli.main, ["serve", "--run", "x", "--policy", "y", *args])
    return seen[-1], result


def test_serve_passes_prefill_ahead_to_its_config(monkeypatch):
    """``serve --prefill-ahead N`` reaches ``ServeConfig.prefill_ahead`` (16 by default), the
    --port server's too; a negative one is refused when parsed."""
    for args, want in (
        ([], 16),
        (["--prefill-ahead", "0"], 0),
        (["--prefill-ahead", "4"], 4),
        (["--port", "8000", "--prefill-ahead", "2"], 2),
    ):
        seen, result = serve_option(monkeypatch, "prefill_ahead", *args)
        assert result.exit_code == 1 and seen == want, result.output
    seen, result = serve_option(monkeypatch, "prefill_ahead", "--prefill-ahead", "-1")
    assert result.exit_code == 2 and "prefill-ahead" in result.output and seen is None


def test_serve_passes_first_stop_and_warmup_needs_a_port(monkeypatch):
    """Decode calls wait for priced stops unless ``--first-stop``; ``--warmup`` without
    ``--port`` is a usage error."""
    for args, want in (([], True), (["--first-stop"], False)):
        seen, result = serve_option(monkeypatch, "priced_stops", *args)
        assert result.exit_code == 1 and seen is want, result.output
    for flag in (["--warmup"], ["--compile-cache", "x"]):
        seen, result = serve_option(monkeypatch, "priced_stops", *flag)
        assert result.exit_code == 2 and "are for --port: give --port" in result.output


# ---- with a model -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(served_run_dir) -> Path:
    return served_run_dir


@pytest.fixture(scope="module")
def scrambled(run_dir) -> LoadedRun:
    return scramble(load_run(run_dir))


@pytest.fixture(scope="module")
def engine(scrambled) -> Engine:
    return Engine(scrambled)


PROMPTS = ["def main(argv):\n    return argv[0]", "import os", "x = 1"]


def full_forward_nats(run: LoadedRun, ids: np.ndarray, head: int) -> float:
    """-sum log p(x_i | x_<i), i >= 1, from the training forward and materialised logits (the
    sequence right-padded to max_seq: causal, so the padding changes no earlier position)."""

    @jax.jit
    def logp(params, ids_t):
        model = run.fn.model(params)
        return jax.nn.log_softmax(model.logits(model(ids_t[None]), head)[0], axis=-1)

    padded = np.zeros(run.max_seq, np.int32)
    padded[: len(ids)] = ids
    table = np.asarray(logp(run.params, jnp.asarray(padded)))
    return -float(table[np.arange(len(ids) - 1), ids[1:]].astype(np.float64).sum())


@pytest.mark.slow
@pytest.mark.parametrize("head", HEADS)
def test_prompt_bpb_equals_a_full_forward(engine, scrambled, head):
    out = engine.generate(PROMPTS, head=head, max_new_tokens=2, score=True, pad_batch_to=4)
    level = scrambled.level(head)
    for prompt, c, ids in zip(PROMPTS, out.completions, engine.encode(PROMPTS, head)):
        want = full_forward_nats(scrambled, ids, head)
        assert c.prompt_nats == pytest.approx(want, rel=2e-5, abs=1e-4)
        assert c.prompt_bytes == len(prompt.encode()) == int(level.token_bytes[ids[1:]].sum())
        assert c.prompt_bpb == pytest.approx(want / (math.log(2) * c.prompt_bytes), rel=2e-5)
    assert out.padded_batch == 4 and out.batch == 3
    assert len({round(c.prompt_nats, 3) for c in out.completions}) == 3  # not one value


@pytest.mark.slow
def test_padding_rows_and_per_prompt_limits_change_nothing_else(engine):
    padded = engine.generate(PROMPTS, head=300, max_new_tokens=6, score=True, pad_batch_to=4)
    plain = engine.generate(PROMPTS, head=300, max_new_tokens=6, score=True)
    assert [c.tokens for c in padded.completions] == [c.tokens for c in plain.completions]
    for a, b in zip(padded.completions, plain.completions):
        assert a.prompt_nats == pytest.approx(b.prompt_nats, rel=1e-5)
    assert plain.padded_batch == 3
    limited = engine.generate(PROMPTS, head=300, max_new_tokens=[1, 6, 3], pad_batch_to=4)
    for c, n, full in zip(limited.completions, (1, 6, 3), padded.completions):
        assert c.tokens == full.tokens[:n]  # the same greedy tokens, cut at its own limit
        assert c.prompt_nats is None and c.prompt_bpb is None  # score=False
    assert len(limited.completions[1].tokens) > 3  # the limits differ in effect
    with pytest.raises(UserError, match="2 max_new_tokens for 3 prompts"):
        engine.generate(PROMPTS, head=300, max_new_tokens=[1, 2])
    with pytest.raises(UserError, match="pad_batch_to=2 must be an integer >= 3"):
        engine.generate(PROMPTS, head=300, pad_batch_to=2)


def trace() -> list[Request]:
    """B = 1 at 0 s; four at 5 s (max_batch 3: a batch of 3, then one that queued); one at
    10 s. (Alone, always the same prompt: fewer shapes to compile.)"""
    reqs = [Request("a", 0.0, PROMPTS[0], 4)]
    reqs += [Request(f"b{i}", 5.0, PROMPTS[i] if i < 3 else PROMPTS[0], 4) for i in range(4)]
    return [*reqs, Request("c", 10.0, PROMPTS[0], 4)]


@pytest.mark.slow
def test_the_serving_loop_routes_moves_and_keeps_its_clock(engine):
    # Thresholds far below any BPB of these prompts: every full window asks for a level up.
    config = ServeConfig(max_batch=3, window=2, batching="static")
    result = serve(engine, trace(), ROUTES, config, thresholds=Thresholds(0.5, 0.25, "test"))
    by_id = {r.id: r for r in result.requests}
    assert [b.batch for b in result.batches] == [1, 3, 1, 1]
    assert [b.routed_head for b in result.batches] == [300, 500, 300, 300]
    assert [b.offset for b in result.batches] == [0, 0, 1, 1]  # up after batch 1's first
    assert [b.head for b in result.batches] == [300, 500, 500, 500]  # 300 shifted up one
    assert [r.head for r in result.requests] == [300, 500, 500, 500, 500, 500]
    assert by_id["b3"].batch == 2 and by_id["b3"].offset == 1  # queued behind the batch of 3
    assert by_id["b1"].window_bpb is None  # served at offset 0 after the move: not counted
    assert result.offset_range == (-1, 1)
    switches = [(s.by, s.from_head, s.to_head, s.from_offset, s.to_offset, s.batch)
                for s in result.switches]  # fmt: skip
    assert switches == [("router", 300, 500, 0, 0, 1), ("controller", 500, 500, 0, 1, 1)]
    assert "routes B=3 (B > 1) to 500" in result.switches[0].reason
    assert "> high 0.500 over the last 2 requests: one level up" in result.switches[1].reason
    # the clock: a batch starts at max(previous finish, its first arrival), runs its service
    finish = 0.0
    for b in result.batches:
        first = min(r.arrival_s for r in result.requests if r.batch == b.index)
        assert b.start_s == max(finish, first)
        finish = b.start_s + b.service_s
        assert b.service_s > 0 and b.rows == config.rows(b.batch)
        for r in result.requests:
            if r.batch == b.index:
                assert (r.start_s, r.finish_s) == (b.start_s, finish)
    assert by_id["b3"].queue_s == pytest.approx(result.batches[1].service_s)
    assert all(r.latency_s == pytest.approx(r.queue_s + r.service_s) for r in result.requests)
    assert result.batches[0].compile_s > 0  # a new shape: compiled, reported, not charged
    s = result.summary()
    assert (s["requests"], s["batches"], s["router_switches"], s["controller_moves"]) == (
        6, 4, 1, 1
    )  # fmt: skip
    assert s["generated_tokens"] == sum(r.new_tokens for r in result.requests) > 0
    assert s["latency_p50_s"] <= s["latency_p95_s"]
    assert s["busy_s"] == pytest.approx(sum(b.service_s for b in result.batches), abs=1e-6)
    rows = {r["head"]: r for r in result.head_rows()}
    assert (rows[300]["batches"], rows[500]["requests"]) == (1, 5)
    assert rows[300]["impl"] == result.batches[0].impl
    # Served again by the same engine: the same decisions, every shape compiled already.
    again = serve(engine, trace(), ROUTES, config, thresholds=Thresholds(0.5, 0.25, "test"))
    assert all(b.compile_s == 0 for b in again.batches)
    assert [(r.head, r.new_tokens) for r in again.requests] == [
        (r.head, r.new_tokens) for r in result.requests
    ]


@pytest.mark.slow
@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_without_prompt_scoring_the_tokens_are_the_same_and_no_bpb_is_made(engine, batching):
    """``score_prompts=False``: every request gets the tokens it gets with scoring, no prompt
    bits per byte is recorded, and a quality controller, which reads them, is refused."""
    scored = ServeConfig(max_batch=3, batching=batching)
    plain = dataclasses.replace(scored, score_prompts=False)
    a, b = serve(engine, trace(), ROUTES, scored), serve(engine, trace(), ROUTES, plain)
    assert [(r.id, r.head, r.text) for r in b.requests] == [
        (r.id, r.head, r.text) for r in a.requests
    ]
    assert all(r.prompt_bpb is not None for r in a.requests)
    assert all(r.prompt_bpb is None and r.window_bpb is None for r in b.requests)
    assert all(x.mean_bpb is None for x in b.batches)
    assert b.summary()["mean_prompt_bpb"] is None
    with pytest.raises(UserError, match="keep prompt scoring on"):
        serve(engine, trace(), ROUTES, plain, thresholds=Thresholds(0.5, 0.25, "test"))


def test_the_clock_charges_service_but_not_compiling(engine, monkeypatch):
    """With a stand-in clock, each batch takes 10 s of wall time of which the engine says 9 s
    were compiling: the virtual clock advances 1 s per batch."""
    import types

    from vocabjax.serving import server

    wall = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(server, "time", types.SimpleNamespace(perf_counter=lambda: wall.now))

    class Compiling:
        run = engine.run

        def generate(self, prompts, **options):
            wall.now += 10.0
            return dataclasses.replace(engine.generate(prompts, **options), compile_s=9.0)

    result = serve(Compiling(), trace(), ROUTES, ServeConfig(max_batch=3, batching="static"))
    assert [(b.start_s, b.service_s, b.compile_s) for b in result.batches] == [
        (0.0, 1.0, 9.0), (5.0, 1.0, 9.0), (6.0, 1.0, 9.0), (10.0, 1.0, 9.0)
    ]  # fmt: skip
    assert [r.latency_s for r in result.requests] == [1.0, 1.0, 1.0, 1.0, 2.0, 1.0]
    s = result.summary()
    assert (s["makespan_s"], s["busy_s"], s["compile_s"]) == (11.0, 4.0, 36.0)


def test_a_prompt_too_long_for_the_run_is_one_error_naming_the_request(engine, scrambled):
    reqs = [Request("fine", 0.0, "x"), Request("long", 1.0, "word " * 100)]
    with pytest.raises(UserError, match=r"request 'long': its prompt is \d+ tokens at head 300"):
        serve(engine, reqs, ROUTES)
    room = prompt_room(scrambled, 8)
    assert room.max_tokens == SEQ_LEN + 1 - 8
    assert room.tokens("import os") == max(len(engine.encode(["import os"], h)[0]) for h in HEADS)


# ---- the command line ---------------------------------------------------------------------------


def invoke(*args: str):
    return CliRunner().invoke(cli.main, ["serve", *args], catch_exceptions=False)


@pytest.fixture(scope="module")
def files(run_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("serve_cli")
    (d / "policy.json").write_text(json.dumps(POLICY))
    write_lines(
        d / "trace.jsonl",
        {"id": "one", "arrival_s": 0, "prompt": "def main("},
        {"id": "two", "arrival_s": 3, "prompt": "import os", "max_new_tokens": 2},
        {"id": "three", "arrival_s": 3, "prompt": "class A:"},
    )
    write_lines(d / "one.jsonl", {"arrival_s": 0, "prompt": "def main("})
    return {
        "run": str(run_dir),
        "policy": str(d / "policy.json"),
        "trace": str(d / "trace.jsonl"),
        "one": str(d / "one.jsonl"),
    }


@pytest.mark.slow
def test_json_output_and_plot(files, tmp_path):
    plot = tmp_path / "serve.png"
    result = invoke(
        "--run", files["run"], "--policy", files["policy"], "--trace", files["trace"],
        "--max-new-tokens", "3", "--bpb-high", "20", "--bpb-low", "1", "--format", "json",
        "--plot", str(plot),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # JSON alone on stdout
    assert (data["schema"], data["kind"], data["heads"]) == (1, "serve", list(HEADS))
    assert data["trace"] == files["trace"] and data["controller"]["high"] == 20
    assert data["summary"]["requests"] == 3 and data["summary"]["batches"] == 2
    assert [b["B"] for b in data["batches"]] == [1, 2]
    assert [b["head"] for b in data["batches"]] == [300, 500]
    assert data["switches"][0]["by"] == "router" and data["switches"][0]["to_head"] == 500
    req = {r["id"]: r for r in data["requests"]}
    assert req["two"]["new_tokens"] <= 2 and req["one"]["new_tokens"] <= 3
    assert set(req["one"]) >= {
        "head", "queue_s", "service_s", "latency_s", "prompt_tokens", "new_tokens",
        "prompt_bytes", "prompt_bpb", "window_bpb", "arrival_s", "stop", "text",
    }  # fmt: skip
    assert req["one"]["prompt_bytes"] == len("def main(") and req["one"]["prompt_bpb"] > 0
    assert {r["head"] for r in data["by_head"]} == set(HEADS)
    assert "quality controller: up above 20.000, down below 1.000" in result.stderr
    assert plot.stat().st_size > 10_000 and f"wrote {plot}" in result.stderr
    # every device call priced: each kind's measured time, summed, is the clock's busy time
    priced = {row["kind"]: row for row in data["priced"]["calls"]}
    assert {"prefill", "join", "steps", "all"} <= set(priced)
    kinds = sum(row["measured_ms"] for kind, row in priced.items() if kind != "all")
    assert kinds == pytest.approx(priced["all"]["measured_ms"], abs=0.01)
    assert priced["all"]["measured_ms"] == pytest.approx(1e3 * data["summary"]["busy_s"], abs=0.01)
    assert data["priced"]["device"].startswith("a100-80gb: ")  # serve's default device


def test_warmup_compiles_the_shapes_before_the_port_opens(files, monkeypatch):
    """``--warmup`` calls ``LiveServer.compile_shapes`` before the port opens (not without it)
    and says what it compiled; that it compiles every shape is tests/test_http.py's."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from vocabjax.serving import http
    from vocabjax.serving.live import LiveServer

    events = []

    def compile_shapes(live, *, sampled):
        events.append(f"c sampled={sampled}")
        return 7, 0.5

    monkeypatch.setattr(LiveServer, "compile_shapes", compile_shapes)
    monkeypatch.setattr(http, "serve_http", lambda live, **_: events.append("port"))
    args = ("--run", files["run"], "--policy", files["policy"], "--trace", files["trace"],
            "--port", "8765")  # fmt: skip
    cold = invoke(*args)
    warm = invoke("--warmup", *args)  # a bare --warmup before another option: greedy
    both = invoke(*args, "--warmup", "sampled")
    assert cold.exit_code == 0 and warm.exit_code == 0 and both.exit_code == 0, warm.output
    assert events == ["port", "c sampled=False", "port", "c sampled=True", "port"]
    assert "warm-up: 7 shapes compiled in 0.5 s" in warm.stderr
    assert "every shape greedy and sampled requests can need" in both.stderr
    wrong = invoke(*args, "--warmup", "top_k")
    assert wrong.exit_code == 2 and "'top_k' is not one of 'greedy', 'sampled'" in wrong.output


@pytest.mark.slow
def test_the_compile_cache_keeps_even_short_compiles(tmp_path):
    """``--compile-cache DIR`` (``cli.use_compile_cache``): a compile of well under a second,
    as a serving shape's is, lands in DIR (JAX's default keeps only those over a second)."""
    cache = tmp_path / "compiled"
    code = (
        "import cli, jax, jax.numpy as jnp; "
        f"cli.use_compile_cache({str(cache)!r}); "
        "jax.jit(lambda x: x * 2 + 1).lower(jnp.ones(3)).compile()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert any(cache.iterdir())


@pytest.mark.slow
def test_csv_and_markdown_give_one_row_per_batch(files):
    args = ("--run", files["run"], "--policy", files["policy"], "--trace", files["one"],
            "--max-new-tokens", "1")  # fmt: skip
    csv = invoke(*args, "--format", "csv")
    assert csv.exit_code == 0, csv.output
    lines = csv.stdout.splitlines()
    assert lines[0].startswith("batch,start_s,B,rows,bucket,routed_head,offset,head,impl,")
    assert len(lines) == 2 and lines[1].startswith("0,0.0,1,1,16,300,0,300,")
    md = invoke(*args, "--format", "markdown").stdout.splitlines()
    assert md[0].startswith("| batch | start_s | B |") and len(md) == 3
    assert "quality controller off: the run has no held-out bits per byte" in csv.stderr


@pytest.mark.slow
def test_the_demo_is_the_default_and_prints_a_table(files):
    result = invoke("--run", files["run"], "--policy", files["policy"], "--max-new-tokens", "4")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.startswith("served 136 requests in ")
    for section in ("\nper head\n", "\nper phase\n", "\nswitches\n"):
        assert section in out
    assert "code, burst" in out and "policy routes B=32 (B > 1) to 500" in out
    assert "demo trace (no --trace given): 136 requests" in result.stderr


@pytest.mark.slow
def test_no_prompt_scoring_turns_the_controller_off(files):
    args = ["--run", files["run"], "--policy", files["policy"], "--trace", files["trace"]]
    result = invoke(*args, "--no-prompt-scoring")
    assert result.exit_code == 0, result.output
    assert "quality controller off: prompts are not scored" in result.stderr
    assert "mean prompt BPB not scored" in result.stdout
    live = invoke(*args, "--no-prompt-scoring", "--port", "8000")  # /metrics reports the BPB
    assert live.exit_code == 1 and "no --no-prompt-scoring" in live.stderr


def _error(*args: str, code: int = 1) -> str:
    result = invoke(*args)
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result.stderr.strip().splitlines()[-1]


def test_errors_are_one_line(files, tmp_path):
    run, policy, trace_file = files["run"], files["policy"], files["trace"]
    missing = tmp_path / "missing"
    assert _error("--run", str(missing), "--policy", policy) == (
        f"Error: run directory '{missing}' does not exist"
    )
    (tmp_path / "empty").mkdir()
    assert "holds no run.json" in _error("--run", str(tmp_path / "empty"), "--policy", policy)
    assert _error("--run", run, "--policy", str(missing)) == (
        f"Error: policy profile '{missing}' does not exist"
    )
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert _error("--run", run, "--policy", str(bad)).startswith(
        f"Error: policy profile '{bad}' is not valid JSON"
    )
    lines = write_lines(tmp_path / "t.jsonl", {"arrival_s": 0, "prompt": "a"}, {"prompt": "b"})
    assert _error("--run", run, "--policy", policy, "--trace", str(lines)) == (
        f"Error: {lines}:2: missing 'arrival_s'"
    )
    assert _error("--run", run, "--policy", policy, "--trace", trace_file, "--demo") == (
        "Error: give --trace FILE or --demo, not both"
    )
    assert _error("--run", run, "--policy", policy, "--bpb-high", "2", "--bpb-low", "3") == (
        "Error: bpb low=3 must be below high=2 (the band between them is the hysteresis)"
    )
    assert _error("--run", run, "--policy", policy, "--bpb-low", "1").startswith(
        "Error: --bpb-low given without --bpb-high, and "
    )
    assert "Invalid value for '--max-batch'" in _error(
        "--run", run, "--policy", policy, "--max-batch", "0", code=2
    )
    assert "Invalid value for '--window'" in _error(
        "--run", run, "--policy", policy, "--window", "0", code=2
    )
    assert "Missing option '--policy'" in _error("--run", run, code=2)


def test_help_has_an_example():
    text = CliRunner().invoke(cli.main, ["serve", "--help"]).output
    assert "Example:" in text and "python cli.py serve --run runs/tiny --policy" in text
    assert "serve" in CliRunner().invoke(cli.main, ["--help"]).output
