"""Per-op roofline cost of decode, prefill and the training step, for one point.

Every op has FLOPs and bytes; its time is the roofline bound

    t_math = flops / (P * e_c),   t_mem = bytes / (BW * e_m),   t = max(t_math, t_mem)

with P, BW, e_c, e_m from the device profile. A step is the sum over its ops plus its kernel
launches times the launch overhead. A decode step's memory time is scaled where its bytes fit
the profile's cache and the step follows another of the same call
(``hardware.loop_memory_factor``: a calibrated CPU profile's; 1 for every other). The functions
take one (V, B, T) point and are written against an array namespace ``xp``: ``jax.numpy`` to be
vmapped over a grid (lifecycle.py), or ``PyMath`` to evaluate the very same formulas point by
point on Python floats.

Letters (DESIGN.md): V vocab, D d_model, L layers, F d_ff, H query heads, K kv heads, Dh head
dim, B batch, T context tokens, beta(V) bytes per token, w bytes per weight, k bytes per KV
element, N_nv non-embedding weights.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import jax.numpy as jnp

from vocabjax.compression import DEFAULT_CURVE, CompressionCurve
from vocabjax.errors import UserError
from vocabjax.hardware import BYTES_PER_ELEMENT, DeviceProfile, loop_memory_factor
from vocabjax.shapes import ModelShape
from vocabjax.trainprofile import TrainingProfile
from vocabjax.xp import interp

CostMode = Literal["full", "weights-only"]
COST_MODES: tuple[str, ...] = ("full", "weights-only")
AttentionKind = Literal["flash", "materialized"]
ATTENTION_KINDS: tuple[str, ...] = ("flash", "materialized")
LOGIT_BYTES = 4  # logits are written and read in f32
ELEMENTWISE_FLOPS = 4  # scale, subtract max, exp, accumulate: per logit when sampling


@dataclasses.dataclass(frozen=True)
class Settings:
    """How the model is served and trained (the CLI's cost options set the first fields)."""

    prompt_bytes: float = 4096.0  # S_in, bytes of prompt per sequence
    output_bytes: float = 1024.0  # S_out, bytes generated per sequence
    mode: CostMode = "full"  # "weights-only" drops attention and KV-cache terms
    weight_dtype: str = "bf16"  # w: storage of weights (and the dtype of the matmul peak)
    kv_dtype: str = "bf16"  # k: storage of the KV cache
    act_dtype: str = "bf16"  # storage of activations between ops
    # unembedding + sampling fused, and training's cross-entropy: the logits never hit memory
    fused_logits: bool = False
    include_prefill: bool = False  # charge each sequence's prompt prefill to its output bytes
    launches_per_layer: int = 8  # kernel launches per layer per step (norms, matmuls, attention)
    train_seq_tokens: int = 2048  # training context length, tokens
    train_batch_tokens: int = 2**20  # tokens per optimizer step (a 1M-token batch)
    steps_per_call: int = 1  # decode steps per host call (an on-device loop runs several)
    # "flash": fused attention (serving engines on GPUs): causal FLOPs, K/V read once, scores
    # never in memory. "materialized": the einsums of vocabjax's own model: every query against
    # every cache position, masked, with the f32 scores written and read (SCORE_PASSES).
    attention: AttentionKind = "flash"

    def __post_init__(self) -> None:
        if self.mode not in COST_MODES:
            raise UserError(f"cost model {self.mode!r} must be one of {', '.join(COST_MODES)}")
        for name in ("prompt_bytes", "output_bytes"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value)):
                raise UserError(f"{name} must be a finite number, got {value!r}")
        if self.prompt_bytes < 0:
            raise UserError(f"prompt_bytes must be >= 0, got {self.prompt_bytes}")
        if self.output_bytes <= 0:
            raise UserError(f"output_bytes must be > 0, got {self.output_bytes}")
        for name in ("weight_dtype", "kv_dtype", "act_dtype"):
            if getattr(self, name) not in BYTES_PER_ELEMENT:
                raise UserError(
                    f"{name} {getattr(self, name)!r} is not one of {', '.join(BYTES_PER_ELEMENT)}"
                )
        if self.train_seq_tokens <= 0 or self.train_batch_tokens <= 0:
            raise UserError("train_seq_tokens and train_batch_tokens must be > 0")
        if self.launches_per_layer < 0:
            raise UserError("launches_per_layer must be >= 0")
        if self.steps_per_call < 1:
            raise UserError(f"steps_per_call must be >= 1, got {self.steps_per_call}")
        if self.attention not in ATTENTION_KINDS:
            raise UserError(
                f"attention {self.attention!r} must be one of {', '.join(ATTENTION_KINDS)}"
            )

    @property
    def full(self) -> bool:
        return self.mode == "full"


class Op(NamedTuple):
    """Work of one op: FLOPs and bytes moved to or from device memory, done by ``kernels``
    kernels of equal size (a calibrated efficiency is read at one kernel's size). A ``kind``
    other than "matmul" (``hardware.OP_KINDS``: "attention", "train", "elementwise",
    "optimizer", "sampling") runs at the profile's efficiency for that kind beside the tables
    (its kernels are not the GEMMs the tables describe; "sampling" is the pick of a token from
    the logits, an index-carrying reduction). ``row_bytes``: for a matmul of one activation row (a
    matrix-vector product), the bytes of one weight row it streams, which a calibrated
    profile's one-row table reads; 0 for anything else."""

    flops: object
    bytes: object
    kernels: float = 1.0
    kind: str = "matmul"
    row_bytes: object = 0.0


MATMULS_PER_LAYER = 4  # QKV, attention output, MLP in (up and gate fused), MLP out
ELEMENTWISE_PER_LAYER = 5  # two RMSNorms, the MLP's activation, two residual adds
# f32 passes over a materialized score matrix: the QK^T einsum writes it, the softmax reads it
# for its max and for its sum and writes the probabilities, the PV einsum reads those
SCORE_PASSES = 5
# AdamW's pass over one parameter, all f32: the backward writes its gradient; the update reads
# the weight, the gradient and both moments and writes the weight and both moments: 8 x 4 bytes.
OPTIMIZER_BYTES_PER_PARAM = 32.0
# the forward, the backward to the activations and the backward to the weights: each a pass
# over every matmul's weights and activations
TRAIN_PASSES = 3.0
# the cross-entropy's f32 passes over the logits: the head's matmul writes them, the loss reads
# them, its backward reads them again and writes their gradient, which the head's two backward
# matmuls (to the hidden states, to the weights) each read
LOSS_PASSES = 6.0
PREFILL_HEAD_OPS = 2  # launches of the prefill's head: the last token's logits and their max
# the families of priced time that ``CostModel.scaled`` can stretch one by one: the ops of
# decode, prefill and the training step by name, and "overhead" for kernel launches and host calls
OP_FAMILIES: tuple[str, ...] = (
    "embedding", "backbone", "elementwise", "attention", "unembedding", "sampling", "train",
    "train_elementwise", "loss", "train_attention", "optimizer", "overhead",
)  # fmt: skip


class OpTime(NamedTuple):
    t_math: object  # seconds if compute-bound
    t_mem: object  # seconds if memory-bound
    t: object  # the roofline lower bound max(t_math, t_mem), or a measured time
    measured: bool = False  # t comes from an autotuned kernel table

    @property
    def bound(self) -> str:
        if self.measured:
            return "measured"
        return "compute" if self.t_math >= self.t_mem else "memory"


def op_seconds(t_math, t_mem, overlap, *, xp):
    """An op's time from its compute and memory times: the longer, plus the part of the shorter
    that the device does not overlap with it (``DeviceProfile.overlap``; 1: the roofline's
    max)."""
    return xp.maximum(t_math, t_mem) + (1.0 - overlap) * xp.minimum(t_math, t_mem)


def _passes(op: Op, kind: str) -> Op:
    """``op`` done ``TRAIN_PASSES`` times (a training step's forward and backward), as ``kind``."""
    return Op(TRAIN_PASSES * op.flops, TRAIN_PASSES * op.bytes, TRAIN_PASSES * op.kernels, kind)


def arithmetic_intensity(op: Op) -> float:
    """FLOP per byte of an op (compare with ``DeviceProfile.ridge_point``)."""
    return op.flops / op.bytes if op.bytes else math.inf


@dataclasses.dataclass(frozen=True)
class MeasuredUnembed:
    """Decode unembedding + argmax times from an autotuned profile, on a full (V, B) grid.

    Interpolated linearly in (log V, log B, log t), continued along the end segments outside the
    measured grid, and scaled by D / d_model for another model width (time is linear in D).
    """

    d_model: int
    log_vocab: tuple[float, ...]
    log_batch: tuple[float, ...]
    log_time: tuple[tuple[float, ...], ...]  # [batch][vocab]

    @classmethod
    def from_profile(
        cls, device: DeviceProfile, d_model: int, dtype: str
    ) -> MeasuredUnembed | None:
        rows = device.best_rows("greedy", dtype)
        if not rows:
            return None
        d_meas = min({r.d_model for r in rows}, key=lambda d: (abs(math.log(d / d_model)), d))
        rows = [r for r in rows if r.d_model == d_meas]
        vocab = sorted({r.vocab for r in rows})
        batch = sorted({r.batch for r in rows})
        times = {(r.vocab, r.batch): r.time_s for r in rows}
        if len(times) != len(vocab) * len(batch):
            raise UserError(
                f"device {device.name!r}: measured 'greedy' times at d_model={d_meas} do not form "
                f"a full V x B grid ({len(times)} of {len(vocab) * len(batch)} points)"
            )
        return cls(
            d_model=d_meas,
            log_vocab=tuple(math.log(v) for v in vocab),
            log_batch=tuple(math.log(b) for b in batch),
            log_time=tuple(tuple(math.log(times[v, b]) for v in vocab) for b in batch),
        )

    def time(self, vocab, batch, d_model: int, *, xp):
        lv, lb = xp.log(vocab), xp.log(batch)
        per_b = [interp(lv, self.log_vocab, col, xp=xp, extrapolate=True) for col in self.log_time]
        log_t = interp(lb, self.log_batch, _stack(per_b, xp), xp=xp, extrapolate=True)
        return xp.exp(log_t) * (d_model / self.d_model)


def _stack(values, xp):
    return values if xp is not jnp else jnp.stack(values)


class CostModel:
    """The roofline of one model shape on one device, with one compression curve."""

    def __init__(
        self,
        device: DeviceProfile,
        shape: ModelShape,
        settings: Settings | None = None,
        compression: CompressionCurve = DEFAULT_CURVE,
        training: TrainingProfile | None = None,
    ) -> None:
        self.device = device
        self.shape = shape
        self.settings = settings or Settings()
        self.compression = compression
        self.training = training if training is not None and training.tokens_per_s else None
        s = self.settings
        self.w = float(BYTES_PER_ELEMENT[s.weight_dtype])
        self.k = float(BYTES_PER_ELEMENT[s.kv_dtype])
        self.a = float(BYTES_PER_ELEMENT[s.act_dtype])
        self.measured_unembed = MeasuredUnembed.from_profile(device, shape.d_model, s.weight_dtype)
        self.op_scale: Mapping[str, Any] = {}  # family -> time multiplier (see ``scaled``)
        self.prompt_bytes: Any = s.prompt_bytes  # S_in and S_out: the settings', or a traffic
        self.output_bytes: Any = s.output_bytes  # class's own (``with_io``), maybe traced

    def scaled(self, scales: Mapping[str, Any]) -> CostModel:
        """This model with the time of each family in ``scales`` (``OP_FAMILIES``) multiplied
        by its value; values may be traced arrays, so an ensemble of perturbed models is one
        ``vmap`` over the multipliers (lifecycle's ``v_star_share``)."""
        unknown = set(scales) - set(OP_FAMILIES)
        if unknown:
            raise ValueError(f"unknown op families {sorted(unknown)}; known: {OP_FAMILIES}")
        out = copy.copy(self)
        out.op_scale = {**self.op_scale, **scales}
        return out

    def with_io(self, prompt_bytes, output_bytes) -> CostModel:
        """This model serving sequences of ``prompt_bytes`` in and ``output_bytes`` out (S_in,
        S_out) instead of the settings'; values may be traced arrays, so the traffic classes of
        a plan are one ``vmap`` (planning's ``_plan_grid``). Not checked: the caller's are."""
        out = copy.copy(self)
        out.prompt_bytes, out.output_bytes = prompt_bytes, output_bytes
        return out

    def _times(self, times: Mapping[str, OpTime]) -> dict[str, OpTime]:
        """``times`` with each family's ``op_scale`` applied."""
        out = {}
        for name, t in times.items():
            k = self.op_scale.get(name)
            out[name] = t if k is None else OpTime(t.t_math * k, t.t_mem * k, t.t * k, t.measured)
        return out

    def _overhead(self, seconds):
        return seconds * self.op_scale.get("overhead", 1.0)

    # ---- per-op work -------------------------------------------------------------------------
    @property
    def _act_width(self) -> float:
        """Activation elements read + written per token per layer by the layer's matmuls."""
        m = self.shape
        f_widths = (3 if m.glu else 2) * m.d_ff
        return float(4 * m.d_model + 2 * (m.n_heads + m.n_kv_heads) * m.dh + f_widths)

    @property
    def _elementwise_width(self) -> float:
        """Activation elements read + written per token per layer by the elementwise kernels:
        each RMSNorm reads and writes D, each residual add reads 2 D and writes D, the MLP's
        activation reads its input(s) and writes F."""
        m = self.shape
        return float(10 * m.d_model + (3 if m.glu else 2) * m.d_ff)

    def _layers(self, tokens) -> dict[str, Op]:
        """The backbone's matmuls and its elementwise kernels over ``tokens`` tokens (rows)."""
        m = self.shape
        n_nv, d, L = float(m.n_nonembedding), float(m.d_model), float(m.n_layers)
        return {
            "backbone": Op(
                2.0 * tokens * n_nv,
                self.w * n_nv + tokens * L * self._act_width * self.a,
                L * MATMULS_PER_LAYER,
                row_bytes=self._one_row(tokens),
            ),
            "elementwise": Op(
                ELEMENTWISE_FLOPS * tokens * L * d,
                tokens * L * self._elementwise_width * self.a,
                L * ELEMENTWISE_PER_LAYER,
                "elementwise",
            ),
        }

    def _one_row(self, rows):
        """``Op.row_bytes`` of a matmul over ``rows`` activation rows contracting over D: one
        weight row's bytes when it is a matrix-vector product (one row), else 0."""
        one_row = 0.5 * ((2.0 - rows) + abs(2.0 - rows))  # 1 at one row, 0 from two on
        return self.w * float(self.shape.d_model) * one_row

    def _attention(self, batch, queries, keys, *, causal: bool) -> Op:
        """``batch`` x ``queries`` queries over ``keys`` cached positions in every layer (see
        ``Settings.attention``); ``causal``: the queries are the keys (a prompt), so a fused
        kernel skips the masked half."""
        m = self.shape
        L, hd = float(m.n_layers), float(m.n_heads * m.dh)
        kv = batch * keys * float(2 * m.n_kv_heads * m.dh) * self.k * L
        pairs = batch * queries * keys
        if self.settings.attention == "materialized":
            scores = SCORE_PASSES * pairs * float(m.n_heads) * LOGIT_BYTES * L
            return Op(4.0 * pairs * hd * L, kv + scores, L, "attention")
        return Op((2.0 if causal else 4.0) * pairs * hd * L, kv, L, "attention")

    def decode_ops(self, vocab, batch, context) -> dict[str, Op]:
        """One decode step: ``batch`` sequences each attending over ``context`` cached tokens."""
        s = self.settings
        d = float(self.shape.d_model)
        logits = 0.0 if s.fused_logits else batch * vocab * LOGIT_BYTES
        ops = {
            "embedding": Op(0.0 * batch, batch * d * self.w),
            **self._layers(batch),
            "unembedding": Op(
                2.0 * batch * vocab * d,
                self.w * vocab * d + logits,
                row_bytes=self._one_row(batch),
            ),
            "sampling": Op(ELEMENTWISE_FLOPS * batch * vocab, logits, kind="sampling"),
        }
        if s.full:
            ops["attention"] = self._attention(batch, 1.0, context, causal=False)
        return ops

    def prefill_ops(self, vocab, batch, prompt_tokens) -> dict[str, Op]:
        """The prompt pass: all prompt tokens through the backbone, logits for the last only."""
        d = float(self.shape.d_model)
        tokens = batch * prompt_tokens
        ops = {
            "embedding": Op(0.0 * tokens, tokens * d * self.w),
            **self._layers(tokens),
            "unembedding": Op(
                2.0 * batch * vocab * d,
                self.w * vocab * d + batch * vocab * LOGIT_BYTES,
                row_bytes=self._one_row(batch),
            ),
            # the first token picked from the last position's logits
            "sampling": Op(
                ELEMENTWISE_FLOPS * batch * vocab, batch * vocab * LOGIT_BYTES, kind="sampling"
            ),
        }
        if self.settings.full:
            # the prompt's K/V written to the cache once, then attended over causally
            ops["attention"] = self._attention(batch, prompt_tokens, prompt_tokens, causal=True)
        return ops

    def compute_rate(self, flops, intensity, *, xp=jnp):
        """Achieved FLOP/s of one kernel of ``flops`` at ``intensity`` FLOP/byte: the peak
        times e_c, or a calibrated profile's e_c(flops, intensity)."""
        peak = self.device.flops(self.settings.weight_dtype)
        return peak * self.device.compute_fraction(flops, intensity, xp=xp)

    def memory_rate(self, nbytes, *, xp=jnp, row_bytes=0.0):
        """Achieved bytes/s of one kernel moving ``nbytes``: bandwidth times e_m (or e_m(bytes),
        and a one-row matmul's e_m(row bytes))."""
        fraction = self.device.memory_fraction(nbytes, xp=xp, row_bytes=row_bytes)
        return self.device.hbm_bandwidth * fraction

    def op_time(self, op: Op, *, xp=jnp, memory_factor=1.0) -> OpTime:
        """The op's roofline time; ``memory_factor`` scales its memory time (a decode loop's
        cached share, ``hardware.loop_memory_factor``)."""
        scale = self.device.kind_efficiency(op.kind)
        # an op priced by its FLOPs alone has no intensity: 1 byte keeps it past every knot
        intensity = op.flops / xp.maximum(op.bytes, 1.0)
        t_math = op.flops / (self.compute_rate(op.flops / op.kernels, intensity, xp=xp) * scale)
        rate = self.memory_rate(op.bytes / op.kernels, xp=xp, row_bytes=op.row_bytes)
        t_mem = op.bytes / (rate * scale) * memory_factor
        return OpTime(t_math, t_mem, op_seconds(t_math, t_mem, self.device.overlap, xp=xp))

    def _launches(self, n_head_ops: int, calls: float):
        """Launch overhead of a step with ``n_head_ops`` head kernels, plus ``calls`` host
        calls' dispatch overhead."""
        launches = (self.shape.n_layers * self.settings.launches_per_layer + n_head_ops) * (
            self.device.launch_overhead_s
        )
        return self._overhead(launches + calls * self.device.dispatch_overhead_s)

    def decode_times(self, vocab, batch, context, *, xp=jnp) -> dict[str, OpTime]:
        """Per-op times of one decode step; the measured kernel table replaces the roofline of
        unembedding + sampling when the device profile has one."""
        ops = self.decode_ops(vocab, batch, context)
        # the steps of a call after its first find what fits the cache there (a profile's
        # cache_bytes; 1 without one)
        warm = 1.0 - 1.0 / self.settings.steps_per_call
        working = sum(op.bytes for op in ops.values())
        factor = loop_memory_factor(self.device, working, warm, xp=xp)
        times = {name: self.op_time(op, xp=xp, memory_factor=factor) for name, op in ops.items()}
        if self.measured_unembed is not None:
            t = self.measured_unembed.time(vocab, batch, self.shape.d_model, xp=xp)
            u = times["unembedding"]
            times["unembedding"] = OpTime(u.t_math, u.t_mem, t, measured=True)
            times["sampling"] = OpTime(0.0 * t, 0.0 * t, 0.0 * t, measured=True)
        return self._times(times)

    def decode_head_ops(self) -> int:
        """Kernel launches of a decode step's head: one fused or measured kernel, else the
        unembedding matmul, the logits' reduction and the sampling."""
        return 1 if self.measured_unembed is not None or self.settings.fused_logits else 3

    def decode_step(self, vocab, batch, context, *, xp=jnp):
        """Seconds for one decode step: ops + launches + its share of one host call."""
        times = self.decode_times(vocab, batch, context, xp=xp)
        overhead = self._launches(self.decode_head_ops(), 1.0 / self.settings.steps_per_call)
        return sum(t.t for t in times.values()) + overhead

    def score_ops(self, vocab, tokens) -> dict[str, Op]:
        """Scoring ``tokens`` prompt positions at head ``vocab`` (each prompt's teacher-forced
        nats, which serving's quality controller reads): every position's logits, then their
        log-sum-exp and the label's logit, a pass over the logits priced as the sampling pass."""
        d = float(self.shape.d_model)
        logits = tokens * vocab * LOGIT_BYTES
        return {
            "unembedding": Op(2.0 * tokens * vocab * d, self.w * vocab * d + logits),
            "sampling": Op(ELEMENTWISE_FLOPS * tokens * vocab, logits, kind="sampling"),
        }

    def host_call(self, kernels=0.0, calls=1.0):
        """Seconds of ``calls`` host calls that launch ``kernels`` kernels in all, beside their
        ops' own time: the profile's dispatch and launch overheads."""
        return self._overhead(
            kernels * self.device.launch_overhead_s + calls * self.device.dispatch_overhead_s
        )

    def prefill_time(self, vocab, batch, prompt_tokens, *, xp=jnp):
        """Seconds for the prompt pass: ops + launches + one host call."""
        ops = self.prefill_ops(vocab, batch, prompt_tokens)
        times = self._times({name: self.op_time(op, xp=xp) for name, op in ops.items()})
        return sum(t.t for t in times.values()) + self._launches(PREFILL_HEAD_OPS, 1.0)

    # ---- per-byte costs ---------------------------------------------------------------------
    def beta(self, vocab, *, xp=jnp):
        """Bytes per token at ``vocab``."""
        return self.compression.beta(vocab, xp=xp)

    def mean_context(self, vocab, *, xp=jnp):
        """Mean context over a generation: T runs from S_in/beta to (S_in + S_out)/beta, and a
        step's time is linear in T, so the mean step is the step at the midpoint."""
        return (self.prompt_bytes + 0.5 * self.output_bytes) / self.beta(vocab, xp=xp)

    def c_infer(self, vocab, batch, *, xp=jnp):
        """Seconds per served byte at batch ``batch``: mean decode step / (B beta(V)), plus the
        prompt prefill spread over the output bytes when ``include_prefill``."""
        beta = self.beta(vocab, xp=xp)
        cost = self.decode_step(vocab, batch, self.mean_context(vocab, xp=xp), xp=xp) / (
            batch * beta
        )
        if self.settings.include_prefill:  # none to charge for an empty prompt
            prompt = self.prompt_bytes
            prefill = self.prefill_time(vocab, batch, prompt / beta, xp=xp)
            cost = cost + xp.where(prompt > 0, prefill / (batch * self.output_bytes), 0.0)
        return cost

    def train_flops_per_token(self, vocab):
        """6 (N_nv + V D), plus 6 L T H Dh for attention in full mode (Kaplan et al. 2020)."""
        m = self.shape
        flops = 6.0 * (float(m.n_nonembedding) + vocab * float(m.d_model))
        if self.settings.full:
            flops = flops + 6.0 * float(
                m.n_layers * self.settings.train_seq_tokens * m.n_heads * m.dh
            )
        return flops

    def train_ops(self, vocab, tokens) -> dict[str, Op]:
        """One optimizer step over ``tokens`` tokens in windows of ``train_seq_tokens``:

        - train: the matmuls' forward and backward, 6 (N_nv + V D) FLOPs per token and
          ``TRAIN_PASSES`` passes over their weights and activations, the head's included;
        - train_attention (full mode): each window attending over itself, ``TRAIN_PASSES``
          times the prompt pass's attention (``Settings.attention``), at the attention rate;
        - train_elementwise: the layers' norms, activations and residual adds, forward and
          backward (``TRAIN_PASSES`` times the prompt pass's);
        - loss: the cross-entropy's ``LOSS_PASSES`` passes over the tokens x V f32 logits
          (none with ``fused_logits``: a fused cross-entropy keeps them on chip);
        - optimizer: AdamW's pass over every parameter (memory only,
          ``OPTIMIZER_BYTES_PER_PARAM`` bytes each).

        Every op but the attention and the optimizer runs at the profile's training scale
        (kind "train"): the backward's kernels are not the forward GEMMs the tables describe."""
        m = self.shape
        d, L = float(m.d_model), float(m.n_layers)
        params = float(m.n_nonembedding) + 2.0 * vocab * d
        matmuls = (
            self.w * (float(m.n_nonembedding) + vocab * d)
            + tokens * (L * self._act_width + 2.0 * d) * self.a
        )
        ops = {
            "train": Op(
                tokens * 6.0 * (float(m.n_nonembedding) + vocab * d),
                TRAIN_PASSES * matmuls,
                TRAIN_PASSES * (L * MATMULS_PER_LAYER + 1.0),
                "train",
            ),
            "train_elementwise": _passes(self._layers(tokens)["elementwise"], "train"),
            "loss": Op(
                ELEMENTWISE_FLOPS * tokens * vocab,
                0.0 if self.settings.fused_logits else LOSS_PASSES * tokens * vocab * LOGIT_BYTES,
                LOSS_PASSES,
                "train",
            ),
            "optimizer": Op(0.0 * vocab, OPTIMIZER_BYTES_PER_PARAM * params, kind="optimizer"),
        }
        if self.settings.full:
            seq = float(self.settings.train_seq_tokens)
            window = self._attention(tokens / seq, seq, seq, causal=True)
            ops["train_attention"] = _passes(window, "attention")
        return ops

    def train_step(self, vocab, tokens, *, xp=jnp):
        """Seconds for one optimizer step over ``tokens`` tokens: its ops plus one host call."""
        ops = self.train_ops(vocab, tokens)
        times = self._times({name: self.op_time(op, xp=xp) for name, op in ops.items()})
        return sum(t.t for t in times.values()) + self._overhead(self.device.dispatch_overhead_s)

    def c_train(self, vocab, *, xp=jnp):
        """Seconds per training byte: measured s/token when a training profile has it, else one
        optimizer step of ``train_batch_tokens`` (``train_step``) over its tokens; divided by
        beta(V)."""
        if self.training is not None:
            t_token = self.training.seconds_per_token(vocab, xp=xp)
        else:
            tokens = float(self.settings.train_batch_tokens)
            t_token = self.train_step(vocab, tokens, xp=xp) / tokens
        return t_token / self.beta(vocab, xp=xp)

    # ---- memory ------------------------------------------------------------------------------
    def kv_bytes_per_seq(self, vocab, *, xp=jnp):
        """((S_in + S_out) / beta) 2 L K Dh k."""
        tokens = (self.prompt_bytes + self.output_bytes) / self.beta(vocab, xp=xp)
        return tokens * float(self.shape.kv_elements_per_token) * self.k

    def weight_bytes(self, vocab):
        """w (N_nv + 2 V D): backbone, embedding table and (untied) head."""
        return self.w * (float(self.shape.n_nonembedding) + 2.0 * vocab * float(self.shape.d_model))

    def b_max(self, vocab, *, xp=jnp):
        """Largest batch whose KV cache fits beside the weights (0 if the weights do not fit)."""
        free = self.device.memory_bytes - self.weight_bytes(vocab)
        return xp.maximum(xp.floor(free / self.kv_bytes_per_seq(vocab, xp=xp)), 0.0)

    # ---- reporting ---------------------------------------------------------------------------
    def breakdown(self, vocab: int, batch: int) -> list[dict]:
        """Per-op rows (t_math, t_mem, t, bound, arithmetic intensity) of the mean decode step,
        evaluated in plain Python for display."""
        from vocabjax.xp import PyMath

        context = self.mean_context(float(vocab), xp=PyMath)
        ops = self.decode_ops(float(vocab), float(batch), context)
        times = self.decode_times(float(vocab), float(batch), context, xp=PyMath)
        rows = []
        for name, t in times.items():
            op = ops[name]
            rows.append(
                {
                    "op": name,
                    "flops": op.flops,
                    "bytes": op.bytes,
                    "intensity": arithmetic_intensity(op),
                    "t_math": t.t_math,
                    "t_mem": t.t_mem,
                    "t": t.t,
                    "bound": t.bound,
                }
            )
        return rows
