"""Measure this device's ceilings and time every unembedding kernel candidate on a (V, B) grid.

    run = autotune(vocabs=[8192, 32768], batches=[1, 64], d_model=768, dtype="bf16")
    save_device(run.profile, "profiles/cpu.json")

One run measures the roofline ceilings (a large on-device copy for memory bandwidth, a large
matmul per dtype for peak FLOP/s, a tiny op for the launch overhead; ridge point = peak /
bandwidth), then for every (op, V, B) point and every candidate (``xla``, ``chunked`` at several
``block_v``, the Pallas kernels at their block candidates on a GPU or TPU) it

1. checks the candidate against the reference (``xla`` at HIGHEST precision) on the point's
   inputs; a candidate that disagrees is reported and never timed or chosen;
2. times the candidates that passed side by side (``time_interleaved``: warm-up calls, then
   rounds that call every candidate once, the median per candidate), each call on the next of a
   few input sets (rotated, so a W that fits in cache does not flatter the kernel);
3. keeps ``xla`` unless a candidate beats it by more than ``baseline_margin``, and re-times a
   winner that is not ``xla`` against ``xla`` alone (``confirm_repeats`` more rounds): the
   winner stays only if it is still ahead by the margin.

The result is a measured :class:`DeviceProfile`: ``kernels`` holds every timed candidate,
``best`` the fastest per (op, V, B, D, dtype), which ``impl="auto"`` and ``sweep --device`` read.
Each row carries ``roofline_fraction`` = roofline floor / measured time, with the floor
``max(flops / peak, bytes / bandwidth)`` from the measured ceilings.

On a CPU the Pallas kernels only run through Pallas' interpreter, which says nothing about their
speed: they are checked for correctness but not timed there (``include_interpret`` overrides).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vocabjax import unembed
from vocabjax.errors import UserError
from vocabjax.hardware import BYTES_PER_ELEMENT, DTYPES, DeviceProfile, KernelTiming
from vocabjax.progress import Progress
from vocabjax.timing import TimingSettings, block, copy_probe, time_call, time_interleaved

DEFAULT_VOCABS: tuple[int, ...] = tuple(2**p for p in range(13, 20))  # 8k .. 512k
DEFAULT_BATCHES: tuple[int, ...] = tuple(2**p for p in range(0, 10))  # 1 .. 512
QUICK_VOCABS: tuple[int, ...] = (8192, 32768, 131072)
QUICK_BATCHES: tuple[int, ...] = (1, 8, 64)
DEFAULT_D_MODEL = 768  # GPT-2 small's width; pass the served model's d_model
QUICK_OPS: tuple[str, ...] = ("greedy", "linear_cross_entropy")
TOP_K = 50  # k of the timed top_k op (a common sampling cut-off)


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """The measured roofline of this device."""

    hbm_bandwidth: float  # bytes/s of a large copy (read + write)
    peak_flops: dict[str, float]  # FLOP/s of a large matmul per dtype
    launch_overhead_s: float  # wall time of a tiny jitted op, seconds

    def ridge_point(self, dtype: str) -> float:
        return self.peak_flops[dtype] / self.hbm_bandwidth

    def floor_s(self, op: str, vocab: int, batch: int, d_model: int, dtype: str) -> float:
        """The roofline floor of an unembedding op: max(t_math, t_mem)."""
        flops, bytes_ = unembed.unembed_cost(
            op, vocab=vocab, batch=batch, d_model=d_model, dtype=dtype
        )
        t_math = flops / self.peak_flops[dtype]
        t_mem = bytes_ / self.hbm_bandwidth
        return max(t_math, t_mem)

    def rows(self) -> list[dict[str, Any]]:
        """One row per ceiling (name, value, unit), for the printed tables."""
        rows = [{"ceiling": "hbm_bandwidth", "value": self.hbm_bandwidth, "unit": "bytes/s"}]
        for dtype, value in self.peak_flops.items():
            rows.append({"ceiling": f"peak_flops[{dtype}]", "value": value, "unit": "FLOP/s"})
            rows.append(
                {
                    "ceiling": f"ridge_point[{dtype}]",
                    "value": self.ridge_point(dtype),
                    "unit": "FLOP/byte",
                }
            )
        rows.append({"ceiling": "launch_overhead", "value": self.launch_overhead_s, "unit": "s"})
        return rows


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One implementation and tiling to try."""

    impl: str  # "xla", "chunked" or "pallas"
    blocks: Any  # ChunkBlocks / Pallas blocks dataclass / None
    interpret: bool = False  # Pallas through its interpreter (CPU)

    @property
    def blocks_json(self) -> dict[str, int]:
        if self.blocks is None:
            return {}
        if hasattr(self.blocks, "to_json"):
            return dict(self.blocks.to_json())
        out = {k: int(v) for k, v in dataclasses.asdict(self.blocks).items()}
        kind = type(self.blocks).__name__
        if kind in ("TiledBlocks", "DecodeBlocks"):  # which Pallas decode kernel the row names
            out["tiled"] = int(kind == "TiledBlocks")
        return out

    def label(self) -> str:
        inner = ",".join(f"{k}={v}" for k, v in self.blocks_json.items())
        return f"{self.impl}[{inner}]" if inner else self.impl


@dataclasses.dataclass(frozen=True)
class Failure:
    """A candidate that disagreed with the reference (never timed, never chosen)."""

    op: str
    vocab: int
    batch: int
    impl: str
    blocks: dict[str, int]
    error: str


@dataclasses.dataclass(frozen=True)
class Run:
    """What one autotune run produced."""

    profile: DeviceProfile
    ceilings: Ceilings
    failures: tuple[Failure, ...]
    seconds: float  # wall time of the whole run
    # Points whose first-pass winner lost the confirming rounds (xla kept): the winner's row.
    unconfirmed: tuple[KernelTiming, ...] = ()

    def table_rows(self) -> list[dict[str, Any]]:
        """One row per timed candidate, the best of each point marked."""
        best = {_point(r) + (r.impl, tuple(sorted(r.blocks.items()))) for r in self.profile.best}
        out = []
        for r in self.profile.kernels:
            key = _point(r) + (r.impl, tuple(sorted(r.blocks.items())))
            out.append(
                {
                    "op": r.op,
                    "vocab": r.vocab,
                    "batch": r.batch,
                    "d_model": r.d_model,
                    "dtype": r.dtype,
                    "impl": r.impl,
                    "blocks": ",".join(f"{k}={v}" for k, v in r.blocks.items()) or "-",
                    "time_us": r.time_s * 1e6,
                    "roofline_fraction": r.roofline_fraction,
                    "best": key in best,
                }
            )
        return out

    def ceiling_rows(self) -> list[dict[str, Any]]:
        return self.ceilings.rows()


def _point(r: KernelTiming) -> tuple:
    return (r.op, r.vocab, r.batch, r.d_model, r.dtype)


# --------------------------------------------------------------------------------------------
# Ceilings


def measure_ceilings(
    dtypes: Sequence[str] = DTYPES,
    settings: TimingSettings | None = None,
    progress: Progress | None = None,
) -> Ceilings:
    """Bandwidth of a large copy, peak FLOP/s of a large matmul per dtype, a tiny op's time."""
    settings = settings or TimingSettings()
    say = progress or (lambda _m: None)
    step, moved = copy_probe(settings.copy_bytes)
    t = time_call(step, [()], settings, fastest=True)
    del step
    bandwidth = moved / t
    say(
        f"ceilings: copy of {settings.copy_bytes / 2**20:.0f} MiB: {t * 1e3:.2f} ms -> "
        f"{bandwidth / 1e9:.1f} GB/s"
    )
    peak = {}
    for dtype in dtypes:
        m = settings.matmul_n[dtype]
        jdt = jnp.bfloat16 if dtype == "bf16" else jnp.float32
        prec = jax.lax.Precision.HIGHEST if dtype == "f32" else None
        mm = jax.jit(
            lambda a, b, prec=prec: jnp.dot(
                a, b, precision=prec, preferred_element_type=jnp.float32
            )
        )
        keys = jax.random.split(jax.random.key(0), 4)
        sets = [
            (
                jax.random.normal(keys[2 * i], (m, m), jnp.float32).astype(jdt),
                jax.random.normal(keys[2 * i + 1], (m, m), jnp.float32).astype(jdt),
            )
            for i in range(2)
        ]
        t = time_call(mm, sets, settings, fastest=True)
        peak[dtype] = 2.0 * m**3 / t
        say(f"ceilings: {dtype} matmul {m}^3: {t * 1e3:.2f} ms -> {peak[dtype] / 1e12:.3f} TFLOP/s")
    tiny = jax.jit(lambda x: x + jnp.float32(1))
    small = [(jnp.zeros((8,), jnp.float32),), (jnp.ones((8,), jnp.float32),)]
    launch = time_call(
        tiny, small, dataclasses.replace(settings, repeats=max(25, settings.repeats))
    )
    say(f"ceilings: tiny op: {launch * 1e6:.1f} us launch overhead")
    return Ceilings(hbm_bandwidth=bandwidth, peak_flops=peak, launch_overhead_s=launch)


# --------------------------------------------------------------------------------------------
# Candidates and the functions they time


def candidates(
    op: str,
    vocab: int,
    batch: int,
    d_model: int,
    dtype: str,
    *,
    backend: str | None = None,
    settings: TimingSettings | None = None,
    include_interpret: bool = False,
) -> list[Candidate]:
    """Every implementation and tiling worth timing at this point, the baseline first."""
    settings = settings or TimingSettings()
    backend = backend or jax.default_backend()
    out = [Candidate("xla", None)]
    quick = settings.chunk_candidates == "quick"
    for blocks in unembed.ChunkBlocks.candidates(batch, vocab, d_model, dtype, quick=quick, op=op):
        out.append(Candidate("chunked", blocks))
    if backend != "cpu" or include_interpret:
        found = _pallas_candidates(op, vocab, batch, d_model, dtype, interpret=backend == "cpu")
        if settings.pallas_candidates:  # keep the first n of each kernel (its default first)
            kept: dict[str, int] = {}
            for cand in found:
                kind = type(cand.blocks).__name__
                kept[kind] = kept.get(kind, 0) + 1
                if kept[kind] <= settings.pallas_candidates:
                    out.append(cand)
        else:
            out.extend(found)
    return out


def _pallas_candidates(op, vocab, batch, d_model, dtype, *, interpret) -> list[Candidate]:
    """Every block configuration the op's Pallas kernels offer for this point."""
    import importlib

    modules = {
        "linear_cross_entropy": [("linear_ce", "CEBlocks")],
        "top_k": [("fused_topk", "TopKBlocks")],
    }.get(op, [("fused_decode", "DecodeBlocks"), ("tiled_decode", "TiledBlocks")])
    out = []
    for mod_name, cls_name in modules:
        cls = getattr(importlib.import_module(f"pallas_kernels.{mod_name}"), cls_name)
        found = cls.candidates(batch, vocab, d_model, dtype)
        out.extend(Candidate("pallas", b, interpret) for b in found)
    return out


def _op_fn(op: str, cand: Candidate) -> Callable[..., Any]:
    """A jitted function of the point's inputs that runs ``op`` with this candidate."""
    kw: dict[str, Any] = {"impl": cand.impl, "blocks": cand.blocks}
    if cand.impl == "pallas":
        kw["interpret"] = cand.interpret
    if op == "greedy":
        return jax.jit(lambda h, w, lab, key: unembed.greedy(h, w, **kw))
    if op == "logsumexp":
        return jax.jit(lambda h, w, lab, key: unembed.logsumexp(h, w, **kw))
    if op == "top_k":
        return jax.jit(lambda h, w, lab, key: unembed.top_k(h, w, min(TOP_K, w.shape[0]), **kw))
    if op == "sample":
        return jax.jit(lambda h, w, lab, key: unembed.sample(h, w, key, 1.0, **kw))
    if op == "linear_cross_entropy":
        loss = lambda h, w, lab: unembed.linear_cross_entropy(h, w, lab, **kw)  # noqa: E731
        grad = jax.value_and_grad(loss, argnums=(0, 1))
        return jax.jit(lambda h, w, lab, key: grad(h, w, lab))
    raise UserError(f"unknown op {op!r} (choose from {', '.join(unembed.OPS)})")


def _inputs(
    vocab: int, batch: int, d_model: int, dtype: str, n_sets: int, seed: int
) -> list[tuple]:
    """``n_sets`` distinct input sets (h, w, labels, key) of one point.

    W is drawn once on the host (numpy, seeded) and each further set is a scaled copy on the
    device: distinct buffers of the same distribution, without paying the generator per set.
    """
    jdt = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    rng = np.random.default_rng(seed)
    w0 = jnp.asarray(rng.standard_normal((vocab, d_model), dtype=np.float32))
    w0 = w0 * jnp.float32(2 / math.sqrt(d_model))
    sets = []
    for i in range(n_sets):
        h = jnp.asarray(rng.standard_normal((batch, d_model), dtype=np.float32)).astype(jdt)
        w = (w0 * jnp.float32(1 + i / 64)).astype(jdt)
        lab = jnp.asarray(rng.integers(0, vocab, size=batch, dtype=np.int32))
        sets.append((h, w, lab, jax.random.key(seed * 131 + i)))
    return sets


def _agree(op: str, got: Any, ref: Any, inputs: tuple) -> str | None:
    """None when a candidate's output matches the reference's, else what differs."""
    h, w, _, key = inputs

    def logit_at(ids):  # the exact-ish logit of chosen ids, gathered (no B x V)
        rows = jnp.take(w, jnp.clip(ids, 0, w.shape[0] - 1), axis=0).astype(jnp.float32)
        return np.asarray(
            jnp.einsum("bd,bd->b", h.astype(jnp.float32), rows, precision="highest"), np.float64
        )

    def close(a, b, rtol=1e-3, atol=1e-3):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            return f"shape {a.shape} != {b.shape}"
        if not np.all(np.isfinite(a)):
            return "non-finite values"
        err = np.abs(a - b) - (atol + rtol * np.abs(b))
        return None if np.all(err <= 0) else f"max abs error {np.max(np.abs(a - b)):.3g}"

    if op in ("greedy", "sample"):
        got_ids, ref_ids = np.asarray(got), np.asarray(ref)
        if got_ids.min() < 0 or got_ids.max() >= w.shape[0]:
            return f"token ids out of range: {got_ids.min()}..{got_ids.max()}"
        if op == "greedy":
            return close(logit_at(got_ids), logit_at(ref_ids))
        same = np.mean(got_ids == ref_ids)
        return None if same >= 0.99 else f"only {same:.0%} of sampled tokens match xla"
    if op == "logsumexp":
        return close(got, ref)
    if op == "top_k":
        ids = np.asarray(got[1])
        if ids.min() < 0 or ids.max() >= w.shape[0]:
            return f"token ids out of range: {ids.min()}..{ids.max()}"
        at_ids = np.stack([logit_at(ids[:, j]) for j in range(ids.shape[1])], axis=1)
        return close(got[0], ref[0]) or close(at_ids, ref[0])
    if op == "linear_cross_entropy":
        (loss, (dh, dw)), (rloss, (rdh, rdw)) = got, ref
        msg = close(loss, rloss)
        for name, a, b in (("dh", dh, rdh), ("dw", dw, rdw)):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            rel = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
            if not np.isfinite(rel) or rel > 1e-2:
                msg = msg or f"{name} relative error {rel:.3g}"
        return msg
    raise AssertionError(op)


# --------------------------------------------------------------------------------------------
# The run


def autotune(
    vocabs: Sequence[int] = DEFAULT_VOCABS,
    batches: Sequence[int] = DEFAULT_BATCHES,
    d_model: int = DEFAULT_D_MODEL,
    dtype: str = "bf16",
    *,
    ops: Sequence[str] = unembed.OPS,
    settings: TimingSettings | None = None,
    progress: Progress | None = None,
    include_interpret: bool = False,
    ceilings: Ceilings | None = None,
    name: str | None = None,
) -> Run:
    """Measure the ceilings and every candidate on the grid; return the measured profile."""
    t_start = time.perf_counter()
    settings = settings or TimingSettings()
    say = progress or (lambda _m: None)
    _check_grid(vocabs, batches, d_model, dtype, ops)
    if ceilings is None:
        ceilings = measure_ceilings(tuple(dict.fromkeys((dtype, *DTYPES))), settings, say)
    grid = [(op, v, b) for op in ops for v in vocabs for b in batches]
    kernels: list[KernelTiming] = []
    best: list[KernelTiming] = []
    failures: list[Failure] = []
    unconfirmed: list[KernelTiming] = []
    for n, (op, vocab, batch) in enumerate(grid, 1):
        where = f"[{n}/{len(grid)}] {op} V={vocab} B={batch} D={d_model} {dtype}"
        point = _Point(op, vocab, batch, d_model, dtype, where)
        sets = _inputs(vocab, batch, d_model, dtype, point.input_sets(settings), seed=n)
        passed, failed = _check_candidates(point, sets, settings, include_interpret, say)
        failures.extend(failed)
        rows = _time_candidates(point, passed, sets, ceilings, settings, say)
        kernels.extend(rows)
        if rows:
            pick, lost = _pick(point, rows, passed, sets, settings, say)
            best.append(pick)
            unconfirmed.extend(lost)
    profile = _measured_profile(kernels, best, ceilings, name)
    return Run(
        profile, ceilings, tuple(failures), time.perf_counter() - t_start, tuple(unconfirmed)
    )


@dataclasses.dataclass(frozen=True)
class _Point:
    """One (op, V, B) of an autotune grid, at the run's d_model and dtype."""

    op: str
    vocab: int
    batch: int
    d_model: int
    dtype: str
    where: str  # the prefix of this point's progress lines

    def input_sets(self, settings: TimingSettings) -> int:
        """How many input sets the point's calls rotate through: enough to touch
        ``rotate_bytes``, 2 to ``max_sets``."""
        set_bytes = (self.vocab + self.batch) * self.d_model * BYTES_PER_ELEMENT[self.dtype]
        return max(2, min(settings.max_sets, math.ceil(settings.rotate_bytes / set_bytes)))


def _check_candidates(
    p: _Point, sets, settings: TimingSettings, include_interpret: bool, say: Progress
) -> tuple[list[tuple[Candidate, Callable[..., Any]]], list[Failure]]:
    """(candidate, its jitted function) for every candidate that agrees with the reference on
    the first input set, and a ``Failure`` for each one that does not (or does not compile)."""
    ref = block(_op_fn(p.op, Candidate("xla", None))(*sets[0]))
    passed: list[tuple[Candidate, Callable[..., Any]]] = []
    failures: list[Failure] = []
    for cand in candidates(
        p.op,
        p.vocab,
        p.batch,
        p.d_model,
        p.dtype,
        backend=jax.default_backend(),
        settings=settings,
        include_interpret=include_interpret,
    ):
        fn = _op_fn(p.op, cand)
        try:
            problem = _agree(p.op, block(fn(*sets[0])), ref, sets[0])
        except Exception as exc:  # a kernel that does not compile for this shape
            problem = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        if problem:
            failures.append(Failure(p.op, p.vocab, p.batch, cand.impl, cand.blocks_json, problem))
            say(f"{p.where} {cand.label()}: FAILED check ({problem}); not timed")
            continue
        passed.append((cand, fn))
    return passed, failures


def _time_candidates(
    p: _Point, passed, sets, ceilings: Ceilings, settings: TimingSettings, say: Progress
) -> list[KernelTiming]:
    """One row per checked candidate, timed side by side (``time_interleaved``)."""
    floor = ceilings.floor_s(p.op, p.vocab, p.batch, p.d_model, p.dtype)
    times = time_interleaved([fn for _, fn in passed], sets, settings)
    rows = []
    for (cand, _), t in zip(passed, times, strict=True):
        rows.append(
            KernelTiming(
                op=p.op,
                vocab=p.vocab,
                batch=p.batch,
                d_model=p.d_model,
                dtype=p.dtype,
                impl=cand.impl,
                blocks=cand.blocks_json,
                time_s=t,
                roofline_fraction=floor / t,
            )
        )
        say(f"{p.where} {cand.label()}: {t * 1e3:.3f} ms ({floor / t:.2f} of roofline)")
    return rows


def _pick(
    p: _Point, rows, passed, sets, settings: TimingSettings, say: Progress
) -> tuple[KernelTiming, list[KernelTiming]]:
    """The point's best row (``_best``), and the first-pass winner if it lost the confirming
    rounds against xla alone (then xla is the best)."""
    pick = _best(rows, settings.baseline_margin)
    xla_at = next((i for i, (c, _) in enumerate(passed) if c.impl == "xla"), None)
    if pick.impl == "xla" or xla_at is None or not settings.confirm_repeats:
        return pick, []
    won_at = rows.index(pick)
    t_xla, t_won = time_interleaved(
        [passed[xla_at][1], passed[won_at][1]],
        sets,
        dataclasses.replace(settings, repeats=settings.confirm_repeats),
    )
    kept = t_won < t_xla * (1 - settings.baseline_margin)
    say(
        f"{p.where} confirm {passed[won_at][0].label()} against xla: "
        f"{t_won * 1e3:.3f} vs {t_xla * 1e3:.3f} ms -> " + ("kept" if kept else "xla kept")
    )
    return (pick, []) if kept else (rows[xla_at], [pick])


def _measured_profile(kernels, best, ceilings: Ceilings, name: str | None) -> DeviceProfile:
    """The measured profile of this device: its ceilings, every timed row and the best."""
    backend = jax.default_backend()
    device = jax.devices()[0]
    kind = str(getattr(device, "device_kind", backend))
    return DeviceProfile(
        name=name or _device_name(kind),
        peak_flops=dict(ceilings.peak_flops),
        hbm_bandwidth=ceilings.hbm_bandwidth,
        memory_bytes=_memory_bytes(device),
        launch_overhead_s=ceilings.launch_overhead_s,
        source=(
            f"autotune {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on {kind} "
            f"({backend}, jax {jax.__version__}, {os.cpu_count()} host cores)"
        ),
        kernels=tuple(kernels),
        best=tuple(best),
        measured=True,
    )


def _best(rows: Sequence[KernelTiming], margin: float) -> KernelTiming:
    """The fastest row, unless it beats the xla row by no more than ``margin``: then xla."""
    fastest = min(rows, key=lambda r: r.time_s)
    baseline = next((r for r in rows if r.impl == "xla"), None)
    if baseline is not None and fastest.time_s >= baseline.time_s * (1 - margin):
        return baseline
    return fastest


def _check_grid(vocabs, batches, d_model, dtype, ops) -> None:
    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not vocabs or not batches:
        raise UserError("autotune needs at least one vocabulary size and one batch size")
    for what, values in (("vocab", vocabs), ("batch", batches)):
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"{what} sizes must be positive integers, got {v!r}")
    if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 1:
        raise UserError(f"d_model must be a positive integer, got {d_model!r}")
    unknown = [op for op in ops if op not in unembed.OPS]
    if unknown or not ops:
        raise UserError(
            f"unknown op(s) {', '.join(unknown) or '(none)'} (choose from {', '.join(unembed.OPS)})"
        )


def _device_name(kind: str) -> str:
    return (
        "".join(c if c.isalnum() or c in "-_." else "-" for c in kind.lower()).strip("-")
        or "device"
    )


def default_out(device_kind: str | None = None) -> str:
    """``profiles/<device>.json``, e.g. ``profiles/cpu.json`` or ``profiles/nvidia-h200.json``."""
    if device_kind is None:
        device = jax.devices()[0]
        device_kind = str(getattr(device, "device_kind", jax.default_backend()))
    return os.path.join("profiles", f"{_device_name(device_kind)}.json")


def _memory_bytes(device) -> float:
    try:
        stats = device.memory_stats() or {}
    except Exception:  # CPU devices have no memory_stats on some versions
        stats = {}
    if stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16e9
