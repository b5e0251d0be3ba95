"""The cost model's figure for each validation point: the same terms ``sweep`` and ``plan`` use,
evaluated on Python floats (``xp=PyMath``) for one point.

Every point is priced in float32 (weights, KV cache, activations: what ``validate`` runs on a
CPU) and the ``full`` cost mode. Per family:

    decode       CostModel.decode_step(V, B, T): embedding + backbone + attention over the T
                 cache positions + unembedding + sampling, plus (L launches_per_layer + head
                 ops) launches. The engine's attention reads every cache position (masked), so
                 T is the cache length.
    prefill      CostModel.prefill_time(V, B, T): T prompt tokens per row, logits for the last.
    train        see :func:`train_step`: compute only, as ``c_train`` prices training.
    backbone     op_time(decode_ops["backbone"]) + L launches_per_layer launches (the layers'
                 own launches in a decode step).
    attention    op_time(decode_ops(T)["attention"]) + L launches (one attention per layer).
    unembedding  op_time(decode_ops["unembedding"]) + 1 launch: the B x V f32 logits written.

Op rows keep each op's FLOPs and bytes, so a later fit can re-price a point without timing it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vocabjax.costmodel import CostModel, Op, OpTime, Settings
from vocabjax.hardware import DeviceProfile
from vocabjax.validation.grid import Point
from vocabjax.xp import PyMath

DTYPE = "f32"  # what validate runs: weights, KV cache and activations in float32


def settings_for(point: Point) -> Settings:
    """The cost-model settings of a point: float32 throughout, full mode; the training context
    is the point's sequence length (it enters the attention FLOPs of a training token)."""
    seq = point.context if point.family == "train" and point.context else Settings.train_seq_tokens
    return Settings(
        mode="full", weight_dtype=DTYPE, kv_dtype=DTYPE, act_dtype=DTYPE, train_seq_tokens=seq
    )


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

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The cost model's time for one point, op by op."""

    ops: tuple[OpRow, ...]
    launches: float  # kernel launches charged
    launch_s: float  # launches x the device's launch overhead
    predicted_s: float  # sum of the ops' t plus launch_s

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
        memory-bound ops' time and the launch time. A measured kernel time counts by its
        roofline's bound."""
        share = {"compute": 0.0, "memory": 0.0, "launch": self.launch_s}
        for o in self.ops:
            share["memory" if o.t_mem is not None and o.t_mem > o.t_math else "compute"] += o.t
        return max(share, key=lambda k: share[k])


def _row(name: str, op: Op, t: OpTime) -> OpRow:
    return OpRow(
        name, float(op.flops), float(op.bytes), t.t_math, t.t_mem, t.t, t.bound, float(op.kernels)
    )


def _launch(cm: CostModel, n: float) -> tuple[float, float]:
    return n, n * cm.device.launch_overhead_s


def train_step(cm: CostModel, vocab: int, batch: int, seq: int) -> OpRow:
    """One training step of ``batch`` windows of ``seq`` tokens, priced as ``c_train`` prices a
    training token without a training profile: ``train_flops_per_token(V) / peak`` per token
    (a calibrated profile's e_c read at the step's FLOPs).

    It assumes what ``c_train`` assumes: the step is compute-bound at the device's (efficiency-
    scaled) matmul peak; FLOPs are 6 (N_nv + V D) per token for the forward and backward
    matmuls plus 6 L T H Dh for attention (Kaplan et al. 2020, without the causal halving);
    the AdamW update, norms, softmax, the weights' and optimizer state's memory traffic and
    kernel launches cost nothing. No bytes are modelled (``bytes`` and ``t_mem`` are None).
    """
    flops = float(batch * seq) * cm.train_flops_per_token(float(vocab))
    t = flops / cm.compute_rate(flops, xp=PyMath)
    return OpRow("train", flops, None, t, None, t, "compute")


def predict(point: Point, device: DeviceProfile) -> Prediction:
    """The cost model's time for ``point`` on ``device`` (module docstring, per family)."""
    cm = CostModel(device, point.shape, settings_for(point))
    m, s = point.shape, cm.settings
    b = float(point.batch)
    per_layer = float(m.n_layers * s.launches_per_layer)
    if point.family == "train":
        row = train_step(cm, point.vocab, point.batch, point.context)
        return Prediction((row,), 0.0, 0.0, row.t)
    if point.family == "prefill":
        v, t = float(point.vocab), float(point.context)
        ops = cm.prefill_ops(v, b, t)
        rows = tuple(_row(k, op, cm.op_time(op, xp=PyMath)) for k, op in ops.items())
        n, launch_s = _launch(cm, per_layer + 2)  # CostModel.prefill_time's head ops
        total = cm.prefill_time(v, b, t, xp=PyMath)
        return Prediction(rows, n, launch_s, total)
    if point.family == "decode":
        v, t = float(point.vocab), float(point.context)
        ops = cm.decode_ops(v, b, t)
        times = cm.decode_times(v, b, t, xp=PyMath)
        rows = tuple(_row(k, ops[k], times[k]) for k in ops)
        head_ops = 1 if cm.measured_unembed is not None or s.fused_logits else 3
        n, launch_s = _launch(cm, per_layer + head_ops)  # as CostModel.decode_step charges
        return Prediction(rows, n, launch_s, cm.decode_step(v, b, t, xp=PyMath))
    # ops alone: the roofline of the matching decode op (V and T only where the op reads them)
    v = float(point.vocab or 1)
    t = float(point.context or 1)
    op = cm.decode_ops(v, b, t)[point.family]
    row = _row(point.family, op, cm.op_time(op, xp=PyMath))
    launches = {"backbone": per_layer, "attention": float(m.n_layers), "unembedding": 1.0}
    n, launch_s = _launch(cm, launches[point.family])
    return Prediction((row,), n, launch_s, row.t + launch_s)


def call_flops(point: Point, prediction: Prediction, decode_steps: int) -> float:
    """FLOPs of one timed call of ``point`` (the decode loop runs ``decode_steps`` steps)."""
    return prediction.flops * (decode_steps if point.family == "decode" else 1)
