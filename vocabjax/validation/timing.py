"""Build and time the calls of the validation points.

Every point's call is compiled first (its compile time kept), then autotune's
``time_interleaved`` times all of them side by side: one untimed first call each, warm-up
rounds, then rounds that call every point once in a rotating order, the median per point; each
call blocks until its results are ready. A noisy machine so slows every point alike. Before
every call a buffer of four times the last-level cache is written (``timing.cache_evictor``),
so each call reads its weights from memory rather than a warm cache: in a rotating order a
point always follows the same point, and one that follows a point reading the same weights
(decode at T = 512 after decode at T = 64, same V) can find them cached every round (the full
grid of 2026-12-04, without eviction: `tiny` V = 16k B = 1, 0.38 ms at T = 512 against 0.79
at T = 64; docs/validation.md). Each model shape's points share one set of parameters
(``Group``); every group stays resident while the rounds run.

What each family's call runs (float32 throughout, parameters drawn from a fixed seed):

    decode       the serving engine's jitted decode loop (``Engine``'s own compiled function)
                 for ``decode_steps`` steps (or the point's own ``steps``) on a cache of T
                 positions; per step = call / steps
    prefill      the engine's compiled prefill: B prompts of T tokens into a cache of T
    train        ``make_train_step``'s step (loss, gradient, AdamW) on B windows of T + 1 ids
    backbone     the model's blocks (``GPT.blocks``) on x of (B, 1, D)
    attention    the einsums, mask and softmax of ``Attention._attend`` over L caches of T
                 positions (without its output projection, which is a backbone matmul)
    unembedding  ``GPT.logits``' einsum: h @ W[:V].T at HIGHEST precision, (B, V) f32

An op's call takes only the arrays it reads (a jitted call's dispatch time grows with its
arguments); a step's call takes what the engine or the training loop passes.

The engine's prefill and decode are closures that ``Engine`` compiles for a trained run; a
stand-in run (these parameters, one head, no tokenizer: ids are drawn, never encoded) lets them
be compiled and called as ``serve`` calls them.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vocabjax.errors import UserError
from vocabjax.models import GPT, GPTConfig
from vocabjax.models.gpt import LayerCache
from vocabjax.progress import Progress
from vocabjax.serving.engine import MIN_BUCKET, Engine, LoadedRun, Sampling
from vocabjax.shapes import ModelShape
from vocabjax.timing import Tally, cache_evictor, minor_faults, spread_pct, time_rounds
from vocabjax.train import CorpusSpec, Functional, HeadTokenizer, RunConfig
from vocabjax.train.steps import make_train_step, optimizer
from vocabjax.validation.grid import Grid, Point

Call = Callable[[], Any]


class Timed(NamedTuple):
    """One point's timing: seconds per step (decode: per step of the loop) or per op, its
    compile seconds, the median minor page faults of one timed call (None: not counted), and
    the memory one call maps afresh (``fresh_bytes``), and the timed calls' own spread,
    (max - min) / median in % (``repeat_spread_pct``)."""

    seconds: float
    compile_s: float
    faults_per_call: float | None
    fresh_bytes: float | None
    repeat_spread_pct: float | None = None


# glibc serves an allocation of less than its largest mmap threshold (32 MiB on 64-bit) from its
# heap, reused call after call; a larger one it maps afresh and unmaps when freed, so every page
# of it faults again on the next call (docs/validation.md)
FRESH_THRESHOLD = 32 * 2**20


def fresh_bytes(compiled) -> float | None:
    """The memory one call of ``compiled`` (a jax ``Compiled``) maps afresh: on a CPU, XLA's
    temporary buffer (one allocation per call, ``memory_analysis().temp_size_in_bytes``) when
    it is ``FRESH_THRESHOLD`` or more, else 0; 0 on an accelerator (its allocator keeps its
    memory); None where XLA gives no memory analysis."""
    if jax.default_backend() != "cpu":
        return 0.0
    try:
        analysis = compiled.memory_analysis()
    except (NotImplementedError, jax.errors.JaxRuntimeError):
        return None
    if analysis is None:
        return None
    temp = float(analysis.temp_size_in_bytes)
    return temp if temp >= FRESH_THRESHOLD else 0.0


class Built(NamedTuple):
    """A point's timed call, its compile seconds and the memory it maps afresh."""

    call: Call
    compile_s: float
    fresh_bytes: float | None


class _Params:
    """One shape's parameters, drawn once at the grid's largest V and longest sequence. A
    smaller model's parameters (V rows of the tables, fewer positions) are prefix slices, each
    distinct slice made once, so the points of a group share every array they can."""

    def __init__(self, shape: ModelShape, vocab: int, max_seq: int, seed: int) -> None:
        self.shape = shape
        self.vocab, self.max_seq = vocab, max_seq
        model = GPT(GPTConfig(shape, max_vocab=vocab, max_seq=max_seq), rngs=nnx.Rngs(seed))
        _, self.base = Functional.of(model)
        self._slices: dict[tuple, jax.Array] = {}
        self._models: dict[tuple[int, int], tuple[Functional, dict[str, jax.Array]]] = {}

    def model(self, vocab: int, max_seq: int) -> tuple[Functional, dict[str, jax.Array]]:
        """(graph, parameters) of the GPT with ``vocab`` rows of tables and ``max_seq``
        positions."""
        key = (vocab, max_seq)
        if key not in self._models:
            config = GPTConfig(self.shape, max_vocab=vocab, max_seq=max_seq)
            fn, like = Functional.of(nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0))))
            self._models[key] = (fn, {n: self._slice(n, like[n].shape) for n in fn.names})
        return self._models[key]

    def _slice(self, name: str, shape: tuple[int, ...]) -> jax.Array:
        base = self.base[name]
        if base.shape == shape:
            return base
        if (name, shape) not in self._slices:
            self._slices[name, shape] = base[tuple(slice(0, n) for n in shape)]
        return self._slices[name, shape]


def _stand_in_engine(shape: ModelShape, fn: Functional, params, vocab: int, max_seq: int):
    """An ``Engine`` over these parameters: one head of ``vocab``, no tokenizer, no separator."""
    config = RunConfig(
        shape=shape, heads=(vocab,), tokenizer="-", corpus=CorpusSpec("builtin"), steps=1,
        seq_len=max_seq,
    )  # fmt: skip
    level = HeadTokenizer(vocab, None, None, np.zeros(vocab, np.int64))  # type: ignore[arg-type]
    run = LoadedRun(Path("."), config, fn.model(params), fn, params, (level,), step=0)
    return Engine(run)


def _decode_attention(q_btkgd: jax.Array, caches: Sequence[LayerCache], pos_b: jax.Array) -> list:
    """Decode attention of each layer over its cache, as ``Attention._attend`` computes it
    (scores, causal mask up to ``pos_b``, softmax, weighted values), without the output
    projection."""
    s, dh = caches[0].k_bskd.shape[1], caches[0].k_bskd.shape[-1]
    mask_bts = jnp.arange(s, dtype=pos_b.dtype)[None, None, :] <= pos_b[:, None, None]
    out = []
    for cache in caches:
        scores = jnp.einsum(
            "btkgd,bskd->bkgts", q_btkgd, cache.k_bskd, preferred_element_type=jnp.float32
        ) / math.sqrt(dh)
        scores = jnp.where(mask_bts[:, None, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        out.append(
            jnp.einsum("bkgts,bskd->btkgd", probs, cache.v_bskd, preferred_element_type=jnp.float32)
        )
    return out


class Group:
    """The calls of one shape's points, built (compiled) one by one, then timed together."""

    def __init__(self, shape: ModelShape, grid: Grid, points: Sequence[Point], seed: int = 0):
        self.shape, self.grid = shape, grid
        self.params = _Params(shape, grid.max_vocab, grid.max_seq, seed)
        self.rng = np.random.default_rng(seed)
        # the prefill points: a decode point at the same (V, B, T) shares their engine build
        self._prefills = {(p.vocab, p.batch, p.context) for p in points if p.family == "prefill"}
        self._engines: dict[tuple, tuple] = {}
        self._caches: dict[tuple[int, int], list] = {}
        self._train_states: dict[int, tuple[Any, list]] = {}

    # ---- inputs ---------------------------------------------------------------------------
    def _normal(self, shape: tuple[int, ...]) -> jax.Array:
        return jnp.asarray(self.rng.standard_normal(shape, dtype=np.float32))

    def _cache_holder(self, batch: int, length: int) -> list:
        """[caches] of B rows and ``length`` positions, shared by the decode points (which
        donate it and put back the loop's result) and the attention points of that (B, T)."""
        key = (batch, length)
        if key not in self._caches:
            m = self.shape
            cache = (batch, length, m.n_kv_heads, m.dh)
            self._caches[key] = [
                tuple(
                    LayerCache(self._normal(cache), self._normal(cache)) for _ in range(m.n_layers)
                )
            ]
        return self._caches[key]

    def _engine(self, vocab: int, batch: int, max_seq: int, bucket: int):
        """(prefill, decode, compile seconds, example arguments) of the engine for a head of
        ``vocab``, B rows, a cache of ``max_seq`` and prompts of ``bucket`` tokens."""
        key = (vocab, batch, max_seq, bucket)
        if key not in self._engines:
            fn, params = self.params.model(vocab, max_seq)
            engine = _stand_in_engine(self.shape, fn, params, vocab, max_seq)
            ids = jnp.asarray(self.rng.integers(0, vocab, (batch, bucket), dtype=np.int32))
            example = (params, ids, jnp.full((batch,), bucket, jnp.int32), jax.random.key(0))
            # Engine's own compile step: prefill + decode loop, one warm-up call of each
            prefill, decode, seconds = engine.compile(
                vocab, batch, bucket, Sampling(), False, example
            )
            self._engines[key] = (prefill, decode, seconds, example)
        return self._engines[key]

    # ---- one call per family --------------------------------------------------------------
    def build(self, point: Point) -> Built:
        """The point's timed call, its compile seconds and the memory it maps afresh."""
        call, seconds, compiled = getattr(self, f"_{point.family}")(point)
        return Built(call, seconds, fresh_bytes(compiled))

    def _decode(self, p: Point) -> tuple[Call, float, Any]:
        t, n = p.context, p.per_call(self.grid.decode_steps)
        bucket = t if (p.vocab, p.batch, t) in self._prefills else min(MIN_BUCKET, t)
        _, decode, seconds, (params, _, _, rng) = self._engine(p.vocab, p.batch, t, bucket)
        holder = self._cache_holder(p.batch, t)
        first_b = jnp.zeros((p.batch,), jnp.int32)
        start_b = jnp.full((p.batch,), t - n, jnp.int32)  # the n steps end at the last position
        limits_b = jnp.full((p.batch,), n + 1, jnp.int32)  # the first token counts as one
        real_b = jnp.ones((p.batch,), bool)

        def call():
            done = decode(params, holder[0], first_b, start_b, limits_b, real_b, rng)
            holder[0] = done.caches
            return done

        steps = int(jax.block_until_ready(call()).steps)
        if steps != n:
            raise UserError(f"{p.label()}: the engine's decode loop ran {steps} steps, not {n}")
        return call, seconds, decode

    def _prefill(self, p: Point) -> tuple[Call, float, Any]:
        prefill, _, seconds, example = self._engine(p.vocab, p.batch, p.context, p.context)
        return (lambda: prefill(*example)), seconds, prefill

    def _train(self, p: Point) -> tuple[Call, float, Any]:
        fn, params = self.params.model(p.vocab, p.context)
        config = RunConfig(
            shape=self.shape, heads=(p.vocab,), tokenizer="-", corpus=CorpusSpec("builtin"),
            steps=1000, seq_len=p.context, batch=p.batch,
        )  # fmt: skip
        if p.vocab not in self._train_states:
            # one training state per V, continued by every batch size's step (memory: one
            # copy of parameters and AdamW moments per V, as train/steps.py's ``stepping``)
            tx = optimizer(config)
            self._train_states[p.vocab] = (tx, [jax.tree.map(jnp.copy, (params, tx.init(params)))])
        tx, holder = self._train_states[p.vocab]
        step = make_train_step(fn, (p.vocab,), tx, config.impl)
        batch_hbt = jnp.asarray(
            self.rng.integers(0, p.vocab, (1, p.batch, p.context + 1), dtype=np.int32)
        )
        started = time.perf_counter()
        compiled = step.lower(*holder[0], batch_hbt).compile()
        seconds = time.perf_counter() - started

        def call():
            new_params, new_opt, losses = compiled(*holder[0], batch_hbt)
            holder[0] = (new_params, new_opt)
            return losses, new_params

        return call, seconds, compiled

    def _compiled(self, fn: Callable, *args) -> tuple[Call, float, Any]:
        started = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        return (lambda: compiled(*args)), time.perf_counter() - started, compiled

    def _backbone(self, p: Point) -> tuple[Call, float, Any]:
        fn, params = self.params.model(self.params.vocab, self.params.max_seq)
        # the blocks alone as (graph, arrays): the call takes their weights and nothing else
        blocks_fn, blocks = Functional.of(fn.model(params).blocks)

        def layers(blocks, x_btd):
            for block in blocks_fn.model(blocks):
                x_btd = block(x_btd)
            return x_btd

        return self._compiled(layers, blocks, self._normal((p.batch, 1, self.shape.d_model)))

    def _attention(self, p: Point) -> tuple[Call, float, Any]:
        m = self.shape
        q = self._normal((p.batch, 1, m.n_kv_heads, m.n_heads // m.n_kv_heads, m.dh))
        holder = self._cache_holder(p.batch, p.context)
        pos_b = jnp.full((p.batch,), p.context - 1, jnp.int32)  # every cached position seen
        started = time.perf_counter()
        compiled = jax.jit(_decode_attention).lower(q, holder[0], pos_b).compile()
        seconds = time.perf_counter() - started
        return (lambda: compiled(q, holder[0], pos_b)), seconds, compiled

    def _unembedding(self, p: Point) -> tuple[Call, float, Any]:
        fn, params = self.params.model(p.vocab, self.params.max_seq)
        w_vd = fn.model(params).head(p.vocab)
        h_btd = self._normal((p.batch, 1, self.shape.d_model))

        def logits(h_btd, w_vd):  # GPT.logits on the head's rows alone
            return jnp.einsum(
                "btd,vd->btv", h_btd, w_vd, preferred_element_type=jnp.float32,
                precision=jax.lax.Precision.HIGHEST,
            )  # fmt: skip

        return self._compiled(logits, h_btd, w_vd)


def resident_bytes(shape: ModelShape, points: Sequence[Point], grid: Grid) -> float:
    """About the bytes a shape's group holds at once (f32): the parameters at the grid's
    largest V and their smaller-V table slices, one KV cache per (B, T), one training state
    (parameters and two AdamW moments) per training V, and the largest single call's
    transient (a prefill's cache, the logits, a gradient)."""
    f32, d = 4.0, shape.d_model
    n_nv = float(shape.n_nonembedding)
    tables = {v for p in points if p.vocab is not None for v in [p.vocab]} - {grid.max_vocab}
    total = f32 * (n_nv + (2 * grid.max_vocab + grid.max_seq) * d)
    total += sum(f32 * 2 * v * d for v in tables)
    per_token = f32 * shape.kv_elements_per_token
    caches = {(p.batch, p.context) for p in points if p.family in ("decode", "attention")}
    total += sum(b * t * per_token for b, t in caches)
    train = {p.vocab for p in points if p.family == "train"}
    total += sum(3 * f32 * (n_nv + 2 * v * d) for v in train)
    transient = [0.0]
    for p in points:
        if p.family == "prefill":
            transient.append(p.batch * p.context * per_token)
        elif p.family == "unembedding":
            transient.append(f32 * p.batch * p.vocab)
        elif p.family == "train":
            transient.append(f32 * (n_nv + 2 * p.vocab * d))
    return total + max(transient)


def measure(
    points: Sequence[Point],
    grid: Grid,
    *,
    seed: int = 0,
    progress: Progress | None = None,
    by_shape: bool = False,
    warm: bool = False,
) -> list[Timed]:
    """(measured seconds per step or op, compile seconds, minor page faults per call) of each
    of ``points`` (``Timed``; the faults None where the platform does not count them): every
    point's call is built (compiled) first, shape by shape, then all are timed round-robin as
    one set, so that a load that comes and goes during the run slows every point alike.
    ``by_shape``: each model shape's points are built and timed as a set of their own, one
    shape after another, the other shapes' arrays and calls freed (a point can run slower
    beside the other shapes' resident arrays: docs/validation.md). ``warm``: each point's calls
    back to back, nothing between them, one point after another, as a serving loop calls its
    steps (on a CPU whose last-level cache holds a point's arrays they are read from there, and
    the runtime's own state is warm too: docs/validation.md, "Warm calls")."""
    if not by_shape:
        return _measure_set(points, grid, seed=seed, progress=progress, warm=warm)
    out: dict[int, Timed] = {}
    for shape in dict.fromkeys(p.shape for p in points):
        index = [i for i, p in enumerate(points) if p.shape == shape]
        times = _measure_set(
            [points[i] for i in index], grid, seed=seed, progress=progress, warm=warm
        )
        out.update(zip(index, times, strict=True))
    return [out[i] for i in range(len(points))]


def _measure_set(
    points: Sequence[Point], grid: Grid, *, seed: int, progress: Progress | None, warm: bool
) -> list[Timed]:
    """``measure`` of one set of points timed together."""
    say = progress or (lambda _m: None)
    shapes = list(dict.fromkeys(p.shape for p in points))
    try:
        groups = {s: Group(s, grid, [p for p in points if p.shape == s], seed) for s in shapes}
        calls, compiles, fresh = [], [], []
        for i, p in enumerate(points, 1):
            built = groups[p.shape].build(p)
            calls.append(built.call)
            compiles.append(built.compile_s)
            fresh.append(built.fresh_bytes)
            say(f"validate: compiled {i}/{len(points)}: {p.label()} ({built.compile_s:.1f} s)")
        s = grid.timing
        if warm:
            say(
                f"validate: timing {len(points)} points one after another, each called back to "
                f"back ({s.warmup - 1} warm-up and {s.repeats} timed calls after a first call)"
            )
            rounds, faults = [], []
            for i, call in enumerate(calls):
                own = Tally(minor_faults)
                rounds += time_rounds([call], [()], s, tally=own)
                faults += own.medians(1)
                if (i + 1) % 50 == 0 and i + 1 < len(calls):
                    say(f"validate: timed {i + 1}/{len(calls)}")
        else:
            say(
                f"validate: timing {len(points)} points round-robin ({s.warmup - 1} warm-up "
                f"and {s.repeats} timed rounds after a first call each)"
            )
            tally = Tally(minor_faults)
            rounds = time_rounds(calls, [()], s, between=cache_evictor(), tally=tally)
            faults = tally.medians(len(points))
    except jax.errors.JaxRuntimeError as exc:  # e.g. RESOURCE_EXHAUSTED: the grid's memory
        first = str(exc).strip().splitlines()[0][:300]
        raise UserError(f"validate: the device refused a call: {first}") from None
    finally:
        groups = calls = None  # free the arrays before the caller goes on
        gc.collect()
    per_call = [p.per_call(grid.decode_steps) for p in points]
    return [
        Timed(statistics.median(t) / n, c, f, m, spread_pct(t))
        for t, n, c, f, m in zip(rounds, per_call, compiles, faults, fresh, strict=True)
    ]
