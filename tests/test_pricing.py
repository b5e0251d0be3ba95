"""The serving loop's device calls priced by the cost model (``serving.pricing``): each kind of
call at the price its module doc gives, and a served trace's record holding every call the
clock was charged for, so that measured and predicted cover the same busy time."""

from __future__ import annotations

import dataclasses
import math

import pytest
from serving_testing import scrambled_engine

from vocabjax.costmodel import CostModel, Op, Settings
from vocabjax.hardware import DeviceProfile
from vocabjax.serving import Request, ServeConfig, serve
from vocabjax.serving.batching import Call
from vocabjax.serving.pricing import CallPricer, total
from vocabjax.shapes import ModelShape
from vocabjax.xp import PyMath

SHAPE = ModelShape("tiny", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256)
DEVICE = DeviceProfile(
    name="round",
    peak_flops={"f32": 1e12},
    hbm_bandwidth=1e11,
    memory_bytes=1e9,
    launch_overhead_s=1e-6,
    dispatch_overhead_s=1e-4,
    source="test",
)
F32 = Settings(weight_dtype="f32", kv_dtype="f32", act_dtype="f32", attention="materialized")
MAX_SEQ = 128


def pricer() -> CallPricer:
    return CallPricer(CostModel(DEVICE, SHAPE, F32), MAX_SEQ)


def call(kind, rows, **kw) -> Call:
    return Call(kind, 1024, rows, 0, 0.0, 0.0, **kw)


def test_a_carry_row_is_its_cache_and_its_tokens():
    # K and V of 2 layers, 2 KV heads of 16, f32, at each of 128 positions; an int32 token each
    assert pricer().row_bytes == MAX_SEQ * (2 * 2 * 2 * 16 * 4 + 4)


def test_copies_are_a_host_call_and_their_passes_over_the_rows():
    p = pricer()
    host = DEVICE.dispatch_overhead_s + DEVICE.launch_overhead_s
    row_s = p.row_bytes / DEVICE.hbm_bandwidth  # elementwise efficiency 1 on a datasheet

    def close(kind, rows, passes, **kw):
        want = host + passes * rows * row_s
        return math.isclose(p.seconds(call(kind, rows, **kw), score=False), want)

    assert close("empty", 8, 1)
    assert close("regroup", 8, 2)
    assert close("merge", 8, 4)
    # three requests join a carry of 16 rows: two passes over each joining row alone
    join = p.seconds(call("join", 16, joined=3), score=False)
    assert math.isclose(join, host + 2 * 3 * row_s)


def test_decode_calls_are_loops_of_their_steps():
    p, cm = pricer(), CostModel(DEVICE, SHAPE, dataclasses.replace(F32, steps_per_call=5))
    want = 5 * cm.decode_step(1024.0, 8.0, 64.0, xp=PyMath)
    assert math.isclose(p.seconds(call("steps", 8, steps=5, window=64), score=False), want)
    # no window: the steps attend to every position of the carry
    whole = 5 * cm.decode_step(1024.0, 8.0, float(MAX_SEQ), xp=PyMath)
    assert math.isclose(p.seconds(call("steps", 8, steps=5), score=False), whole)


def test_a_scored_prefill_adds_every_prompt_positions_logits_and_their_reduction():
    p = pricer()
    cm = p.cm
    plain = p.seconds(call("prefill", 4, bucket=32), score=False)
    scored = p.seconds(call("prefill", 4, bucket=32), score=True)
    score = sum(cm.op_time(op, xp=PyMath).t for op in cm.score_ops(1024.0, 128.0).values())
    assert math.isclose(scored - plain, score)
    zeros = cm.op_time(Op(0.0, 4 * p.row_bytes, kind="elementwise"), xp=PyMath).t
    assert math.isclose(plain, cm.prefill_time(1024.0, 4.0, 32.0, xp=PyMath) + zeros)
    assert cm.score_ops(1024.0, 128.0)["sampling"].kind == "sampling"


def test_an_unknown_kind_has_no_price():
    with pytest.raises(ValueError, match="no price"):
        pricer().seconds(call("teleport", 4), score=False)


TRACE = tuple(
    Request(str(i), 1e-9 * i, "def f(x):\n    return x" + " + 1" * (i % 3), 3 + i % 4)
    for i in range(10)
)


@pytest.mark.slow
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_a_served_trace_prices_every_call_the_clock_charged(served_run_dir, batching):
    engine = scrambled_engine(served_run_dir)
    config = ServeConfig(max_batch=4, batching=batching, device=DEVICE)
    result = serve(engine, TRACE, [(None, 500)], config)
    cm = CostModel(DEVICE, engine.run.config.shape, F32)
    priced = CallPricer(cm, engine.run.max_seq).served(result)
    busy = result.summary()["busy_s"]
    assert math.isclose(total(priced).measured_s, busy, abs_tol=1e-5)
    kinds = {p.kind for p in priced}
    if batching == "static":
        assert kinds == {"batch"} and not result.calls
    else:  # a first carry, the prefill, its join, decode steps; staged prompts joining later
        assert {"empty", "prefill", "join", "steps"} <= kinds
        assert sum(c.kind == "prefill" for c in result.calls) == len(result.batches)
    assert all(p.predicted_s > 0 and p.calls > 0 for p in priced)
