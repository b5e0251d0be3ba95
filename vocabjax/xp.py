"""The small array namespace the cost model is written against.

The cost model is written once, for one point, against ``xp``: ``jax.numpy`` when it is traced,
jitted and vmapped over a grid, and ``PyMath`` (plain Python floats) when the benchmark evaluates
the same formulas point by point as a baseline, or a test checks them by hand.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence


class PyMath:
    """The subset of ``jax.numpy`` the cost model uses, on Python scalars and lists."""

    inf = math.inf

    @staticmethod
    def asarray(x, dtype=None):
        return list(x) if isinstance(x, Sequence) and not isinstance(x, str) else x

    @staticmethod
    def maximum(a, b):
        return a if a >= b else b

    @staticmethod
    def minimum(a, b):
        return a if a <= b else b

    @staticmethod
    def clip(x, lo, hi):
        return lo if x < lo else hi if x > hi else x

    @staticmethod
    def where(cond, a, b):
        return a if cond else b

    @staticmethod
    def log(x):
        return math.log(x)

    @staticmethod
    def exp(x):
        return math.exp(x)

    @staticmethod
    def floor(x):
        return float(math.floor(x))

    @staticmethod
    def searchsorted(xs, x, side="left"):
        return (bisect.bisect_right if side == "right" else bisect.bisect_left)(xs, x)


def interp(x, xs, ys, *, xp, extrapolate: bool = False):
    """Piecewise-linear ``y(x)`` through sorted knots ``xs``.

    Outside the knots the end value is held (``extrapolate=False``) or the end segment's line
    is continued. Works for ``xp = jax.numpy`` (traced ``x``) and ``xp = PyMath``.
    """
    n = len(xs)
    if n == 1:
        return ys[0] + 0.0 * x
    xs_a, ys_a = xp.asarray(xs), xp.asarray(ys)
    i = xp.clip(xp.searchsorted(xs_a, x, side="right") - 1, 0, n - 2)
    x0, x1, y0, y1 = xs_a[i], xs_a[i + 1], ys_a[i], ys_a[i + 1]
    t = (x - x0) / (x1 - x0)
    if not extrapolate:
        t = xp.clip(t, 0.0, 1.0)
    return y0 + t * (y1 - y0)
