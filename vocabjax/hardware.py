"""Device profiles: the roofline ceilings of an accelerator and, after ``autotune``, its measured
unembedding kernel times.

A builtin profile is a datasheet: every number below carries its source. ``autotune`` writes a
measured profile in the same schema (``ceilings``, ``kernels``, ``best``); ``load_device`` reads
either a builtin name or such a JSON file.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from vocabjax.errors import UserError
from vocabjax.outputs import atomic_write_json
from vocabjax.profiles import (
    SCHEMA,
    VOCAB_MAX,
    a_list,
    an_object,
    boolean,
    check_profile,
    closed,
    field_name,
    integer,
    load_json,
    one_of,
    positive_number,
    require,
    text,
)
from vocabjax.xp import interp

Dtype = Literal["bf16", "f32"]
DTYPES: tuple[str, ...] = ("bf16", "f32")
BYTES_PER_ELEMENT: Mapping[str, int] = {"bf16": 2, "f32": 4, "fp8": 1}

TFLOPS = 1e12
GBPS = 1e9
GB = 1e9
GIB = 1024**3


KERNEL_IMPLS: tuple[str, ...] = ("xla", "chunked", "pallas")
_DIM_MAX = 2**31 - 1  # batch rows and d_model enter jax shapes as int32


def _blocks(value: Any, *, where: str) -> dict[str, int]:
    """A kernel row's tile sizes: names to positive integers (``tiled``, which Pallas decode
    kernel the row ran, 0 or 1). Which names a tile class takes is checked where the class is
    built (``vocabjax.unembed``)."""
    blocks = an_object(value, where=where)
    return {
        str(k): integer(
            v,
            where=f"{where}.{field_name(k)}",
            minimum=0 if k == "tiled" else 1,
            maximum=1 if k == "tiled" else _DIM_MAX,
        )
        for k, v in blocks.items()
    }


# A fitted efficiency may pass 1 where an op's data stays in a CPU's caches: the ceiling is the
# bandwidth of a copy larger than every cache. 64 leaves room for that and refuses nonsense.
MAX_FITTED_EFFICIENCY = 64.0
MAX_KNOTS = 64


@dataclasses.dataclass(frozen=True)
class EfficiencyTable:
    """Achieved over peak as a function of an op's size: piecewise linear in log(size) through
    the knots ``(size, efficiency)``, held at the end values outside them. ``sizes`` are FLOPs
    (a compute table) or bytes (a memory table), increasing; written by ``validate --fit``."""

    sizes: tuple[float, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if not 1 <= len(self.sizes) == len(self.values) <= MAX_KNOTS:
            raise UserError(f"an efficiency table needs 1..{MAX_KNOTS} (size, efficiency) knots")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:], strict=False)):
            raise UserError("an efficiency table's sizes must increase")

    def at(self, size, *, xp):
        """The efficiency at ``size`` (Python float or traced array)."""
        log_sizes = [math.log(x) for x in self.sizes]
        return interp(xp.log(xp.maximum(size, 1.0)), log_sizes, list(self.values), xp=xp)

    def to_json(self) -> list[list[float]]:
        return [[s, v] for s, v in zip(self.sizes, self.values, strict=True)]

    @classmethod
    def from_json(cls, value: Any, *, where: str) -> EfficiencyTable:
        rows = a_list(value, where=where, nonempty=True)
        if len(rows) > MAX_KNOTS:
            raise UserError(f"{where} has {len(rows)} knots; at most {MAX_KNOTS}")
        sizes, values = [], []
        for i, row in enumerate(rows):
            at = f"{where}[{i}]"
            pair = a_list(row, where=at)
            if len(pair) != 2:
                raise UserError(f"{at} must be [size, efficiency], got {len(pair)} items")
            sizes.append(positive_number(pair[0], where=f"{at} size"))
            values.append(
                positive_number(pair[1], where=f"{at} efficiency", maximum=MAX_FITTED_EFFICIENCY)
            )
        if any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
            raise UserError(f"{where}: sizes must increase")
        return cls(tuple(sizes), tuple(values))


def fractions(tables, flops, intensity, nbytes, *, xp, row_bytes=0.0):
    """(e_c, e_m) of one kernel of ``flops`` FLOPs moving ``nbytes`` at ``intensity`` FLOP per
    byte, read from ``tables`` (a DeviceProfile, or anything with its table and scalar fields,
    such as the calibration's trial tables): e_c is the product of the compute tables it has
    (by FLOPs, by intensity), else its scalar ``compute_efficiency``; e_m its memory table,
    else ``memory_efficiency``, times its one-row table at ``row_bytes`` for a matrix-vector
    product (``row_bytes`` > 0: the bytes of one weight row it streams; 0 for anything else)."""
    e_c = tables.compute_efficiency
    if tables.compute_table is not None or tables.intensity_table is not None:
        e_c = 1.0
        if tables.compute_table is not None:
            e_c = e_c * tables.compute_table.at(flops, xp=xp)
        if tables.intensity_table is not None:
            e_c = e_c * tables.intensity_table.at(intensity, xp=xp)
    e_m = tables.memory_efficiency
    if tables.memory_table is not None:
        e_m = tables.memory_table.at(nbytes, xp=xp)
    if tables.row_table is not None:
        one_row = tables.row_table.at(xp.maximum(row_bytes, 1.0), xp=xp)
        e_m = e_m * xp.where(row_bytes > 0, one_row, 1.0)
    return e_c, e_m


# The width of the cache's edge, in natural log of a step's bytes: a step reads about a third of
# its bytes from cache at 1.65x the cache's size, two thirds at 1 / 1.65x (cached_share).
CACHE_EDGE = 0.5


def cached_share(working_bytes, cache_bytes, *, xp):
    """The share of a decode step's bytes that a step after the first of a call finds in a
    cache of ``cache_bytes`` (a profile's ``cache_bytes``): 1 well under its size, 0 well over
    it, a logistic in log bytes between (``CACHE_EDGE``)."""
    z = (xp.log(xp.maximum(working_bytes, 1.0)) - xp.log(cache_bytes)) / CACHE_EDGE
    return 1.0 / (1.0 + xp.exp(xp.clip(z, -50.0, 50.0)))


def loop_memory_factor(tables, working_bytes, warm, *, xp):
    """The factor on a decode step's memory time from the cache (``tables``: a DeviceProfile or
    the calibration's trial tables): ``1 - warm * share * (1 - cached_time)``, where ``warm`` is
    the share of the steps that follow another step of the same call (the on-device loop's
    steps re-read the same weights and cache; the first of a call starts cold) and ``share``
    the step's ``working_bytes`` that fit ``cache_bytes`` (``cached_share``). 1 for a profile
    with no cache (``cache_bytes`` 0: datasheet and GPU profiles)."""
    size = tables.cache_bytes
    if isinstance(size, int | float) and size <= 0:
        return 1.0
    share = cached_share(working_bytes, size, xp=xp)
    return 1.0 - warm * share * (1.0 - tables.cached_time)


@dataclasses.dataclass(frozen=True)
class KernelTiming:
    """One measured (or selected) unembedding kernel at one shape."""

    op: str  # public op name, e.g. "greedy", "logsumexp", "linear_cross_entropy"
    vocab: int  # V, rows of the unembedding matrix
    batch: int  # B, rows of h
    d_model: int  # D, the shared inner dimension
    dtype: str  # weight dtype, "bf16" or "f32"
    impl: str  # "xla", "chunked" or "pallas"
    blocks: Mapping[str, int]  # tile sizes the implementation ran with ({} when it has none)
    time_s: float  # median wall time of one call, seconds
    roofline_fraction: float  # roofline floor time / measured time, in (0, 1] when sound

    @classmethod
    def from_json(cls, row: Any, *, where: str) -> KernelTiming:
        row = an_object(row, where=where)
        closed(row, KERNEL_FIELDS, where=where)
        require(row, ("op", "vocab", "batch", "d_model", "dtype", "impl", "time_s"), where=where)
        return cls(
            op=text(row["op"], where=f"{where}.op", empty=False),
            vocab=integer(row["vocab"], where=f"{where}.vocab", maximum=VOCAB_MAX),
            batch=integer(row["batch"], where=f"{where}.batch", maximum=_DIM_MAX),
            d_model=integer(row["d_model"], where=f"{where}.d_model", maximum=_DIM_MAX),
            dtype=one_of(row["dtype"], DTYPES, where=f"{where}.dtype"),
            impl=one_of(row["impl"], KERNEL_IMPLS, where=f"{where}.impl"),
            blocks=_blocks(row.get("blocks", {}), where=f"{where}.blocks"),
            time_s=positive_number(row["time_s"], where=f"{where}.time_s"),
            roofline_fraction=positive_number(
                row.get("roofline_fraction", 0.0),
                where=f"{where}.roofline_fraction",
                allow_zero=True,
            ),
        )

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "blocks": dict(self.blocks)}


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Roofline ceilings of one device, and what autotune measured on it."""

    name: str  # short name used in tables ("a100-80gb", or the autotuned device's kind)
    peak_flops: Mapping[str, float]  # dense FLOP/s per dtype ("bf16", "f32")
    hbm_bandwidth: float  # bytes/s of device memory
    memory_bytes: float  # device memory capacity, bytes
    launch_overhead_s: float  # fixed cost of one kernel launch, seconds
    source: str  # where the numbers come from (datasheet, paper, or "autotune ...")
    compute_efficiency: float = 1.0  # e_c: achieved / peak FLOP/s for large matmuls
    memory_efficiency: float = 1.0  # e_m: achieved / peak bandwidth for large copies
    kernels: tuple[KernelTiming, ...] = ()  # every candidate autotune timed
    best: tuple[KernelTiming, ...] = ()  # the fastest candidate per (op, vocab, batch, d, dtype)
    measured: bool = False  # True for a profile written by autotune
    # Fitted by ``validate --fit``: efficiency by op size, replacing the scalar e_c / e_m above,
    # and how the fit was made (points, split, errors before and after, residual spread). With
    # both compute tables, e_c is their product (``compute_fraction``).
    compute_table: EfficiencyTable | None = None  # e_c by one kernel's FLOPs
    memory_table: EfficiencyTable | None = None  # e_m by one kernel's bytes
    intensity_table: EfficiencyTable | None = None  # e_c by a kernel's FLOP per byte moved
    # e_m of a one-row matmul (a matrix-vector product: decode at B = 1) by the bytes of one
    # weight row, times e_m above: XLA's CPU matrix-vector emitter streams long rows faster
    # (benchmarks/xla_cpu_dot.py: 17 GB/s at D = 128, 34 at D = 1024, the same 32 MiB)
    row_table: EfficiencyTable | None = None
    calibration: Mapping[str, Any] | None = None
    # Host cost of one call of a compiled program (argument handling, output allocation, the
    # wait for its results), charged once per call rather than per kernel: the decode loop of a
    # serving engine pays it once per call of however many steps. 0: not modelled (datasheet
    # profiles, and GPU fits on kernel timings, which never include it).
    dispatch_overhead_s: float = 0.0
    # Fitted multipliers of the rates above for work the tables do not describe: attention
    # kernels (a batched matrix-vector product with a mask and a softmax, not a GEMM), the
    # forward and backward of a training step, elementwise kernels (norms, activations,
    # residual adds: no reuse at all), the optimizer's update over every parameter, and the
    # pick of a token from the B x V logits (an argmax or a sample: a reduction with an index,
    # which XLA's CPU backend runs at about a tenth of the rate of a plain max, docs/validation.md).
    # 1: priced like a matmul.
    attention_efficiency: float = 1.0
    train_efficiency: float = 1.0
    elementwise_efficiency: float = 1.0
    optimizer_efficiency: float = 1.0
    sampling_efficiency: float = 1.0
    # The share of the shorter of an op's compute and memory times that runs under the longer:
    # 1 is the roofline's max(t_math, t_mem) (perfect overlap), 0 runs one after the other.
    overlap: float = 1.0
    # A decode loop's steps after the first of a call re-read the weights and cache the step
    # before read: where those bytes fit a cache of ``cache_bytes``, they cost ``cached_time``
    # of their time from memory (``loop_memory_factor``). Fitted by ``validate --fit`` on a CPU
    # (its last-level cache); 0: no cache modelled (datasheet and GPU profiles).
    cache_bytes: float = 0.0
    cached_time: float = 1.0
    # Bytes/s at which a call first touches memory mapped afresh for it (its page faults): on a
    # CPU, XLA's temporaries of 32 MiB or more are mapped anew on every call
    # (``validation.timing.fresh_bytes``). Fitted by ``validate --fit`` where the points carry
    # such bytes; 0: not modelled.
    fresh_bandwidth: float = 0.0

    def __post_init__(self) -> None:
        if not self.peak_flops:
            raise UserError(f"device {self.name!r}: peak_flops needs at least one dtype")
        for dtype, value in self.peak_flops.items():
            positive_number(value, where=f"device {self.name!r} peak_flops[{dtype}]")
        positive_number(self.hbm_bandwidth, where=f"device {self.name!r} hbm_bandwidth")
        positive_number(self.memory_bytes, where=f"device {self.name!r} memory_bytes")
        positive_number(
            self.launch_overhead_s, where=f"device {self.name!r} launch_overhead_s", allow_zero=True
        )
        positive_number(
            self.dispatch_overhead_s,
            where=f"device {self.name!r} dispatch_overhead_s",
            allow_zero=True,
        )
        for field in ("compute_efficiency", "memory_efficiency"):
            value = positive_number(getattr(self, field), where=f"device {self.name!r} {field}")
            if value > 1.0:
                raise UserError(f"device {self.name!r} {field} must be <= 1, got {value}")
        if not 0.0 <= self.overlap <= 1.0:
            raise UserError(f"device {self.name!r} overlap must be in [0, 1], got {self.overlap}")
        positive_number(
            self.cache_bytes, where=f"device {self.name!r} cache_bytes", allow_zero=True
        )
        positive_number(self.cached_time, where=f"device {self.name!r} cached_time", maximum=1.0)
        positive_number(
            self.fresh_bandwidth, where=f"device {self.name!r} fresh_bandwidth", allow_zero=True
        )
        for field in KIND_FIELDS:
            positive_number(
                getattr(self, field),
                where=f"device {self.name!r} {field}",
                maximum=MAX_FITTED_EFFICIENCY,
            )
        if self.calibration is not None and "log_residual_sd" in self.calibration:
            positive_number(
                self.calibration["log_residual_sd"],
                where=f"device {self.name!r} calibration.log_residual_sd",
                allow_zero=True,
            )

    @property
    def residual_sd(self) -> float | None:
        """The calibration's spread of log(predicted / measured) on its fit points (what the
        V* ensemble draws from), or None for a profile that was never calibrated."""
        if self.calibration is None or "log_residual_sd" not in self.calibration:
            return None
        return float(self.calibration["log_residual_sd"])

    @property
    def fresh_s_per_byte(self) -> float:
        """Seconds per byte of memory a call maps afresh (0 where not modelled)."""
        return 1.0 / self.fresh_bandwidth if self.fresh_bandwidth > 0 else 0.0

    def compute_fraction(self, flops, intensity, *, xp):
        """e_c of one kernel of ``flops`` FLOPs at ``intensity`` FLOP/byte (``fractions``)."""
        return fractions(self, flops, intensity, 1.0, xp=xp)[0]

    def memory_fraction(self, nbytes, *, xp, row_bytes=0.0):
        """e_m of one kernel moving ``nbytes`` (``fractions``; ``row_bytes``: a one-row
        matmul's weight row)."""
        return fractions(self, 1.0, 1.0, nbytes, xp=xp, row_bytes=row_bytes)[1]

    def kind_efficiency(self, kind: str) -> float:
        """The multiplier of the rates for an op of ``kind`` (costmodel.Op.kind)."""
        return float(getattr(self, f"{kind}_efficiency")) if kind in OP_KINDS else 1.0

    def flops(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s for ``dtype`` (bf16 falls back to f32 on devices without it)."""
        if dtype in self.peak_flops:
            return float(self.peak_flops[dtype])
        if dtype == "bf16" and "f32" in self.peak_flops:
            return float(self.peak_flops["f32"])
        raise UserError(f"device {self.name!r} has no peak FLOP/s for dtype {dtype!r}")

    def ridge_point(self, dtype: str = "bf16") -> float:
        """FLOP per byte at which a kernel turns from memory-bound to compute-bound."""
        return self.flops(dtype) / self.hbm_bandwidth

    def best_rows(self, op: str, dtype: str) -> tuple[KernelTiming, ...]:
        return tuple(r for r in self.best if r.op == op and r.dtype == dtype)

    # --- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "kind": "device",
            "name": self.name,
            "source": self.source,
            "measured": self.measured,
            "memory_bytes": self.memory_bytes,
            "ceilings": {
                "hbm_bandwidth": self.hbm_bandwidth,
                "peak_flops": dict(self.peak_flops),
                "ridge_point": {d: self.ridge_point(d) for d in self.peak_flops},
                "launch_overhead_s": self.launch_overhead_s,
                "dispatch_overhead_s": self.dispatch_overhead_s,
                **({"fresh_bandwidth": self.fresh_bandwidth} if self.fresh_bandwidth > 0 else {}),
            },
            "efficiency": {
                "compute": self.compute_efficiency,
                "memory": self.memory_efficiency,
                "overlap": self.overlap,
                **(
                    {"cache_bytes": self.cache_bytes, "cached_time": self.cached_time}
                    if self.cache_bytes > 0
                    else {}
                ),
                **{kind: self.kind_efficiency(kind) for kind in OP_KINDS},
                **{
                    key: getattr(self, field).to_json()
                    for field, key in TABLE_FIELDS.items()
                    if getattr(self, field) is not None
                },
            },
            **({"calibration": dict(self.calibration)} if self.calibration is not None else {}),
            "kernels": [k.to_json() for k in self.kernels],
            "best": [k.to_json() for k in self.best],
        }

    @property
    def calibrated(self) -> bool:
        """Fitted by ``validate --fit`` (an anchor alone scales a profile, fits nothing)."""
        return bool(set(self.calibration or {}) - {"anchor"})

    @classmethod
    def from_json(cls, data: Any, *, where: str = "device profile") -> DeviceProfile:
        data = check_profile(data, "device", where=where)
        closed(data, DEVICE_FIELDS, where=where)
        require(data, ("name", "ceilings", "memory_bytes"), where=where)
        ceilings = an_object(data["ceilings"], where=f"{where}: ceilings")
        # ridge_point is derived (peak / bandwidth) and written for readers; it is not read back.
        closed(ceilings, CEILING_FIELDS, where=f"{where}: ceilings")
        require(
            ceilings,
            ("hbm_bandwidth", "peak_flops", "launch_overhead_s"),
            where=f"{where}: ceilings",
        )
        peak = ceilings["peak_flops"]
        if not isinstance(peak, Mapping):  # a single number: the profile's one dtype
            peak = {one_of(data.get("dtype", "bf16"), DTYPES, where=f"{where}: dtype"): peak}
        if not peak:
            raise UserError(f"{where}: ceilings.peak_flops needs at least one dtype")
        peak = {
            str(k): positive_number(v, where=f"{where}: ceilings.peak_flops.{field_name(k)}")
            for k, v in peak.items()
        }
        efficiency = efficiency_fields(data.get("efficiency", {}), where=f"{where}: efficiency")
        calibration = None
        if "calibration" in data:
            calibration = dict(an_object(data["calibration"], where=f"{where}: calibration"))
        rows = {}
        for key in ("kernels", "best"):
            value = a_list(data.get(key, []), where=f"{where}: {key}")
            rows[key] = tuple(
                KernelTiming.from_json(r, where=f"{where}: {key}[{i}]") for i, r in enumerate(value)
            )
        return cls(
            name=text(data["name"], where=f"{where}: name", empty=False),
            peak_flops=peak,
            hbm_bandwidth=positive_number(
                ceilings["hbm_bandwidth"], where=f"{where}: ceilings.hbm_bandwidth"
            ),
            memory_bytes=positive_number(data["memory_bytes"], where=f"{where}: memory_bytes"),
            launch_overhead_s=positive_number(
                ceilings["launch_overhead_s"],
                where=f"{where}: ceilings.launch_overhead_s",
                allow_zero=True,
            ),
            dispatch_overhead_s=positive_number(
                ceilings.get("dispatch_overhead_s", 0.0),
                where=f"{where}: ceilings.dispatch_overhead_s",
                allow_zero=True,
            ),
            fresh_bandwidth=positive_number(
                ceilings.get("fresh_bandwidth", 0.0),
                where=f"{where}: ceilings.fresh_bandwidth",
                allow_zero=True,
            ),
            source=text(data.get("source", where), where=f"{where}: source"),
            measured=boolean(data.get("measured", False), where=f"{where}: measured"),
            calibration=calibration,
            **efficiency,
            **rows,
        )


def efficiency_fields(value: Any, *, where: str) -> dict[str, Any]:
    """A profile's ``efficiency`` object (as ``DeviceProfile.to_json`` writes it) as the
    DeviceProfile fields it sets: the scalars, the kind scales and the fitted tables."""
    efficiency = an_object(value, where=where)
    closed(efficiency, EFFICIENCY_FIELDS, where=where)
    out: dict[str, Any] = {
        f"{k}_efficiency": positive_number(efficiency.get(k, 1.0), where=f"{where}.{k}",
                                           maximum=1.0)
        for k in ("compute", "memory")
    }  # fmt: skip
    out["overlap"] = positive_number(
        efficiency.get("overlap", 1.0), where=f"{where}.overlap", allow_zero=True, maximum=1.0
    )
    out["cache_bytes"] = positive_number(
        efficiency.get("cache_bytes", 0.0), where=f"{where}.cache_bytes", allow_zero=True
    )
    out["cached_time"] = positive_number(
        efficiency.get("cached_time", 1.0), where=f"{where}.cached_time", maximum=1.0
    )
    for kind in OP_KINDS:
        out[f"{kind}_efficiency"] = positive_number(
            efficiency.get(kind, 1.0), where=f"{where}.{kind}", maximum=MAX_FITTED_EFFICIENCY
        )
    for field, key in TABLE_FIELDS.items():
        if key in efficiency:
            out[field] = EfficiencyTable.from_json(efficiency[key], where=f"{where}.{key}")
    return out


KERNEL_FIELDS = tuple(f.name for f in dataclasses.fields(KernelTiming))
DEVICE_FIELDS = (
    "schema", "kind", "name", "source", "measured", "memory_bytes", "dtype", "ceilings",
    "efficiency", "calibration", "kernels", "best",
)  # fmt: skip
TABLE_FIELDS = {
    "compute_table": "compute_by_flops",
    "intensity_table": "compute_by_intensity",
    "memory_table": "memory_by_bytes",
    "row_table": "memory_by_row_bytes_one_row",
}
# costmodel.Op.kind with a scale field ``{kind}_efficiency``
OP_KINDS = ("attention", "train", "elementwise", "optimizer", "sampling")
KIND_FIELDS = tuple(f"{kind}_efficiency" for kind in OP_KINDS)
EFFICIENCY_FIELDS = (
    "compute", "memory", "overlap", "cache_bytes", "cached_time", *OP_KINDS,
    *TABLE_FIELDS.values(),
)  # fmt: skip
CEILING_FIELDS = (
    "hbm_bandwidth", "peak_flops", "ridge_point", "launch_overhead_s", "dispatch_overhead_s",
    "fresh_bandwidth",
)  # fmt: skip


# Launch overhead is not a datasheet number. 4 us is the order of a CUDA kernel launch seen from
# the host without CUDA graphs (NVIDIA CUDA C++ Best Practices Guide, "kernel launch overhead" is
# a few microseconds); autotune replaces it with a measured value.
_LAUNCH_S = 4e-6

BUILTIN_DEVICES: Mapping[str, DeviceProfile] = {
    p.name: p
    for p in (
        DeviceProfile(
            name="a10g",
            # AWS G5's A10G: 24 GB GDDR6 at 600 GB/s, BF16 tensor 70 TFLOPS dense, FP32 31.2 TFLOPS
            # (Baseten, "NVIDIA A10 vs A10G for ML model inference", spec table; AWS G5 page).
            # Ridge point 70e12 / 600e9 = 116.7 FLOP/byte: the paper's "about 117".
            peak_flops={"bf16": 70 * TFLOPS, "f32": 31.2 * TFLOPS},
            hbm_bandwidth=600 * GBPS,
            memory_bytes=24 * GB,
            launch_overhead_s=_LAUNCH_S,
            source="datasheet: AWS G5 / Baseten A10 vs A10G spec table",
        ),
        DeviceProfile(
            name="a100-40gb",
            # NVIDIA A100 datasheet (SXM4 40GB): BF16 tensor 312 TFLOPS dense, FP32 19.5 TFLOPS,
            # HBM2 1,555 GB/s, 40 GB.
            peak_flops={"bf16": 312 * TFLOPS, "f32": 19.5 * TFLOPS},
            hbm_bandwidth=1555 * GBPS,
            memory_bytes=40 * GB,
            launch_overhead_s=_LAUNCH_S,
            source="datasheet: NVIDIA A100 Tensor Core GPU, 40GB SXM",
        ),
        DeviceProfile(
            name="a100-80gb",
            # NVIDIA A100 datasheet (SXM4 80GB): BF16 312 TFLOPS dense, FP32 19.5 TFLOPS,
            # HBM2e 2,039 GB/s, 80 GB.
            peak_flops={"bf16": 312 * TFLOPS, "f32": 19.5 * TFLOPS},
            hbm_bandwidth=2039 * GBPS,
            memory_bytes=80 * GB,
            launch_overhead_s=_LAUNCH_S,
            source="datasheet: NVIDIA A100 Tensor Core GPU, 80GB SXM",
        ),
        DeviceProfile(
            name="a100-paper",
            # The source paper quotes an A100 ridge point of about 183 FLOP/byte, between the
            # datasheet's 40GB (201) and 80GB (153) parts. Peak is the datasheet's 312 TFLOPS;
            # bandwidth is derived as 312e12 / 183 so that the paper's ridge point holds. Memory
            # is taken as 80 GB. Use it to reproduce the paper, a datasheet profile otherwise.
            peak_flops={"bf16": 312 * TFLOPS, "f32": 19.5 * TFLOPS},
            hbm_bandwidth=312 * TFLOPS / 183.0,
            memory_bytes=80 * GB,
            launch_overhead_s=_LAUNCH_S,
            source="as the paper states: A100 ridge point 183 FLOP/byte (bandwidth derived)",
        ),
        DeviceProfile(
            name="h100-sxm",
            # NVIDIA H100 datasheet (SXM5): BF16 989.4 TFLOPS dense (1,979 with sparsity),
            # FP32 67 TFLOPS, HBM3 3.35 TB/s, 80 GB.
            peak_flops={"bf16": 989.4 * TFLOPS, "f32": 67 * TFLOPS},
            hbm_bandwidth=3350 * GBPS,
            memory_bytes=80 * GB,
            launch_overhead_s=_LAUNCH_S,
            source="datasheet: NVIDIA H100 Tensor Core GPU, SXM5",
        ),
        DeviceProfile(
            name="h200",
            # NVIDIA H200 datasheet (SXM): BF16 989 TFLOPS dense (1,979 sparse), FP32 67 TFLOPS,
            # HBM3e 4.8 TB/s, 141 GB.
            peak_flops={"bf16": 989.4 * TFLOPS, "f32": 67 * TFLOPS},
            hbm_bandwidth=4800 * GBPS,
            memory_bytes=141 * GB,
            launch_overhead_s=_LAUNCH_S,
            source="datasheet: NVIDIA H200 Tensor Core GPU, SXM",
        ),
        DeviceProfile(
            name="l4",
            # NVIDIA L4 datasheet: BF16 tensor 121 TFLOPS dense (242 sparse), FP32 30.3 TFLOPS,
            # GDDR6 300 GB/s, 24 GB.
            peak_flops={"bf16": 121 * TFLOPS, "f32": 30.3 * TFLOPS},
            hbm_bandwidth=300 * GBPS,
            memory_bytes=24 * GB,
            launch_overhead_s=_LAUNCH_S,
            source="datasheet: NVIDIA L4 Tensor Core GPU",
        ),
    )
}


CALIBRATED_GPUS = ("a100-80gb", "h100-sxm")
DATASHEET = "-datasheet"  # the name suffix of a calibrated GPU's datasheet profile


def _calibrated(name: str) -> DeviceProfile:
    """The datasheet profile ``name`` with the efficiency tables vocabjax/gpu_calibrations.py
    holds (fitted by sims/calibrate_gpu.py on published per-op kernel timings)."""
    from vocabjax.gpu_calibrations import GPU_CALIBRATIONS

    entry = GPU_CALIBRATIONS[name]
    base = BUILTIN_DEVICES[name]
    return dataclasses.replace(
        base,
        launch_overhead_s=entry["launch_overhead_s"],
        **efficiency_fields(entry["efficiency"], where=f"{name} efficiency"),
        calibration=entry["calibration"],
        source=f"{base.source}; calibrated: {entry['calibration']['source']}",
    )


# a100-80gb and h100-sxm are the calibrated profiles; their datasheet ceilings at efficiency 1
# stay beside them as a100-80gb-datasheet and h100-sxm-datasheet
def _with_calibrated(devices: Mapping[str, DeviceProfile]) -> dict[str, DeviceProfile]:
    out: dict[str, DeviceProfile] = {}
    for name, profile in devices.items():
        if name in CALIBRATED_GPUS:
            out[name] = _calibrated(name)
            out[name + DATASHEET] = dataclasses.replace(profile, name=name + DATASHEET)
        else:
            out[name] = profile
    return out


BUILTIN_DEVICES = _with_calibrated(BUILTIN_DEVICES)

DEFAULT_DEVICE = "a100-80gb"


def calibration_note(device: DeviceProfile) -> str:
    """One line saying which efficiencies the costs of ``device`` use."""
    cal = dict(device.calibration or {})
    anchor = cal.pop("anchor", None)  # validate --anchor: the machine's speed on a later day
    speed = f"; anchored {anchor['date']}: times x{anchor['total_factor']:.3f}" if anchor else ""
    if not cal:
        return (
            f"{device.name}: efficiency {device.compute_efficiency:g} (compute), "
            f"{device.memory_efficiency:g} (memory), not calibrated{speed} ({device.source})"
        )
    err = cal.get("held_out_median_abs_error_pct", {})
    after = f"; held-out median error {err['after']:.1f}%" if "after" in err else ""
    return f"{device.name}: calibrated on {cal.get('source', 'measured points')}{after}{speed}"


def load_device(name_or_path: str | os.PathLike) -> DeviceProfile:
    """A builtin profile by name, or a device profile JSON (as ``autotune`` writes)."""
    key = str(name_or_path)
    if key.lower() in BUILTIN_DEVICES:
        return BUILTIN_DEVICES[key.lower()]
    path = Path(key)
    if path.suffix.lower() == ".json" or path.exists():
        return DeviceProfile.from_json(load_json(path, "device"), where=str(path))
    known = ", ".join(BUILTIN_DEVICES)
    raise UserError(f"unknown device {key!r} (builtin: {known}; or a profile .json)")


def save_device(profile: DeviceProfile, path: str | os.PathLike) -> Path:
    """Write ``profile`` atomically (temporary file + rename)."""
    return atomic_write_json(path, profile.to_json())
