"""The roofline cost model: hand-checked values and hypothesis properties."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vocabjax.compression import CompressionCurve
from vocabjax.costmodel import CostModel, Settings
from vocabjax.hardware import BUILTIN_DEVICES, DeviceProfile, KernelTiming, load_device
from vocabjax.shapes import BUILTIN_SHAPES, ModelShape, load_shape
from vocabjax.xp import PyMath

TINY = ModelShape("tiny", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256)
ROUND = DeviceProfile(
    name="round",
    peak_flops={"bf16": 1e12},
    hbm_bandwidth=1e11,
    memory_bytes=1e9,
    launch_overhead_s=1e-6,
    source="test",
)
FLAT = CompressionCurve("flat4", (1000, 10**7), (4.0, 4.0))


def test_tiny_shape_counts():
    # attention: q, o are 64 x (4*16); k, v are 64 x (2*16); mlp: 2 x 64 x 256; 2 layers
    assert TINY.dh == 16
    assert TINY.n_nonembedding == 2 * (2 * 64 * 64 + 2 * 64 * 32 + 2 * 64 * 256)
    assert TINY.kv_elements_per_token == 2 * 2 * 2 * 16


def test_hand_checked_decode_cost():
    """c_infer at V=1000, B=2 from DESIGN.md's formulas, written out by hand."""
    s = Settings(prompt_bytes=400.0, output_bytes=200.0, launches_per_layer=5)
    cm = CostModel(ROUND, TINY, s, FLAT)
    V, B, D, L, w, k = 1000.0, 2.0, 64.0, 2.0, 2.0, 2.0
    n_nv = float(TINY.n_nonembedding)
    beta = 4.0
    T = (400 + 100) / beta  # mean context over the generation: S_in/beta + S_out/(2 beta)
    P, BW = 1e12, 1e11
    act = B * L * (4 * 64 + 2 * (4 + 2) * 16 + 2 * 256) * 2
    t_embed = B * D * w / BW
    t_backbone = max(2 * B * n_nv / P, (w * n_nv + act) / BW)
    # norms, the activation and residual adds: 10 D + 2 F elements per token per layer
    t_elementwise = max(4 * B * L * D / P, B * L * (10 * 64 + 2 * 256) * 2 / BW)
    t_unembed = max(2 * B * V * D / P, (w * V * D + B * V * 4) / BW)
    t_sample = max(4 * B * V / P, B * V * 4 / BW)
    t_attn = max(4 * B * T * 4 * 16 * L / P, B * T * 2 * 2 * 16 * k * L / BW)
    launches = (2 * 5 + 3) * 1e-6
    step = t_embed + t_backbone + t_elementwise + t_unembed + t_sample + t_attn + launches
    expected = step / (B * beta)
    assert cm.c_infer(V, B, xp=PyMath) == pytest.approx(expected, rel=1e-12)
    assert float(cm.c_infer(jnp.float32(V), jnp.float32(B))) == pytest.approx(expected, rel=1e-5)
    # training, one 2^20-token step of 2048-token windows, per token: the matmuls' 6 (N_nv + V D)
    # FLOPs (their three passes over weights and activations), the windows' causal attention
    # (three times 2 T H Dh L FLOPs and the K/V read per token), the elementwise kernels three
    # times, the loss's six f32 passes over the logits, and AdamW's f32 pass over every
    # parameter (32 bytes each) once per step; then per byte
    n = 2.0**20
    weights = w * (n_nv + V * D) / n
    act_train = L * (4 * 64 + 2 * (4 + 2) * 16 + 2 * 256) * 2 + 2 * D * 2
    t_matmuls = max(6 * (n_nv + V * D) / P, 3 * (weights + act_train) / BW)
    t_attention = 3 * max(2 * 2048 * 4 * 16 * L / P, 2048 * 2 * 2 * 16 * k * L / 2048 / BW)
    t_norms = 3 * max(4 * L * D / P, L * (10 * 64 + 2 * 256) * 2 / BW)
    t_loss = max(4 * V / P, 6 * V * 4 / BW)
    optimizer = 32 * (n_nv + 2 * V * D) / BW / n
    c_train = (t_matmuls + t_attention + t_norms + t_loss + optimizer) / beta
    assert cm.c_train(V, xp=PyMath) == pytest.approx(c_train, rel=1e-12)
    # KV plan: ((S_in + S_out) / beta) 2 L K Dh k bytes per sequence
    kv = (600 / beta) * 2 * 2 * 2 * 16 * 2
    assert cm.kv_bytes_per_seq(V, xp=PyMath) == pytest.approx(kv)
    assert cm.b_max(V, xp=PyMath) == math.floor((1e9 - w * (n_nv + 2 * V * D)) / kv)


def test_fused_logits_keep_the_training_loss_off_memory():
    """The loss's passes over the logits cost memory unless the cross-entropy is fused; its
    FLOPs stay, and so does every other op of the step."""
    plain = CostModel(ROUND, TINY, Settings(), FLAT)
    fused = CostModel(ROUND, TINY, Settings(fused_logits=True), FLAT)
    ops, ops_fused = plain.train_ops(32000.0, 4096.0), fused.train_ops(32000.0, 4096.0)
    assert ops["loss"].bytes == 6 * 4096 * 32000 * 4 and ops_fused["loss"].bytes == 0
    assert ops_fused["loss"].flops == ops["loss"].flops
    assert {k: v for k, v in ops.items() if k != "loss"} == {
        k: v for k, v in ops_fused.items() if k != "loss"
    }
    assert fused.c_train(32000.0, xp=PyMath) < plain.c_train(32000.0, xp=PyMath)


def test_weights_only_drops_attention_and_kv():
    full = CostModel(ROUND, TINY, Settings(), FLAT)
    wo = CostModel(ROUND, TINY, Settings(mode="weights-only"), FLAT)
    assert "attention" in full.decode_ops(1000.0, 1.0, 100.0)
    assert "attention" not in wo.decode_ops(1000.0, 1.0, 100.0)
    assert wo.c_infer(1000.0, 8.0, xp=PyMath) < full.c_infer(1000.0, 8.0, xp=PyMath)
    # weights-only training is exactly 6 (N_nv + V D)
    assert wo.train_flops_per_token(1000.0) == 6 * (TINY.n_nonembedding + 1000 * 64)


def test_prefill_is_charged_only_when_asked():
    base = CostModel(ROUND, TINY, Settings(), FLAT)
    pre = CostModel(ROUND, TINY, Settings(include_prefill=True), FLAT)
    extra = pre.c_infer(4096.0, 4.0, xp=PyMath) - base.c_infer(4096.0, 4.0, xp=PyMath)
    expected = base.prefill_time(4096.0, 4.0, 4096 / 4.0, xp=PyMath) / (4.0 * 1024.0)
    assert extra == pytest.approx(expected, rel=1e-9)


def test_breakdown_reports_bounds():
    cm = CostModel(load_device("a10g"), load_shape("paper-100m"))
    rows = {r["op"]: r for r in cm.breakdown(32768, 1)}
    assert rows["unembedding"]["bound"] == "memory"  # B = 1 is far below the ridge point
    big = {r["op"]: r for r in cm.breakdown(32768, 4096)}
    assert big["unembedding"]["bound"] == "compute"
    for r in rows.values():
        assert r["t"] == max(r["t_math"], r["t_mem"])


vocab_st = st.integers(min_value=1024, max_value=2**21)
# The pure roofline's properties (linear in V, a flat floor past the ridge) hold at constant
# efficiency: the datasheet profiles. A calibrated one's efficiency varies with op size.
device_st = st.sampled_from(sorted(n for n, p in BUILTIN_DEVICES.items() if not p.calibrated))
shape_st = st.sampled_from(sorted(BUILTIN_SHAPES))


@given(vocab_st, st.integers(2, 16), device_st, shape_st)
def test_unembedding_time_linear_in_vocab_at_batch_one(v, factor, device, shape):
    cm = CostModel(load_device(device), load_shape(shape))
    t = lambda vv: cm.decode_times(float(vv), 1.0, 100.0, xp=PyMath)["unembedding"].t  # noqa: E731
    assert t(v * factor) == pytest.approx(factor * t(v), rel=1e-9)


@given(vocab_st, device_st, shape_st, st.booleans())
def test_per_sequence_unembedding_cost_falls_with_batch_until_ridge(v, device, shape, fused):
    dev = load_device(device)
    cm = CostModel(dev, load_shape(shape), Settings(fused_logits=fused))
    per_seq = [
        cm.decode_times(float(v), float(b), 100.0, xp=PyMath)["unembedding"].t / b
        for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    ]
    ridge = dev.ridge_point("bf16")
    batches = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    for (_, c0), (b1, c1) in zip(zip(batches, per_seq), zip(batches[1:], per_seq[1:])):
        assert c1 <= c0 * (1 + 1e-12)  # never rises
        if b1 <= ridge:
            assert c1 < c0  # strictly amortized below the ridge point
    peak = dev.flops("bf16")  # a datasheet profile runs at its peak
    floor = 2 * v * cm.shape.d_model / peak  # compute-bound: the V x D read fully amortized
    assert per_seq[-1] >= floor * (1 - 1e-12)
    if fused:  # intensity ~ B, so B = 2048 is past every builtin ridge point
        assert per_seq[-1] == pytest.approx(floor, rel=1e-9)


@given(vocab_st, st.integers(1, 512), device_st, st.sampled_from([2.0, 10.0, 0.5]))
def test_costs_are_seconds(v, b, device, k):
    """Units: making the device k times faster in every ceiling divides every cost by k."""
    dev = load_device(device)
    fast = dataclasses.replace(
        dev,
        peak_flops={d: p * k for d, p in dev.peak_flops.items()},
        hbm_bandwidth=dev.hbm_bandwidth * k,
        launch_overhead_s=dev.launch_overhead_s / k,
    )
    shape = load_shape("llama-1b")
    slow_cm, fast_cm = CostModel(dev, shape), CostModel(fast, shape)
    for f in ("c_infer", "c_train"):
        args = (float(v), float(b)) if f == "c_infer" else (float(v),)
        assert getattr(fast_cm, f)(*args, xp=PyMath) == pytest.approx(
            getattr(slow_cm, f)(*args, xp=PyMath) / k, rel=1e-9
        )
    # and per-byte costs times bytes per step are the step's seconds
    beta = slow_cm.beta(float(v), xp=PyMath)
    step = slow_cm.decode_step(
        float(v), float(b), slow_cm.mean_context(float(v), xp=PyMath), xp=PyMath
    )
    assert slow_cm.c_infer(float(v), float(b), xp=PyMath) * b * beta == pytest.approx(
        step, rel=1e-12
    )


def test_jnp_and_python_agree_on_a_grid():
    cm = CostModel(load_device("h100-sxm"), load_shape("llama-8b"))
    vs = jnp.asarray([8192.0, 50257.0, 262144.0])
    bs = jnp.asarray([1.0, 7.0, 300.0])
    grid = jax.jit(jax.vmap(jax.vmap(cm.c_infer, (None, 0)), (0, None)))(vs, bs)
    for i, v in enumerate([8192.0, 50257.0, 262144.0]):
        for j, b in enumerate([1.0, 7.0, 300.0]):
            assert float(grid[i, j]) == pytest.approx(cm.c_infer(v, b, xp=PyMath), rel=1e-5)


def _measured_profile(d_model=512):
    rows = []
    for v in (8192, 32768, 131072):
        for b in (1, 16, 256):
            t = 1e-6 * (v / 8192) * (1 + b / 64)
            rows.append(KernelTiming("greedy", v, b, d_model, "bf16", "chunked", {}, t, 0.5))
    return dataclasses.replace(load_device("a100-80gb"), best=tuple(rows), measured=True)


def test_measured_kernel_times_replace_the_unembedding_roofline():
    dev = _measured_profile(d_model=512)
    shape = dataclasses.replace(load_shape("paper-100m"), d_model=1024, n_heads=16, n_kv_heads=16)
    cm = CostModel(dev, shape)
    t = cm.decode_times(32768.0, 16.0, 100.0, xp=PyMath)
    # measured at d=512, scaled by 1024 / 512
    assert t["unembedding"].t == pytest.approx(2 * 1e-6 * 4 * (1 + 16 / 64), rel=1e-9)
    assert t["unembedding"].bound == "measured" and t["sampling"].t == 0
    # between measured points: interpolated in log-log, so between its neighbours
    mid = cm.decode_times(65536.0, 16.0, 100.0, xp=PyMath)["unembedding"].t
    hi = cm.decode_times(131072.0, 16.0, 100.0, xp=PyMath)["unembedding"].t
    assert t["unembedding"].t < mid < hi
    jit_mid = float(
        cm.decode_times(jnp.float32(65536.0), jnp.float32(16.0), 100.0)["unembedding"].t
    )
    assert jit_mid == pytest.approx(mid, rel=1e-5)


def test_scaled_stretches_one_op_family_and_leaves_the_model_alone():
    cm = CostModel(load_device("a100-80gb"), load_shape("llama-8b"))
    base = cm.decode_times(32768.0, 8.0, 1000.0, xp=PyMath)
    slow = cm.scaled({"unembedding": 2.0, "overhead": 3.0})
    times = slow.decode_times(32768.0, 8.0, 1000.0, xp=PyMath)
    assert times["unembedding"].t == pytest.approx(2 * base["unembedding"].t)
    assert times["backbone"].t == base["backbone"].t
    step, slow_step = (m.decode_step(32768.0, 8.0, 1000.0, xp=PyMath) for m in (cm, slow))
    overhead = step - sum(t.t for t in base.values())
    assert slow_step == pytest.approx(step + base["unembedding"].t + 2 * overhead, rel=1e-9)
    assert cm.op_scale == {}  # the original is unchanged
    trained = cm.scaled({"optimizer": 0.5})
    assert trained.train_step(32768.0, 2.0**20, xp=PyMath) < cm.train_step(
        32768.0, 2.0**20, xp=PyMath
    )
    with pytest.raises(ValueError, match="unknown op families"):
        cm.scaled({"softmax": 2.0})


def test_the_one_row_table_prices_matrix_vector_products_alone():
    """A profile's one-row table (e_m of a matmul over one activation row, by its weight rows'
    bytes) speeds the memory time of the backbone and unembedding at B = 1, reads the table at
    D x the weight's bytes, and leaves B = 2 and every other op as they were."""
    from vocabjax.hardware import EfficiencyTable

    bf16 = Settings()  # bf16 weights: a row is D x 2 bytes
    plain = CostModel(ROUND, TINY, bf16)
    fast = CostModel(
        dataclasses.replace(ROUND, row_table=EfficiencyTable((128.0, 4096.0), (2.0, 2.0))),
        TINY,
        bf16,
    )
    one = fast.decode_ops(4096.0, 1.0, 128.0)
    assert one["backbone"].row_bytes == one["unembedding"].row_bytes == 2.0 * TINY.d_model
    assert one["attention"].row_bytes == one["sampling"].row_bytes == 0.0
    assert all(o.row_bytes == 0.0 for o in fast.decode_ops(4096.0, 2.0, 128.0).values())
    a, b = (
        plain.decode_times(4096.0, 1.0, 128.0, xp=PyMath),
        fast.decode_times(4096.0, 1.0, 128.0, xp=PyMath),
    )
    for name in a:
        ratio = a[name].t_mem / b[name].t_mem
        assert ratio == pytest.approx(2.0 if name in ("backbone", "unembedding") else 1.0)
    two = (plain.decode_step(4096.0, 2.0, 128.0, xp=PyMath),
           fast.decode_step(4096.0, 2.0, 128.0, xp=PyMath))  # fmt: skip
    assert two[0] == two[1]
    # traced batches (sweep's vmaps) take the same path
    assert float(fast.decode_step(4096.0, jnp.float32(1.0), 128.0)) == pytest.approx(
        fast.decode_step(4096.0, 1.0, 128.0, xp=PyMath), rel=1e-5
    )


def test_the_pick_of_a_token_runs_at_its_own_kinds_rate():
    """The decode step's sampling and the prefill's pick of the first token are kind
    "sampling": a profile's ``sampling_efficiency`` stretches them and nothing else."""
    base = CostModel(ROUND, TINY, Settings(), FLAT)
    slow = CostModel(dataclasses.replace(ROUND, sampling_efficiency=0.25), TINY, Settings(), FLAT)
    for ops in ("decode_ops", "prefill_ops"):
        a = getattr(base, ops)(32768.0, 8.0, 64.0)
        b = getattr(slow, ops)(32768.0, 8.0, 64.0)
        assert a["sampling"].kind == "sampling"
        for name in a:
            t_a = base.op_time(a[name], xp=PyMath).t
            t_b = slow.op_time(b[name], xp=PyMath).t
            assert t_b == pytest.approx(t_a * (4.0 if name == "sampling" else 1.0), rel=1e-12)
    step = base.decode_step(32768.0, 8.0, 64.0, xp=PyMath)
    sampling = base.op_time(base.decode_ops(32768.0, 8.0, 64.0)["sampling"], xp=PyMath).t
    assert slow.decode_step(32768.0, 8.0, 64.0, xp=PyMath) == pytest.approx(step + 3 * sampling)
