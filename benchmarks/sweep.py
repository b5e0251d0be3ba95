"""Sweep throughput: the jitted, vmapped grid against the same cost model point by point.

    python benchmarks/sweep.py [--vocab-points 1000 --batch-points 100 --lam-points 100]

Both sides evaluate the very same formulas (vocabjax.costmodel, written against an array
namespace): the grid through jax.jit(vmap(...)) in one call, the baseline in plain Python floats
(vocabjax.xp.PyMath) on a random sample of the grid's points, in the same process. Prints points
per second for each and their ratio, and checks that the two agree on the sample.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from vocabjax.costmodel import CostModel, Settings  # noqa: E402
from vocabjax.hardware import load_device  # noqa: E402
from vocabjax.lifecycle import Grid, sweep  # noqa: E402
from vocabjax.shapes import load_shape  # noqa: E402
from vocabjax.xp import PyMath  # noqa: E402


def main() -> None:
    """Options, then each measured variant side by side in this process, then the table; one
    script read top to bottom, hence its length."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-points", type=int, default=1000)
    ap.add_argument("--batch-points", type=int, default=100)
    ap.add_argument("--lam-points", type=int, default=100)
    ap.add_argument("--sample", type=int, default=3000, help="points evaluated one by one")
    ap.add_argument("--device", default="a100-80gb")
    ap.add_argument("--model", default="llama-8b")
    args = ap.parse_args()

    vocab = tuple(
        int(v) for v in np.unique(np.geomspace(4096, 2**21, args.vocab_points).astype(int))
    )
    batch = tuple(
        int(b) for b in np.unique(np.geomspace(1, 4096, args.batch_points * 3).astype(int))
    )
    batch = batch[:: max(1, len(batch) // args.batch_points)][: args.batch_points]
    lam = tuple(
        float(x) for x in np.concatenate([[0.0], np.geomspace(1e-2, 1e4, args.lam_points - 1)])
    )
    grid = Grid(vocab, batch, lam)
    cm = CostModel(load_device(args.device), load_shape(args.model), Settings(mode="full"))
    print(
        f"jax {jax.__version__} on {jax.default_backend()} ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"
    )
    print(
        f"grid: {len(grid.vocab)} V x {len(grid.batch)} B x {len(grid.lam)} lambda = {grid.points:,} points"
    )

    t0 = time.perf_counter()
    res = sweep(cm, grid)
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = sweep(cm, grid)
    t_second = time.perf_counter() - t0

    rng = np.random.default_rng(0)
    idx = rng.integers(0, [len(grid.vocab), len(grid.batch), len(grid.lam)], size=(args.sample, 3))
    t0 = time.perf_counter()
    j_py = []
    for vi, bi, li in idx:
        v, b, x = float(grid.vocab[vi]), float(grid.batch[bi]), grid.lam[li]
        ct = cm.c_train(v, xp=PyMath)
        j_py.append(ct + x * cm.c_infer(v, b, xp=PyMath) if x > 0 else ct)
    t_py = time.perf_counter() - t0

    # agreement on the sample: J recomputed from the grid's own per-(V, B) arrays
    j_grid = np.where(
        np.asarray(grid.lam)[idx[:, 2]] > 0,
        res.c_train[idx[:, 0]]
        + np.asarray(grid.lam)[idx[:, 2]] * res.c_infer[idx[:, 0], idx[:, 1]],
        res.c_train[idx[:, 0]],
    )
    err = float(np.max(np.abs(j_grid - np.asarray(j_py)) / np.asarray(j_py)))

    pps_first = grid.points / t_first
    pps_warm = grid.points / t_second
    pps_py = args.sample / t_py
    print(f"grid, compile included : {t_first:7.3f} s   {pps_first:14,.0f} points/s")
    print(f"grid, compiled (warm)  : {t_second:7.3f} s   {pps_warm:14,.0f} points/s")
    print(
        f"python point by point  : {t_py:7.3f} s   {pps_py:14,.0f} points/s   ({args.sample:,} sampled points)"
    )
    print(
        f"ratio vs python: {pps_first / pps_py:,.0f}x compile included, {pps_warm / pps_py:,.0f}x warm"
    )
    print(f"max relative difference on the sample: {err:.2e}")
    verdict = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    print(
        f"goal: whole grid < 10 s compile included -> {verdict(t_first < 10)}; "
        f">= 1000x python -> {verdict(pps_first / pps_py >= 1000)} compile included, "
        f"{verdict(pps_warm / pps_py >= 1000)} warm"
    )


if __name__ == "__main__":
    main()
