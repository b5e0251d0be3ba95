"""The cost model's figure for each validation point: the same terms ``sweep`` and ``plan`` use,
evaluated on Python floats (``xp=PyMath``) for one point.

Every point is priced in float32 (weights, KV cache, activations: what ``validate`` runs on a
CPU) and the ``full`` cost mode. Per family:

    decode       CostModel.decode_step(V, B, T): embedding + backbone + attention over the T
                 cache positions + unembedding + sampling, plus (L launches_per_layer + head
                 ops) launches, plus 1 / decode_steps host calls (the engine's loop runs
                 decode_steps steps per call). The engine's attention reads every cache
                 position (masked), so T is the cache length.
    prefill      CostModel.prefill_time(V, B, T): T prompt tokens per row, logits for the last,
                 one host call.
    train        see :func:`train_rows`: compute for the FLOPs, memory for the optimizer's pass,
                 as ``c_train`` prices a step, and one host call.
    backbone     op_time(decode_ops["backbone"]) + L launches_per_layer launches (the layers'
                 own launches in a decode step) + 1 host call.
    attention    op_time(decode_ops(T)["attention"]) + L launches (one attention per layer)
                 + 1 host call.
    unembedding  op_time(decode_ops["unembedding"]) + 1 launch + 1 host call: the B x V f32
                 logits written.

A host call costs the profile's ``dispatch_overhead_s`` (0 unless measured or fitted). Memory
the point's compiled call maps afresh (``fresh_bytes``: on a CPU, XLA's temporaries of 32 MiB or
more, ``timing.fresh_bytes``; a decode step its eighth of the loop's) costs its page faults at
the profile's ``fresh_bandwidth`` (0 unless fitted). That figure comes from XLA's own buffer
assignment of the compiled call, which ``sweep`` and ``plan`` do not have: they price no page
faults.

Op rows keep each op's FLOPs and bytes, so a later fit can re-price a point without timing it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vocabjax.costmodel import PREFILL_HEAD_OPS, CostModel, Op, OpTime, Settings
from vocabjax.hardware import DeviceProfile
from vocabjax.validation.grid import Point
from vocabjax.xp import PyMath

DTYPE = "f32"  # what validate runs: weights, KV cache and activations in float32
# the decode step's ops that an op timed alone runs: the layers run their norms, activations
# and residual adds beside their matmuls
OP_PARTS = {
    "backbone": ("backbone", "elementwise"),
    "attention": ("attention",),
    "unembedding": ("unembedding",),
}


def settings_for(point: Point, decode_steps: int = 1) -> Settings:
    """The cost-model settings of a point: float32 throughout, full mode; the training context
    is the point's sequence length (it enters the attention FLOPs of a training token); a
    decode point's loop runs ``decode_steps`` steps per host call."""
    seq = point.context if point.family == "train" and point.context else Settings.train_seq_tokens
    return Settings(
        mode="full", weight_dtype=DTYPE, kv_dtype=DTYPE, act_dtype=DTYPE, train_seq_tokens=seq,
        steps_per_call=decode_steps if point.family == "decode" else 1, attention="materialized",
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class OpRow:
    """One op's work and roofline times; ``bytes``/``t_mem`` are None where the model has none."""

    op: str
    flops: float
    bytes: float | None
    t_math: float
    t_mem: float | None
    t: float  # the time the cost model charges (roofline max, or a measured kernel time)
    bound: str  # "compute", "memory" or "measured" (an autotuned kernel table's time)
    kernels: float = 1.0  # Op.kernels: a calibrated efficiency is read at one kernel's size
    kind: str = "matmul"  # Op.kind: "attention" and "train" run at their own fitted scale
    row_bytes: float = 0.0  # Op.row_bytes: a matrix-vector product's weight row, else 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The cost model's time for one point, op by op."""

    ops: tuple[OpRow, ...]
    launches: float  # kernel launches charged
    launch_s: float  # launches x the device's launch overhead
    predicted_s: float  # sum of the ops' t plus launch_s, dispatch_s and fresh_s
    calls: float = 0.0  # host calls per measured unit (a decode step: 1 / steps per call)
    dispatch_s: float = 0.0  # calls x the device's dispatch overhead
    fresh_bytes: float = 0.0  # memory mapped afresh per measured unit (its page faults)
    fresh_s: float = 0.0  # fresh_bytes at the device's fresh_bandwidth (0: not modelled)

    @property
    def flops(self) -> float:
        return sum(o.flops for o in self.ops)

    @property
    def bytes(self) -> float | None:
        parts = [o.bytes for o in self.ops]
        return None if any(b is None for b in parts) else sum(parts)

    @property
    def bound(self) -> str:
        """What the model says holds: the largest of the compute-bound ops' time, the
        memory-bound ops' time (and the fresh memory's) and the launch and dispatch time
        ("launch"). A measured kernel
        time counts by its roofline's bound."""
        share = {"compute": 0.0, "memory": self.fresh_s, "launch": self.launch_s + self.dispatch_s}
        for o in self.ops:
            share["memory" if o.t_mem is not None and o.t_mem > o.t_math else "compute"] += o.t
        return max(share, key=lambda k: share[k])


def _row(name: str, op: Op, t: OpTime) -> OpRow:
    return OpRow(
        name, float(op.flops), float(op.bytes), t.t_math, t.t_mem, t.t, t.bound, float(op.kernels),
        op.kind, float(op.row_bytes),
    )  # fmt: skip


def _launch(cm: CostModel, n: float) -> tuple[float, float]:
    return n, n * cm.device.launch_overhead_s


def train_rows(cm: CostModel, vocab: int, batch: int, seq: int) -> tuple[OpRow, ...]:
    """One training step of ``batch`` windows of ``seq`` tokens, priced as ``c_train`` prices
    an optimizer step (``CostModel.train_ops``): the matmuls' forward and backward, 6 (N_nv +
    V D) FLOPs per token (Kaplan et al. 2020), the windows' attention, the layers' elementwise
    kernels, the loss's passes over the logits and AdamW's f32 pass over every parameter.
    Kernel launches are not charged (one host call is)."""
    ops = cm.train_ops(float(vocab), float(batch * seq))
    return tuple(_row(k, op, cm.op_time(op, xp=PyMath)) for k, op in ops.items())


def predict(
    point: Point, device: DeviceProfile, *, decode_steps: int = 1, fresh_bytes: float = 0.0
) -> Prediction:
    """The cost model's time for ``point`` on ``device`` (module docstring, per family); a
    decode point's time is per step of a loop of ``decode_steps`` steps per call (the point's
    own ``steps`` where it has them). ``fresh_bytes``: the memory one call of the point maps
    afresh (module docstring)."""
    steps = point.per_call(decode_steps)  # steps per call of a decode point; 1 for the rest
    q = _predict(point, device, steps)
    per_unit = fresh_bytes / steps
    fresh_s = per_unit * device.fresh_s_per_byte
    return dataclasses.replace(
        q, fresh_bytes=per_unit, fresh_s=fresh_s, predicted_s=q.predicted_s + fresh_s
    )


def _predict(point: Point, device: DeviceProfile, decode_steps: int) -> Prediction:
    """``predict`` without the fresh memory."""
    cm = CostModel(device, point.shape, settings_for(point, decode_steps))
    m, s = point.shape, cm.settings
    b = float(point.batch)
    per_layer = float(m.n_layers * s.launches_per_layer)
    dispatch = device.dispatch_overhead_s
    if point.family == "train":
        rows = train_rows(cm, point.vocab, point.batch, point.context)
        total = cm.train_step(float(point.vocab), float(point.batch * point.context), xp=PyMath)
        return Prediction(rows, 0.0, 0.0, total, 1.0, dispatch)
    if point.family == "prefill":
        v, t = float(point.vocab), float(point.context)
        ops = cm.prefill_ops(v, b, t)
        rows = tuple(_row(k, op, cm.op_time(op, xp=PyMath)) for k, op in ops.items())
        n, launch_s = _launch(cm, per_layer + PREFILL_HEAD_OPS)
        total = cm.prefill_time(v, b, t, xp=PyMath)
        return Prediction(rows, n, launch_s, total, 1.0, dispatch)
    if point.family == "decode":
        v, t = float(point.vocab), float(point.context)
        ops = cm.decode_ops(v, b, t)
        times = cm.decode_times(v, b, t, xp=PyMath)
        rows = tuple(_row(k, ops[k], times[k]) for k in ops)
        n, launch_s = _launch(cm, per_layer + cm.decode_head_ops())
        calls = 1.0 / decode_steps
        total = cm.decode_step(v, b, t, xp=PyMath)
        return Prediction(rows, n, launch_s, total, calls, calls * dispatch)
    # ops alone: the roofline of the matching decode ops (V and T only where they read them)
    ops = cm.decode_ops(float(point.vocab or 1), b, float(point.context or 1))
    rows = tuple(_row(k, ops[k], cm.op_time(ops[k], xp=PyMath)) for k in OP_PARTS[point.family])
    launches = {"backbone": per_layer, "attention": float(m.n_layers), "unembedding": 1.0}
    n, launch_s = _launch(cm, launches[point.family])
    total = sum(r.t for r in rows) + launch_s + dispatch
    return Prediction(rows, n, launch_s, total, 1.0, dispatch)


def call_flops(point: Point, prediction: Prediction, decode_steps: int) -> float:
    """FLOPs of one timed call of ``point`` (a decode loop runs ``decode_steps`` steps, or the
    point's own)."""
    return prediction.flops * point.per_call(decode_steps)
