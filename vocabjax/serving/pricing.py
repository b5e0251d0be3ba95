"""What the cost model predicts for the device calls a served trace made, call by call, beside
what each call measured: where the simulator's price of serving and the serving loop part.

Every device call of the continuous loop is a host call (the profile's dispatch overhead)
plus its work, priced by the same ``CostModel`` that ``sweep`` and ``plan`` use:

    prefill   ``CostModel.prefill_time`` of its rows (a power of two) and padded prompt length,
              the zeros of its cache (every row ``max_seq`` positions, written once) and, where
              prompts are scored, ``CostModel.score_ops`` of every padded prompt position
    steps     k decode steps of its head, rows and attended positions (its window, else
              ``max_seq``), priced as a loop of k steps per call (``Settings.steps_per_call``:
              one host call, the steps after the first reading what fits a calibrated
              profile's cache)
    join      staged rows moved into free rows of the running carry: each joining row's
              cache read from the stage and written into the carry (two passes over a row's
              bytes; the stage's other rows are not read)
    regroup   the held rows gathered into a carry of another size: read and written
    merge     two groups' carries concatenated, then gathered into one: priced as two passes
              over the merged carry's rows each way
    empty     a new group's carry of zeros, written once

A row's bytes are its cache (``2 L K Dh`` elements a position at the KV dtype, ``max_seq``
positions) and its generated tokens (``max_seq`` int32). The copies run at the profile's
elementwise efficiency. A static batch (``--batching static``) is one record per batch:
its prefill, scored as above, and its decode loop of k steps.

The measured side is each call's wall time as the clock charged it (results fetched,
compiling left out), host work inside the call included; what the host does between calls
is on no call and priced by none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from vocabjax import unembed
from vocabjax.costmodel import CostModel, Op, Settings
from vocabjax.hardware import DeviceProfile
from vocabjax.serving.batching import Call
from vocabjax.xp import PyMath

TOKEN_BYTES = 4  # a generated token id in the carry: int32
JOIN_PASSES = 2  # a joining row: read from the stage, written into the carry
MERGE_PASSES = 4  # a merge: the concatenation read and written, then gathered: read and written
KINDS = ("prefill", "join", "steps", "regroup", "merge", "empty", "batch")


def run_model(run, device: DeviceProfile) -> CostModel:
    """The cost model of a served run (``LoadedRun``) on ``device``: the run's shape, its
    weights' and its compute dtype, attention as vocabjax's model computes it (every query
    against every position, materialized)."""
    compute = unembed.dtype_name(run.model.config.dtype)
    weights = {unembed.dtype_name(x.dtype) for x in run.params.values() if x.ndim == 2}
    settings = Settings(
        weight_dtype=weights.pop() if len(weights) == 1 else compute,
        kv_dtype=compute,
        act_dtype=compute,
        attention="materialized",
    )
    return CostModel(device, run.config.shape, settings)


@dataclasses.dataclass(frozen=True)
class Priced:
    """The calls of one kind: how many, their measured and their predicted seconds."""

    kind: str
    calls: int
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        """Predicted over measured, less 1 (negative: priced too fast)."""
        return self.predicted_s / self.measured_s - 1.0 if self.measured_s > 0 else 0.0

    def row(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "calls": self.calls,
            "measured_ms": round(1e3 * self.measured_s, 3),
            "predicted_ms": round(1e3 * self.predicted_s, 3),
            "error_pct": round(100.0 * self.error, 1),
        }


class CallPricer:
    """Prices the serving loop's device calls (module doc) on one cost model, for a run whose
    carries hold ``max_seq`` positions."""

    def __init__(self, cm: CostModel, max_seq: int) -> None:
        self.cm = cm
        self.max_seq = max_seq
        self._loops: dict[int, CostModel] = {}

    @classmethod
    def of(cls, run, device: DeviceProfile) -> CallPricer:
        """The pricer of a served run (``LoadedRun``) on ``device`` (``run_model``)."""
        return cls(run_model(run, device), run.max_seq)

    @property
    def row_bytes(self) -> float:
        """One row of a carry: its cache and its generated tokens."""
        kv = self.cm.shape.kv_elements_per_token * self.cm.k
        return float(self.max_seq) * (kv + TOKEN_BYTES)

    def _copy(self, nbytes: float) -> float:
        """One host call moving ``nbytes`` (one kernel, at the elementwise efficiency)."""
        t = self.cm.op_time(Op(0.0, nbytes, kind="elementwise"), xp=PyMath).t
        return t + self.cm.host_call(kernels=1.0)

    def steps(self, k: int, head: int, rows: int, context: int | None = None) -> float:
        """One call of ``k`` decode steps at ``head`` and ``rows`` rows attending to
        ``context`` positions (all ``max_seq`` by default)."""
        if k not in self._loops:
            settings = dataclasses.replace(self.cm.settings, steps_per_call=k)
            self._loops[k] = CostModel(self.cm.device, self.cm.shape, settings)
        positions = float(context or self.max_seq)
        return k * self._loops[k].decode_step(float(head), float(rows), positions, xp=PyMath)

    def prefill(self, head: int, rows: int, bucket: int, *, score: bool) -> float:
        """One prefill call of ``rows`` prompts padded to ``bucket`` tokens, ``score``: their
        positions scored."""
        cm = self.cm
        t = cm.prefill_time(float(head), float(rows), float(bucket), xp=PyMath)
        zeros = cm.op_time(Op(0.0, rows * self.row_bytes, kind="elementwise"), xp=PyMath).t
        if not score:
            return t + zeros
        ops = cm.score_ops(float(head), float(rows * bucket))
        return t + zeros + sum(cm.op_time(op, xp=PyMath).t for op in ops.values())

    def seconds(self, call: Call, *, score: bool) -> float:
        """The predicted seconds of one device call of the continuous loop (``score``: a
        prefill scores its prompts)."""
        if call.kind == "prefill":
            return self.prefill(call.head, call.rows, call.bucket, score=score)
        if call.kind == "steps":
            return self.steps(call.steps, call.head, call.rows, call.window)
        if call.kind == "join":
            return self._copy(JOIN_PASSES * call.joined * self.row_bytes)
        if call.kind == "regroup":
            return self._copy(2.0 * call.rows * self.row_bytes)
        if call.kind == "merge":
            return self._copy(MERGE_PASSES * call.rows * self.row_bytes)
        if call.kind == "empty":
            return self._copy(call.rows * self.row_bytes)
        raise ValueError(f"no price for a {call.kind!r} call")

    def served(self, result) -> list[Priced]:
        """A served trace's calls by kind, in ``KINDS`` order: measured against predicted
        (continuous: every call the clock was charged for; static: each batch)."""
        score = result.config.score_prompts
        totals: dict[str, list[float]] = {}

        def add(kind: str, measured: float, predicted: float) -> None:
            n, m, p = totals.get(kind, (0, 0.0, 0.0))
            totals[kind] = [n + 1, m + measured, p + predicted]

        if result.config.batching == "static":
            for b in result.batches:
                predicted = self.prefill(b.head, b.rows, b.bucket, score=score)
                if b.steps:
                    predicted += self.steps(b.steps, b.head, b.rows)
                add("batch", b.service_s, predicted)
        else:
            for c in result.calls:
                add(c.kind, c.seconds, self.seconds(c, score=score))
        return [Priced(k, int(totals[k][0]), *totals[k][1:]) for k in KINDS if k in totals]


def total(priced: Iterable[Priced]) -> Priced:
    """Every kind together."""
    rows = list(priced)
    return Priced(
        "all",
        sum(p.calls for p in rows),
        sum(p.measured_s for p in rows),
        sum(p.predicted_s for p in rows),
    )
