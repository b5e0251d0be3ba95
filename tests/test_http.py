"""`serve --port`: the OpenAI-style HTTP endpoint over the live engine loop, on a real uvicorn
server. 200 concurrent clients, streaming and not, each get a complete, well-formed response
with the tokens their prompt gets alone, none lost or duplicated, and /metrics counts them; bad
requests get one clear 400 line; a client that leaves mid-stream is cleaned up without
disturbing the others; Ctrl-C drains (503 for new requests, the running ones finish). The
engine loop alone prefills ahead within the KV budget, its staged requests counted, released
when their clients leave and finished by a drain."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import threading
import time

import pytest
from serving_testing import scrambled_engine

fastapi = pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from vocabjax.serving import (  # noqa: E402
    Engine,
    LiveRequest,
    LiveServer,
    Request,
    Sampling,
    ServeConfig,
    Thresholds,
    Ticket,
    memory_plan,
)
from vocabjax.serving.http import DrainingServer, create_app  # noqa: E402

PROMPTS = ("def main(", "import os", "x = 1", "class A:", "for i in range(3):", "return self",
           "y = [1, 2]", "print(x)")  # fmt: skip
HEAD = 500


@pytest.fixture(scope="module")
def engine(served_run_dir) -> Engine:
    return scrambled_engine(served_run_dir)


class SlowLive(LiveServer):
    """The live loop with 20 ms added to every round of decode calls: a stream then outlasts
    the moment its client leaves, whatever the machine's speed."""

    def _advance(self) -> None:
        time.sleep(0.02)
        super()._advance()


@contextlib.contextmanager
def running(engine: Engine, live_class: type[LiveServer] = LiveServer, **options):
    """A live server on a free local port in a thread: (its completions URL, the loop, the
    uvicorn server, its log lines)."""
    config = ServeConfig(max_batch=16)
    sample = [Request(f"p{i}", 0.0, p, 8) for i, p in enumerate(PROMPTS)]
    plan = memory_plan(engine.run, sample, config, lambda _line: None)
    lines: list[str] = []
    thresholds = Thresholds(50.0, 0.01, "test")  # never moves; the window is still reported
    live = live_class(
        engine, [(None, HEAD)], config, plan, thresholds=thresholds, progress=lines.append,
        **options,
    )  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = DrainingServer(
        uvicorn.Config(create_app(live), host="127.0.0.1", port=port, log_level="warning"),
        live,
        lines.append,
    )
    live.start()
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", live, server, thread, lines
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        live.stop()


def events(lines: list[str]) -> list[dict | str]:
    """The ``data:`` payloads of a server-sent event stream, JSON decoded ([DONE] kept)."""
    out: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# sampled clients' settings, one batch for all (and the greedy ones): by seed % 2
TEMPERATURE, TOP_K = (0.8, 1.1), (None, 12)


@pytest.mark.slow
def test_two_hundred_concurrent_clients_each_get_their_tokens(engine):
    # (prompt, max_tokens, seed: None for greedy, stream)
    cases = [(PROMPTS[i % 8], 3 + i % 6, None if i % 2 else 1000 + i, i % 3 == 0)
             for i in range(200)]  # fmt: skip

    async def one(client, url, case):
        prompt, n, seed, stream = case
        body = {"prompt": prompt, "max_tokens": n, "stream": stream}
        if seed is not None:
            body.update(temperature=TEMPERATURE[seed % 2], top_k=TOP_K[seed % 2], seed=seed)
        if not stream:
            r = await client.post(url, json=body)
            assert r.status_code == 200, r.text
            data = r.json()
            return data["choices"][0]["text"], data
        async with client.stream("POST", url, json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            got = events([line async for line in r.aiter_lines()])
        assert got[-1] == "[DONE]" and got.count("[DONE]") == 1
        chunks = got[:-1]
        assert all(c["id"] == chunks[0]["id"] for c in chunks)
        assert [c["choices"][0]["finish_reason"] for c in chunks][:-1] == [None] * (len(chunks) - 1)
        return "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]

    async def clients(url):
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one(client, url, c) for c in cases))

    with running(engine) as (base, live, server, thread, lines):
        results = asyncio.run(clients(base + "/v1/completions"))
        metrics = httpx.get(base + "/metrics").json()
    assert len({last["id"] for _, last in results}) == 200  # none duplicated, none lost
    for (prompt, n, seed, _), (text, last) in zip(cases, results, strict=True):
        sampling = Sampling()
        if seed is not None:
            sampling = Sampling(TEMPERATURE[seed % 2], TOP_K[seed % 2], seed)
        want = engine.generate([prompt], head=HEAD, max_new_tokens=n, sampling=sampling)
        c = want.completions[0]
        assert text == c.text, (prompt, n, seed)
        assert last["usage"]["completion_tokens"] == len(c.tokens)
        assert last["choices"][0]["finish_reason"] == ("stop" if c.stop == "eos" else "length")
        assert last["vocabjax"]["head"] == HEAD and last["model"] == f"head-{HEAD}"
    assert metrics["requests"] == {"submitted": 200, "completed": 200, "cancelled": 0,
                                   "failed": 0, "in_flight": 0}  # fmt: skip
    row = next(r for r in metrics["by_head"] if r["head"] == HEAD)
    assert row["requests"] == 200
    assert row["new_tokens"] == sum(last["usage"]["completion_tokens"] for _, last in results)
    assert metrics["queue_length"] == 0 and metrics["running"] == 0
    assert metrics["windowed_bpb"] is not None and metrics["memory"]["kv_bytes"] == 0
    assert any("compiled head 500: join at 16 rows" in line for line in lines)  # batched
    late = sum("(its requests waited for it)" in line for line in lines)
    compiled = metrics["compiled"]
    assert compiled["while_waiting"] == late > 0 and compiled["while_waiting_s"] > 0
    assert compiled["shapes"] >= late
    cpu = metrics["cpu_s"]  # the loop's thread did host work, a share of the process's
    assert 0 < cpu["engine_loop"] <= cpu["process"]


@pytest.mark.slow
def test_bad_requests_get_one_clear_400_and_a_client_that_leaves_is_cleaned_up(engine):
    with running(engine, SlowLive, steps_per_call=2) as (base, live, server, thread, lines):
        url = base + "/v1/completions"

        def error(status=400, **request):
            r = httpx.post(url, **request)
            assert r.status_code == status, r.text
            return r.json()["error"]["message"]

        assert "JSON decode error" in error(
            content=b"{not json", headers={"content-type": "application/json"}
        )
        assert error(json={"prompt": "x", "temprature": 1}) == (
            "temprature: Extra inputs are not permitted"
        )
        for n in (0, -3):
            message = error(json={"prompt": "x", "max_tokens": n})
            assert message == "max_tokens: Input should be greater than or equal to 1"
        assert "prompt: String should have at least 1 character" in error(json={"prompt": ""})
        assert "above the run's context of 40 positions" in error(json={"prompt": "word " * 60})
        assert "model '123' must be 'auto' or one of the heads 300, 500" in error(
            json={"prompt": "x", "model": "123"}
        )
        assert "top_k applies to sampling" in error(json={"prompt": "x", "top_k": 3})
        assert "temperature=1e-09 is below 1e-06: give 0" in error(
            json={"prompt": "x", "temperature": 1e-9}
        )
        assert "prompt: Input should be a valid string" in error(json={"prompt": ["a", "b"]})

        async def leave_while_another_stays():
            async with httpx.AsyncClient(timeout=120) as client:
                body = {"prompt": PROMPTS[0], "max_tokens": 30}
                stays = asyncio.create_task(client.post(url, json=body))
                leaving = {"prompt": PROMPTS[1], "max_tokens": 30, "stream": True}
                async with client.stream("POST", url, json=leaving) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            break  # leave after the first piece of text
                return await stays

        stayed = asyncio.run(leave_while_another_stays())
        assert stayed.status_code == 200
        want = engine.generate([PROMPTS[0]], head=HEAD, max_new_tokens=30).completions[0]
        assert stayed.json()["choices"][0]["text"] == want.text  # undisturbed
        deadline = time.monotonic() + 30
        while (m := httpx.get(base + "/metrics").json())["requests"]["in_flight"]:
            assert time.monotonic() < deadline, m
            time.sleep(0.05)
        assert m["requests"]["cancelled"] == 1 and m["requests"]["completed"] == 1
        assert m["running"] == 0 and m["memory"]["kv_bytes"] == 0
        assert httpx.get(base + "/health").json()["status"] == "ok"


def test_ctrl_c_drains_new_requests_get_503_and_the_running_ones_finish(engine):
    with running(engine, SlowLive, steps_per_call=1) as (base, live, server, thread, lines):
        url = base + "/v1/completions"
        result: dict = {}
        body = {"prompt": PROMPTS[2], "max_tokens": 20}

        def post() -> None:
            result["r"] = httpx.post(url, json=body, timeout=120)

        inflight = threading.Thread(target=post)
        inflight.start()
        deadline = time.monotonic() + 60
        while httpx.get(base + "/metrics").json()["running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        server.handle_exit(signal.SIGINT, None)  # what Ctrl-C calls
        refused = httpx.post(url, json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.json()["error"]["message"] == (
            "the server is draining: it takes no new requests"
        )
        assert httpx.get(base + "/health").json()["status"] == "draining"
        inflight.join(timeout=120)
        thread.join(timeout=60)
        assert not thread.is_alive()  # drained, then stopped
    r = result["r"]
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
    assert lines[-2:] == [
        "SIGINT: draining (new requests get 503); again to stop at once",
        "drained: every request finished",
    ]


# short code to draw prompts of seven tokens at head 500 from (``seven``)
SEVEN_POOL = ("def main(", "import os", "return self", "print(x)", "import io", "print(y)",
              "print(z)", "print(a)", "print(b)", "assert x", "print(n)", "return x", "for x in y",
              "print(i)", "print(j)", "import gc")  # fmt: skip


@pytest.fixture(scope="module")
def seven(engine) -> tuple[str, ...]:
    """Seven prompts of seven tokens at head 500, so that requests of one limit reserve equal
    caches: the first seven of ``SEVEN_POOL`` the run's tokenizer splits so. Which ones it does
    depends on its corpus, the running Python's own standard library (3.12's splits "return
    self" in eight, 3.11's in seven), so they are picked here rather than written down."""
    picked = [
        p for p, ids in zip(SEVEN_POOL, engine.encode(list(SEVEN_POOL), HEAD)) if len(ids) == 7
    ]
    assert len(picked) >= 7, f"only {len(picked)} prompts of SEVEN_POOL are seven tokens at {HEAD}"
    return tuple(picked[:7])


class Watched(LiveServer):
    """The live loop keeping /metrics after every turn; the client of ticket ``leaving`` leaves
    after the first turn (when the test below has staged its request)."""

    def __init__(self, *args, **options) -> None:
        super().__init__(*args, **options)
        self.seen: list[dict] = []
        self.leaving: Ticket | None = None

    def _publish(self) -> None:
        super()._publish()
        self.seen.append(self.metrics())
        if len(self.seen) == 1 and self.leaving is not None:
            self.cancel(self.leaving)


@pytest.mark.slow
def test_the_live_server_prefills_ahead_within_the_budget_and_keeps_solo_tokens(engine, seven):
    """Eight greedy then four sampled requests at once, one row, a budget of four sequences:
    the prefill of the one that gets the row stages three more (the limit of the budget and
    b_max, not the seven that wait), /metrics counts them staged, and their caches count
    against the budget; a staged request whose client leaves is released and never joins; the
    drain waits for staged requests too; and every request gets exactly the tokens it gets
    alone."""
    limit = 6
    per_position = engine.run.config.shape.kv_elements_per_token * 4  # float32 cache
    weights = sum(x.size * x.dtype.itemsize for x in engine.run.params.values())
    sequence = (7 + limit - 1) * per_position
    config = ServeConfig(max_batch=1, memory_bytes=weights + 4 * sequence + per_position)
    cases = [(seven[i % 7], None) for i in range(8)] + [(seven[i], 50 + i) for i in range(4)]
    plan = memory_plan(engine.run, [Request("r", 0.0, seven[0], limit)], config, lambda _: None)
    assert plan.b_max[HEAD] == 4 and config.prefill_ahead == 16
    live = Watched(engine, [(None, HEAD)], config, plan, steps_per_call=2)

    def sampling(seed: int | None) -> Sampling:  # four settings, sharing the one row
        return (
            Sampling() if seed is None else Sampling(0.6 + seed % 4 / 4, (None, 5)[seed % 2], seed)
        )

    tickets = [live.submit(LiveRequest(p, limit, sampling(seed))) for p, seed in cases]
    leaving = 2
    live.leaving = tickets[leaving]  # the second of three staged by the first prefill
    live.start()
    try:
        assert live.drain(timeout=120)
        outcomes = [t.result(timeout=0) for t in tickets]  # all there once it has drained
    finally:
        live.stop()
    first, second, *_ = live.seen
    assert (first["running"], first["staged"], first["queue_length"]) == (1, 3, 8)
    assert (second["staged"], second["requests"]["cancelled"]) == (2, 1)  # released at once
    for m in live.seen:
        assert m["memory"]["kv_bytes"] == (m["running"] + m["staged"]) * sequence <= plan.kv_budget
        assert m["requests"]["in_flight"] == m["queue_length"] + m["staged"] + m["running"]
    # the drain waited for a staged request alone (nothing waiting, nothing running)
    assert any(m["staged"] and not m["running"] and not m["queue_length"] for m in live.seen)
    assert outcomes[leaving].stop == "cancelled" and outcomes[leaving].head is None
    for i, ((prompt, seed), outcome) in enumerate(zip(cases, outcomes, strict=True)):
        if i == leaving:
            continue
        want = engine.generate([prompt], head=HEAD, max_new_tokens=limit, sampling=sampling(seed))
        assert outcome.tokens == want.completions[0].tokens, (prompt, seed)
    assert len({o.tokens for o in outcomes}) > 8  # varied tokens: the check has teeth
    last = live.seen[-1]
    assert last["requests"] == {"submitted": 12, "completed": 11, "cancelled": 1, "failed": 0,
                                "in_flight": 0}  # fmt: skip
    assert last["staged"] == 0 and last["memory"]["kv_bytes"] == 0


def test_port_takes_no_static_batching(served_run_dir, tmp_path):
    from click.testing import CliRunner

    import cli

    (tmp_path / "policy.json").write_text('{"schema": 1, "kind": "policy", "batch_routes": '
                                          '[{"head": 500}]}')  # fmt: skip
    result = CliRunner().invoke(cli.main, [
        "serve", "--run", str(served_run_dir), "--policy", str(tmp_path / "policy.json"),
        "--port", "8000", "--batching", "static"])  # fmt: skip
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: --port serves live traffic with continuous batching: no --plot or --batching static"
    )


@pytest.mark.slow
def test_after_compile_shapes_live_traffic_compiles_nothing(served_run_dir):
    """``LiveServer.compile_shapes(sampled=True)`` (``serve --port --warmup sampled``) compiles
    every call greedy and sampled traffic makes: requests at both heads, greedy and sampled at
    several temperatures in the same batches, short and long prompts, short and long limits,
    more at once than rows (so prefills stage, rows join and carries regroup) compile nothing
    new."""
    engine = scrambled_engine(served_run_dir)
    config = ServeConfig(max_batch=2, prefill_ahead=2)
    long = "def main(argv):\n    return [x * 2 for x in argv if x]"[:40]
    prompts = [*PROMPTS, long, long[:24]]
    plan = memory_plan(engine.run, [Request("r", 0.0, p, 8) for p in prompts], config, print)
    live = LiveServer(engine, [(1, 300), (None, HEAD)], config, plan, steps_per_call=2)
    shapes, _ = live.compile_shapes(sampled=True)
    assert shapes == engine.shapes > 0
    cases = [(p, limit, head) for p in prompts for limit, head in ((1, None), (12, 300), (5, HEAD))]
    settings = [Sampling(), Sampling(0.7, seed=1), Sampling(), Sampling(1.3, seed=2)]
    live.start()
    try:
        tickets = [
            live.submit(LiveRequest(p, limit, settings[i % 4], head=head))
            for i, (p, limit, head) in enumerate(cases)
        ]
        outcomes = [t.result(timeout=300) for t in tickets]
        lone = live.submit(LiveRequest(long, 3)).result(timeout=300)  # B = 1: routed to 300
    finally:
        live.stop()
    assert all(o.stop in ("eos", "max_new_tokens", "max_seq") for o in [*outcomes, lone])
    assert {o.head for o in [*outcomes, lone]} == {300, HEAD}
    assert engine.shapes == shapes
    assert live.metrics()["compiled"] == {"shapes": shapes, "while_waiting": 0,
                                          "while_waiting_s": 0.0}  # fmt: skip


@pytest.mark.slow
def test_requests_staged_at_one_head_do_not_hold_back_another_head(engine, seven):
    """Four requests at head 500 with one row: one runs and three are staged. A request at
    head 300 behind them in the queue is prefilled and runs at the next turn, while requests are
    still staged at 500 (it used to wait until all of them had joined), and gets its solo
    tokens."""
    limit = 6
    per_position = engine.run.config.shape.kv_elements_per_token * 4  # float32 cache
    weights = sum(x.size * x.dtype.itemsize for x in engine.run.params.values())
    sequence = (7 + limit - 1) * per_position
    config = ServeConfig(max_batch=1, memory_bytes=weights + 8 * sequence + per_position)
    plan = memory_plan(engine.run, [Request("r", 0.0, seven[0], limit)], config, lambda _: None)
    live = Watched(engine, [(None, HEAD)], config, plan, steps_per_call=1)
    tickets = [live.submit(LiveRequest(p, limit, head=HEAD)) for p in seven[:4]]
    other = live.submit(LiveRequest(seven[4], limit, head=300))
    live.start()
    try:
        assert live.drain(timeout=120)
    finally:
        live.stop()

    def running(m: dict) -> dict[int, int]:
        return {row["head"]: row["running"] for row in m["by_head"]}

    first, second = live.seen[:2]
    assert first["staged"] == 3 and running(first) == {HEAD: 1, 300: 0}  # 300 waits its turn
    assert second["staged"] >= 2 and running(second) == {HEAD: 1, 300: 1}  # and runs at once
    outcome = other.result(timeout=0)
    want = engine.generate([seven[4]], head=300, max_new_tokens=limit)
    assert outcome.head == 300 and outcome.tokens == want.completions[0].tokens
    assert all(t.result(timeout=0).stop in ("eos", "max_new_tokens") for t in tickets)
