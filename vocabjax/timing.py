"""Wall-clock timing of jitted calls: one set of primitives for autotune, training throughput,
validation and the benchmarks.

    t = time_call(fn, [(x,), (y,)], TimingSettings())        # median seconds of fn(*args)
    t_a, t_b = time_interleaved([fa, fb], sets, settings)     # side by side, round-robin

Every timed call blocks until its outputs are ready, and the first call of each function (which
compiles) is never timed. ``time_interleaved`` times several functions in rounds that call each
once, so all of them see the same machine load; ratios measured that way are the ones a shared
machine can be trusted with. Consecutive calls take consecutive input sets, so a function does
not find its inputs in a cache the previous call warmed. A ``Tally`` (``minor_faults``) counts
something around each timed call, outside its timed interval.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

try:
    import resource  # POSIX only
except ImportError:  # pragma: no cover - Windows
    resource = None


@dataclasses.dataclass(frozen=True)
class TimingSettings:
    """How hard a measurement measures; ``quick()`` fits autotune in minutes on two CPU cores.
    The timers read the first four fields; the rest are autotune's (its probes and search)."""

    warmup: int = 2  # untimed calls before timing (the first also compiles)
    repeats: int = 7  # timed calls; the median is kept
    min_repeats: int = 3  # calls slower than ``slow_call_s`` drop to this many repeats
    slow_call_s: float = 0.5  # above this, one warm-up and ``min_repeats`` repeats
    rotate_bytes: int = 256 * 2**20  # input sets rotate until this many bytes are touched
    max_sets: int = 8  # at most this many input sets
    copy_bytes: int = 512 * 2**20  # the bandwidth probe copies an array of this size
    matmul_n: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"f32": 4096, "bf16": 4096}
    )  # square matmul size per dtype for peak FLOP/s
    chunk_candidates: str = "all"  # "all" or "quick" (default tile and two neighbours)
    pallas_candidates: int = 0  # per Pallas kernel, try at most this many tilings (0: all)
    # A candidate becomes a point's ``best`` only if it beats xla by more than this fraction:
    # a smaller gain is within the repeat-to-repeat noise of a shared machine, and the
    # baseline is the one choice that cannot be slower than itself.
    baseline_margin: float = 0.05
    # A point whose best is not xla is timed again, winner against xla alone, in this many
    # more rounds; it keeps the winner only if it is still ahead by the margin (0: no check).
    # Load on a shared host drifts within minutes, and one lucky round set should not decide.
    confirm_repeats: int = 9

    @classmethod
    def quick(cls) -> TimingSettings:
        return cls(
            warmup=1,
            repeats=5,
            min_repeats=3,
            slow_call_s=0.2,
            rotate_bytes=128 * 2**20,
            max_sets=8,
            copy_bytes=128 * 2**20,
            matmul_n={"f32": 1024, "bf16": 1024},
            chunk_candidates="quick",
        )


class Tally:
    """A count read before and after each timed call of ``time_interleaved`` (outside the
    timed interval), kept per function: ``medians()`` is each one's median per call, None for
    a function never counted (or a ``read`` that gives None: a counter this platform lacks)."""

    def __init__(self, read: Callable[[], float]) -> None:
        self.read = read
        self.counts: dict[int, list[float]] = {}

    def add(self, index: int, before: float | None, after: float | None) -> None:
        if before is not None and after is not None:
            self.counts.setdefault(index, []).append(after - before)

    def medians(self, n: int) -> list[float | None]:
        return [statistics.median(self.counts[i]) if i in self.counts else None for i in range(n)]


def minor_faults() -> float | None:
    """Minor page faults of this process so far (every thread's), None where the platform
    does not count them: a call's delta is the pages it touched for the first time, each a
    trip to the kernel (docs/validation.md)."""
    if resource is None:
        return None
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def block(x: Any) -> Any:
    """Wait until every array in ``x`` (any pytree) is computed; returns ``x``."""
    jax.tree_util.tree_map(
        lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x
    )
    return x


def time_call(
    fn: Callable[..., Any],
    arg_sets: Sequence[tuple],
    settings: TimingSettings,
    *,
    fastest: bool = False,
) -> float:
    """Median wall time of ``fn(*args)``; call i uses ``arg_sets[i % len(arg_sets)]``.

    ``fastest=True`` returns the fastest repeat instead: what the ceilings use, since a ceiling
    is the best the device does (on a shared machine the median also counts other jobs).
    """
    t0 = time.perf_counter()
    block(fn(*arg_sets[0]))  # compiles
    first = time.perf_counter() - t0
    slow = first > 4 * settings.slow_call_s
    for i in range(0 if slow else settings.warmup - 1):
        block(fn(*arg_sets[(i + 1) % len(arg_sets)]))
    times = []
    repeats = settings.min_repeats if slow else settings.repeats
    for i in range(repeats):
        args = arg_sets[(i + 1) % len(arg_sets)]
        t0 = time.perf_counter()
        block(fn(*args))
        times.append(time.perf_counter() - t0)
        if i + 1 >= settings.min_repeats and times[0] > settings.slow_call_s:
            break
    return min(times) if fastest else statistics.median(times)


def time_interleaved(
    fns: Sequence[Callable[..., Any]],
    arg_sets: Sequence[tuple],
    settings: TimingSettings,
    *,
    between: Callable[[], Any] | None = None,
    tally: Tally | None = None,
) -> list[float]:
    """Median wall time of each of ``fns`` (``time_rounds``'s repeats, each function's median)."""
    rounds = time_rounds(fns, arg_sets, settings, between=between, tally=tally)
    return [statistics.median(t) for t in rounds]


def time_rounds(
    fns: Sequence[Callable[..., Any]],
    arg_sets: Sequence[tuple],
    settings: TimingSettings,
    *,
    between: Callable[[], Any] | None = None,
    tally: Tally | None = None,
) -> list[list[float]]:
    """Every timed call's wall time, per function of ``fns``, timed round-robin: every round
    calls each function once (starting at a different one each round), so all of them see the
    same machine load; consecutive calls take consecutive input sets. Slow points get fewer
    rounds. ``between`` (``cache_evictor()``) runs, untimed, before every warm-up and timed
    call: without it a function that follows one reading the same arrays finds them in the
    cache, and in a fixed round-robin order it follows that one every round. ``tally`` counts
    something around every timed call (``Tally``)."""
    if not fns:
        return []
    n = len(arg_sets)
    pause = (lambda: block(between())) if between is not None else (lambda: None)
    firsts = []
    for fn in fns:  # compiles (the functions were already checked once)
        t0 = time.perf_counter()
        block(fn(*arg_sets[0]))
        firsts.append(time.perf_counter() - t0)
    slow = min(firsts) > 4 * settings.slow_call_s
    call = 0
    for _ in range(0 if slow else settings.warmup - 1):
        for fn in fns:
            call += 1
            pause()
            block(fn(*arg_sets[call % n]))
    times: list[list[float]] = [[] for _ in fns]
    for r in range(settings.min_repeats if slow else settings.repeats):
        for k in range(len(fns)):
            j = (r + k) % len(fns)
            call += 1
            args = arg_sets[call % n]
            pause()
            before = tally.read() if tally is not None else None
            t0 = time.perf_counter()
            block(fns[j](*args))
            times[j].append(time.perf_counter() - t0)
            if tally is not None:
                tally.add(j, before, tally.read())
        if r + 1 >= settings.min_repeats and min(t[0] for t in times) > settings.slow_call_s:
            break
    return times


def spread_pct(times: Sequence[float]) -> float:
    """(max - min) / median of ``times``, in %: how far repeated timings of one thing disagree."""
    return 100.0 * (max(times) - min(times)) / statistics.median(times)


EVICT_BYTES = 256 * 2**20  # written between timed calls where the last-level cache is unknown


def last_level_cache_bytes() -> int | None:
    """The CPU's largest cache (sysfs), or None where it cannot be read."""
    best = None
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip().upper()
            value = int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
        except (OSError, ValueError, IndexError):
            continue
        best = value if best is None else max(best, value)
    return best


def cache_evictor(nbytes: int | None = None) -> Callable[[], jax.Array]:
    """A call that writes a device buffer of ``nbytes`` (default: four times the CPU's
    last-level cache, or ``EVICT_BYTES`` on an accelerator or where it is unknown), so the next
    timed call reads its operands from memory, not from what the previous call left cached."""
    if nbytes is None:
        llc = last_level_cache_bytes() if jax.default_backend() == "cpu" else None
        nbytes = 4 * llc if llc else EVICT_BYTES
    step, _ = copy_probe(nbytes)
    return step


def copy_probe(nbytes: int) -> tuple[Callable[..., jax.Array], int]:
    """(step, bytes moved per call): ``x <- x + 1`` on an f32 array of ``nbytes`` with the input
    donated, so each call reads and writes a buffer the device already holds (a fresh output
    each call would time the allocator's page faults on a CPU). ``step`` ignores its arguments.
    """
    n = nbytes // 4
    add = jax.jit(lambda x: x + jnp.float32(1), donate_argnums=0)
    state = [jnp.zeros((n,), jnp.float32)]

    def step(*_):
        state[0] = add(state[0])
        return state[0]

    return step, 2 * n * 4
