"""``validate``: time the project's own model on this machine and put the cost model's figure
for the same configuration beside every point.

    v = validate("profiles/cpu.json", "quick", progress=print)
    v.results[0].measured_s, v.results[0].prediction.predicted_s, v.results[0].error_pct

The device profile prices the points (``predict``); the grid says which points (``grid``);
``timing`` builds and times them, one round-robin group per model shape. ``device="measure"``
measures this machine's ceilings first with autotune's quick probes (a large copy, a matmul,
a tiny op: a few seconds), so a fresh machine validates without a profile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import platform
import re
import time

import jax

from vocabjax import autotune as at
from vocabjax import unembed
from vocabjax.errors import UserError
from vocabjax.hardware import DeviceProfile, load_device
from vocabjax.validation.grid import Grid, Point, get_grid
from vocabjax.validation.prediction import DTYPE, Prediction, call_flops, predict
from vocabjax.validation.timing import measure, resident_bytes

MEASURE = "measure"  # the --device that measures this machine's ceilings first


@dataclasses.dataclass(frozen=True)
class Result:
    """One point: what the cost model predicted and what this machine took."""

    point: Point
    prediction: Prediction
    measured_s: float  # median seconds per step (decode: per step of the loop) or per op
    compile_s: float  # seconds to compile the point's call (an engine build: with its warm-up)
    # several runs combined (``combine_runs``): (max - min) / median of the point's runs, in %
    runs_spread_pct: float | None = None
    # minor page faults of one timed call (a decode point's call runs the whole loop), median;
    # None where not counted (a platform without getrusage, a run saved before they were)
    faults_per_call: float | None = None
    # memory one call maps afresh (``timing.fresh_bytes``: XLA's temporaries of 32 MiB or more
    # on a CPU, 0 elsewhere); None where not known (a run saved before they were recorded)
    fresh_bytes: float | None = None
    # (max - min) / median of the point's timed calls in its run, in % (several runs combined:
    # the median over them); None for a run saved before they were recorded
    repeat_spread_pct: float | None = None

    @property
    def error_pct(self) -> float:
        """100 (predicted - measured) / measured: negative when the model is too optimistic."""
        return 100.0 * (self.prediction.predicted_s - self.measured_s) / self.measured_s


@dataclasses.dataclass(frozen=True)
class Validation:
    """A validation run."""

    device: DeviceProfile  # the profile the predictions come from
    device_kind: str  # what that profile describes (a measured device's kind, or its name)
    running_on: str  # the device kind the timings ran on
    mismatch: str | None  # why the two differ, when they do
    grid: Grid
    results: tuple[Result, ...]
    skipped: tuple[Point, ...]  # points over the grid's FLOP cap, not timed
    date: str  # UTC start of the run
    host: str  # machine, processor, cores, jax version
    seconds: float  # wall time of the run
    load_average: float = 0.0  # this machine's 1-minute load average before the timing began
    runs: int = 1  # runs of the grid whose per-point medians these are (``combine_runs``)
    by_shape: bool = False  # each shape's points timed as a set of their own (``measure``)
    warm: bool = False  # each point's calls back to back, no cache eviction (``measure``)


def running_kind() -> str:
    """The device kind the timings run on (``cpu``, ``NVIDIA H200``, ...)."""
    device = jax.devices()[0]
    return str(getattr(device, "device_kind", None) or jax.default_backend())


_MEASURED_ON = re.compile(
    r" on (.+?) \("
)  # autotune's source: "autotune <date> UTC on cpu (cpu, ..."


def profile_kind(device: DeviceProfile) -> str:
    """The device a profile describes: the kind a measured profile's source names, else its
    name (a datasheet profile names its device)."""
    found = _MEASURED_ON.search(device.source) if device.measured else None
    return found.group(1) if found else device.name


def device_mismatch(device: DeviceProfile, running: str) -> str | None:
    """A note when ``device`` describes another device kind than ``running``, else None."""
    kind = profile_kind(device)
    if at._device_name(kind) == at._device_name(running):
        return None
    how = "was measured on" if device.measured else "is a datasheet profile of"
    return (
        f"device profile {device.name!r} {how} {kind!r}, not this machine's {running!r}: the "
        "predictions are for that device, the timings for this one"
    )


def measured_device(progress=None) -> DeviceProfile:
    """This machine's ceilings, measured now with autotune's quick probes (f32 only)."""
    ceilings = at.measure_ceilings((DTYPE,), at.TimingSettings.quick(), progress)
    kind = running_kind()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")
    return DeviceProfile(
        name=at._device_name(kind),
        peak_flops=dict(ceilings.peak_flops),
        hbm_bandwidth=ceilings.hbm_bandwidth,
        memory_bytes=at._memory_bytes(jax.devices()[0]),
        launch_overhead_s=ceilings.launch_overhead_s,
        source=(
            f"validate: ceilings measured {stamp} UTC on {kind} ({jax.default_backend()}, "
            f"jax {jax.__version__}, autotune's quick probes)"
        ),
        measured=True,
    )


def load_validation_device(spec: DeviceProfile | str, progress=None) -> DeviceProfile:
    """``measure``, a builtin name, a profile JSON, or a DeviceProfile; it must price f32."""
    if isinstance(spec, DeviceProfile):
        device = spec
    elif str(spec).lower() == MEASURE:
        device = measured_device(progress)
    else:
        device = load_device(spec)
    device.flops(DTYPE)  # a UserError when the profile has no f32 peak
    return device


def check_memory(grid: Grid, points: list[Point], fraction: float = 0.7) -> None:
    """Refuse, before any work, a grid whose points would hold more than ``fraction`` of this
    machine's memory (every shape's arrays are resident while the points are timed
    round-robin)."""
    memory = at._memory_bytes(jax.devices()[0])
    shapes = list(dict.fromkeys(p.shape for p in points))
    need = {s: resident_bytes(s, [p for p in points if p.shape == s], grid) for s in shapes}
    total = sum(need.values())
    if total > fraction * memory:
        largest = max(need, key=lambda s: need[s])
        raise UserError(
            f"grid {grid.name!r}: its points hold about {total / 1e9:.1f} GB at once (the "
            f"{largest.name} points {need[largest] / 1e9:.1f} GB), above {fraction:.0%} of this "
            f"machine's {memory / 1e9:.1f} GB; use {{quick}} or a grid with fewer, smaller points",
            settings=["quick"],
        )


BUSY_LOAD = 0.5  # a 1-minute load average above this share of the cores: other work is running


def busy(say) -> float:
    """This machine's 1-minute load average, with a warning when other work shares it (the
    timings then carry that work)."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > BUSY_LOAD * cores:
        say(
            f"warning: load average {load:.1f} on {cores} cores: other work shares this machine, "
            "and the timings carry it"
        )
    return load


def host() -> str:
    """``x86_64, Intel(R) Xeon(R) Processor, 2 cores, jax 0.10.2``."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    parts = [platform.machine(), cpu, f"{os.cpu_count()} cores", f"jax {jax.__version__}"]
    return ", ".join(p for p in parts if p)


def matmuls_as_priced():
    """A context in which the points' f32 matmuls run at the precision the cost model prices
    them at, the device's f32 peak: on a GPU, JAX by default computes f32 dot products on TF32
    tensor cores (docs.jax.dev, "Matmul precision"), which no f32 peak prices, so there it pins
    true float32; a CPU's f32 dots are float32 already, and its timings stay as they were."""
    if jax.default_backend() == "cpu":
        return contextlib.nullcontext()
    return jax.default_matmul_precision("float32")


def validate(
    device: DeviceProfile | str = MEASURE,
    grid: Grid | str = "full",
    *,
    seed: int = 0,
    progress=None,
    by_shape: bool = False,
    warm: bool = False,
) -> Validation:
    """Time every point of ``grid`` on this machine beside the cost model's prediction on
    ``device``. ``impl="auto"`` follows ``device`` while the points compile, as it does in
    ``serve`` with that profile. Points whose call needs more than ``grid.max_flops`` FLOPs
    are left out (``skipped``). ``by_shape``: time each model shape's points as a set of
    their own; ``warm``: each point's calls back to back, the cache not evicted
    (``timing.measure``)."""
    started = time.perf_counter()
    say = progress or (lambda _m: None)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    grid = get_grid(grid) if isinstance(grid, str) else grid
    device = load_validation_device(device, say)
    running = running_kind()
    mismatch = device_mismatch(device, running)
    if mismatch:
        say(f"warning: {mismatch}")
    priced = [(p, predict(p, device, decode_steps=grid.decode_steps)) for p in grid.points()]
    kept = [(p, q) for p, q in priced if call_flops(p, q, grid.decode_steps) <= grid.max_flops]
    skipped = tuple(p for p, q in priced if call_flops(p, q, grid.decode_steps) > grid.max_flops)
    if not kept:
        raise UserError(f"grid {grid.name!r}: every point is over max_flops={grid.max_flops:g}")
    if skipped:
        say(f"validate: {len(skipped)} points over {grid.max_flops:.3g} FLOPs per call left out")
    check_memory(grid, [p for p, _ in kept])
    load = busy(say)  # read before the timing, whose own load it would otherwise count
    with unembed.using_device_profile(device), matmuls_as_priced():
        times = measure(
            [p for p, _ in kept], grid, seed=seed, progress=say, by_shape=by_shape, warm=warm
        )
    results: list[Result] = []
    for (p, _), t in zip(kept, times, strict=True):
        measured = t.seconds
        # priced again with the memory its compiled call maps afresh, known once built
        q = predict(p, device, decode_steps=grid.decode_steps, fresh_bytes=t.fresh_bytes or 0.0)
        r = Result(
            p, q, measured, t.compile_s, faults_per_call=t.faults_per_call,
            fresh_bytes=t.fresh_bytes, repeat_spread_pct=t.repeat_spread_pct,
        )  # fmt: skip
        results.append(r)
        say(
            f"  {p.label()}: measured {measured * 1e3:.4g} ms, predicted "
            f"{q.predicted_s * 1e3:.4g} ms ({r.error_pct:+.0f}%, {q.bound})"
        )
    return Validation(
        device=device,
        device_kind=profile_kind(device),
        running_on=running,
        mismatch=mismatch,
        grid=grid,
        results=tuple(results),
        skipped=skipped,
        date=date,
        host=host(),
        seconds=time.perf_counter() - started,
        load_average=load,
        by_shape=by_shape,
        warm=warm,
    )
