"""Mixed-workload plans: single V, nested heads, routes, policy JSON."""

import itertools

import numpy as np
import pytest

from vocabjax.costmodel import CostModel, Settings
from vocabjax.errors import UserError
from vocabjax.hardware import DeviceProfile, load_device
from vocabjax.lifecycle import DEFAULT_VOCAB
from vocabjax.planning import (
    decode_routes,
    kv_table,
    make_plan,
    parse_workload,
    policy_json,
    subset_masks,
)
from vocabjax.shapes import load_shape
from vocabjax.xp import PyMath

WORKLOAD = "edge:b=1:share=0.5,dc:b=256:share=0.5"


def _model(**kw):
    return CostModel(load_device("a100-80gb"), load_shape("paper-1.5b"), Settings(**kw))


def test_parse_workload():
    classes = parse_workload("edge:b=1:share=0.25,dc:b=256:share=0.75:in=100:out=50")
    assert [(c.name, c.batch, c.share) for c in classes] == [("edge", 1, 0.25), ("dc", 256, 0.75)]
    assert classes[1].prompt_bytes == 100 and classes[1].output_bytes == 50


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "workload is empty"),
        ("edge:b=1:share=0.5", "shares sum to 0.5"),
        ("edge:b=1", "needs both b= and share="),
        ("edge:b=0:share=1", "must be positive"),
        ("edge:b=1:share=x", "is not a number"),
        ("edge:q=1:share=1", "is not b=N"),
        ("a:b=1:share=0.5,a:b=2:share=0.5", "must be unique"),
        (":b=1:share=1", "needs a name first"),
    ],
)
def test_bad_workloads(text, message):
    with pytest.raises(UserError, match=message):
        parse_workload(text)


def test_subset_masks_enumerate_every_set_fewest_heads_first():
    m = subset_masks(5, 3)
    assert len(m) == 5 + 10 + 10
    sizes = m.sum(axis=1)
    assert (np.diff(sizes) >= 0).all()
    assert len({tuple(r) for r in m}) == len(m)
    with pytest.raises(UserError, match="max_heads must be >= 1"):
        subset_masks(5, 0)


@pytest.mark.slow
def test_plan_against_brute_force():
    cm = _model()
    classes = parse_workload(WORKLOAD)
    lam = 100.0
    p = make_plan(cm, DEFAULT_VOCAB, classes, lam, max_heads=3)
    ct = {v: cm.c_train(float(v), xp=PyMath) for v in DEFAULT_VOCAB}
    ci = {  # capped by default: each class costed at the largest batch that fits
        (v, c.batch): cm.c_infer(
            float(v), min(float(c.batch), cm.b_max(float(v), xp=PyMath)), xp=PyMath
        )
        for v in DEFAULT_VOCAB
        for c in classes
    }
    single = {
        v: ct[v] + lam * sum(c.share * ci[v, c.batch] for c in classes) for v in DEFAULT_VOCAB
    }
    assert DEFAULT_VOCAB[p.single] == min(single, key=single.get)
    assert p.single_cost == pytest.approx(min(single.values()), rel=1e-5)
    best = None
    for k in (1, 2, 3):
        for s in itertools.combinations(DEFAULT_VOCAB, k):
            j = sum(c.share * min(ct[h] + lam * ci[h, c.batch] for h in s) for c in classes)
            used = {min(s, key=lambda h: ct[h] + lam * ci[h, c.batch]) for c in classes}
            if used == set(s) and (best is None or j < best[0] * (1 - 1e-6)):
                best = (j, s)
    assert tuple(DEFAULT_VOCAB[i] for i in p.heads) == best[1]
    assert p.heads_cost == pytest.approx(best[0], rel=1e-5)
    assert p.heads_cost <= p.single_cost * (1 + 1e-6)


@pytest.mark.slow
def test_single_class_plan_is_one_head_and_matches_sweep():
    from vocabjax.lifecycle import Grid, sweep

    cm = _model()
    p = make_plan(cm, DEFAULT_VOCAB, parse_workload("dc:b=64:share=1"), 10.0)
    assert len(p.heads) == 1 and p.heads[0] == p.single
    res = sweep(cm, Grid(batch=(64,), lam=(10.0,)))
    assert res.v_star[0, 0] == p.vocab[p.single]


def test_policy_json_routes_every_batch():
    cm = _model()
    p = make_plan(cm, DEFAULT_VOCAB, parse_workload(WORKLOAD), 100.0)
    pol = policy_json(p, cm, max_heads=3)
    assert pol["schema"] == 2 and pol["kind"] == "policy"
    assert set(r["head"] for r in pol["batch_routes"]) <= set(pol["heads"])
    assert pol["batch_routes"][-1]["max_batch"] is None
    maxes = [r["max_batch"] for r in pol["batch_routes"][:-1]]
    assert maxes == sorted(maxes)
    assert {r["name"] for r in pol["routes"]} == {"edge", "dc"}
    for r in pol["routes"]:
        assert r["head"] in pol["heads"]
    assert [r["vocab"] for r in pol["kv_plan"]] == list(DEFAULT_VOCAB)
    assert all(r["lam"] is None or isinstance(r["lam"], float) for r in pol["break_even"])
    assert any(r["lam"] is None for r in pol["break_even"])  # some V is never worth it here
    assert {r["reference_vocab"] for r in pol["kv_plan"]} == {32768}
    assert [r["gain"] for r in pol["kv_plan"] if r["vocab"] == 32768] == [1.0]


def test_lambda_zero_plan_is_the_training_optimum():
    cm = _model()
    p = make_plan(cm, DEFAULT_VOCAB, parse_workload(WORKLOAD), 0.0)
    assert p.single == p.v_train == int(np.argmin(p.c_train))
    assert p.heads == (p.v_train,)


@pytest.mark.slow
def test_plan_prices_each_class_as_the_sweep_prices_its_batch():
    from vocabjax.lifecycle import Grid, sweep

    cm = _model()
    p = make_plan(cm, DEFAULT_VOCAB, parse_workload(WORKLOAD), 100.0)
    res = sweep(cm, Grid(batch=(1, 256), lam=(100.0,)))
    # one per-point function under both: the same numbers to a few float32 ulp (a calibrated
    # sweep evaluates it vmapped over the ensemble's scale vectors: another XLA program)
    np.testing.assert_allclose(p.c_train, res.c_train, rtol=5e-7, atol=0)
    np.testing.assert_allclose(p.c_infer, res.c_infer, rtol=5e-7, atol=0)
    np.testing.assert_array_equal(p.b_max[:, 0], res.b_max)


def test_a_class_with_its_own_bytes_is_priced_as_a_model_with_them():
    """The plan prices every class in one vmapped call (``CostModel.with_io``): a class's
    S_in and S_out cost what a model with those settings costs, the other class the model's."""
    cm = _model(prompt_bytes=2000.0)
    workload = parse_workload("a:b=1:share=0.5,b:b=64:share=0.5:in=100:out=50")
    p = make_plan(cm, DEFAULT_VOCAB, workload, 100.0)
    for c, (model, batch) in enumerate(
        [(cm, 1.0), (_model(prompt_bytes=100.0, output_bytes=50.0), 64.0)]
    ):
        for i, v in enumerate(DEFAULT_VOCAB):
            b_max = model.b_max(float(v), xp=PyMath)
            want = model.c_infer(float(v), min(batch, b_max), xp=PyMath)
            assert p.c_infer[i, c] == pytest.approx(want, rel=1e-5), (c, v)
            assert p.b_max[i, c] == pytest.approx(b_max, rel=1e-6)
            assert p.kv_bytes_per_seq[i, c] == pytest.approx(
                model.kv_bytes_per_seq(float(v), xp=PyMath), rel=1e-6
            )


@pytest.mark.slow
def test_plan_compiles_once_per_model_and_options(monkeypatch):
    from vocabjax import planning

    traced = []
    head_sets = planning._head_sets
    monkeypatch.setattr(planning, "_head_sets", lambda *a: traced.append(1) or head_sets(*a))
    for lam, workload in (
        (100.0, WORKLOAD),
        (0.0, WORKLOAD),
        (10.0, "a:b=4:share=0.2,b:b=8:share=0.8"),
    ):
        cm = _model(prompt_bytes=3001.0)  # an equal model each time, new to the cache
        make_plan(cm, DEFAULT_VOCAB, parse_workload(workload), lam)
    assert len(traced) == 1


def test_lambda_zero_policy_routes_every_batch_to_the_training_optimum():
    cm = _model()
    p = make_plan(cm, DEFAULT_VOCAB, parse_workload(WORKLOAD), 0.0)
    pol = policy_json(p, cm, max_heads=3)
    assert [r["head"] for r in pol["batch_routes"]] == [DEFAULT_VOCAB[p.v_train]]
    assert pol["batch_routes"][0]["max_batch"] is None


def test_kv_table_puts_break_even_beside_the_kv_plan():
    cm = _model()
    pol = policy_json(
        make_plan(cm, DEFAULT_VOCAB, parse_workload(WORKLOAD), 100.0), cm, max_heads=3
    )
    table = kv_table(pol)
    assert [r["vocab"] for r in table] == list(DEFAULT_VOCAB)
    for row, kv, be in zip(table, pol["kv_plan"], pol["break_even"], strict=True):
        assert row["gain_vs_32k"] == kv["gain"] and row["b_max"] == kv["b_max"]
        assert row["break_even_lam"] == ("never" if be["lam"] is None else be["lam"])


# ---- a trained run's heads routed by the decode step's cost per byte ---------------------------


def _tiny_cpu() -> CostModel:
    cpu = DeviceProfile(
        name="cpu", peak_flops={"f32": 1e11}, hbm_bandwidth=2e10, memory_bytes=16e9,
        launch_overhead_s=1e-5, source="a 2-core CPU-like profile",
    )  # fmt: skip
    f32 = Settings(weight_dtype="f32", kv_dtype="f32", act_dtype="f32")
    return CostModel(cpu, load_shape("tiny"), f32)


def test_decode_routes_take_each_batchs_cheapest_head_per_byte():
    """Each power-of-two batch goes to the argmin of decode_step / (B bytes per token), runs
    of one head merge, and the last route covers every larger batch."""
    cm = _tiny_cpu()
    bpt = {1024: 2.0, 4096: 2.5, 16384: 5.0}
    routes = decode_routes(cm, bpt, max_batch=256, context=128)
    # at small B the weights' read dominates a step and 16384's bytes pay for it; at large B
    # the step's FLOPs grow with V and the smallest head is cheaper per byte
    assert len(routes) >= 2 and routes[0][1] == 16384 and routes[-1] == (None, 1024)
    assert [b for b, _ in routes[:-1]] == sorted(b for b, _ in routes[:-1])
    for b in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        want = min(bpt, key=lambda v: cm.decode_step(v, b, 128.0, xp=PyMath) / (b * bpt[v]))
        got = next(h for m, h in routes if m is None or b <= m)
        assert got == want, (b, routes)
    # alike bytes per token: the cheapest step (the smallest head) everywhere
    assert decode_routes(cm, dict.fromkeys(bpt, 3.0), max_batch=64, context=128) == [(None, 1024)]
    # a head that packs far more bytes wins everywhere
    assert decode_routes(cm, {1024: 1.0, 4096: 40.0}, max_batch=8, context=128) == [(None, 4096)]


@pytest.mark.parametrize(
    ("bpt", "max_batch"), [({}, 8), ({1024: 2.0}, 0), ({1024: float("nan")}, 8), ({1024: 0.0}, 8)]
)
def test_decode_routes_refuse_bad_input(bpt, max_batch):
    with pytest.raises(UserError):
        decode_routes(_tiny_cpu(), bpt, max_batch=max_batch, context=128)
