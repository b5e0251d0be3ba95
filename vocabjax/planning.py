"""Deployment plans: a mixed workload's best single V, its best set of nested heads, the route
of each batch size to a head, break-even lambda and the KV-cache plan, written as ``policy.json``
for the serving engine.

A workload is traffic classes, each a share of the served bytes at one batch size. With a set S
of nested heads (every smaller vocabulary a prefix of the largest, one backbone), the training
bytes are split across the levels in the proportion of the served bytes each level serves, so

    J(S) = sum_c share_c * min_{h in S} [c_train(h) + lambda * c_infer(h, B_c)]

and each class goes to the head that attains its minimum. A head that serves nothing costs
nothing and is never chosen (ties keep fewer heads). The whole search (every subset of the
vocabulary grid up to ``max_heads``) is one jitted call.

``decode_routes`` routes a trained run's own heads by the decode step's cost per byte at their
measured bytes per token (what ``benchmarks/serve.py`` serves as the simulator's routes).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vocabjax.costmodel import CostModel
from vocabjax.errors import UserError
from vocabjax.lifecycle import (
    KV_REFERENCE_VOCAB,
    Quality,
    allowed_vocab,
    break_even_vs,
    cost_grid,
    jitted,
    objective_grid,
    train_optimum,
)
from vocabjax.outputs import schemas
from vocabjax.render import human_size
from vocabjax.units import BATCH_RANGE, BYTES_MAX, parse_size, quote_input
from vocabjax.xp import PyMath

MAX_SUBSETS = 200_000
ROUTE_BATCHES: tuple[int, ...] = tuple(2**i for i in range(11))  # 1 .. 1024


@dataclasses.dataclass(frozen=True)
class TrafficClass:
    """One slice of the served traffic."""

    name: str  # label ("edge", "dc")
    batch: int  # serving batch B of this traffic
    share: float  # fraction of the served bytes, shares sum to 1
    prompt_bytes: float | None = None  # S_in for this class (None: the model's setting)
    output_bytes: float | None = None  # S_out for this class (None: the model's setting)


_KEYS = {
    "b": "batch",
    "batch": "batch",
    "share": "share",
    "in": "prompt_bytes",
    "out": "output_bytes",
}


POLICY_KIND = "policy"  # the kind of the policy JSON plan writes and serving reads


def parse_workload(text: str) -> tuple[TrafficClass, ...]:
    """``"edge:b=1:share=0.5,dc:b=256:share=0.5"`` (optional ``in=`` / ``out=`` bytes).

    Each key once per class; ``b`` in ``BATCH_RANGE``, ``share`` in 0..1, ``in``/``out`` bytes
    above 0 and at most ``BYTES_MAX``; names unique, shares summing to 1.
    """
    classes = [_parse_class(p.strip()) for p in str(text).split(",") if p.strip()]
    if not classes:
        raise UserError("workload is empty; example: edge:b=1:share=0.5,dc:b=256:share=0.5")
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        twice = next(n for i, n in enumerate(names) if n in names[:i])
        raise UserError(f"workload class names must be unique ({quote_input(twice)} twice)")
    total = sum(c.share for c in classes)
    if abs(total - 1.0) > 1e-6:
        raise UserError(f"workload shares sum to {total:g}; they must sum to 1")
    return tuple(classes)


def _parse_class(part: str) -> TrafficClass:
    """One class of a workload: ``name:key=value:...``."""
    name, *fields = part.split(":")
    if not name or not re.fullmatch(r"[\w.-]+", name):
        raise UserError(
            f"workload class {quote_input(part)} needs a name first, as in edge:b=1:share=0.5"
        )
    label = quote_input(name)
    values: dict[str, Any] = {}
    given: dict[str, str] = {}  # attribute -> the field that set it
    for field in fields:
        key, sep, value = field.partition("=")
        key = key.strip()
        if not sep or key not in _KEYS:
            raise UserError(
                f"workload class {label}: {quote_input(field)} is not b=N, share=X, "
                "in=BYTES or out=BYTES"
            )
        attr = _KEYS[key]
        if attr in given:
            raise UserError(
                f"workload class {label} gives {key}= twice "
                f"({quote_input(given[attr])} and {quote_input(field)})"
            )
        given[attr] = field
        values[attr] = _parse_value(label, key, attr, value)
    if "batch" not in values or "share" not in values:
        raise UserError(f"workload class {label} needs both b= and share=")
    return TrafficClass(name=name, **values)


def _parse_value(label: str, key: str, attr: str, value: str) -> int | float:
    """The value of one ``key=value`` field of class ``label``, checked against its range."""
    if attr == "batch":
        lo, hi = BATCH_RANGE
        return parse_size(value, what=f"workload {label} batch", minimum=lo, maximum=hi)
    try:
        number = float(value)
    except ValueError:
        raise UserError(
            f"workload class {label}: {key}={quote_input(value)} is not a number"
        ) from None
    if attr == "share":
        if not (math.isfinite(number) and 0.0 <= number <= 1.0):
            raise UserError(
                f"workload class {label}: share={quote_input(value)} is out of range 0..1"
            )
    elif not (math.isfinite(number) and 0.0 < number <= BYTES_MAX):
        raise UserError(
            f"workload class {label}: {key}={quote_input(value)} is out of range; "
            f"bytes must be > 0 and <= {BYTES_MAX}"
        )
    return number


def subset_masks(n_vocab: int, max_heads: int) -> np.ndarray:
    """Every set of 1..max_heads vocabulary indices as a [S, V] bool mask, fewer heads first."""
    if max_heads < 1:
        raise UserError(f"max_heads must be >= 1, got {max_heads}")
    k_max = min(max_heads, n_vocab)
    count = sum(math.comb(n_vocab, k) for k in range(1, k_max + 1))
    if count > MAX_SUBSETS:
        raise UserError(
            f"{count:,} head sets of up to {k_max} heads from {n_vocab} vocabularies; "
            f"the limit is {MAX_SUBSETS:,} (use fewer {{vocab}} values or {{max_heads}})",
            settings=["vocab", "max_heads"],
        )
    masks = np.zeros((count, n_vocab), bool)
    row = 0
    for k in range(1, k_max + 1):
        for combo in itertools.combinations(range(n_vocab), k):
            masks[row, list(combo)] = True
            row += 1
    return masks


@dataclasses.dataclass(frozen=True)
class Plan:
    vocab: tuple[int, ...]
    classes: tuple[TrafficClass, ...]
    lam: float
    c_train: np.ndarray  # [V]
    c_infer: np.ndarray  # [V, C]
    c_mix: np.ndarray  # [V] share-weighted c_infer
    single: int  # index of the best single V
    single_cost: float
    heads: tuple[int, ...]  # indices of the best head set
    heads_cost: float
    routes: tuple[int, ...]  # [C] index of the head each class goes to
    by_heads: tuple[tuple[tuple[int, ...], float], ...]  # best set and J for 1..max heads
    route_batches: tuple[int, ...]
    batch_routes: tuple[int, ...]  # head index for each of route_batches
    break_even: np.ndarray  # [V] vs the training optimum on the mixed workload
    v_train: int
    b_max: np.ndarray  # [V, C] per class settings
    kv_bytes_per_seq: np.ndarray  # [V, C]
    allowed: np.ndarray  # [V]
    route_b_max: np.ndarray  # [V] largest batch that fits, with the base settings (batch routes)
    capped: bool = True  # batches costed at the largest that fits (else uncapped roofline)

    def batch_run(self, batch: float, b_max: float) -> float:
        """The batch a class of ``batch`` is costed at on a head where ``b_max`` fits."""
        return min(batch, b_max) if self.capped else batch


def class_bytes(model: CostModel, classes: Sequence[TrafficClass]) -> list[tuple[float, float]]:
    """Each traffic class's (S_in, S_out): its own, or the model's settings where it has none."""
    s = model.settings
    return [
        (s.prompt_bytes if c.prompt_bytes is None else c.prompt_bytes,
         s.output_bytes if c.output_bytes is None else c.output_bytes)
        for c in classes
    ]  # fmt: skip


def _head_sets(j_hc, masks_sv, share_c):
    """Every head set at once: J [S] (the share-weighted J of each class's best head in the set;
    inf where a head serves nothing, which is the smaller set plus dead weight), the head each
    class takes [S, C], and the set's size [S]. ``j_hc`` [V, C] is J of each head per class."""
    in_set = jnp.where(masks_sv[:, :, None], j_hc[None, :, :], jnp.inf)  # [S, V, C]
    route_sc = jnp.argmin(in_set, axis=1)
    j_set = jnp.sum(jnp.min(in_set, axis=1) * share_c[None, :], axis=1)
    used = jnp.any(jax.nn.one_hot(route_sc, j_hc.shape[0], dtype=bool), axis=1)  # [S, V]
    j_set = jnp.where(jnp.all(used == masks_sv, axis=1), j_set, jnp.inf)
    return j_set, route_sc, jnp.sum(masks_sv, axis=1)


def _plan_grid(model, v, masks_sv, route_b, batch_c, share_c, io_c, lam, *, cap_batch, quality):
    """Everything ``make_plan`` reads, as arrays: the costs of each V for each traffic class
    (at its batch, with its S_in and S_out, ``io_c`` [C, 2]) and for the batch ladder
    ``route_b`` (with the model's own settings), J of every single V and every head set, the
    routes, break-even lambda on the mixed workload and the KV plan. Jitted once per model and
    options (``jitted``); the workload's batches, bytes and shares and lambda are arguments.
    The costs are one ``cost_grid`` vmapped over the model's and each class's bytes, at every
    batch of the ladder and the classes, so that the program holds one copy of the formulas."""
    lam_l = lam[None]
    allowed = allowed_vocab(quality, v, jnp.ones(v.shape, bool))
    base = jnp.asarray([[model.prompt_bytes, model.output_bytes]], jnp.float32)
    ios = jnp.concatenate([base, io_c])  # [1 + C, 2]: the ladder's bytes, then each class's
    n_route, n_class = route_b.shape[0], batch_c.shape[0]
    batches = jnp.concatenate([route_b, batch_c])

    def at(io):
        return cost_grid(model.with_io(io[0], io[1]), v, batches, cap_batch=cap_batch)

    cost = jax.vmap(at)(ios)  # fields [1 + C, V] or [1 + C, V, R + C]
    c_train = cost.c_train[0]
    classes = jnp.arange(n_class)
    c_inf = cost.c_infer[1 + classes, :, n_route + classes].T  # [V, C]: each class at its batch
    c_mix = jnp.sum(c_inf * share_c[None, :], axis=1)
    j_set, route_sc, n_heads = _head_sets(
        objective_grid(c_train, c_inf, lam_l, allowed)[:, :, 0], masks_sv, share_c
    )
    v_train = train_optimum(c_train, allowed)
    return dict(
        c_train=c_train,
        c_inf=c_inf,
        c_mix=c_mix,
        j_single=objective_grid(c_train, c_mix[:, None], lam_l, allowed)[:, 0, 0],
        j_set=j_set,
        n_heads=n_heads,
        route_sc=route_sc,
        j_route=objective_grid(c_train, cost.c_infer[0, :, :n_route], lam_l, allowed)[:, :, 0],
        v_train=v_train,
        be=break_even_vs(c_train, c_mix, v_train, allowed),
        b_max=cost.b_max[1:].T,
        kv=cost.kv_bytes_per_seq[1:].T,
        allowed=allowed,
        route_b_max=cost.b_max[0],
    )


def make_plan(
    model: CostModel,
    vocab: Sequence[int],
    classes: Sequence[TrafficClass],
    lam: float,
    *,
    max_heads: int = 3,
    cap_batch: bool = True,
    quality: Quality | None = None,
) -> Plan:
    """The best single V and nested head set for a mixed workload at one lambda, in one jitted
    call (``_plan_grid``, compiled once per model and options)."""
    vocab = tuple(sorted(set(int(v) for v in vocab)))
    if not vocab or min(vocab) <= 0:
        raise UserError("vocab sizes must be positive")
    if not (math.isfinite(lam) and lam >= 0):
        raise UserError(f"lambda must be a finite number >= 0, got {lam}")
    classes = tuple(classes)
    masks = subset_masks(len(vocab), max_heads)
    fn = jitted(_plan_grid, model, cap_batch=cap_batch, quality=quality)
    out = fn(
        jnp.asarray(vocab, jnp.float32),
        jnp.asarray(masks),
        jnp.asarray(ROUTE_BATCHES, jnp.float32),
        jnp.asarray([c.batch for c in classes], jnp.float32),
        jnp.asarray([c.share for c in classes], jnp.float32),
        jnp.asarray(class_bytes(model, classes), jnp.float32),
        jnp.float32(lam),
    )
    return _plan(vocab, classes, float(lam), masks, jax.device_get(out), capped=cap_batch)


def _plan(vocab, classes, lam, masks, out, *, capped: bool) -> Plan:
    """The plan from ``_plan_grid``'s arrays: the best single V and head set (ties keep fewer
    heads), the best set of each size, and each batch of the ladder routed among the heads."""
    j_single, j_set = np.asarray(out["j_single"], np.float64), np.asarray(out["j_set"], np.float64)
    if not np.isfinite(j_single).any():
        raise UserError("no vocabulary size is allowed (quality bound) or fits on the device")
    single = int(np.argmin(j_single))
    best = int(np.argmin(j_set))  # masks are ordered by size, so ties keep fewer heads
    heads = tuple(int(i) for i in np.flatnonzero(masks[best]))
    head_idx = np.asarray(heads)
    j_route = np.asarray(out["j_route"])  # [V, route batches]
    return Plan(
        vocab=vocab,
        classes=classes,
        lam=lam,
        c_train=np.asarray(out["c_train"], np.float64),
        c_infer=np.asarray(out["c_inf"], np.float64),
        c_mix=np.asarray(out["c_mix"], np.float64),
        single=single,
        single_cost=float(j_single[single]),
        heads=heads,
        heads_cost=float(j_set[best]),
        routes=tuple(int(r) for r in np.asarray(out["route_sc"])[best]),
        by_heads=_best_by_size(masks, j_set, np.asarray(out["n_heads"])),
        route_batches=ROUTE_BATCHES,
        batch_routes=tuple(int(head_idx[i]) for i in np.argmin(j_route[head_idx], axis=0)),
        break_even=np.asarray(out["be"], np.float64),
        v_train=int(out["v_train"]),
        b_max=np.asarray(out["b_max"]),
        kv_bytes_per_seq=np.asarray(out["kv"], np.float64),
        allowed=np.asarray(out["allowed"]),
        route_b_max=np.asarray(out["route_b_max"]),
        capped=capped,
    )


def _best_by_size(masks, j_set, n_heads) -> tuple[tuple[tuple[int, ...], float], ...]:
    """The best set of 1, 2, ... heads and its J, up to the first size with no set whose every
    head serves traffic."""
    out = []
    for k in range(1, int(n_heads.max()) + 1):
        sel = np.flatnonzero((n_heads == k) & np.isfinite(j_set))
        if not len(sel):
            break
        i = int(sel[np.argmin(j_set[sel])])
        out.append((tuple(int(x) for x in np.flatnonzero(masks[i])), float(j_set[i])))
    return tuple(out)


def _lam_json(x: float) -> float | None:
    """A break-even lambda for JSON: None (null) where it never comes, as in sweep's JSON."""
    return float(x) if math.isfinite(x) else None


def kv_plan_rows(vocab: Sequence[int], b_max: np.ndarray, kv_bytes: np.ndarray) -> list[dict]:
    """Per V: the largest batch that fits and its gain over 32k (or the smallest V)."""
    ref = vocab.index(KV_REFERENCE_VOCAB) if KV_REFERENCE_VOCAB in vocab else 0
    rows = []
    for i, v in enumerate(vocab):
        gain = float(b_max[i] / b_max[ref]) if b_max[ref] > 0 else None
        rows.append(
            {
                "vocab": v,
                "b_max": int(b_max[i]),
                "kv_bytes_per_seq": float(kv_bytes[i]),
                "reference_vocab": vocab[ref],
                "gain": gain,  # b_max over b_max at reference_vocab
            }
        )
    return rows


def policy_json(plan: Plan, model: CostModel, *, max_heads: int) -> dict[str, Any]:
    """The policy the serving engine reads (``kind: policy``)."""
    v = plan.vocab
    merged: list[dict] = []
    for b, h in zip(plan.route_batches, plan.batch_routes, strict=True):
        fits = bool(b <= plan.route_b_max[h])
        if merged and merged[-1]["head"] == v[h]:
            merged[-1]["max_batch"] = b
            merged[-1]["fits"] = fits  # fits at every batch up to b: the largest decides
        else:
            merged.append(
                {"max_batch": b, "head": v[h], "b_max": int(plan.route_b_max[h]), "fits": fits}
            )
    merged[-1]["max_batch"] = None  # the last head takes every larger batch too
    return {
        "schema": schemas(POLICY_KIND)[-1],
        "kind": POLICY_KIND,
        "device": model.device.name,
        "model": model.shape.name,
        "compression": model.compression.name,
        "cost_model": model.settings.mode,
        "cap_batch": plan.capped,
        "lam": plan.lam,
        "max_heads": max_heads,
        "single": {"vocab": v[plan.single], "cost_per_byte": plan.single_cost},
        "heads": [v[i] for i in plan.heads],
        "cost_per_byte": plan.heads_cost,
        # a set of one head is the single V, so the best set never costs more; the two J are
        # summed in different orders (f32), and a tie must not print as "-0.00% below single"
        "saving_vs_single": max(0.0, 1.0 - plan.heads_cost / plan.single_cost),
        "routes": [
            {
                "name": c.name,
                "batch": c.batch,
                "share": c.share,
                "head": v[plan.routes[j]],
                "infer_cost_per_byte": float(plan.c_infer[plan.routes[j], j]),
                "b_max": int(plan.b_max[plan.routes[j], j]),
                "fits": bool(c.batch <= plan.b_max[plan.routes[j], j]),
                "batch_run": int(plan.batch_run(c.batch, plan.b_max[plan.routes[j], j])),
            }
            for j, c in enumerate(plan.classes)
        ],
        "batch_routes": merged,
        "by_heads": [
            {"n_heads": len(s), "heads": [v[i] for i in s], "cost_per_byte": j}
            for s, j in plan.by_heads
        ],
        "train_optimal_vocab": v[plan.v_train],
        "break_even": [
            {"vocab": x, "lam": _lam_json(plan.break_even[i]), "allowed": bool(plan.allowed[i])}
            for i, x in enumerate(v)
        ],
        "kv_plan": kv_plan_rows(v, plan.b_max[:, 0], plan.kv_bytes_per_seq[:, 0]),
    }


def kv_table(policy: dict[str, Any]) -> list[dict]:
    """Per V of a policy: the KV plan (largest batch that fits, KV bytes per sequence, the gain
    over the reference V) beside break-even lambda ("never" where it never comes), as ``plan``
    prints it."""
    be = {r["vocab"]: "never" if r["lam"] is None else r["lam"] for r in policy["break_even"]}
    return [
        {
            "vocab": r["vocab"],
            "b_max": r["b_max"],
            "kv_bytes_per_seq": r["kv_bytes_per_seq"],
            f"gain_vs_{human_size(r['reference_vocab'])}": r["gain"],
            "break_even_lam": be[r["vocab"]],
        }
        for r in policy["kv_plan"]
    ]


def decode_routes(
    model: CostModel, bytes_per_token: Mapping[int, float], *, max_batch: int, context: int
) -> list[tuple[int | None, int]]:
    """Batch routes among a run's heads, as a policy's ``batch_routes`` (``(max_batch or None,
    head)``, increasing): each power-of-two batch up to ``max_batch`` goes to the head whose
    decode step costs least per byte, ``decode_step(V, B, T) / (B bytes_per_token[V])`` at a
    cache of ``context`` positions (``make_plan`` routes its batch ladder by J the same way, on
    the compression curve; here the heads and their bytes per token are a trained run's)."""
    if not bytes_per_token or max_batch < 1:
        raise UserError("decode_routes needs at least one head and max_batch >= 1")
    if not all(math.isfinite(b) and b > 0 for b in bytes_per_token.values()):
        raise UserError(f"bytes per token must be finite and > 0, got {dict(bytes_per_token)}")
    routes: list[tuple[int | None, int]] = []
    b = 1
    while b <= max_batch:
        cost = {
            v: model.decode_step(float(v), float(b), float(context), xp=PyMath) / (b * bpt)
            for v, bpt in sorted(bytes_per_token.items())
        }
        head = min(cost, key=lambda v: cost[v])
        if routes and routes[-1][1] == head:
            routes[-1] = (b, head)
        else:
            routes.append((b, head))
        b *= 2
    routes[-1] = (None, routes[-1][1])
    return routes
