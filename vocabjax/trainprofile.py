"""Training profiles: measured training throughput and bits per byte across V.

``python cli.py train`` writes one (``kind: training``); ``sweep --training FILE`` then uses the
measured tokens/s for c_train instead of the 6 N FLOP rule, and its BPB for the quality
constraint. Between measured V both are interpolated in log V; outside, nothing is assumed.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax.numpy as jnp

from vocabjax.errors import UserError
from vocabjax.profiles import SCHEMA, load_json, positive_number, text, vocab_points
from vocabjax.xp import interp


@dataclasses.dataclass(frozen=True)
class TrainingProfile:
    """Measured training points, sorted by vocabulary size."""

    name: str  # label (run directory, model)
    vocab: tuple[int, ...]  # V of each measured run, increasing
    tokens_per_s: tuple[float, ...] | None  # training throughput, tokens/s (None: not measured)
    bpb: tuple[float, ...] | None  # held-out bits per byte (None: not measured)
    source: str = ""

    def covers(self, vocab: int) -> bool:
        return self.vocab[0] <= vocab <= self.vocab[-1]

    def seconds_per_token(self, vocab, *, xp=jnp):
        """1 / tokens_per_s, interpolated linearly in (log V, log t)."""
        if self.tokens_per_s is None:
            raise UserError(f"training profile {self.name!r} has no tokens_per_s")
        logs = tuple(-math.log(t) for t in self.tokens_per_s)
        lv = tuple(math.log(v) for v in self.vocab)
        return xp.exp(interp(xp.log(vocab), lv, logs, xp=xp))

    def bpb_at(self, vocab, *, xp=jnp):
        if self.bpb is None:
            raise UserError(f"training profile {self.name!r} has no bpb")
        lv = tuple(math.log(v) for v in self.vocab)
        return interp(xp.log(vocab), lv, self.bpb, xp=xp)

    @classmethod
    def from_json(cls, data: dict[str, Any], *, where: str) -> TrainingProfile:
        rows = []
        for at, p in vocab_points(data, where=where):
            v = p["vocab"]
            tps = p.get("tokens_per_s")
            bpb = p.get("bpb")
            rows.append(
                (
                    v,
                    None if tps is None else positive_number(tps, where=f"{at}.tokens_per_s"),
                    None if bpb is None else positive_number(bpb, where=f"{at}.bpb"),
                )
            )
        rows.sort()
        if len({v for v, _, _ in rows}) != len(rows):
            raise UserError(f"{where}: two points have the same vocab")

        def column(j):
            values = [r[j] for r in rows]
            if all(x is None for x in values):
                return None
            if any(x is None for x in values):
                raise UserError(
                    f"{where}: {('tokens_per_s', 'bpb')[j - 1]} is missing at some points"
                )
            return tuple(values)

        tps, bpb = column(1), column(2)
        if tps is None and bpb is None:
            raise UserError(f"{where}: points need tokens_per_s or bpb")
        return cls(
            name=text(data.get("name", where), where=f"{where}: name"),
            vocab=tuple(r[0] for r in rows),
            tokens_per_s=tps,
            bpb=bpb,
            source=text(data.get("source", where), where=f"{where}: source"),
        )

    def to_json(self) -> dict[str, Any]:
        points = []
        for i, v in enumerate(self.vocab):
            p: dict[str, Any] = {"vocab": v}
            if self.tokens_per_s is not None:
                p["tokens_per_s"] = self.tokens_per_s[i]
            if self.bpb is not None:
                p["bpb"] = self.bpb[i]
            points.append(p)
        return {
            "schema": SCHEMA,
            "kind": "training",
            "name": self.name,
            "source": self.source,
            "points": points,
        }


def load_training(path: str | os.PathLike) -> TrainingProfile:
    return TrainingProfile.from_json(load_json(path, "training"), where=str(path))
