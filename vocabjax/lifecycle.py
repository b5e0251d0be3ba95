"""The lifecycle objective over whole (V, B, lambda) grids, in one jitted, vmapped call.

    J(V; B, lambda) = c_train(V) + lambda * c_infer(V, B)        V* = argmin_V J

c_train is seconds per training byte, c_infer seconds per served byte, lambda the bytes served
over the bytes trained, so J is seconds per training byte over the model's life. The objective is
written for one point and lifted with ``jax.vmap``; the V axis is sharded over ``jax.devices()``
when there are several (results are identical to one device: every point is computed the same
way and the argmin is exact).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from vocabjax import render
from vocabjax.costmodel import OP_FAMILIES, CostModel
from vocabjax.errors import UserError
from vocabjax.trainprofile import TrainingProfile

DEFAULT_VOCAB: tuple[int, ...] = (8192, 16384, 32768, 65536, 131072, 262144, 524288)
DEFAULT_BATCH: tuple[int, ...] = (1, 4, 16, 64, 256)
DEFAULT_LAM: tuple[float, ...] = (0.0, 1.0, 10.0, 100.0, 1000.0)
KV_REFERENCE_VOCAB = 32768  # "by how much a larger V raises the batch that fits": against 32k
NO_VOCAB = 0  # the V* of a point where no V is allowed or fits: no vocabulary size, no index
BYTES_PER_POINT = 16  # f32 objective plus temporaries, per (V, B, lambda) point
DEFAULT_TOLERANCE = 0.01  # the V* band: every V whose J is within 1% of J at V*
FINE_PER_OCTAVE = 16  # sizes per doubling of V on the band's grid (steps of about 4.4%)
FINE_ROUND = 128  # band sizes are multiples of 128, as vocabularies are padded for the matmul
N_DRAWS = 256  # perturbed profiles of the v_star_share ensemble (shares in steps of 1/256)
MIN_DRAWS = 16  # fewer than this and the share is not reported
DRAW_CHUNK = 32  # draws evaluated together (vmapped) inside the one call
ENSEMBLE_SEED = 0  # the ensemble's draws are the same on every run


@dataclasses.dataclass(frozen=True)
class Grid:
    """The swept values; every entry positive (lambda >= 0), no duplicates."""

    vocab: tuple[int, ...] = DEFAULT_VOCAB
    batch: tuple[int, ...] = DEFAULT_BATCH
    lam: tuple[float, ...] = DEFAULT_LAM

    def __post_init__(self) -> None:
        for name, values in (("vocab", self.vocab), ("batch", self.batch), ("lam", self.lam)):
            if not values:
                raise UserError(f"{name} grid is empty")
            for v in values:
                if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
                    raise UserError(f"{name} {v!r} must be a finite number")
        if min(self.vocab) <= 0:
            raise UserError(f"vocab sizes must be positive, got {min(self.vocab)}")
        if min(self.batch) <= 0:
            raise UserError(f"batch sizes must be positive, got {min(self.batch)}")
        if min(self.lam) < 0:
            raise UserError(f"lambda must be >= 0, got {min(self.lam)}")
        object.__setattr__(self, "vocab", tuple(sorted(set(int(v) for v in self.vocab))))
        object.__setattr__(self, "batch", tuple(sorted(set(int(b) for b in self.batch))))
        object.__setattr__(self, "lam", tuple(sorted(set(float(x) for x in self.lam))))

    @property
    def points(self) -> int:
        return len(self.vocab) * len(self.batch) * len(self.lam)


@dataclasses.dataclass(frozen=True)
class Quality:
    """Keep only V whose held-out BPB is within ``tolerance`` (relative) of the best measured."""

    profile: TrainingProfile  # must carry bpb
    tolerance: float = 0.02  # 0.02: at most 2% worse BPB than the best V of the profile

    def __post_init__(self) -> None:
        if self.profile.bpb is None:
            raise UserError(
                f"training profile {self.profile.name!r} has no bpb for a quality bound"
            )
        if not (math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise UserError(f"bpb tolerance must be >= 0, got {self.tolerance}")


@dataclasses.dataclass(frozen=True)
class SweepResult:
    """Host-side arrays of one sweep, along ``grid``'s axes.

    The chosen vocabularies (``v_star``, ``v_infer``, ``v_train``) are sizes from ``grid.vocab``,
    never grid indices; where no V is allowed or fits they hold ``NO_VOCAB`` (0), which is no
    size, and which :meth:`index` refuses to turn into an index.
    """

    grid: Grid
    c_train: np.ndarray  # [V] s / training byte
    c_infer: np.ndarray  # [V, B] s / served byte (inf where nothing fits)
    batch_eff: np.ndarray  # [V, B] batch actually run (capped at b_max when asked)
    b_max: np.ndarray  # [V] largest batch whose KV cache fits
    kv_bytes_per_seq: np.ndarray  # [V]
    allowed: np.ndarray  # [V] bool, passes the quality bound
    unembed_compute_bound: np.ndarray  # [V, B] bool
    v_star: np.ndarray  # [B, lam] int64 size argmin_V J, NO_VOCAB where no V is allowed
    j_star: np.ndarray  # [B, lam] J at V* (inf where no V is allowed)
    v_infer: np.ndarray  # [B] int64 size argmin_V c_infer (lambda -> infinity), or NO_VOCAB
    v_train: int  # size argmin_V c_train over the allowed V (lambda = 0), or NO_VOCAB
    break_even: np.ndarray  # [V, B] lambda at which V beats v_train (inf: never)
    capped: bool = True  # B was capped at b_max (batch_eff); else costed however much it needs
    tolerance: float = DEFAULT_TOLERANCE  # relative J of the band
    fine_vocab: tuple[int, ...] = ()  # the band's grid
    v_low: np.ndarray | None = None  # [B, lam] smallest V of the band (NO_VOCAB: not found)
    v_high: np.ndarray | None = None  # [B, lam] largest V of the band
    v_star_share: np.ndarray | None = None  # [V, B, lam] share of ensemble draws picking V
    share_note: str = ""  # what v_star_share is, or why it is None

    @property
    def fits(self) -> np.ndarray:
        """[V, B] bool: the asked batch B fits in device memory at V (KV cache and weights)."""
        return np.asarray(self.grid.batch)[None, :] <= self.b_max[:, None]

    @property
    def batch_capped(self) -> np.ndarray:
        """[V, B] bool: B was costed at a smaller batch, the largest that fits."""
        return self.batch_eff < np.asarray(self.grid.batch)[None, :]

    @property
    def found(self) -> np.ndarray:
        """[B, lam] bool: some V is allowed and fits, so ``v_star`` is a size of the grid."""
        return self.v_star != NO_VOCAB

    def index(self, vocab):
        """Grid index of each vocabulary size in ``vocab`` (an int or an array of them). A size
        not in the grid, ``NO_VOCAB`` included, is a UserError rather than an index."""
        sizes = np.asarray(vocab)
        grid = np.asarray(self.grid.vocab)
        at = np.minimum(np.searchsorted(grid, sizes), len(grid) - 1)
        missing = grid[at] != sizes
        if missing.any():
            bad = int(sizes[missing].flat[0])
            why = "no V is allowed or fits there" if bad == NO_VOCAB else "not in the grid"
            raise UserError(f"vocab {bad} has no grid index: {why} (grid: {self.grid.vocab})")
        return int(at) if at.ndim == 0 else at


def _memory_budget() -> float:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 * 1024**3
    return 0.5 * total


def _base_bytes(grid: Grid) -> float:
    """Memory of one sweep's objective on its grid and on the band's fine grid."""
    fine = len(fine_vocab(grid.vocab))
    return (len(grid.vocab) + fine) * len(grid.batch) * len(grid.lam) * BYTES_PER_POINT


def check_grid_fits(grid: Grid, *, budget_bytes: float | None = None) -> None:
    """One error where the grid's objective would not fit in this machine's memory (the
    ensemble of ``v_star_share`` shrinks to what is left instead)."""
    budget = _memory_budget() if budget_bytes is None else budget_bytes
    need = _base_bytes(grid)
    if need > budget:
        raise UserError(
            f"a grid of {grid.points:,} points needs about {need / 1024**3:.1f} GiB, over the "
            f"{budget / 1024**3:.1f} GiB this machine allows; use fewer vocab, batch or lambda"
        )


def _padded(values: Sequence[float], multiple: int) -> tuple[np.ndarray, np.ndarray]:
    """``values`` as float32, padded with its last value to a multiple of ``multiple`` (the
    device count), and the mask of the entries that are not padding."""
    arr = np.asarray(values, np.float32)
    pad = (-len(arr)) % multiple
    valid = np.ones(len(arr) + pad, bool)
    if pad:
        valid[-pad:] = False
    return np.concatenate([arr, np.full(pad, arr[-1], np.float32)]), valid


# ---- one point -------------------------------------------------------------------------------


class PointCost(NamedTuple):
    """What training and serving cost at one (V, B). A NamedTuple, so that ``jax.vmap``'s
    ``out_axes`` can say which fields depend on V alone (``cost_grid``)."""

    c_train: Any  # s / training byte (V alone)
    c_infer: Any  # s / served byte at the batch costed; inf where not one sequence fits
    batch_run: Any  # the batch costed: B, or with the cap the largest batch that fits
    b_max: Any  # largest batch whose KV cache fits beside the weights (V alone)
    kv_bytes_per_seq: Any  # KV-cache bytes of one sequence (V alone)
    unembed_compute_bound: Any  # bool: the unembedding's t_math >= t_mem at the batch costed


def point_cost(model: CostModel, v, b, *, cap_batch: bool) -> PointCost:
    """The costs at one (V, B), scalars; with ``cap_batch`` B is costed at the largest batch
    that fits, and c_infer is ``inf`` where not even one sequence does. Sweep and plan lift it
    with ``jax.vmap`` (``cost_grid``); ``model`` may be a copy with traced op scales."""
    b_run = jnp.minimum(b, model.b_max(v)) if cap_batch else b
    b_safe = jnp.maximum(b_run, 1.0)
    c_infer = jnp.where(b_run >= 1.0, model.c_infer(v, b_safe), jnp.inf)
    u = model.decode_times(v, b_safe, model.mean_context(v))["unembedding"]
    return PointCost(
        c_train=model.c_train(v),
        c_infer=c_infer,
        batch_run=b_run,
        b_max=model.b_max(v),
        kv_bytes_per_seq=model.kv_bytes_per_seq(v),
        unembed_compute_bound=u.t_math >= u.t_mem,
    )


_OVER_B = PointCost(None, 0, 0, None, None, 0)  # out_axes over B: fields of V alone stay [V]


def cost_grid(model: CostModel, v, b, *, cap_batch: bool) -> PointCost:
    """``point_cost`` over every (V, B) of ``v`` [V] and ``b`` [B]: the fields of V alone are
    [V], the others [V, B]."""
    one = functools.partial(point_cost, model, cap_batch=cap_batch)
    over_b = jax.vmap(one, in_axes=(None, 0), out_axes=_OVER_B)
    return jax.vmap(over_b, in_axes=(0, None))(v, b)


def objective(c_train, c_infer, lam):
    """J at one (V, B, lambda); lambda = 0 is training alone, whatever serving costs."""
    return jnp.where(lam > 0, c_train + lam * c_infer, c_train)


def objective_grid(c_train, c_infer, lam, allowed):
    """``objective`` over the grid: J [V, B, lam] from c_train [V], c_infer [V, B] and lam
    [lam], inf where V is not ``allowed`` [V]."""
    over_lam = jax.vmap(objective, in_axes=(None, None, 0))
    over_b_lam = jax.vmap(over_lam, in_axes=(None, 0, None))
    j = jax.vmap(over_b_lam, in_axes=(0, 0, None))(c_train, c_infer, lam)
    return jnp.where(allowed[:, None, None], j, jnp.inf)


def allowed_vocab(quality: Quality | None, v, valid):
    """Mask of the grid's V that pass the quality bound (all ``valid`` ones without one)."""
    if quality is None:
        return valid
    prof = quality.profile
    covered = (v >= prof.vocab[0]) & (v <= prof.vocab[-1])
    bpb = jax.vmap(prof.bpb_at)(v)
    best = jnp.min(jnp.where(valid & covered, bpb, jnp.inf))
    return valid & covered & (bpb <= best * (1.0 + quality.tolerance))


def train_optimum(c_train, allowed):
    """Index of V_t, the allowed V of least c_train (the answer at lambda = 0); 0 where no V is
    allowed."""
    return jnp.argmin(jnp.where(allowed, c_train, jnp.inf))


def break_even(d_train, d_infer):
    """lambda at which a V whose training costs ``d_train`` more per byte and whose serving
    costs ``d_infer`` less per byte than the training optimum becomes the cheaper choice:
    0 if it is no dearer to train, ``inf`` (never) if it is no cheaper to serve. Elementwise."""
    safe = jnp.where(d_infer > 0, d_infer, 1.0)
    return jnp.where(d_train <= 0, 0.0, jnp.where(d_infer > 0, d_train / safe, jnp.inf))


def break_even_vs(c_train, c_infer, v_train, allowed):
    """``break_even`` of every V against the V of index ``v_train``: c_train [V], c_infer
    [V, ...] (one column per batch, or a workload's mix [V]); inf where V is not allowed."""
    extra = (1,) * (c_infer.ndim - 1)
    d_train = (c_train - c_train[v_train]).reshape(c_train.shape + extra)
    be = break_even(d_train, c_infer[v_train][None] - c_infer)
    return jnp.where(allowed.reshape(allowed.shape + extra), be, jnp.inf)


def _argmin_v(j):
    """argmin over V (axis 0) of J [V, ...], -1 where every J is inf."""
    return jnp.where(jnp.isfinite(jnp.min(j, axis=0)), jnp.argmin(j, axis=0), -1)


def fine_vocab(vocab: Sequence[int]) -> tuple[int, ...]:
    """The V* band's grid: ``vocab`` itself and ``FINE_PER_OCTAVE`` log-spaced sizes per octave
    between its ends, rounded to a multiple of ``FINE_ROUND`` (as vocabularies are padded for the
    matmul) where that leaves them inside the range."""
    vocab = sorted(set(int(v) for v in vocab))
    lo, hi = vocab[0], vocab[-1]
    out = set(vocab)
    if hi > lo:
        n = math.ceil(math.log2(hi / lo) * FINE_PER_OCTAVE)
        for k in range(1, n):
            x = lo * (hi / lo) ** (k / n)
            step = FINE_ROUND if x >= 8 * FINE_ROUND else 1
            out.add(min(max(int(round(x / step)) * step, lo), hi))
    return tuple(sorted(out))


def ensemble_draws(model: CostModel, grid: Grid, budget_bytes: float | None = None) -> int:
    """How many perturbed profiles the ``v_star_share`` ensemble draws: ``N_DRAWS``, fewer where
    the grid is so large that their objectives would not fit the memory budget, 0 without a
    calibration to draw from."""
    if model.device.residual_sd is None:
        return 0
    budget = _memory_budget() if budget_bytes is None else budget_bytes
    left = budget - _base_bytes(grid)
    per_draw = grid.points * (1 + BYTES_PER_POINT * DRAW_CHUNK / N_DRAWS)
    return int(min(N_DRAWS, max(0.0, left / per_draw)))


def share_note(model: CostModel, draws: int) -> str:
    """What ``v_star_share`` is for ``model``'s device, or why it is null."""
    sd = model.device.residual_sd
    if sd is None:
        return (
            f"{model.device.name} is not calibrated: no residual spread to draw profiles from "
            "(validate --fit calibrates one)"
        )
    if draws < MIN_DRAWS:
        return f"the grid is too large for an ensemble of {MIN_DRAWS} or more profiles"
    return (
        f"share of {draws} profiles, each op family's time scaled by exp(N(0, {sd:.3g}^2)), "
        "the calibration's log residual spread, that pick each V"
    )


# ---- the sweep's grid function ---------------------------------------------------------------


def _band(quality, fine, v_fine, valid_fine, lam, j_star, tol):
    """(v_low, v_high) [B, lam]: the smallest and largest V of the fine grid (costs ``fine``)
    whose J is within ``tol`` of ``j_star`` (+inf and -inf where no V is)."""
    allowed = allowed_vocab(quality, v_fine, valid_fine)
    j = objective_grid(fine.c_train, fine.c_infer, lam, allowed)
    in_band = jnp.isfinite(j) & (j <= j_star * (1.0 + tol))
    v_col = v_fine[:, None, None]
    low = jnp.min(jnp.where(in_band, v_col, jnp.inf), axis=0)
    return low, jnp.max(jnp.where(in_band, v_col, -jnp.inf), axis=0)


class _FamilyParts(NamedTuple):
    """The costs as an affine function of the op families' time scales (``CostModel.scaled``):
    every priced second belongs to one family, so at scales ``s`` [F]

        c(s) = base + sum_f s_f part_f

    with ``base`` the costs at all scales 0 (what no family scales: a measured training
    profile) and ``part_f`` what family f adds at scale 1. ``part`` is 0 where ``base`` is
    inf (not one sequence fits)."""

    base_train: Any  # [V]
    base_infer: Any  # [V, B]
    part_train: Any  # [F, V]
    part_infer: Any  # [F, V, B]

    def at(self, s):
        """(c_train [V], c_infer [V, B]) at scales ``s`` [F]."""
        return self.base_train + s @ self.part_train, self.base_infer + jnp.einsum(
            "f,fvb->vb", s, self.part_infer
        )


def _costs_and_parts(model, v, b, *, cap_batch) -> tuple[PointCost, _FamilyParts]:
    """``cost_grid`` of ``model`` and its ``_FamilyParts``, from one ``cost_grid`` vmapped over
    the scale vectors ones (the model as it is: its costs, unchanged), zeros and the unit
    vectors, so that the program holds one copy of the cost formulas."""
    n = len(OP_FAMILIES)
    rows = jnp.concatenate([jnp.ones((1, n)), jnp.zeros((1, n)), jnp.eye(n)])

    def at(s):
        scales = {f: s[i] for i, f in enumerate(OP_FAMILIES)}
        return cost_grid(model.scaled(scales), v, b, cap_batch=cap_batch)

    costs = jax.vmap(at)(rows)

    def parts(c):  # c [2 + F, ...]: ones, zeros, units
        return jnp.where(jnp.isfinite(c[1]), c[2:] - c[1], 0.0)

    fam = _FamilyParts(costs.c_train[1], costs.c_infer[1], parts(costs.c_train),
                       parts(costs.c_infer))  # fmt: skip
    return jax.tree.map(lambda x: x[0], costs), fam


def _v_star_share(parts: _FamilyParts, sd, lam, allowed, z):
    """[V, B, lam] share of the perturbed profiles (one row of ``z`` each, standard normal per
    op family, scaled by the calibration's residual spread ``sd``) whose V* is each V."""

    def draw(zk):
        c_train, c_infer = parts.at(jnp.exp(sd * zk))
        return _argmin_v(objective_grid(c_train, c_infer, lam, allowed))

    picks = jax.lax.map(draw, z, batch_size=DRAW_CHUNK)  # [N, B, lam]
    hits = picks[None] == jnp.arange(allowed.shape[0])[:, None, None, None]
    return jnp.mean(hits, axis=1, dtype=jnp.float32)


def _sweep_grid(model, at, valid, b, lam, v_fine, valid_fine, tol, z, *, cap_batch, quality):
    """The whole sweep of one grid as arrays (``grid_function`` jits it): the costs, V*, its
    band on ``v_fine``, break-even lambda, the KV plan, ``j`` [V, B, lam] and, when ``z`` has
    rows, the ensemble's ``v_star_share``. The grid's V are ``v_fine[at]``: the band's grid
    holds every V of the grid (``fine_vocab``), so the costs are evaluated once, on it. V*
    indices (into ``at``) are -1 where no V is allowed."""
    if z.shape[0]:
        fine, parts = _costs_and_parts(model, v_fine, b, cap_batch=cap_batch)
    else:
        fine, parts = cost_grid(model, v_fine, b, cap_batch=cap_batch), None
    cost = jax.tree.map(lambda x: x[at], fine)
    allowed = allowed_vocab(quality, v_fine[at], valid)
    j = objective_grid(cost.c_train, cost.c_infer, lam, allowed)  # [V, B, lam]
    j_star = jnp.min(j, axis=0)
    v_train = train_optimum(cost.c_train, allowed)
    v_low, v_high = _band(quality, fine, v_fine, valid_fine, lam, j_star, tol)
    out = dict(
        c_train=cost.c_train,
        c_infer=cost.c_infer,
        batch_eff=cost.batch_run,
        b_max=cost.b_max,
        kv=cost.kv_bytes_per_seq,
        allowed=allowed,
        compute_bound=cost.unembed_compute_bound,
        v_star=_argmin_v(j),
        j_star=j_star,
        v_infer=_argmin_v(jnp.where(allowed[:, None], cost.c_infer, jnp.inf)),
        v_train=v_train,
        break_even=break_even_vs(cost.c_train, cost.c_infer, v_train, allowed),
        v_low=v_low,
        v_high=v_high,
        j=j,  # [V, B, lam], inf where V is not allowed
    )
    if parts is not None:
        main = _FamilyParts(parts.base_train[at], parts.base_infer[at], parts.part_train[:, at],
                            parts.part_infer[:, at])  # fmt: skip
        out["v_star_share"] = _v_star_share(main, model.device.residual_sd, lam, allowed, z)
    return out


_COMPILED: dict = {}
_COMPILED_MAX = 64


def _model_key(model: CostModel) -> str:
    """Value identity of a cost model: its frozen inputs (profiles, shape, settings, curves)."""
    return repr((model.device, model.shape, model.settings, model.compression, model.training))


def jitted(fn: Callable, model: CostModel, **options):
    """``jax.jit(partial(fn, model, **options))``, made once per (fn, the model's value,
    options): repeated sweeps and plans of equal models reuse the compiled executable instead
    of tracing a new closure. ``options`` are ``fn``'s static keyword-only arguments (their
    repr is part of the key)."""
    key = (fn, _model_key(model), repr(sorted(options.items())))
    if key not in _COMPILED:
        if len(_COMPILED) >= _COMPILED_MAX:
            _COMPILED.pop(next(iter(_COMPILED)))
        _COMPILED[key] = jax.jit(functools.partial(fn, model, **options))
    return _COMPILED[key]


def grid_function(model: CostModel, *, cap_batch: bool, quality: Quality | None):
    """The sweep's jitted whole-grid function for ``model`` (``_sweep_grid``), compiled once per
    model and options: ``f(at, valid, b, lam, v_fine, valid_fine, tol, z) -> dict``, the grid's V
    being ``v_fine[at]``."""
    return jitted(_sweep_grid, model, cap_batch=cap_batch, quality=quality)


def no_draws() -> np.ndarray:
    """The ``z`` of a grid call without an ensemble: no rows."""
    return np.zeros((0, len(OP_FAMILIES)), np.float32)


def _grid_args(grid: Grid, devices: Sequence[jax.Device], tolerance: float, draws: int):
    """The grid function's arguments for ``grid``, on ``devices``: both V axes (the grid's as
    indices into the band's) padded to a multiple of the device count and sharded over the
    devices, the rest replicated."""
    v_pad, valid = _padded(grid.vocab, len(devices))
    f_pad, valid_f = _padded(fine_vocab(grid.vocab), len(devices))
    at = np.searchsorted(f_pad, v_pad).astype(np.int32)  # f_pad holds every V of the grid
    z = np.random.default_rng(ENSEMBLE_SEED).standard_normal((draws, len(OP_FAMILIES)))
    b = np.asarray(grid.batch, np.float32)
    lam = np.asarray(grid.lam, np.float32)
    host = (at, valid, b, lam, f_pad, valid_f, np.float32(tolerance), z.astype(np.float32))
    if len(devices) == 1:
        return tuple(jax.device_put(x, devices[0]) for x in host)
    mesh = Mesh(np.asarray(devices), ("v",))
    shard = NamedSharding(mesh, PartitionSpec("v"))
    repl = NamedSharding(mesh, PartitionSpec())
    placement = (shard, shard, repl, repl, shard, shard, repl, repl)
    return tuple(jax.device_put(x, p) for x, p in zip(host, placement, strict=True))


def sweep(
    model: CostModel,
    grid: Grid = Grid(),
    *,
    cap_batch: bool = True,
    quality: Quality | None = None,
    devices: Sequence[jax.Device] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> SweepResult:
    """V*, its band and ensemble share, break-even lambda and the KV plan over ``grid`` in one
    jitted call. ``cap_batch``: cost each B at the largest batch that fits (else the roofline
    of B however much memory it needs); ``tolerance``: relative J of the band around V*."""
    if not (isinstance(tolerance, int | float) and math.isfinite(tolerance) and tolerance >= 0):
        raise UserError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
    check_grid_fits(grid)
    devices = list(devices if devices is not None else jax.devices())
    draws = ensemble_draws(model, grid)
    draws = draws if draws >= MIN_DRAWS else 0
    fn = grid_function(model, cap_batch=cap_batch, quality=quality)
    out = fn(*_grid_args(grid, devices, tolerance, draws))
    out.pop("j")  # J over the whole grid is for vj.objective; a sweep keeps only its argmin
    out = jax.device_get(out)
    nv = len(grid.vocab)
    allowed = np.asarray(out["allowed"][:nv])
    share = out.get("v_star_share")
    return SweepResult(
        grid=grid,
        c_train=np.asarray(out["c_train"][:nv], np.float64),
        c_infer=np.asarray(out["c_infer"][:nv], np.float64),
        batch_eff=np.asarray(out["batch_eff"][:nv]),
        b_max=np.asarray(out["b_max"][:nv]),
        kv_bytes_per_seq=np.asarray(out["kv"][:nv], np.float64),
        allowed=allowed,
        unembed_compute_bound=np.asarray(out["compute_bound"][:nv]),
        v_star=_sizes(grid, out["v_star"]),
        j_star=np.asarray(out["j_star"], np.float64),
        v_infer=_sizes(grid, out["v_infer"]),
        v_train=int(_sizes(grid, out["v_train"] if allowed.any() else -1)),
        break_even=np.asarray(out["break_even"][:nv], np.float64),
        capped=cap_batch,
        tolerance=float(tolerance),
        fine_vocab=fine_vocab(grid.vocab),
        v_low=_band_edge(out["v_low"]),
        v_high=_band_edge(out["v_high"]),
        v_star_share=None if share is None else np.asarray(share[:nv], np.float64),
        share_note=share_note(model, draws),
    )


def _band_edge(x) -> np.ndarray:
    """A band edge from the grid function (+-inf: no V in the band) as sizes (``NO_VOCAB``)."""
    x = np.asarray(x, np.float64)
    return np.where(np.isfinite(x), np.rint(np.where(np.isfinite(x), x, 0)), NO_VOCAB).astype(
        np.int64
    )


def _sizes(grid: Grid, index) -> np.ndarray:
    """The grid function's argmin indices (-1: nothing allowed) as sizes (``NO_VOCAB``)."""
    index = np.asarray(index)
    vocab = np.asarray(grid.vocab, np.int64)
    return np.where(index >= 0, vocab[np.maximum(index, 0)], NO_VOCAB)


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def sweep_rows(model: CostModel, result: SweepResult) -> list[dict]:
    """One row per (B, lambda): the JSON/CSV ``table`` of ``sweep``."""
    g = result.grid
    rows = []
    for bi, b in enumerate(g.batch):
        v_inf = int(result.v_infer[bi])
        for li, lam in enumerate(g.lam):
            v = int(result.v_star[bi, li])
            ok = v != NO_VOCAB
            vi = result.index(v) if ok else None
            rows.append(
                {
                    "device": model.device.name,
                    "model": model.shape.name,
                    "batch": b,
                    "lam": lam,
                    "v_star": v if ok else None,
                    "cost_per_byte": _finite_or_none(result.j_star[bi, li]),
                    "train_cost_per_byte": float(result.c_train[vi]) if ok else None,
                    "infer_cost_per_byte": _finite_or_none(result.c_infer[vi, bi]) if ok else None,
                    "batch_run": float(result.batch_eff[vi, bi]) if ok else None,
                    "b_max": int(result.b_max[vi]) if ok else None,
                    "fits": bool(result.fits[vi, bi]) if ok else None,
                    "batch_capped": bool(result.batch_capped[vi, bi]) if ok else None,
                    "v_low": int(result.v_low[bi, li]) if ok else None,
                    "v_high": int(result.v_high[bi, li]) if ok else None,
                    "v_star_share": _shares(result, bi, li) if ok else None,
                    "unembed_bound": (
                        None
                        if not ok
                        else "measured"
                        if model.measured_unembed is not None
                        else "compute"
                        if result.unembed_compute_bound[vi, bi]
                        else "memory"
                    ),
                    "v_infer_only": v_inf if v_inf != NO_VOCAB else None,
                }
            )
    return rows


def _shares(result: SweepResult, bi: int, li: int) -> list[dict] | None:
    """The ensemble's picks at one (B, lambda) as ``[{"vocab": V, "share": s}]``, most picked
    first (V with no pick left out); None without an ensemble."""
    if result.v_star_share is None:
        return None
    col = result.v_star_share[:, bi, li]
    order = sorted(np.flatnonzero(col > 0), key=lambda i: (-col[i], i))
    return [{"vocab": result.grid.vocab[i], "share": round(float(col[i]), 6)} for i in order]


def share_of_v_star(row: dict) -> float | None:
    """The ensemble's share for the row's own V* (0 when no draw picked it), or None."""
    if row["v_star_share"] is None:
        return None
    return next((s["share"] for s in row["v_star_share"] if s["vocab"] == row["v_star"]), 0.0)


def train_optimal_vocab(result: SweepResult) -> int:
    """The V_t that break-even lambda is measured against, as schema 1 reports it: the smallest
    V of the grid where no V is allowed (every break-even is then "never")."""
    return result.v_train if result.v_train != NO_VOCAB else result.grid.vocab[0]


def break_even_rows(model: CostModel, result: SweepResult) -> list[dict]:
    """lambda at which each V beats the training-optimal V, per batch ("never": None)."""
    g = result.grid
    return [
        {
            "device": model.device.name,
            "model": model.shape.name,
            "vocab": v,
            "batch": b,
            "train_optimal_vocab": train_optimal_vocab(result),
            "break_even_lam": _finite_or_none(result.break_even[vi, bi]),
        }
        for vi, v in enumerate(g.vocab)
        for bi, b in enumerate(g.batch)
    ]


# ---- what the command line prints -------------------------------------------------------------


def sweep_json(runs: Sequence[tuple[CostModel, SweepResult]]) -> dict:
    """The JSON document of ``python cli.py sweep --format json``: the ``table`` and
    ``break_even`` rows of every (model, result) in ``runs``, sweeps of one grid with one set of
    settings, compression curve and options (those of the first run head the document)."""
    model, result = runs[0]
    return {
        "schema": 1,
        "kind": "sweep",
        "cost_model": model.settings.mode,
        "compression": model.compression.name,
        "cap_batch": result.capped,
        "tolerance": result.tolerance,
        "v_star_share_notes": [
            {"device": cm.device.name, "model": cm.shape.name, "note": res.share_note}
            for cm, res in runs
        ],
        "table": [row for cm, res in runs for row in sweep_rows(cm, res)],
        "break_even": [row for cm, res in runs for row in break_even_rows(cm, res)],
    }


@dataclasses.dataclass(frozen=True)
class SweepTables:
    """One sweep as the tables ``python cli.py sweep`` prints, rows of plain values."""

    v_star: list[dict]  # per B: V* and its band per lambda ("64k [45.2k..123k]*"), infer-only
    share: list[dict] | None  # per B: the ensemble's share of each V* ("74%"); None without one
    break_even: list[dict]  # per V: break-even lambda per B ("never" where it never comes)


def sweep_tables(model: CostModel, result: SweepResult) -> SweepTables:
    """The printed tables of one sweep (``render.rows`` draws them as text or Markdown)."""
    rows = sweep_rows(model, result)
    by_cell = {(r["batch"], r["lam"]): r for r in rows}
    infer = {r["batch"]: r["v_infer_only"] for r in rows}

    def by_lam(b: int, cell: Callable[[dict], Any]) -> dict:
        return {"B": b, **{f"lam={x:g}": cell(by_cell[b, x]) for x in result.grid.lam}}

    return SweepTables(
        v_star=[
            {**by_lam(b, render.v_star_cell), "infer-only": _size_or_dash(infer[b])}
            for b in result.grid.batch
        ],
        share=None
        if result.v_star_share is None
        else [by_lam(b, _share_cell) for b in result.grid.batch],
        break_even=render.pivot(
            break_even_rows(model, result),
            index="vocab",
            columns="batch",
            value="break_even_lam",
            column_label=lambda b: f"B={b}",
            cell=lambda x: "never" if x is None else x,
        ),
    )


def _size_or_dash(v: int | None) -> str:
    return "-" if v is None else render.human_size(v)


def _share_cell(row: dict) -> str:
    share = share_of_v_star(row)
    return "-" if share is None else f"{100 * share:.0f}%"
