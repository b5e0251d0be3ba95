"""Continuous batching: a running batch of rows at one head, which requests join between decode
steps and leave when they stop.

    batch = RunningBatch(engine, head=500, max_rows=32, score=True)
    joined, done, calls = batch.join([Joining(tag, ids, limit, key, Sampling(0.8)), ...])
    done, calls = batch.advance(max_steps=16)    # <= 16 steps on the device, fewer if a row stops
    batch.live, batch.rows

The rows come in buckets (powers of two, at most ``max_rows``), so a few compiled shapes serve
every batch size: a join that needs more rows than the bucket has first regroups the batch into
a larger bucket, and once at most a quarter of the rows hold requests it regroups into a
smaller one (``decode.take_rows``); a batch that empties is dropped. The joining prompts are
prefilled together, apart from the running rows (which are not recomputed), and their caches,
first tokens and counters written into free rows (``decode.join``). The two halves are also
callable apart: ``prefill`` of more prompts than there are free rows keeps their caches staged
on the device (``Staged``), and ``join_staged`` writes the next of them into rows as rows free,
so a caller can prefill several waiting prompts in one larger call and join them a few at a
time (``staging.py`` decides which; a staged request whose client leaves is skipped,
``Staged.cancel``):

    staged, call = prefill(engine, [Joining(...), ...], head=500, score=True)
    joined, done, calls = batch.join_staged(staged, 2)   # the first two; staged.left: the rest

``advance`` runs ``decode.decode_some``: the on-device loop, for at most ``max_steps`` steps
and no further than the step at which a row stops, so the host can free its row and admit.

A request's tokens do not depend on the rows it shares a batch with or on when it joined: the
model computes each row on its own, greedy picks are per row, and a sampled row draws token j
with ``fold_in(Joining.key, j)``. So a request gets what ``Engine.generate`` gives it alone
with that key (``solo_key``; tested).

Each request brings its own sampling (``Joining.sampling``: temperature and top k), carried per
row on the device, so one batch holds greedy and sampled requests of any settings. Rows may also
be at different nested heads (``join(..., head=V)``). A batch whose rows are all greedy at one
head steps over that head with ``unembed``'s kernels as before; one that holds sampled rows or
several heads (a mixed group, see ``mixing.py``) steps over the widest head ``W[:V_max]``, each
row picking its own way over its own prefix ``W[:V_row]`` (``decode.pick_rows``), so a row's
tokens are still those of its own head and setting. Such a step is compiled per
``decode.RowPicks`` (whether any row samples, a bucket of the largest top k), not per setting.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from vocabjax.serving import decode
from vocabjax.serving.decode import STOP_CODES, STOP_NAMES, RowPicks, Sampling, Stop
from vocabjax.serving.engine import Engine, attention_window, bucket_length, check_finite

SHRINK = 4  # regroup into a smaller bucket once at most 1/SHRINK of the rows hold requests


def solo_key(seed: int) -> jax.Array:
    """The sampling key of a request that ``Engine.generate`` serves alone with ``seed``: its
    row 0's key, ``fold_in(key(seed), 0)``. One compiled call for a seed in [0, 2^32), the same
    key as the two ops run one by one (the key of a uint32 seed is that of the same Python int),
    which the serving loops make per request: 13 against 195 us on a 2-core CPU
    (benchmarks/live_host.py)."""
    if 0 <= seed < 2**32:
        return _solo_key(np.uint32(seed))
    return _row0_key(seed)


def _row0_key(seed) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), 0)


_solo_key = jax.jit(_row0_key)


@jax.jit
def _stacked(keys: tuple[jax.Array, ...]) -> jax.Array:
    """Typed keys stacked in one compiled call (one per count; eagerly, a call per key)."""
    return jnp.stack(keys)


def pow2_rows(n: int, max_rows: int) -> int:
    """The bucket of rows for ``n`` requests: the next power of two, at most ``max_rows``."""
    return min(max_rows, 1 << max(n - 1, 0).bit_length())


def prefill_rows(n: int) -> int:
    """The rows a prefill of ``n`` prompts runs as: the next power of two (no cap: a prefill
    may take more prompts than a batch has rows, the rest staged)."""
    return 1 << (n - 1).bit_length()


def row_buckets(max_rows: int) -> list[int]:
    """Every bucket of rows ``pow2_rows`` gives for 1 to ``max_rows`` requests."""
    return sorted({pow2_rows(n, max_rows) for n in range(1, max_rows + 1)})


@dataclasses.dataclass(frozen=True)
class Joining:
    """A request joining a running batch."""

    tag: Any  # the caller's handle, given back with its results
    ids: np.ndarray  # prompt ids at the batch's head, the separator first
    limit: int  # most tokens it may generate
    key: jax.Array  # its sampling key (typed): token j is drawn with fold_in(key, j)
    sampling: Sampling = Sampling()  # its temperature and top k (its seed is not read: ``key``)


@dataclasses.dataclass(frozen=True)
class Joined:
    """A request that joined: its prompt's tokens and (``score``) negative log-likelihood."""

    tag: Any
    prompt_tokens: int
    prompt_nats: float | None


@dataclasses.dataclass(frozen=True)
class Finished:
    """A request that stopped: what it generated and why."""

    tag: Any
    tokens: tuple[int, ...]  # generated ids (the stopping separator left out)
    stop: Stop


CallKind = Literal["prefill", "join", "steps", "regroup", "merge", "empty"]


@dataclasses.dataclass(frozen=True)
class Call:
    """One device call of a running batch."""

    kind: CallKind
    head: int
    rows: int  # the bucket it ran at
    running: int  # requests the batch held when it started
    seconds: float  # wall time, results fetched, compiling left out
    compile_s: float  # compiling a new shape and one warm-up call (0 when it was kept)
    steps: int = 0  # decode steps run
    tokens: int = 0  # tokens those steps produced for running rows
    joined: int = 0  # requests that joined (a join)
    bucket: int = 0  # padded prompt length of a join
    mixed: bool = False  # decode steps of rows at several heads (``head``: the widest)
    window: int | None = None  # cache positions decode steps attend to (None: all)

    def compiled_line(self) -> str:
        """``compiled head 500: join at 4 rows, prompts of 16 tokens, in 1.20 s``; decode steps
        within a window of the cache say so (``steps at 8 rows, attending to 64 positions``)."""
        prompts = f", prompts of {self.bucket} tokens" if self.bucket else ""
        if self.kind == "steps" and self.window is not None:
            prompts = f", attending to {self.window} positions"
        mixed = " (heads mixed)" if self.mixed else ""
        return (
            f"compiled head {self.head}{mixed}: {self.kind} at {self.rows} rows{prompts}, in "
            f"{self.compile_s:.2f} s"
        )


@dataclasses.dataclass
class _Row:
    tag: Any
    prompt_tokens: int
    head: int  # the head it runs at
    sampling: Sampling  # how it picks
    end: int  # prompt tokens + its limit: it feeds no token at or past this position
    left: int = 0  # decode steps to its limit or the carry's end, as of the last call's counts


def _padded(
    joining: Sequence[Joining], max_seq: int
) -> tuple[np.ndarray, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, int]:
    """The joining requests as a prefill's inputs, padded to a power of two of rows (a padding
    row is one token long, its key the first request's, its limit 1, greedy): ids (rows,
    bucket) with the bucket from ``bucket_length``, lengths, keys, limits, temperatures, top
    ks (0: none), and the bucket."""
    n_pad = prefill_rows(len(joining))
    pad = n_pad - len(joining)
    lengths = [len(j.ids) for j in joining]
    bucket = bucket_length(max(lengths), max_seq)
    ids_nt = np.zeros((n_pad, bucket), np.int32)
    for row, j in zip(ids_nt, joining, strict=False):
        row[: len(j.ids)] = j.ids
    return (
        ids_nt,
        jnp.asarray(np.asarray(lengths + [1] * pad, np.int32)),
        _stacked(tuple(j.key for j in joining) + (joining[0].key,) * pad),
        jnp.asarray(np.asarray([j.limit for j in joining] + [1] * pad, np.int32)),
        jnp.asarray(np.asarray([j.sampling.temperature for j in joining] + [0] * pad, np.float32)),
        jnp.asarray(np.asarray([j.sampling.top_k or 0 for j in joining] + [0] * pad, np.int32)),
        bucket,
    )


@dataclasses.dataclass
class Staged:
    """Prompts prefilled together, waiting to join running rows (``RunningBatch.join_staged``
    takes them in order, skipping any cancelled): their caches, first tokens, lengths, limits,
    keys, temperatures and top ks on the device, as rows of their own prefill (padding rows
    last), and each one's prompt tokens and nats."""

    head: int
    joining: tuple[Joining, ...]
    joined: tuple[Joined, ...]
    bucket: int  # their padded prompt length
    # caches, first tokens, lengths, limits, keys, temperatures, top ks
    arrays: tuple[Any, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]
    # rows still to join, in order: not joined and not cancelled
    pending: list[int] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.pending = list(range(len(self.joining)))

    @property
    def rows(self) -> int:
        """The prefill's rows (a power of two)."""
        return int(self.arrays[1].shape[0])

    @property
    def left(self) -> int:
        """Requests still to join."""
        return len(self.pending)

    @property
    def waiting(self) -> tuple[Joining, ...]:
        """The requests still to join, in order."""
        return tuple(self.joining[r] for r in self.pending)

    def cancel(self, tag: Any) -> bool:
        """The request ``tag`` will not join (its client left): its row is skipped. False when
        it is not still to join here."""
        rows = [r for r in self.pending if self.joining[r].tag == tag]
        if rows:
            self.pending.remove(rows[0])
        return bool(rows)


def prefill(
    engine: Engine, joining: Sequence[Joining], head: int, score: bool
) -> tuple[Staged, Call]:
    """Prefill ``joining`` together at ``head`` (their ids at that head), apart from any running
    batch, each picking its first token by its own sampling: the staged prompts (their nats
    fetched) and the device call."""
    if not joining:
        raise ValueError("nothing to prefill")
    started = time.perf_counter()
    per_row = row_picks([j.sampling for j in joining], mixed=False)
    config = dataclasses.replace(engine.config(head, Sampling(), score), per_row=per_row)
    ids_nt, lengths_n, keys_n, limits_n, temps_n, topks_n, bucket = _padded(joining, config.max_seq)
    params, n_pad = engine.run.params, len(ids_nt)
    args = (params, jnp.asarray(ids_nt), lengths_n, keys_n, temps_n, topks_n)
    fn, compiled = engine.function(
        ("prefill", head, n_pad, bucket, per_row, score),
        functools.partial(decode.prefill, config),
        args,
    )
    caches, first_n, nats_n = fn(*args)
    if nats_n is None:  # the call ends when its results are there, as the join's does
        jax.block_until_ready(first_n)
        nats = [None] * len(joining)
    else:
        nats = [float(x) for x in jax.device_get(nats_n)[: len(joining)]]
    joined = tuple(Joined(j.tag, len(j.ids), nll) for j, nll in zip(joining, nats, strict=True))
    arrays = (caches, first_n, lengths_n, limits_n, keys_n, temps_n, topks_n)
    staged = Staged(head, tuple(joining), joined, bucket, arrays)
    seconds = time.perf_counter() - started - compiled
    return staged, Call(
        "prefill", head, n_pad, 0, seconds, compiled, joined=len(joining), bucket=bucket
    )


def row_picks(samplings: Sequence[Sampling], *, mixed: bool) -> RowPicks | None:
    """How a call of rows with these samplings picks: None (each by ``unembed``'s kernels, all
    greedy at one head) or the per-row pick they need (``decode.RowPicks``)."""
    if not mixed and all(s.greedy for s in samplings):
        return None
    return RowPicks.of(samplings)


class RunningBatch:
    """The running rows of a batch, at one head or several nested heads, each with its own
    sampling: the decode carry on the device and, per row, the request it holds (host side).
    Not thread-safe: one caller drives it."""

    def __init__(self, engine: Engine, head: int, *, max_rows: int, score: bool = False) -> None:
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows={max_rows!r} must be a positive integer")
        self.engine = engine
        self.head = head  # the head requests join at unless ``join`` names another
        self.max_rows = max_rows
        self.score = score
        self.config = engine.config(head, Sampling(), score)
        self._rows: list[_Row | None] = []
        self._state: decode.Decoding | None = None
        self._keys_b: jax.Array | None = None
        self._done = (0, 0)  # the carry's steps and tokens when the host last read them

    @property
    def rows(self) -> int:
        return len(self._rows)

    @property
    def live(self) -> int:
        """Requests held (running, or stopped and not yet collected: never between calls)."""
        return sum(r is not None for r in self._rows)

    @property
    def room(self) -> int:
        """Requests that can still join."""
        return self.max_rows - self.live

    @property
    def mix(self) -> dict[int, int]:
        """The held requests per head."""
        out: dict[int, int] = {}
        for row in self._rows:
            if row is not None:
                out[row.head] = out.get(row.head, 0) + 1
        return out

    @property
    def vocab(self) -> int:
        """The head its decode steps run over: the widest head it holds (``head`` when empty)."""
        return max(self.mix, default=self.head)

    @property
    def mixed(self) -> bool:
        """Whether it holds requests at several heads (its steps mask each row's prefix)."""
        return len(self.mix) > 1

    @property
    def picks(self) -> RowPicks | None:
        """How its decode steps pick (``row_picks`` of the held requests)."""
        held = [row.sampling for row in self._rows if row is not None]
        return row_picks(held, mixed=self.mixed)

    # ---- the calls ----------------------------------------------------------------------------

    def join(
        self, joining: Sequence[Joining], head: int | None = None
    ) -> tuple[list[Joined], list[Finished], list[Call]]:
        """Prefill ``joining`` (their rows alone, their ids at ``head``, by default the
        batch's) into free rows: each one's prompt tokens and nats, the requests that stopped
        at their first token, and the device calls made (the prefill counted in the join's)."""
        if not joining:
            return [], [], []
        if len(joining) > self.room:
            raise ValueError(f"{len(joining)} requests join a batch with room for {self.room}")
        head = self.head if head is None else head
        staged, first = prefill(self.engine, joining, head, self.score)
        joined, finished, calls = self.join_staged(staged, len(joining))
        calls[-1] = dataclasses.replace(
            calls[-1],
            seconds=calls[-1].seconds + first.seconds,
            compile_s=calls[-1].compile_s + first.compile_s,
        )
        return joined, finished, calls

    def join_staged(
        self, staged: Staged, n: int
    ) -> tuple[list[Joined], list[Finished], list[Call]]:
        """The next ``n`` of ``staged`` (prefilled with this batch's scoring) into free rows:
        their prompt tokens and nats, the requests that stopped at their first token, and the
        device calls made (a regroup first when the bucket is too small, then the join, a
        regroup into a smaller bucket after it)."""
        if not 0 < n <= staged.left:
            raise ValueError(f"{n} requests join from a stage of {staged.left}")
        if n > self.room:
            raise ValueError(f"{n} requests join a batch with room for {self.room}")
        calls, started = self._make_room(self.live + n)
        running = self.live
        free = [r for r, row in enumerate(self._rows) if row is None][:n]
        picks = staged.pending[:n]
        slots_n = np.full(staged.rows, self.rows, np.int32)  # past the last row: not joining now
        slots_n[picks] = free
        args = (self._state, self._keys_b, *staged.arrays, slots_n)
        join, compile_j = self._join_function(staged, args)
        self._state, self._keys_b = join(*args)
        counts = jax.device_get(self._counts())
        del staged.pending[:n]
        for r, p in zip(free, picks, strict=True):
            j = staged.joining[p]
            self._rows[r] = _Row(j.tag, len(j.ids), staged.head, j.sampling, len(j.ids) + j.limit)
        finished = self._collect(counts)
        seconds = time.perf_counter() - started - compile_j
        join_call = Call(
            "join", staged.head, self.rows, running, seconds, compile_j, joined=n,
            bucket=staged.bucket,
        )  # fmt: skip
        return (
            [staged.joined[p] for p in picks],
            finished,
            calls + [join_call, *self._shrink()],
        )

    def _make_room(self, need: int) -> tuple[list[Call], float]:
        """Rows for ``need`` requests: the first carry, or a larger one. The call made (the
        empty carry's, or a regroup) and when the join's own time starts."""
        if self._state is None:
            calls = [self._start(pow2_rows(need, self.max_rows))]
        else:
            calls = [self._regroup(pow2_rows(need, self.max_rows))] if need > self.rows else []
        return calls, time.perf_counter()

    def advance(self, max_steps: int, stops: int = 1) -> tuple[list[Finished], list[Call]]:
        """At most ``max_steps`` decode steps on the device, ending early at the step where
        ``stops`` rows have stopped (``cadence.stops_to_wait`` says how many are worth waiting
        for): the requests that stopped, and the device calls made."""
        if self._state is None or self.live == 0:
            return [], []
        started = time.perf_counter()
        running = self.live
        vocab, mixed = self.vocab, self.mixed
        window = attention_window([r.end for r in self._rows if r is not None], self.config.max_seq)
        # host scalars and index arrays go to the compiled call as numpy: a jnp.asarray first
        # is an eager op of its own (~20 us on a 2-core CPU), per call of the serving loop
        args = (self.engine.run.params, self._state, self._keys_b, np.int32(max_steps),
                np.int32(stops))  # fmt: skip
        steps, compiled = self._steps_function(vocab, self.picks, window, args)
        self._state = steps(*args)
        before = self._done
        counts = jax.device_get(self._counts())
        finished = self._collect(counts)
        ran, tokens = (int(x) - y for x, y in zip(counts[:2], before, strict=True))
        seconds = time.perf_counter() - started - compiled
        call = Call(
            "steps", vocab, self.rows, running, seconds, compiled, ran, tokens, mixed=mixed,
            window=window,
        )  # fmt: skip
        return finished, [call, *self._shrink()]

    def remaining(self) -> list[int]:
        """Each held request's decode steps to its limit (or to the carry's last position),
        in row order, as the last call's counts left them: the most it runs before it stops
        (a stop token ends it sooner)."""
        return [row.left for row in self._rows if row is not None]

    def partial(self) -> dict[Any, tuple[int, ...]]:
        """Each held request's tokens so far (for streaming them)."""
        if self._state is None:
            return {}
        n_b, out_bs = jax.device_get((self._state.n_b, self._state.out_bs))
        return {
            row.tag: tuple(map(int, out_bs[r, : n_b[r]]))
            for r, row in enumerate(self._rows)
            if row is not None
        }

    def absorb(self, other: RunningBatch) -> Call:
        """Move ``other``'s held requests into this batch, leaving ``other`` empty: two groups
        merged into one bucket that holds both (this batch's rows first), their carries
        gathered on the device, nothing recomputed. ``mixing.Pricer.merge`` says when."""
        if other is self or other.engine is not self.engine:
            raise ValueError("a batch absorbs another batch of the same engine")
        if (other.score, other.max_rows) != (self.score, self.max_rows):
            raise ValueError("batches of different scoring or max_rows cannot merge")
        if self._state is None or other._state is None:
            raise ValueError("an empty batch has nothing to merge")
        if self.live + other.live > self.max_rows:
            raise ValueError(f"{self.live} + {other.live} requests exceed {self.max_rows} rows")
        started = time.perf_counter()
        mine = [r for r, row in enumerate(self._rows) if row is not None]
        theirs = [r for r, row in enumerate(other._rows) if row is not None]
        rows = pow2_rows(len(mine) + len(theirs), self.max_rows)
        held = mine + [self.rows + r for r in theirs]
        index_r, real_r = _gather(held, rows)
        args = (self._state, self._keys_b, other._state, other._keys_b, index_r, real_r)
        key = ("merge", self.rows, other.rows, rows)
        merge, compiled = self.engine.function(key, _merged, args)
        self._state, self._keys_b = jax.block_until_ready(merge(*args))
        running = len(held)
        self._rows = (
            [self._rows[r] for r in mine]
            + [other._rows[r] for r in theirs]
            + [None] * (rows - len(held))
        )
        other._state, other._keys_b, other._rows = None, None, []
        seconds = time.perf_counter() - started - compiled
        return Call("merge", self.vocab, rows, running, seconds, compiled, mixed=self.mixed)

    def cancel(self, tag: Any) -> bool:
        """Stop the request ``tag`` (its client left): its row is free and runs no more.
        False when the batch does not hold it."""
        held = [r for r, row in enumerate(self._rows) if row is not None and row.tag == tag]
        if not held:
            return False
        assert self._state is not None
        self._rows[held[0]] = None
        self._state = self._state._replace(real_b=self._state.real_b.at[held[0]].set(False))
        self._shrink()
        return True

    def compile_shapes(
        self,
        stages: Sequence[Staged],
        windows: Sequence[int | None],
        picks: Sequence[RowPicks | None] = (None,),
    ) -> None:
        """Compile every call this batch makes at its own head, rows at one head: at each
        bucket of rows up to ``max_rows``, its empty carry, a decode call attending to each of
        ``windows`` for each of ``picks`` (None: greedy rows), a join from each of ``stages``
        (prefilled at its head, one per size of stage) and a regroup into each other bucket.
        The carry is left empty; nothing joins. Only for a batch that holds no request (its
        carry is replaced)."""
        if self.live:
            raise ValueError(f"compile_shapes replaces the carry: {self.live} requests are held")
        buckets, params = row_buckets(self.max_rows), self.engine.run.params
        for rows in buckets:
            self._start(rows)
            for window, how in itertools.product(windows, picks):
                args = (params, self._state, self._keys_b, np.int32(1), np.int32(1))
                self._steps_function(self.head, how, window, args)
            for staged in stages:
                slots_n = np.full(staged.rows, rows, np.int32)  # none joins (as ``join`` passes)
                self._join_function(staged, (self._state, self._keys_b, *staged.arrays, slots_n))
            for other in buckets:
                if other != rows:
                    self._start(rows)
                    self._regroup(other)
        self._state, self._keys_b, self._rows = None, None, []

    def _steps_function(
        self, vocab: int, picks: RowPicks | None, window: int | None, args: tuple
    ) -> tuple[Any, float]:
        """The compiled decode call of this carry at ``vocab`` picking by ``picks`` (None: all
        greedy by the kernels; else each row its own way over its own head) attending to
        ``window`` positions, and the seconds compiling it took."""
        config = self.engine.config(vocab, Sampling(), self.score)
        config = dataclasses.replace(config, per_row=picks, window=window)
        return self.engine.function(
            ("steps", vocab, self.rows, picks, window),
            functools.partial(decode.decode_some, config),
            args,
            donate=(1,),
        )

    def _join_function(self, staged: Staged, args: tuple) -> tuple[Any, float]:
        """The compiled join of ``staged``'s rows into this carry (one per carry and stage
        size), and the seconds compiling it took."""
        config = self.engine.config(staged.head, Sampling(), self.score)
        return self.engine.function(
            ("join", staged.head, self.rows, staged.rows),
            functools.partial(_join_picked, config),
            args,
            donate=(0, 1),
        )

    # ---- rows ---------------------------------------------------------------------------------

    def _start(self, rows: int) -> Call:
        """An empty carry of ``rows`` rows (its cache written with zeros): the call."""
        started = time.perf_counter()
        params = self.engine.run.params
        empty, compiled = self.engine.function(
            ("empty", self.head, rows),
            functools.partial(_empty, self.config, rows=rows),
            (params,),
        )
        self._state, self._keys_b = jax.block_until_ready(empty(params))
        self._done = (0, 0)
        self._rows = [None] * rows
        seconds = time.perf_counter() - started - compiled
        return Call("empty", self.head, rows, 0, seconds, compiled)

    def _regroup(self, rows: int) -> Call:
        """The held requests moved into the first rows of a bucket of ``rows``."""
        started = time.perf_counter()
        held = [r for r, row in enumerate(self._rows) if row is not None]
        index_r, real_r = _gather(held, rows)
        args = (self._state, self._keys_b, index_r, real_r)
        regroup, compiled = self.engine.function(("regroup", self.rows, rows), _regrouped, args)
        self._state, self._keys_b = jax.block_until_ready(regroup(*args))
        running = len(held)
        self._rows = [self._rows[r] for r in held] + [None] * (rows - len(held))
        seconds = time.perf_counter() - started - compiled
        return Call("regroup", self.vocab, rows, running, seconds, compiled)

    def _shrink(self) -> list[Call]:
        """Drop an empty batch; regroup one whose requests fill at most 1/SHRINK of its rows."""
        live = self.live
        if live == 0:
            self._state, self._keys_b, self._rows = None, None, []
            return []
        smaller = pow2_rows(live, self.max_rows)
        return [self._regroup(smaller)] if SHRINK * live <= self.rows else []

    def _counts(self) -> tuple[jax.Array, ...]:
        """What the host reads after a call: the steps and tokens so far, each row's stop, its
        tokens so far and its next position."""
        state = self._state
        assert state is not None
        return state.steps, state.produced, state.stop_b, state.n_b, state.pos_b

    def _collect(self, counts: tuple[np.ndarray, ...]) -> list[Finished]:
        """The held requests whose rows have stopped (``counts``: fetched ``_counts``); their
        rows become free. The others' steps left are updated."""
        assert self._state is not None
        steps, produced, stop_b, n_b, pos_b = counts
        self._done = (int(steps), int(produced))
        max_seq = self.config.max_seq
        for r, row in enumerate(self._rows):
            if row is not None:
                left = min(row.end - row.prompt_tokens - int(n_b[r]), max_seq - int(pos_b[r]))
                row.left = max(left, 0)
        done = [
            r
            for r, row in enumerate(self._rows)
            if row is not None and stop_b[r] != STOP_CODES["running"]
        ]
        if not done:
            return []
        check_finite(stop_b[done])
        n_b, out_bs = jax.device_get((self._state.n_b, self._state.out_bs))
        finished = []
        for r in done:
            row = self._rows[r]
            assert row is not None
            stop: Stop = STOP_NAMES[int(stop_b[r])]  # type: ignore[assignment]  (finite: checked)
            finished.append(Finished(row.tag, tuple(map(int, out_bs[r, : n_b[r]])), stop))
            self._rows[r] = None
        return finished


def _gather(held: list[int], rows: int) -> tuple[jax.Array, jax.Array]:
    """``take_rows``'s index and mask: rows ``held`` first, then ``rows - len(held)`` empty."""
    index_r = jnp.asarray(np.asarray(held + [0] * (rows - len(held)), np.int32))
    return index_r, jnp.asarray(np.arange(rows) < len(held))


def _join_picked(
    config: decode.DecodeConfig,
    state: decode.Decoding,
    keys_b: jax.Array,
    caches: Any,
    first_n: jax.Array,
    lengths_n: jax.Array,
    limits_n: jax.Array,
    keys_n: jax.Array,
    temps_n: jax.Array,
    topks_n: jax.Array,
    slots_n: jax.Array,
) -> tuple[decode.Decoding, jax.Array]:
    """``decode.join`` of a stage's rows into rows ``slots_n`` of the carry: a stage row whose
    slot is past the last row does not join now (its cache is not read). One compiled join per
    carry and stage size, however many of the stage join."""
    real_n = slots_n < keys_b.shape[0]
    return decode.join(
        config, state, keys_b, caches, first_n, lengths_n, limits_n, real_n, keys_n, slots_n,
        temps_n, topks_n,
    )  # fmt: skip


def _regrouped(
    state: decode.Decoding, keys_b: jax.Array, index_r: jax.Array, real_r: jax.Array
) -> tuple[decode.Decoding, jax.Array]:
    return decode.take_rows(state, index_r, real_r), jnp.take(keys_b, index_r, axis=0)


def _merged(
    state: decode.Decoding,
    keys_b: jax.Array,
    other: decode.Decoding,
    other_keys_b: jax.Array,
    index_r: jax.Array,
    real_r: jax.Array,
) -> tuple[decode.Decoding, jax.Array]:
    """The rows of ``state`` then ``other`` (its steps and tokens counters ``state``'s), taken
    by ``index_r`` into one carry."""

    def cat(x, y):
        return jnp.concatenate([x, y])

    both = state._replace(
        **{f: jax.tree.map(cat, getattr(state, f), getattr(other, f)) for f in decode.ROW_FIELDS}
    )
    keys = jnp.concatenate([keys_b, other_keys_b])
    return decode.take_rows(both, index_r, real_r), jnp.take(keys, index_r, axis=0)


def _empty(config: decode.DecodeConfig, params, *, rows: int) -> tuple[decode.Decoding, jax.Array]:
    """An empty carry of ``rows`` rows and stand-in row keys (each replaced as a row joins)."""
    return decode.empty(config, params, rows=rows), decode.row_keys(jax.random.key(0), rows)
