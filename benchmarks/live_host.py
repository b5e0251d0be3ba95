"""The live server's host work per request, before and after: two helpers its engine loop calls
for every request it admits or looks at, side by side in one process.

    python benchmarks/live_host.py [--format table|markdown]

- ``key``: a request's sampling key, ``fold_in(key(seed), 0)``. Before, two JAX ops dispatched
  one by one (``batching._row0_key``); now ``batching.solo_key``, one compiled call for a seed in
  [0, 2^32) (bit for bit the same key, tested).
- ``route``: the head the router gives a request at the loop's load. Before, ``route_batch`` per
  request, and the loop's look for requests to prefill ahead asks it for every waiting request
  each turn; now ``LiveServer`` routes each (B, offset) once and looks it up after.
- ``keys stacked``: a prefill's requests' keys stacked into one array (per request of a prefill
  of 16). Before, ``jnp.stack`` run eagerly; now ``batching._stacked``, one compiled call.

Each side runs ``--requests`` of them (seeds drawn as ``fresh_seed`` draws them; B over 1 to 32,
offset 0), timed round-robin (``vocabjax.timing.time_interleaved``); the table gives the median
microseconds per request and before / after. The whole loop, measured with and without both:
docs/serving.md ("The engine loop's host work").
"""

from __future__ import annotations

import argparse
import sys

import _report
import jax.numpy as jnp
import numpy as np

from vocabjax import render
from vocabjax.serving.batching import _row0_key, _stacked, solo_key
from vocabjax.serving.router import route_batch
from vocabjax.timing import TimingSettings, time_interleaved

HEADS = (1024, 2048, 4096)
ROUTES = [(4, 1024), (None, 4096)]  # benchmarks/serve.py's two routes
SETTINGS = TimingSettings(warmup=3, repeats=15)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=256, help="requests per timed call (256)")
    p.add_argument("--format", choices=["table", "markdown"], default="table")
    args = p.parse_args(argv)
    n = args.requests
    seeds = [int(s) for s in np.random.default_rng(0).integers(0, 2**31, n)]
    loads = [1 + i % 32 for i in range(n)]
    routed: dict[tuple[int, int], object] = {}

    def keys_before():
        return [_row0_key(s) for s in seeds][-1]

    def keys_after():
        return [solo_key(s) for s in seeds][-1]

    def routes_before():
        return [route_batch(HEADS, ROUTES, batch=b, offset=0).head for b in loads][-1]

    def routes_after():
        out = None
        for b in loads:
            route = routed.get((b, 0))
            if route is None:
                route = routed[(b, 0)] = route_batch(HEADS, ROUTES, batch=b, offset=0)
            out = route.head
        return out

    groups = [tuple(solo_key(s) for s in seeds[i : i + 16]) for i in range(0, n - 15, 16)]

    def stack_before():
        return [jnp.stack(g) for g in groups][-1]

    def stack_after():
        return [_stacked(g) for g in groups][-1]

    rows = []
    for what, before, after, per in (("key", keys_before, keys_after, n),
                                     ("route", routes_before, routes_after, n),
                                     ("keys stacked", stack_before, stack_after,
                                      16 * len(groups))):  # fmt: skip
        t_before, t_after = time_interleaved([before, after], [()], SETTINGS)
        rows.append(
            {
                "per request": what,
                "before_us": 1e6 * t_before / per,
                "after_us": 1e6 * t_after / per,
                "before / after": t_before / t_after,
            }
        )
    _report.header(__file__, argv, f"{n} requests a timed call, median of {SETTINGS.repeats}")
    print(render.rows(rows, args.format))
    return 0


if __name__ == "__main__":
    sys.exit(main())
