"""A calibrated sweep (V*, its band and the v_star_share ensemble): the grid function as
``lifecycle`` writes it against the straightforward one, side by side in one process.

    python benchmarks/sweep_ensemble.py [--device a100-80gb] [--model paper-1.5b] [--repeats 3]

Both compute the same outputs from the same per-point cost function (``lifecycle.cost_grid``):

- baseline: the straightforward program, the cost grid evaluated three times: on the grid, on
  the band's fine grid, and once per ensemble draw (a profile with each op family's time
  scaled);
- lifecycle: one evaluation, on the fine grid (which holds every V of the grid), vmapped over
  the scale vectors ones, zeros and the unit vectors; the ensemble then reads each draw's costs
  as an affine function of its scales (``lifecycle._FamilyParts``).

Prints, for the default grid and a larger one, on a calibrated profile (with the ensemble) and
an uncalibrated one (V* and the band only: the baseline evaluates the costs twice, lifecycle
once), the trace + compile time and the warm call time of each and their ratios, and compares
the outputs: V* and the band, and the ensemble's shares (the two round each draw's costs
differently, so a draw near a tie may pick another V).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks._report import header  # noqa: E402
from vocabjax import api, lifecycle  # noqa: E402
from vocabjax.costmodel import OP_FAMILIES  # noqa: E402
from vocabjax.lifecycle import (  # noqa: E402
    DRAW_CHUNK,
    Grid,
    _argmin_v,
    _band,
    allowed_vocab,
    cost_grid,
    objective_grid,
)


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


def timed(fn, args, repeats: int) -> tuple[float, float, dict]:
    """(trace + compile seconds, median warm call seconds, outputs) of ``jax.jit(fn)``."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    t_compile = time.perf_counter() - t0
    out = jax.block_until_ready(compiled(*args))
    calls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        calls.append(time.perf_counter() - t0)
    return t_compile, float(np.median(calls)), jax.device_get(out)


def row(name: str, cm, grid: Grid, repeats: int) -> str:
    """One table row: both grid functions compiled and called on ``grid`` for ``cm``."""
    draws = lifecycle.ensemble_draws(cm, grid)
    at, valid, b, lam, v_fine, valid_fine, tol, z = lifecycle._grid_args(
        grid, jax.devices()[:1], 0.01, draws
    )
    new_fn = functools.partial(lifecycle._sweep_grid, cm, cap_batch=True, quality=None)
    old_fn = functools.partial(baseline_grid, cm, cap_batch=True, quality=None)
    old_args = (v_fine[at], valid, b, lam, v_fine, valid_fine, tol, z)
    c_old, t_old, o_old = timed(old_fn, old_args, repeats)
    c_new, t_new, o_new = timed(new_fn, (at, valid, b, lam, v_fine, valid_fine, tol, z), repeats)
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="a100-80gb", help="a calibrated profile")
    ap.add_argument("--plain-device", default="a10g", help="an uncalibrated one (no ensemble)")
    ap.add_argument("--model", default="paper-1.5b")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    cm = api.cost_model(device=args.device, model=args.model)
    plain = api.cost_model(device=args.plain_device, model=args.model)
    if cm.device.residual_sd is None or plain.device.residual_sd is not None:
        raise SystemExit("Error: give a calibrated --device and an uncalibrated --plain-device")
    header(__file__, argv, f"{args.model}, median of {args.repeats} warm calls")
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


if __name__ == "__main__":
    main()
