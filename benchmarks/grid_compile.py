"""The sweep's and the plan's grid programs, each against the straightforward program that
evaluates the cost formulas once per use, side by side in one process.

    python benchmarks/grid_compile.py [--device a100-80gb] [--model paper-1.5b] [--repeats 3]

The sweep (V*, its band and, on a calibrated profile, the v_star_share ensemble):

Both compute the same outputs from the same per-point cost function (``lifecycle.cost_grid``):

- baseline: the straightforward program, the cost grid evaluated three times: on the grid, on
  the band's fine grid, and once per ensemble draw (a profile with each op family's time
  scaled);
- lifecycle: one evaluation, on the fine grid (which holds every V of the grid), vmapped over
  the scale vectors ones, zeros and the unit vectors; the ensemble then reads each draw's costs
  as an affine function of its scales (``lifecycle._FamilyParts``).

The plan (``planning._plan_grid``: the best single V and head set of a mixed workload): the
baseline evaluates the cost grid for the batch ladder and again for each traffic class, a model
with the class's own S_in and S_out; planning evaluates it once, vmapped over the model's and
the classes' bytes (``CostModel.with_io``), at every batch of the ladder and the classes.

Prints, for the sweep on the default grid and a larger one, on a calibrated profile (with the
ensemble) and an uncalibrated one (V* and the band only: the baseline evaluates the costs twice,
lifecycle once), and for the plan of a two- and a three-class workload on the calibrated
profile, the trace + compile time and the warm call time of each (``vocabjax.timing``: the two
programs called round-robin, the median of ``--repeats`` rounds) and their ratios, and compares
the outputs: V*, the band and the ensemble's shares (the two round each draw's costs
differently, so a draw near a tie may pick another V); the plan's routes, best head set and
costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks._report import header  # noqa: E402
from vocabjax import api, lifecycle, planning  # noqa: E402
from vocabjax.costmodel import OP_FAMILIES, CostModel  # noqa: E402
from vocabjax.lifecycle import (  # noqa: E402
    DRAW_CHUNK,
    Grid,
    _argmin_v,
    _band,
    allowed_vocab,
    cost_grid,
    objective_grid,
)
from vocabjax.planning import ROUTE_BATCHES, _head_sets, parse_workload, subset_masks  # noqa: E402
from vocabjax.timing import TimingSettings, time_interleaved  # noqa: E402


def baseline_grid(model, v, valid, b, lam, v_fine, valid_fine, tol, z, *, cap_batch, quality):
    """The outputs this benchmark compares, computed as the sweep computed them before."""
    cost = cost_grid(model, v, b, cap_batch=cap_batch)
    allowed = allowed_vocab(quality, v, valid)
    j = objective_grid(cost.c_train, cost.c_infer, lam, allowed)
    j_star = jnp.min(j, axis=0)
    fine = cost_grid(model, v_fine, b, cap_batch=cap_batch)
    v_low, v_high = _band(quality, fine, v_fine, valid_fine, lam, j_star, tol)
    out = dict(v_star=_argmin_v(j), v_low=v_low, v_high=v_high)
    if not z.shape[0]:
        return out
    sd = model.device.residual_sd

    def draw(zk):
        scales = dict(zip(OP_FAMILIES, jnp.exp(sd * zk), strict=True))
        c = cost_grid(model.scaled(scales), v, b, cap_batch=cap_batch)
        return _argmin_v(objective_grid(c.c_train, c.c_infer, lam, allowed))

    picks = jax.lax.map(draw, z, batch_size=DRAW_CHUNK)
    hits = picks[None] == jnp.arange(v.shape[0])[:, None, None, None]
    return {**out, "v_star_share": jnp.mean(hits, axis=1, dtype=jnp.float32)}


def compiled(fn, args) -> tuple[Any, float]:
    """``jax.jit(fn)`` compiled for ``args``, and its trace + lower + compile seconds."""
    t0 = time.perf_counter()
    out = jax.jit(fn).lower(*args).compile()
    return out, time.perf_counter() - t0


def side_by_side(old_fn, old_args, new_fn, new_args, repeats: int):
    """Both programs compiled, then timed round-robin (``vocabjax.timing.time_interleaved``):
    (compile seconds, median call seconds, outputs) of the baseline, then of the new one."""
    old, c_old = compiled(old_fn, old_args)
    new, c_new = compiled(new_fn, new_args)
    calls = [lambda: old(*old_args), lambda: new(*new_args)]
    t_old, t_new = time_interleaved(calls, [()], TimingSettings(warmup=2, repeats=repeats))
    o_old, o_new = jax.device_get((old(*old_args), new(*new_args)))
    return (c_old, t_old, o_old), (c_new, t_new, o_new)


def row(name: str, cm, grid: Grid, repeats: int) -> str:
    """One table row: both grid functions compiled and called on ``grid`` for ``cm``."""
    draws = lifecycle.ensemble_draws(cm, grid)
    at, valid, b, lam, v_fine, valid_fine, tol, z = lifecycle._grid_args(
        grid, jax.devices()[:1], 0.01, draws
    )
    new_fn = functools.partial(lifecycle._sweep_grid, cm, cap_batch=True, quality=None)
    old_fn = functools.partial(baseline_grid, cm, cap_batch=True, quality=None)
    old_args = (v_fine[at], valid, b, lam, v_fine, valid_fine, tol, z)
    new_args = (at, valid, b, lam, v_fine, valid_fine, tol, z)
    (c_old, t_old, o_old), (c_new, t_new, o_new) = side_by_side(
        old_fn, old_args, new_fn, new_args, repeats
    )
    exact = all(np.array_equal(o_old[k], o_new[k]) for k in ("v_star", "v_low", "v_high"))
    agree = "V* and band equal" if exact else "V* or band DIFFER"
    if draws:
        moved = np.abs(o_old["v_star_share"] - o_new["v_star_share"]) * draws
        agree += "; shares equal" if not moved.any() else (
            f"; shares: {int((moved > 0).sum())} of {moved.size} cells differ, by at most "
            f"{int(round(moved.max()))} draw(s)"
        )  # fmt: skip
    size = f"{len(grid.vocab)} V x {len(grid.batch)} B x {len(grid.lam)} lambda"
    return (
        f"| {name}, {size} | {draws} | {c_old:.2f} s | {1e3 * t_old:.1f} ms | {c_new:.2f} s | "
        f"{1e3 * t_new:.1f} ms | {c_old / c_new:.2f}x | {t_old / t_new:.2f}x | {agree} |"
    )


def baseline_plan(model, v, masks_sv, route_b, batch_c, share_c, lam, *, class_bytes):
    """What the plan comparison reads, as the straightforward program computes it: the cost
    grid of the batch ladder, then one per traffic class, each a model with its own bytes."""
    ladder = cost_grid(model, v, route_b, cap_batch=True)
    allowed = allowed_vocab(None, v, jnp.ones(v.shape, bool))
    per_class = []
    for c, (prompt, output) in enumerate(class_bytes):
        s = dataclasses.replace(model.settings, prompt_bytes=prompt, output_bytes=output)
        own = CostModel(model.device, model.shape, s, model.compression, model.training)
        per_class.append(cost_grid(own, v, batch_c[c : c + 1], cap_batch=True).c_infer)
    c_inf = jnp.concatenate(per_class, axis=1)
    j_hc = objective_grid(ladder.c_train, c_inf, lam[None], allowed)[:, :, 0]
    j_set, route_sc, _ = _head_sets(j_hc, masks_sv, share_c)
    j_route = objective_grid(ladder.c_train, ladder.c_infer, lam[None], allowed)[:, :, 0]
    return dict(c_inf=c_inf, j_set=j_set, route_sc=route_sc, j_route=j_route)


def _largest_relative_difference(old, new) -> float:
    """max |new / old - 1| over the finite, non-zero entries of ``old``."""
    old, new = np.asarray(old, np.float64), np.asarray(new, np.float64)
    ok = np.isfinite(old) & (old != 0)
    return float(np.max(np.abs(new[ok] / old[ok] - 1), initial=0.0))


def plan_row(cm, workload: str, repeats: int) -> str:
    """One table row: both plan programs compiled and called for ``workload`` at lambda 100."""
    classes = parse_workload(workload)
    vocab = lifecycle.DEFAULT_VOCAB
    masks = subset_masks(len(vocab), 3)
    io = planning.class_bytes(cm, classes)
    common = (
        jnp.asarray(vocab, jnp.float32), jnp.asarray(masks),
        jnp.asarray(ROUTE_BATCHES, jnp.float32),
        jnp.asarray([c.batch for c in classes], jnp.float32),
        jnp.asarray([c.share for c in classes], jnp.float32),
    )  # fmt: skip
    lam = jnp.float32(100.0)
    old_fn = functools.partial(baseline_plan, cm, class_bytes=tuple(io))
    new_fn = functools.partial(planning._plan_grid, cm, cap_batch=True, quality=None)
    new_args = (*common, jnp.asarray(io, jnp.float32), lam)
    (c_old, t_old, o_old), (c_new, t_new, o_new) = side_by_side(
        old_fn, (*common, lam), new_fn, new_args, repeats
    )
    same = np.array_equal(o_old["route_sc"], o_new["route_sc"]) and np.array_equal(
        np.argmin(o_old["j_set"]), np.argmin(o_new["j_set"])
    )
    rel = max(
        _largest_relative_difference(o_old[k], o_new[k]) for k in ("c_inf", "j_set", "j_route")
    )
    agree = f"{'routes and best set equal' if same else 'routes DIFFER'}; costs within {rel:.1e}"
    return (
        f"| plan, {len(classes)} classes | {c_old:.2f} s | {1e3 * t_old:.1f} ms | {c_new:.2f} s "
        f"| {1e3 * t_new:.1f} ms | {c_old / c_new:.2f}x | {t_old / t_new:.2f}x | {agree} |"
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="a100-80gb", help="a calibrated profile")
    ap.add_argument("--plain-device", default="a10g", help="an uncalibrated one (no ensemble)")
    ap.add_argument("--model", default="paper-1.5b")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds of the warm calls")
    args = ap.parse_args(argv)
    cm = api.cost_model(device=args.device, model=args.model)
    plain = api.cost_model(device=args.plain_device, model=args.model)
    if cm.device.residual_sd is None or plain.device.residual_sd is not None:
        raise SystemExit("Error: give a calibrated --device and an uncalibrated --plain-device")
    header(
        __file__, argv, f"{args.model}; warm calls: median of {args.repeats} rounds, round-robin"
    )
    large = Grid(
        vocab=tuple(int(v) for v in np.unique(np.geomspace(4096, 2**20, 48).astype(int))),
        batch=tuple(int(b) for b in np.unique(np.geomspace(1, 1024, 24).astype(int))),
        lam=tuple(float(x) for x in np.concatenate([[0.0], np.geomspace(0.1, 1e4, 15)])),
    )
    print("| device, grid | draws | baseline: compile | call | lifecycle: compile | call "
          "| compile ratio | call ratio | outputs |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, model, grid in (
        (args.device, cm, Grid()),
        (args.device, cm, large),
        (args.plain_device, plain, Grid()),
        (args.plain_device, plain, large),
    ):
        print(row(name, model, grid, args.repeats), flush=True)
    print()
    print("| program | baseline: compile | call | planning: compile | call | compile ratio "
          "| call ratio | outputs |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for workload in (
        "edge:b=1:share=0.5,dc:b=256:share=0.5",
        "a:b=1:share=0.3,b:b=16:share=0.3,c:b=256:share=0.4:in=512:out=64",
    ):
        print(plan_row(cm, workload, args.repeats), flush=True)


if __name__ == "__main__":
    main()
