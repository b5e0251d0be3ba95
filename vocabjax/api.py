"""The Python API behind ``import vocabjax as vj``: sweeps and plans from names or objects.

    res = vj.sweep(device="a10g", model="paper-100m", vocab="8k,32k,262k", batch=[1, 256])
    res.v_star              # [B, lam] vocabulary sizes (NO_VOCAB = 0 where none fits)
    res.c_infer             # [V, B] jax.Array, seconds per served byte

Every argument takes what a user has at hand: a builtin name or a profile path or the loaded
object (``DeviceProfile``, ``ModelShape``, ``CompressionCurve``, ``TrainingProfile``), sizes as
ints or strings (``"32k"``, ``"8k,32k"``), and the cost model's settings as keywords named like
``costmodel.Settings``' fields. The numbers come from ``lifecycle.sweep`` and ``plan.make_plan``
(the CLI's own calls), so ``vj.sweep`` and ``python cli.py sweep`` agree by construction.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from vocabjax import lifecycle
from vocabjax.compression import CompressionCurve, load_compression
from vocabjax.costmodel import CostModel, Settings
from vocabjax.errors import UserError
from vocabjax.hardware import DEFAULT_DEVICE, DeviceProfile, load_device
from vocabjax.lifecycle import (
    DEFAULT_BATCH,
    DEFAULT_LAM,
    DEFAULT_TOLERANCE,
    DEFAULT_VOCAB,
    NO_VOCAB,
    Grid,
    Quality,
    SweepResult,
)
from vocabjax.outputs import atomic_write_json
from vocabjax.planning import TrafficClass, make_plan, parse_workload, policy_json
from vocabjax.shapes import DEFAULT_MODEL, ModelShape, load_shape
from vocabjax.trainprofile import TrainingProfile, load_training
from vocabjax.units import (
    BATCH_RANGE,
    LAM_MAX,
    SIZE_MAX,
    VOCAB_RANGE,
    parse_float,
    parse_float_list,
    parse_size,
    parse_size_list,
)

Sizes = int | str | Iterable[int | str]  # 65536, "64k", "8k,32k", [8192, "32k"]
Floats = float | str | Iterable[float | str]  # 100, "0,1,100", [0.0, 10.0]
Named = str | os.PathLike  # a builtin name or a profile file
SETTINGS_FIELDS = tuple(f.name for f in dataclasses.fields(Settings))

# ---- arguments: names, paths or objects ---------------------------------------------------------


def _loaded(value: Any, cls: type, load: Callable[[Any], Any], what: str):
    if isinstance(value, cls):
        return value
    if isinstance(value, str | os.PathLike):
        return load(value)
    raise TypeError(
        f"{what} must be a name, a path or a {cls.__name__}, got {type(value).__name__}"
    )


def _items(value: Any, what: str) -> list[Any]:
    items = list(value) if isinstance(value, Iterable) else [value]
    if not items:
        raise UserError(f"{what} list is empty")
    return items


def sizes(
    value: Sizes, *, what: str = "size", bounds: tuple[int, int] = (1, SIZE_MAX)
) -> tuple[int, ...]:
    """``"8k,32k"``, ``32768``, ``["8k", 65536]`` -> a tuple of ints within ``bounds``."""
    lo, hi = bounds
    if isinstance(value, str):
        return tuple(parse_size_list(value, what=what, minimum=lo, maximum=hi))
    out = []
    for v in _items(value, what):
        if not isinstance(v, str):
            try:
                v = operator.index(v)  # ints of any kind; 8192.0 is no size
            except TypeError:
                raise TypeError(f"{what} {v!r} must be an int or a size like '32k'") from None
        out.append(parse_size(v, what=what, minimum=lo, maximum=hi))
    return tuple(dict.fromkeys(out))


def floats(value: Floats, *, what: str, maximum: float = LAM_MAX) -> tuple[float, ...]:
    """``"0,1,100"``, ``10``, ``[0, 1e3]`` -> a tuple of finite floats in ``0..maximum``."""
    if isinstance(value, str):
        return tuple(parse_float_list(value, what=what, minimum=0.0, maximum=maximum))
    parsed = (parse_float(v, what=what, maximum=maximum) for v in _items(value, what))
    return tuple(dict.fromkeys(parsed))


def _inputs(
    device, model, compression, training, bpb_tolerance, settings: Mapping[str, Any]
) -> tuple[CostModel, Quality | None]:
    """The cost model and quality bound that sweep, objective and plan share."""
    unknown = sorted(set(settings) - set(SETTINGS_FIELDS))
    if unknown:
        raise TypeError(
            f"unknown settings {unknown}; Settings fields: {', '.join(SETTINGS_FIELDS)}"
        )
    train = (
        None if training is None else _loaded(training, TrainingProfile, load_training, "training")
    )
    cm = CostModel(
        _loaded(device, DeviceProfile, load_device, "device"),
        _loaded(model, ModelShape, load_shape, "model"),
        Settings(**settings),
        _loaded(compression, CompressionCurve, load_compression, "compression"),
        train,
    )
    if bpb_tolerance is None:
        return cm, None
    if train is None:
        raise UserError("bpb_tolerance needs a training profile with measured bpb")
    return cm, Quality(train, parse_float(bpb_tolerance, what="bpb_tolerance", maximum=1e6))


def cost_model(
    *,
    device: Named | DeviceProfile = DEFAULT_DEVICE,
    model: Named | ModelShape = DEFAULT_MODEL,
    compression: Named | CompressionCurve = "default",
    training: Named | TrainingProfile | None = None,
    **settings: Any,
) -> CostModel:
    """The roofline cost model of ``model`` served on ``device`` (per-op ``breakdown``,
    ``c_train``, ``c_infer`` at one point); ``settings`` are ``costmodel.Settings`` fields
    (``mode="weights-only"``, ``prompt_bytes=2048``, ``weight_dtype="f32"``, ...)."""
    return _inputs(device, model, compression, training, None, settings)[0]


# ---- the grid function ---------------------------------------------------------------------------

Objective = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _objective(cm: CostModel, cap_batch: bool, quality: Quality | None) -> Objective:
    run = lifecycle.grid_function(cm, cap_batch=cap_batch, quality=quality)

    def j_grid(vocab, batch, lam) -> jax.Array:
        """J(V; B, lambda) = c_train(V) + lambda c_infer(V, B), [V, B, lam] float32 seconds per
        training byte; inf where V fails the quality bound, or where not one sequence fits
        (with ``cap_batch``). ``vocab``, ``batch``, ``lam`` are 1-D; pure and differentiable
        in all three, so ``jax.grad``, ``jax.vmap`` and ``jax.jit`` compose with it."""
        vocab = jnp.asarray(vocab, jnp.float32)
        batch = jnp.asarray(batch, jnp.float32)
        lam = jnp.asarray(lam, jnp.float32)
        valid = jnp.ones(vocab.shape, bool)
        at = jnp.arange(vocab.shape[0], dtype=jnp.int32)
        no_draws = lifecycle.no_draws()  # J alone: the band on the grid itself, no ensemble
        return run(at, valid, batch, lam, vocab, valid, jnp.float32(0), no_draws)["j"]

    return j_grid


def objective(
    *,
    device: Named | DeviceProfile = DEFAULT_DEVICE,
    model: Named | ModelShape = DEFAULT_MODEL,
    compression: Named | CompressionCurve = "default",
    training: Named | TrainingProfile | None = None,
    bpb_tolerance: float | None = None,
    cap_batch: bool = True,
    **settings: Any,
) -> Objective:
    """The pure grid function under :func:`sweep`: ``f(vocab, batch, lam) -> J [V, B, lam]``.

    Arguments as :func:`sweep`. The function is the sweep's own jitted one (no second copy of
    the cost formulas); each of its inputs may carry a tracer, so it can be differentiated and
    vmapped, e.g. ``jax.grad(lambda lam: f(v, b, lam).sum())(lam)``.
    """
    cm, quality = _inputs(device, model, compression, training, bpb_tolerance, settings)
    return _objective(cm, cap_batch, quality)


# ---- sweep ---------------------------------------------------------------------------------------


def _f32(x) -> jax.Array:
    return jnp.asarray(x, jnp.float32)


@dataclasses.dataclass(frozen=True, eq=False)
class Sweep:
    """V* over one (V, B, lambda) grid for one device and model shape, as ``jax.Array``s.

    Axes: V = ``grid.vocab``, B = ``grid.batch``, lam = ``grid.lam`` (each sorted, unique).
    Answers are vocabulary sizes, never grid indices. Where no V is allowed (quality bound) or
    fits (``cap_batch``), ``v_star`` is ``NO_VOCAB`` (0, which is no size), ``found`` is False
    and ``j_star`` is inf; :meth:`at_v_star` reads any [V] or [V, B] array at V* with NaN there.
    Costs are float32 seconds: per training byte (J, c_train) or per served byte (c_infer).
    """

    model: CostModel  # device, shape, settings and curves swept
    grid: Grid
    vocab: jax.Array  # [V] int32 sizes
    batch: jax.Array  # [B] int32
    lam: jax.Array  # [lam] float32
    v_star: jax.Array  # [B, lam] int32 size argmin_V J, NO_VOCAB where not found
    found: jax.Array  # [B, lam] bool: some V is allowed and fits
    j_star: jax.Array  # [B, lam] J at V* (inf where not found)
    c_train: jax.Array  # [V] training cost per training byte
    c_infer: jax.Array  # [V, B] serving cost per served byte (inf where nothing fits)
    v_infer: jax.Array  # [B] int32 size argmin_V c_infer (lambda -> infinity), or NO_VOCAB
    v_train: int  # size argmin_V c_train over the allowed V (lambda = 0), or NO_VOCAB
    break_even: jax.Array  # [V, B] lambda at which V beats v_train (inf: never)
    batch_run: jax.Array  # [V, B] batch actually run (capped at b_max with cap_batch)
    v_low: jax.Array  # [B, lam] int32 smallest V whose J is within ``tolerance`` of J at V*
    v_high: jax.Array  # [B, lam] int32 largest such V (both NO_VOCAB where not found)
    tolerance: float  # of the band
    v_star_share: jax.Array | None  # [V, B, lam] share of calibrated draws picking each V
    share_note: str  # what v_star_share is, or why it is None (an uncalibrated profile)
    b_max: jax.Array  # [V] largest batch whose KV cache fits beside the weights
    kv_bytes_per_seq: jax.Array  # [V]
    allowed: jax.Array  # [V] bool: passes the quality bound
    objective: Objective  # f(vocab, batch, lam) -> J [V, B, lam], pure; see vj.objective
    host: SweepResult  # the same sweep as numpy arrays, what the CLI renders

    @classmethod
    def of(cls, result: SweepResult, model: CostModel, objective: Objective) -> Sweep:
        g = result.grid
        return cls(
            model=model,
            grid=g,
            vocab=jnp.asarray(g.vocab, jnp.int32),
            batch=jnp.asarray(g.batch, jnp.int32),
            lam=_f32(g.lam),
            v_star=jnp.asarray(result.v_star, jnp.int32),
            found=jnp.asarray(result.found),
            j_star=_f32(result.j_star),
            c_train=_f32(result.c_train),
            c_infer=_f32(result.c_infer),
            v_infer=jnp.asarray(result.v_infer, jnp.int32),
            v_train=int(result.v_train),
            break_even=_f32(result.break_even),
            batch_run=_f32(result.batch_eff),
            v_low=jnp.asarray(result.v_low, jnp.int32),
            v_high=jnp.asarray(result.v_high, jnp.int32),
            tolerance=result.tolerance,
            v_star_share=None if result.v_star_share is None else _f32(result.v_star_share),
            share_note=result.share_note,
            b_max=_f32(result.b_max),
            kv_bytes_per_seq=_f32(result.kv_bytes_per_seq),
            allowed=jnp.asarray(result.allowed),
            objective=objective,
            host=result,
        )

    def at_v_star(self, x_v) -> jax.Array:
        """``x`` ([V] or [V, B], e.g. ``c_train``, ``c_infer``, ``b_max``) read at V* of each
        (B, lambda): a [B, lam] float32 array, NaN where no V was found."""
        x_v = jnp.asarray(x_v)
        nv, nb = len(self.grid.vocab), len(self.grid.batch)
        at = jnp.minimum(jnp.searchsorted(self.vocab, self.v_star), nv - 1)  # [B, lam]
        if x_v.shape == (nv,):
            picked = x_v[at]
        elif x_v.shape == (nv, nb):
            picked = x_v[at, jnp.arange(nb)[:, None]]
        else:
            raise ValueError(
                f"x has shape {x_v.shape}; expected [V]=({nv},) or [V, B]=({nv}, {nb})"
            )
        return jnp.where(self.found, picked.astype(jnp.float32), jnp.nan)

    def j(self) -> jax.Array:
        """The whole objective J [V, B, lam] of this grid (inf where V is not allowed)."""
        return self.objective(self.vocab, self.batch, self.lam)

    def band(self, tolerance: float | None = None) -> jax.Array:
        """[V, B, lam] bool: the grid's V whose J is within ``tolerance`` (relative; default
        the sweep's) of the best J at that (B, lambda); all False where no V is found.
        ``v_low``/``v_high`` are the same band's ends on the finer grid of the sweep."""
        tolerance = self.tolerance if tolerance is None else tolerance
        tol = parse_float(tolerance, what="tolerance", maximum=1e6)
        j = self.j()
        best = jnp.min(j, axis=0)
        return jnp.isfinite(j) & (j <= best * (1.0 + tol))

    def rows(self) -> list[dict]:
        """One dict per (B, lambda), the ``table`` rows of ``python cli.py sweep --format json``."""
        return lifecycle.sweep_rows(self.model, self.host)

    def __repr__(self) -> str:
        m = self.model
        return (
            f"Sweep({m.device.name}, {m.shape.name}, {m.settings.mode}; "
            f"vocab={self.grid.vocab}, batch={self.grid.batch}, lam={self.grid.lam}; "
            f"v_star={self.host.v_star.tolist()})"
        )


def sweep(
    *,
    device: Named | DeviceProfile = DEFAULT_DEVICE,
    model: Named | ModelShape = DEFAULT_MODEL,
    vocab: Sizes = DEFAULT_VOCAB,
    batch: Sizes = DEFAULT_BATCH,
    lam: Floats = DEFAULT_LAM,
    compression: Named | CompressionCurve = "default",
    training: Named | TrainingProfile | None = None,
    bpb_tolerance: float | None = None,
    cap_batch: bool = True,
    devices: Sequence[jax.Device] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    **settings: Any,
) -> Sweep:
    """V* = argmin_V c_train(V) + lambda c_infer(V, B) over a (V, B, lambda) grid, in one
    jitted call sharded over ``devices`` (default ``jax.devices()``).

    ``device``: builtin name, autotune profile path or ``DeviceProfile``; ``model``: builtin
    shape, ``.json``/``.toml`` path or ``ModelShape``; ``vocab``, ``batch``: sizes (``"32k"``,
    ``"8k,32k"``, ints); ``lam``: lambda values; ``compression``: ``"default"``, a ``tokenizer
    measure`` profile or a ``CompressionCurve``; ``training``: a training profile (measured
    tokens/s, and with ``bpb_tolerance`` a quality bound on BPB); ``cap_batch``: cap B at the
    largest batch that fits (False: the roofline of B however much memory it needs);
    ``tolerance``: of the V* band (``v_low``, ``v_high``); ``settings``: ``costmodel.Settings``
    fields. Defaults are those of ``python cli.py sweep``.
    """
    grid = Grid(
        vocab=sizes(vocab, what="vocab", bounds=VOCAB_RANGE),
        batch=sizes(batch, what="batch", bounds=BATCH_RANGE),
        lam=floats(lam, what="lam"),
    )
    cm, quality = _inputs(device, model, compression, training, bpb_tolerance, settings)
    result = lifecycle.sweep(
        cm, grid, cap_batch=cap_batch, quality=quality, devices=devices, tolerance=tolerance
    )
    return Sweep.of(result, cm, _objective(cm, cap_batch, quality))


# ---- plan ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Deployment:
    """A mixed workload's plan: the best single V, the best nested heads and each traffic
    class's head, all vocabulary sizes, read from the policy that ``serve --policy`` takes."""

    model: CostModel
    policy: Mapping[str, Any]  # the policy JSON, as ``python cli.py plan --format json`` prints it

    @property
    def single(self) -> int:
        """The best single vocabulary size."""
        return int(self.policy["single"]["vocab"])

    @property
    def heads(self) -> tuple[int, ...]:
        """The best set of nested heads, smallest first."""
        return tuple(int(v) for v in self.policy["heads"])

    @property
    def cost_per_byte(self) -> float:
        """J of the head set, seconds per training byte."""
        return float(self.policy["cost_per_byte"])

    @property
    def routes(self) -> dict[str, int]:
        """Traffic class name -> the head that serves it."""
        return {r["name"]: int(r["head"]) for r in self.policy["routes"]}

    def save(self, path: str | os.PathLike) -> Path:
        """Write the policy JSON atomically, for ``python cli.py serve --policy PATH``."""
        return atomic_write_json(path, self.policy)


def plan(
    *,
    workload: str | Sequence[TrafficClass],
    lam: float | str,
    device: Named | DeviceProfile = DEFAULT_DEVICE,
    model: Named | ModelShape = DEFAULT_MODEL,
    vocab: Sizes = DEFAULT_VOCAB,
    max_heads: int = 3,
    compression: Named | CompressionCurve = "default",
    training: Named | TrainingProfile | None = None,
    bpb_tolerance: float | None = None,
    cap_batch: bool = True,
    **settings: Any,
) -> Deployment:
    """The best single V and nested heads for ``workload`` at one ``lam`` (``plan.make_plan``).

    ``workload``: ``"edge:b=1:share=0.5,dc:b=256:share=0.5"`` or ``TrafficClass`` items; the
    other arguments as :func:`sweep`. Defaults are those of ``python cli.py plan``.
    """
    classes = parse_workload(workload) if isinstance(workload, str) else tuple(workload)
    for c in classes:
        if not isinstance(c, TrafficClass):
            raise TypeError(f"workload items must be TrafficClass, got {type(c).__name__}")
    cm, quality = _inputs(device, model, compression, training, bpb_tolerance, settings)
    result = make_plan(
        cm,
        sizes(vocab, what="vocab", bounds=VOCAB_RANGE),
        classes,
        parse_float(lam, what="lam", maximum=LAM_MAX),
        max_heads=max_heads,
        cap_batch=cap_batch,
        quality=quality,
    )
    return Deployment(cm, policy_json(result, cm, max_heads=max_heads))


__all__ = [
    "NO_VOCAB",
    "Deployment",
    "Sweep",
    "cost_model",
    "floats",
    "objective",
    "plan",
    "sizes",
    "sweep",
]
