"""Calibrating a device profile on measured times: the efficiency tables of ``validate --fit``.

The roofline prices an op at ``max(F / (P e_c), Y / (BW e_m))`` and a step at the sum of its ops
plus ``n`` launches of ``l`` seconds (costmodel.py). A datasheet profile has e_c = e_m = 1; real
kernels reach less: a matrix-vector product (a decode step's matmuls at batch 1) uses a sliver of
the device's arithmetic, small kernels leave it idle, and on a CPU an op whose data stays in
cache streams faster than a large copy. The fit replaces the two scalars with tables:

    e_c(I) = interp(log I; knots, exp(u_i)),   e_m(Y) = interp(log Y; knots, exp(u_m))

over one kernel's arithmetic intensity I (FLOP per byte moved: what separates a 16-row decode
GEMM from a 1024-row prefill GEMM of the same FLOPs) and the bytes Y it moves, with ``KNOTS``
knots each, log-spaced over what the samples hold (``FIT_TABLES``), and where the samples
hold matrix-vector products (an op's ``row_bytes`` > 0: a matmul over one activation row, the
decode step's at B = 1) a factor on their e_m by the bytes of one weight row,
``e_r(row_bytes)`` (``ONE_ROW_TABLE``: XLA's CPU matrix-vector emitter streams a 4 KiB row
twice as fast as a 512-byte one, benchmarks/xla_cpu_dot.py). Beside the tables it fits:

- ``o``, the overlap of each op's compute and memory time (``DeviceProfile.overlap``): the op
  takes the longer plus ``1 - o`` of the shorter (``costmodel.op_seconds``; 1 is the
  roofline's max, 0 one after the other, as XLA's CPU matmuls run);
- ``l``, the launch overhead per kernel;
- ``c``, the host cost of one call (``dispatch_overhead_s``): a point charged ``k`` calls pays
  ``k c``, a decode step of a loop of ``n`` steps per call ``c / n``;
- the cache of a decode loop's steps (``DeviceProfile.cache_bytes``, ``cached_time``): a step
  after the first of a call re-reads the bytes the step before read, and where they fit the
  cache (``hardware.loop_memory_factor``: a logistic in the log of the step's bytes about
  ``cache_bytes``) they cost ``cached_time`` of their time from memory. ``cached_time`` is
  fitted; ``cache_bytes`` is picked from ``CACHE_SIZES`` by the fit's loss, one fit per size
  (vmapped: the loss has no useful gradient in the size far from it). Only samples charged a
  share of a host call (``0 < calls < 1``: a step of an on-device loop) carry it;
- the rate at which a call first touches memory mapped afresh for it
  (``DeviceProfile.fresh_bandwidth``: its page faults), over the bytes a sample says it maps
  (``Sample.fresh_bytes``; on a CPU, XLA's temporaries of 32 MiB or more); fitted only where
  some sample maps any;
- one scale of both rates per op kind (``hardware.OP_KINDS``): attention (a batched
  matrix-vector product with a mask and a softmax, which the GEMM tables do not describe), the
  forward and backward of a training step, elementwise kernels (norms, activations,
  residual adds), the optimizer's pass, and the pick of a token from the logits (an argmax:
  an index-carrying reduction, which XLA's CPU backend runs at about a tenth of a plain read).

Each of ``c`` and the kind scales is fitted only when some sample carries it (kernel timings,
as the GPU fits use, have no calls and no attention), else the profile's value stays. All are
fitted by least squares on the log of the step time (every point weighs alike whether it takes
a microsecond or a second), with a small penalty on the difference of neighbouring knots so that
a knot no op reaches follows its neighbours. ``price`` is the one pricing of a sample, used by
the fit (on trial tables) and by ``predict_samples`` (on a profile); it reads the efficiencies
through ``hardware.fractions``, as ``CostModel.op_time`` does, which a test checks.

Samples are split by a hash of their key: about a third are held out and never seen by the fit;
the errors before and after are reported on them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from vocabjax.costmodel import op_seconds
from vocabjax.errors import UserError
from vocabjax.hardware import (
    MAX_FITTED_EFFICIENCY,
    OP_KINDS,
    TABLE_FIELDS,
    DeviceProfile,
    EfficiencyTable,
    fractions,
    loop_memory_factor,
)

KNOTS = 4  # per table
# the tables the fit makes (DeviceProfile fields): e_c by a kernel's arithmetic intensity, which
# tells a matrix-vector product from a GEMM of many rows at equal FLOPs, and e_m by its bytes
FIT_TABLES: tuple[str, ...] = ("intensity_table", "memory_table")
# and, where the samples hold matrix-vector products (Op.row_bytes > 0), e_m of those by the
# bytes of one weight row (XLA's CPU emitter streams long rows faster than short ones)
ONE_ROW_TABLE = "row_table"
# + launch, dispatch, overlap, the cache's cached time, the fresh memory's rate, kinds
N_PARAMS = (len(FIT_TABLES) + 1) * KNOTS + 5 + len(OP_KINDS)
MIN_FIT_SAMPLES = N_PARAMS + 4  # so the fit is overdetermined
HELD_OUT = 1 / 3
SMOOTHNESS = 1e-2  # weight of the squared log-efficiency differences between neighbour knots
ONE_ROW_PRIOR = 1e-3  # weight of the one-row table's squared log values (its pull towards 1)
STEPS = 3000
LEARNING_RATE = 0.05
MIN_LAUNCH_S = 1e-9  # floor of the fitted launch and dispatch overheads
START_DISPATCH_S = 1e-5  # where the dispatch fit starts when the profile has none
OVERLAP_EDGE = 0.02  # the fit of the overlap starts inside (0, 1), where its gradient lives
# the cache sizes a decode loop's fit tries: 2 to 64 MiB in steps of sqrt(2) (a CPU's last-level
# cache, of which a step's weights and cache compete with everything else the process touches)
CACHE_SIZES = tuple(2.0 ** (20 + i / 2) for i in range(2, 13))
START_CACHED_TIME = 0.5  # where the fit of the cached time starts
START_FRESH_BANDWIDTH = 5e9  # bytes/s of freshly mapped memory where its fit starts (~1 us a page)


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
    row_bytes: tuple[float, ...] = ()  # per op (Op.row_bytes): > 0 for a matrix-vector product
    # the bytes one step reads (the cache's working set; by default its ops' bytes, where a
    # sample leaves out ops priced by a kernel table the step still reads)
    working_bytes: float | None = None
    # memory the measured call maps afresh, per measured unit (a decode step: its share of the
    # loop's call); touching it costs its page faults (``DeviceProfile.fresh_bandwidth``)
    fresh_bytes: float = 0.0
    # what decides the split where several points are one configuration (a decode loop timed
    # at several lengths): they are fitted or held out together. "" : the key
    group: str = ""

    @property
    def split_key(self) -> str:
        return self.group or self.key

    def __post_init__(self) -> None:
        if self.working_bytes is None:
            object.__setattr__(self, "working_bytes", float(sum(self.nbytes)))
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
        if not self.row_bytes:
            object.__setattr__(self, "row_bytes", (0.0,) * len(self.flops))
        if len(self.row_bytes) != len(self.flops):
            raise ValueError("row_bytes needs one entry per op")
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


def _knots(values: np.ndarray) -> tuple[float, ...]:
    pos = values[np.isfinite(values) & (values > 0)]
    if pos.size == 0:
        return tuple(np.geomspace(1.0, 2.0, KNOTS))
    lo, hi = float(pos.min()), float(pos.max())
    if hi <= lo * 1.01:
        hi = lo * 2.0
    return tuple(float(k) for k in np.geomspace(lo, hi, KNOTS))


class _Ops(NamedTuple):
    """The samples as padded arrays, one row per sample and one column per op (padding ops
    do no work); ``kinds`` indexes ``("matmul", *OP_KINDS)``."""

    flops: np.ndarray
    nbytes: np.ndarray
    kernels: np.ndarray
    kinds: np.ndarray
    launches: np.ndarray
    calls: np.ndarray
    fixed: np.ndarray
    row_bytes: np.ndarray
    working: np.ndarray  # per sample: the bytes one step reads
    fresh: np.ndarray  # per sample: the bytes its call maps afresh, per measured unit

    @property
    def intensity(self) -> np.ndarray:
        """FLOP per byte of each op, as ``CostModel.op_time`` reads it."""
        return self.flops / np.maximum(self.nbytes, 1.0)

    def warm(self, xp):
        """Per sample, the share of its steps that follow a step of the same call: ``1 -
        calls`` for a step of an on-device loop (``0 < calls < 1``), else 0 (as
        ``CostModel.decode_times`` reads ``steps_per_call``)."""
        loop = (self.calls > 0) & (self.calls < 1)
        return xp.where(loop, 1.0 - self.calls, 0.0)


def _pad(samples: Sequence[Sample]) -> _Ops:
    n_ops = max(len(s.flops) for s in samples)
    flops = np.zeros((len(samples), n_ops))
    nbytes = np.zeros((len(samples), n_ops))
    kernels = np.ones((len(samples), n_ops))
    kinds = np.zeros((len(samples), n_ops), np.int32)
    row_bytes = np.zeros((len(samples), n_ops))
    for i, s in enumerate(samples):
        row_bytes[i, : len(s.row_bytes)] = s.row_bytes
        flops[i, : len(s.flops)] = s.flops
        nbytes[i, : len(s.nbytes)] = s.nbytes
        kernels[i, : len(s.kernels)] = s.kernels
        kinds[i, : len(s.kinds)] = [OP_KINDS.index(k) + 1 if k in OP_KINDS else 0 for k in s.kinds]
    return _Ops(
        flops, nbytes, kernels, kinds,
        *(np.array([getattr(s, f) for s in samples], float) for f in ("launches", "calls",
                                                                        "fixed_s")),
        row_bytes,
        np.array([s.working_bytes for s in samples], float),
        np.array([s.fresh_bytes for s in samples], float),
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Trial:
    """The fields ``hardware.fractions`` reads, holding the fit's trial tables (traced)."""

    compute_table: EfficiencyTable | None = None
    intensity_table: EfficiencyTable | None = None
    memory_table: EfficiencyTable | None = None
    row_table: EfficiencyTable | None = None
    compute_efficiency: float = 1.0
    memory_efficiency: float = 1.0
    overlap: Any = 1.0
    cache_bytes: Any = 0.0
    cached_time: Any = 1.0


def price(tables, kind_scale, launch_s, dispatch_s, ops: _Ops, *, peak, bandwidth, xp, fresh_s=0.0):
    """Seconds of each sample, as ``CostModel.op_time`` prices each op: ``max(F / (P e_c),
    Y / (BW e_m))`` over its kind's scale (``kind_scale[kinds]``), e_c and e_m read at one
    kernel's size from ``tables`` (``hardware.fractions``), the memory time of a decode loop's
    step scaled by the cache (``hardware.loop_memory_factor``); plus its launches, host calls,
    its fresh memory at ``fresh_s`` seconds a byte, and its fixed time."""
    a = jax.tree.map(xp.asarray, ops) if xp is jnp else ops
    intensity = a.flops / xp.maximum(a.nbytes, 1.0)
    e_c, e_m = fractions(
        tables, a.flops / a.kernels, intensity, a.nbytes / a.kernels, xp=xp, row_bytes=a.row_bytes
    )
    cached = loop_memory_factor(tables, a.working, a.warm(xp), xp=xp)
    t_math = a.flops / (peak * e_c)
    t_mem = a.nbytes / (bandwidth * e_m) * xp.asarray(cached)[..., None]
    t_ops = op_seconds(t_math, t_mem, tables.overlap, xp=xp) / xp.asarray(kind_scale)[a.kinds]
    overheads = a.launches * launch_s + a.calls * dispatch_s + a.fresh * fresh_s
    return t_ops.sum(axis=1) + overheads + a.fixed


def _profile_scales(profile: DeviceProfile) -> np.ndarray:
    return np.array([1.0, *(profile.kind_efficiency(k) for k in OP_KINDS)])


def fit_profile(
    device: DeviceProfile, samples: Sequence[Sample], *, dtype: str, source: str
) -> Fit:
    """Fit ``device``'s efficiency tables and overheads on the fit split of ``samples``
    (``dtype``: the peak the samples ran at). The returned profile carries the tables and a
    ``calibration`` record: the knots' provenance, the split, and the held-out errors before and
    after. Raises UserError when the fit split is smaller than ``MIN_FIT_SAMPLES``."""
    fit, held = _split(samples)
    problem = _Problem.of(device, fit, dtype)
    sizes = CACHE_SIZES if problem.fits_cache else (device.cache_bytes or CACHE_SIZES[0],)
    fits = jax.device_get(_minimize(problem.loss, [_start(device, problem.tables, c)
                                                   for c in sizes]))  # fmt: skip
    params = min(fits, key=lambda p: float(problem.loss(p)))
    if not all(np.all(np.isfinite(v)) for v in params.values()):
        raise UserError("the fit did not converge (a parameter is not finite)")
    sd = problem.residual_sd(params)
    record = {"source": source, "fit_points": len(fit), "held_out_points": len(held),
              "log_residual_sd": sd}  # fmt: skip
    return Fit(
        profile=problem.profile(params, record),
        fit_keys=tuple(s.key for s in fit),
        held_keys=tuple(s.key for s in held),
        log_residual_sd=sd,
    )


def _split(samples: Sequence[Sample]) -> tuple[list[Sample], list[Sample]]:
    """(fit, held out) by ``is_held_out``; a UserError when either is too small to fit on."""
    fit = [s for s in samples if not is_held_out(s.split_key)]
    held = [s for s in samples if is_held_out(s.split_key)]
    if len(fit) < MIN_FIT_SAMPLES:
        raise UserError(
            f"fitting {N_PARAMS} parameters needs at least {MIN_FIT_SAMPLES} points in the fit "
            f"split; {len(samples)} points gave {len(fit)} (a third are held out): use a larger "
            "grid"
        )
    if not held:
        raise UserError(f"none of the {len(samples)} points fell in the held-out split")
    return fit, held


@dataclasses.dataclass(frozen=True)
class _Problem:
    """The fit split as arrays, the tables' knots, and which terms its samples carry."""

    device: DeviceProfile
    ops: _Ops  # as jnp arrays
    log_measured: jax.Array
    knots: dict[str, tuple[float, ...]]  # DeviceProfile table field -> its knots
    peak: float
    bandwidth: float
    fits_dispatch: bool  # some sample is charged a host call
    fits_cache: bool  # some sample is a step of an on-device loop (it reads what fits the cache)
    fits_fresh: bool  # some sample maps memory afresh
    fitted_kinds: tuple[str, ...]  # the op kinds some sample holds
    tables: tuple[str, ...]  # the tables fitted: FIT_TABLES, and the one-row table if any

    @classmethod
    def of(cls, device: DeviceProfile, fit: Sequence[Sample], dtype: str) -> _Problem:
        ops = _pad(fit)
        works = (ops.flops > 0) | (ops.nbytes > 0)
        return cls(
            device=device,
            ops=_Ops(
                *(jnp.asarray(a, jnp.int32 if a.dtype.kind == "i" else jnp.float32) for a in ops)
            ),  # fmt: skip
            log_measured=jnp.log(jnp.asarray([s.measured_s for s in fit], jnp.float32)),
            knots={
                "compute_table": _knots(ops.flops / ops.kernels),
                "intensity_table": _knots(np.where(ops.nbytes > 0, ops.intensity, np.nan)),
                "memory_table": _knots(ops.nbytes / ops.kernels),
                ONE_ROW_TABLE: _knots(np.where(ops.row_bytes > 0, ops.row_bytes, np.nan)),
            },
            peak=device.flops(dtype),
            bandwidth=device.hbm_bandwidth,
            fits_dispatch=bool(np.any(ops.calls > 0)),
            fits_cache=bool(np.any((ops.warm(np) > 0) & (ops.working > 0))),
            fits_fresh=bool(np.any(ops.fresh > 0)),
            fitted_kinds=tuple(
                k for i, k in enumerate(OP_KINDS, 1) if np.any((ops.kinds == i) & works)
            ),
            tables=FIT_TABLES + ((ONE_ROW_TABLE,) if np.any(ops.row_bytes > 0) else ()),
        )

    def predict(self, params):
        trial = _Trial(
            **{f: EfficiencyTable(self.knots[f], jnp.exp(params[f])) for f in self.tables},
            overlap=jax.nn.sigmoid(params["overlap"]),
            **(
                {"cache_bytes": jnp.exp(params["cache"]),
                 "cached_time": jax.nn.sigmoid(params["cached"])}
                if self.fits_cache else {}
            ),
        )  # fmt: skip
        scales = jnp.concatenate([jnp.ones(1), jnp.exp(params["kinds"])])
        launch, dispatch = jnp.exp(params["launch"]), jnp.exp(params["dispatch"])
        fresh = jnp.exp(params["fresh"])
        return price(trial, scales, launch, dispatch, self.ops, peak=self.peak,
                     bandwidth=self.bandwidth, xp=jnp, fresh_s=fresh)  # fmt: skip

    def loss(self, params):
        resid = jnp.log(self.predict(params)) - self.log_measured
        smooth = sum(jnp.sum(jnp.diff(params[f]) ** 2) for f in self.tables)
        # the one-row table is a factor on e_m: held at 1 unless the one-row points ask for
        # more, so that it does not stand in for the other terms (the scales, the memory table)
        prior = jnp.sum(params[ONE_ROW_TABLE] ** 2) if ONE_ROW_TABLE in self.tables else 0.0
        return jnp.mean(resid**2) + SMOOTHNESS * smooth + ONE_ROW_PRIOR * prior

    def residual_sd(self, params) -> float:
        resid = np.log(np.asarray(self.predict(params))) - np.asarray(self.log_measured)
        return float(np.std(resid))

    def profile(self, params, record: dict[str, Any]) -> DeviceProfile:
        """``device`` with the fitted parameters; terms no sample carries keep its values."""
        device = self.device
        scales = {
            f"{k}_efficiency": float(np.exp(u)) if k in self.fitted_kinds
            else device.kind_efficiency(k)
            for k, u in zip(OP_KINDS, params["kinds"], strict=True)
        }  # fmt: skip
        refitted = ["launch overhead"] + ["dispatch overhead"] * self.fits_dispatch
        refitted += ["the cache's size and cached time"] * self.fits_cache
        refitted += ["the fresh memory's rate"] * self.fits_fresh
        cache = {"cache_bytes": device.cache_bytes, "cached_time": device.cached_time}
        if self.fits_cache:
            cache = {"cache_bytes": float(np.exp(params["cache"])),
                     "cached_time": float(jax.nn.sigmoid(params["cached"]))}  # fmt: skip
        refitted += [f"{k} efficiency" for k in self.fitted_kinds]
        base = {"base_launch_overhead_s": device.launch_overhead_s}
        if self.fits_dispatch:
            base["base_dispatch_overhead_s"] = device.dispatch_overhead_s
        method = (
            f"least squares on log step time; {KNOTS} log-spaced knots per table "
            f"({', '.join(TABLE_FIELDS[f] for f in self.tables)}); {', '.join(refitted)} "
            f"refitted; {record['fit_points']} points fitted, {record['held_out_points']} held "
            "out by a hash of each point's key"
        )
        return dataclasses.replace(
            device,
            **scales,
            **{f: _table(self.knots[f], params[f]) for f in self.tables},
            overlap=float(jax.nn.sigmoid(params["overlap"])),
            **cache,
            fresh_bandwidth=float(np.exp(-params["fresh"]))
            if self.fits_fresh
            else device.fresh_bandwidth,
            launch_overhead_s=float(np.exp(params["launch"])),
            dispatch_overhead_s=float(np.exp(params["dispatch"]))
            if self.fits_dispatch
            else device.dispatch_overhead_s,  # fmt: skip
            source=f"{device.source}; calibrated: {record['source']}",
            calibration={
                "source": record["source"],
                "method": method,
                **base,
                **{k: v for k, v in record.items() if k != "source"},
            },  # fmt: skip
        )


def _start(device: DeviceProfile, tables: Sequence[str], cache_bytes: float) -> dict[str, Any]:
    """The fit's first guess: the profile's own scalars and overheads, and a cache of
    ``cache_bytes`` (held there: ``FROZEN``) at ``START_CACHED_TIME``."""
    first = {
        "compute_table": 0.0,
        "intensity_table": math.log(device.compute_efficiency),
        "memory_table": math.log(device.memory_efficiency),
        ONE_ROW_TABLE: 0.0,
    }
    return {
        **{f: jnp.full(KNOTS, first[f], jnp.float32) for f in tables},
        "launch": jnp.float32(math.log(max(device.launch_overhead_s, MIN_LAUNCH_S))),
        "dispatch": jnp.float32(math.log(device.dispatch_overhead_s or START_DISPATCH_S)),
        "kinds": jnp.log(jnp.asarray([device.kind_efficiency(k) for k in OP_KINDS], jnp.float32)),
        "overlap": jnp.float32(_logit(device.overlap)),
        "cache": jnp.float32(math.log(cache_bytes)),
        "cached": jnp.float32(_logit(START_CACHED_TIME)),
        "fresh": jnp.float32(-math.log(device.fresh_bandwidth or START_FRESH_BANDWIDTH)),
    }


def _logit(p: float) -> float:
    p = min(max(p, OVERLAP_EDGE), 1.0 - OVERLAP_EDGE)
    return math.log(p / (1.0 - p))


FROZEN = ("cache",)  # parameters the fit holds at their start: the cache's size (a scan, above)


def _minimize(loss, starts: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``STEPS`` Adam steps on ``loss`` from each of ``starts`` (one jitted scan, vmapped over
    the starts), each parameter kept in its range (log efficiencies up to
    ``MAX_FITTED_EFFICIENCY``, overheads up to 1 s) and the ``FROZEN`` ones where they start."""
    opt = optax.adam(LEARNING_RATE)
    cap = math.log(MAX_FITTED_EFFICIENCY)
    lows = {"launch": math.log(MIN_LAUNCH_S), "dispatch": math.log(MIN_LAUNCH_S), "overlap": -20.0,
            "cache": 0.0, "fresh": -60.0}  # fmt: skip
    highs = {"launch": 0.0, "dispatch": 0.0, "overlap": 20.0, "cached": 20.0, "cache": 60.0,
             "fresh": 0.0}  # fmt: skip

    @jax.jit
    @jax.vmap
    def run(params):
        def step(carry, _):
            params, state = carry
            grads = jax.grad(loss)(params)
            grads = {k: jnp.zeros_like(g) if k in FROZEN else g for k, g in grads.items()}
            with jax.numpy_dtype_promotion("standard"):  # optax mixes its int32 step count
                updates, state = opt.update(grads, state, params)
            params = optax.apply_updates(params, updates)
            params = {k: jnp.clip(v, lows.get(k, -20.0), highs.get(k, cap))
                      for k, v in params.items()}  # fmt: skip
            return (params, state), None

        (params, _), _ = jax.lax.scan(step, (params, opt.init(params)), None, length=STEPS)
        return params

    stacked = run(jax.tree.map(lambda *xs: jnp.stack(xs), *starts))
    return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(len(starts))]


def _table(knots: Sequence[float], u: np.ndarray) -> EfficiencyTable:
    values = np.clip(np.exp(np.asarray(u, float)), 1e-9, MAX_FITTED_EFFICIENCY)
    return EfficiencyTable(tuple(knots), tuple(float(v) for v in values))


def predict_samples(profile: DeviceProfile, samples: Sequence[Sample], *, dtype: str) -> np.ndarray:
    """Step times of ``samples`` under ``profile`` (``price`` with its tables or scalars): the
    fit's own pricing, for tests and for re-pricing without a cost model."""
    return price(
        profile, _profile_scales(profile), profile.launch_overhead_s, profile.dispatch_overhead_s,
        _pad(samples), peak=profile.flops(dtype), bandwidth=profile.hbm_bandwidth, xp=np,
        fresh_s=profile.fresh_s_per_byte,
    )  # fmt: skip
