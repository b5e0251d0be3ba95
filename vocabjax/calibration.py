"""Calibrating a device profile on measured times: the efficiency tables of ``validate --fit``.

The roofline prices an op at ``max(F / (P e_c), Y / (BW e_m))`` and a step at the sum of its ops
plus ``n`` launches of ``l`` seconds (costmodel.py). A datasheet profile has e_c = e_m = 1; real
kernels reach less on small ops (launch-bound, too few blocks to fill the device) and, on a CPU,
more than a large copy's bandwidth where the data stays in cache. The fit replaces the two
scalars with tables over the op's size:

    e_c(F) = interp(log F; knots, exp(u_c)),   e_m(Y) = interp(log Y; knots, exp(u_m))

with ``KNOTS`` knots each, log-spaced over the sizes the samples hold. Beside the tables it
fits:

- ``l``, the launch overhead per kernel;
- ``c``, the host cost of one call (``dispatch_overhead_s``): a point charged ``k`` calls pays
  ``k c``, a decode step of a loop of ``n`` steps per call ``c / n``;
- ``s_a`` and ``s_t``, scales of both rates for attention ops (a batched matrix-vector product
  with a mask and a softmax, which the GEMM tables do not describe) and for a training step
  priced by its FLOPs (backward and optimizer included).

Each of ``c``, ``s_a``, ``s_t`` is fitted only when some sample carries it (kernel timings, as
the GPU fits use, have no calls and no attention), else the profile's value stays. All are fitted
by least squares on the log of the step time (every point weighs alike whether it takes a
microsecond or a second), with a small penalty on the difference of neighbouring knots so that a
knot no op reaches follows its neighbours. The model priced with the fitted profile is the very
same ``CostModel.op_time`` (``EfficiencyTable.at`` is this interpolation), which a test checks.

Samples are split by a hash of their key: about a third are held out and never seen by the fit;
the errors before and after are reported on them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from vocabjax.errors import UserError
from vocabjax.hardware import MAX_FITTED_EFFICIENCY, OP_KINDS, DeviceProfile, EfficiencyTable
from vocabjax.xp import interp

KNOTS = 4  # per table; with two overheads and two kind scales 2 * KNOTS + 4 parameters
N_PARAMS = 2 * KNOTS + 4
MIN_FIT_SAMPLES = 16  # above N_PARAMS, so the fit is overdetermined
HELD_OUT = 1 / 3
SMOOTHNESS = 1e-2  # weight of the squared log-efficiency differences between neighbour knots
STEPS = 3000
LEARNING_RATE = 0.05
MIN_LAUNCH_S = 1e-9  # floor of the fitted launch and dispatch overheads
START_DISPATCH_S = 1e-5  # where the dispatch fit starts when the profile has none


@dataclasses.dataclass(frozen=True)
class Sample:
    """One measured point as the fit sees it: the work of each op it re-prices, the launches,
    the time of whatever it does not re-price (an autotuned kernel time), and the measurement."""

    key: str  # stable identity of the point (shape, family, V, B, T): decides the split
    family: str  # decode, prefill, train, backbone, attention, unembedding
    flops: tuple[float, ...]  # per op
    nbytes: tuple[float, ...]  # per op; 0 where the model prices no bytes (compute only)
    launches: float
    measured_s: float
    fixed_s: float = 0.0
    kernels: tuple[float, ...] = ()  # per op (Op.kernels): efficiency is read at one's size
    calls: float = 0.0  # host calls charged (a decode step: 1 / steps per call; kernels: 0)
    kinds: tuple[str, ...] = ()  # per op (Op.kind): "attention" and "train" get their own scale

    def __post_init__(self) -> None:
        if len(self.flops) != len(self.nbytes):
            raise ValueError("flops and nbytes need one entry per op")
        if not self.kernels:
            object.__setattr__(self, "kernels", (1.0,) * len(self.flops))
        if len(self.kernels) != len(self.flops):
            raise ValueError("kernels needs one entry per op")
        if not self.kinds:
            object.__setattr__(self, "kinds", ("matmul",) * len(self.flops))
        if len(self.kinds) != len(self.flops):
            raise ValueError("kinds needs one entry per op")
        if not (math.isfinite(self.measured_s) and self.measured_s > 0):
            raise UserError(f"point {self.key}: measured time {self.measured_s!r} must be > 0")


def is_held_out(key: str, fraction: float = HELD_OUT) -> bool:
    """Deterministic split by content: the same point is held out on every run and machine."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


@dataclasses.dataclass(frozen=True)
class Fit:
    """A fitted profile and how well it does."""

    profile: DeviceProfile
    fit_keys: tuple[str, ...]
    held_keys: tuple[str, ...]
    log_residual_sd: float  # spread of log(predicted / measured) on the fit split, after

    def summary(self) -> dict[str, Any]:
        return dict(self.profile.calibration or {})


def _knots(values: np.ndarray) -> np.ndarray:
    pos = values[values > 0]
    if pos.size == 0:
        return np.geomspace(1.0, 2.0, KNOTS)
    lo, hi = float(pos.min()), float(pos.max())
    if hi <= lo * 1.01:
        hi = lo * 2.0
    return np.geomspace(lo, hi, KNOTS)


def _pad(samples: Sequence[Sample]) -> tuple[np.ndarray, ...]:
    n_ops = max(len(s.flops) for s in samples)
    flops = np.zeros((len(samples), n_ops))
    nbytes = np.zeros((len(samples), n_ops))
    kernels = np.ones((len(samples), n_ops))
    kinds = np.zeros((len(samples), n_ops), np.int32)
    for i, s in enumerate(samples):
        flops[i, : len(s.flops)] = s.flops
        nbytes[i, : len(s.nbytes)] = s.nbytes
        kernels[i, : len(s.kernels)] = s.kernels
        kinds[i, : len(s.kinds)] = [OP_KINDS.index(k) + 1 if k in OP_KINDS else 0 for k in s.kinds]
    launches = np.array([s.launches for s in samples], float)
    calls = np.array([s.calls for s in samples], float)
    fixed = np.array([s.fixed_s for s in samples], float)
    measured = np.array([s.measured_s for s in samples], float)
    return flops, nbytes, kernels, kinds, launches, calls, fixed, measured


def _predict(params, arrays, *, peak, bandwidth, c_knots, m_knots):
    """Step times under ``params`` (u_c, u_m, u_k, u_l, u_d), as CostModel.op_time prices each
    op."""
    flops, nbytes, kernels, kinds, launches, calls, fixed = arrays
    one_f = jnp.log(jnp.maximum(flops / kernels, 1.0))  # one kernel's size, as Op.kernels says
    one_y = jnp.log(jnp.maximum(nbytes / kernels, 1.0))
    e_c = interp(one_f, c_knots, jnp.exp(params["u_c"]), xp=jnp)
    e_m = interp(one_y, m_knots, jnp.exp(params["u_m"]), xp=jnp)
    scale = jnp.concatenate([jnp.ones(1), jnp.exp(params["u_k"])])[kinds]
    t_ops = jnp.maximum(flops / (peak * e_c), nbytes / (bandwidth * e_m)) / scale
    overheads = launches * jnp.exp(params["u_l"]) + calls * jnp.exp(params["u_d"])
    return t_ops.sum(axis=1) + overheads + fixed


def fit_profile(
    device: DeviceProfile, samples: Sequence[Sample], *, dtype: str, source: str
) -> Fit:
    """Fit ``device``'s efficiency tables and overheads on the fit split of ``samples``
    (``dtype``: the peak the samples ran at). The returned profile carries the tables and a
    ``calibration`` record: the knots' provenance, the split, and the held-out errors before and
    after. Raises UserError when the fit split is smaller than ``MIN_FIT_SAMPLES``."""
    fit = [s for s in samples if not is_held_out(s.key)]
    held = [s for s in samples if is_held_out(s.key)]
    if len(fit) < MIN_FIT_SAMPLES:
        raise UserError(
            f"fitting {N_PARAMS} parameters needs at least {MIN_FIT_SAMPLES} points in the fit "
            f"split; {len(samples)} points gave {len(fit)} (a third are held out): use a larger "
            "grid"
        )
    if not held:
        raise UserError(f"none of the {len(samples)} points fell in the held-out split")
    peak, bandwidth = device.flops(dtype), device.hbm_bandwidth
    flops, nbytes, kernels, kinds, launches, calls, fixed, measured = _pad(fit)
    fits_dispatch = bool(np.any(calls > 0))
    fitted_kinds = [k for i, k in enumerate(OP_KINDS, 1) if np.any((kinds == i) & (flops > 0))]
    c_knots, m_knots = _knots(flops / kernels), _knots(nbytes / kernels)
    log_c, log_m = [math.log(k) for k in c_knots], [math.log(k) for k in m_knots]
    arrays = (
        *(jnp.asarray(a, jnp.float32) for a in (flops, nbytes, kernels)),
        jnp.asarray(kinds),
        *(jnp.asarray(a, jnp.float32) for a in (launches, calls, fixed)),
    )
    log_meas = jnp.log(jnp.asarray(measured, jnp.float32))
    predict = jax.tree_util.Partial(
        _predict, peak=peak, bandwidth=bandwidth, c_knots=log_c, m_knots=log_m
    )
    cap = math.log(MAX_FITTED_EFFICIENCY)

    def loss(params):
        resid = jnp.log(predict(params, arrays)) - log_meas
        smooth = jnp.sum(jnp.diff(params["u_c"]) ** 2) + jnp.sum(jnp.diff(params["u_m"]) ** 2)
        return jnp.mean(resid**2) + SMOOTHNESS * smooth

    opt = optax.adam(LEARNING_RATE)

    @jax.jit
    def run(params):
        def step(carry, _):
            params, state = carry
            grads = jax.grad(loss)(params)
            with jax.numpy_dtype_promotion("standard"):  # optax mixes its int32 step count
                updates, state = opt.update(grads, state, params)
            params = optax.apply_updates(params, updates)
            params = {
                "u_c": jnp.clip(params["u_c"], -20.0, cap),
                "u_m": jnp.clip(params["u_m"], -20.0, cap),
                "u_l": jnp.clip(params["u_l"], math.log(MIN_LAUNCH_S), 0.0),
                "u_d": jnp.clip(params["u_d"], math.log(MIN_LAUNCH_S), 0.0),
                "u_k": jnp.clip(params["u_k"], -20.0, cap),
            }
            return (params, state), None

        (params, _), _ = jax.lax.scan(step, (params, opt.init(params)), None, length=STEPS)
        return params

    start = {
        "u_c": jnp.full(KNOTS, math.log(device.compute_efficiency), jnp.float32),
        "u_m": jnp.full(KNOTS, math.log(device.memory_efficiency), jnp.float32),
        "u_l": jnp.float32(math.log(max(device.launch_overhead_s, MIN_LAUNCH_S))),
        "u_d": jnp.float32(math.log(device.dispatch_overhead_s or START_DISPATCH_S)),
        "u_k": jnp.log(jnp.asarray([device.kind_efficiency(k) for k in OP_KINDS], jnp.float32)),
    }
    params = jax.device_get(run(start))
    if not all(np.all(np.isfinite(v)) for v in params.values()):
        raise UserError("the fit did not converge (a parameter is not finite)")
    sd = float(np.std(np.log(np.asarray(predict(params, arrays))) - np.asarray(log_meas)))
    dispatch = float(np.exp(params["u_d"])) if fits_dispatch else device.dispatch_overhead_s
    scales = {
        f"{k}_efficiency": float(np.exp(u)) if k in fitted_kinds else device.kind_efficiency(k)
        for k, u in zip(OP_KINDS, params["u_k"], strict=True)
    }
    refitted = ["launch overhead"] + ["dispatch overhead"] * fits_dispatch
    refitted += [f"{k} efficiency" for k in fitted_kinds]
    profile = dataclasses.replace(
        device,
        **scales,
        launch_overhead_s=float(np.exp(params["u_l"])),
        dispatch_overhead_s=dispatch,
        compute_table=_table(c_knots, params["u_c"]),
        memory_table=_table(m_knots, params["u_m"]),
        source=f"{device.source}; calibrated: {source}",
        calibration={
            "source": source,
            "method": f"least squares on log step time, {KNOTS} log-spaced knots per table, "
            f"{', '.join(refitted)} refitted; "
            f"{len(fit)} points fitted, {len(held)} held out by a hash of each point's key",
            "base_launch_overhead_s": device.launch_overhead_s,
            **({"base_dispatch_overhead_s": device.dispatch_overhead_s} if fits_dispatch else {}),
            "fit_points": len(fit),
            "held_out_points": len(held),
            "log_residual_sd": sd,
        },
    )
    return Fit(
        profile=profile,
        fit_keys=tuple(s.key for s in fit),
        held_keys=tuple(s.key for s in held),
        log_residual_sd=sd,
    )


def _table(knots: np.ndarray, u: np.ndarray) -> EfficiencyTable:
    values = np.clip(np.exp(np.asarray(u, float)), 1e-9, MAX_FITTED_EFFICIENCY)
    return EfficiencyTable(tuple(float(k) for k in knots), tuple(float(v) for v in values))


def predict_samples(profile: DeviceProfile, samples: Sequence[Sample], *, dtype: str) -> np.ndarray:
    """Step times of ``samples`` under ``profile``'s tables (or scalars): the fit's own pricing,
    for tests and for re-pricing without a cost model."""
    flops, nbytes, kernels, kinds, launches, calls, fixed, _ = _pad(samples)
    peak, bandwidth = profile.flops(dtype), profile.hbm_bandwidth
    c, m = profile.compute_table, profile.memory_table
    e_c = c.at(flops / kernels, xp=np) if c else profile.compute_efficiency
    e_m = m.at(nbytes / kernels, xp=np) if m else profile.memory_efficiency
    scale = np.array([1.0, *(profile.kind_efficiency(k) for k in OP_KINDS)])[kinds]
    t_ops = np.maximum(flops / (peak * e_c), nbytes / (bandwidth * e_m)) / scale
    overheads = launches * profile.launch_overhead_s + calls * profile.dispatch_overhead_s
    return t_ops.sum(axis=1) + overheads + fixed
