"""The router: which head serves a batch, from a policy's batch routes and the quality
controller's level offset.

    routes = load_policy("policy.json")            # [(max_batch or None, head), ...]
    choose_head(run.heads, "auto", batch=8, routes=routes)        # HeadChoice(vocab, reason)
    route_batch(run.heads, routes, batch=8, offset=1).head        # one level above the route

``choose_head`` takes the route for B, snapped to the nearest of the run's heads in log V;
``shift_head`` moves it by the controller's offset in levels, clamped to the run's smallest and
largest head; ``offset_bounds`` is the range of offsets that still change some batch's head.
Pure functions of the heads, the routes and the offset: no model, no clock. The decision itself
is ``router_step``, a pure function of (state: the head the last batch kept, observation: B and
the offset) -> (state, decision) over a ``RouteTable``, on numpy on the host (``route_batch``)
or under ``jax.jit`` (tested equal).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np

from vocabjax.errors import UserError
from vocabjax.planning import POLICY_KIND
from vocabjax.profiles import VOCAB_MAX, a_list, an_object, closed, integer, load_json, require

Routes = Sequence[tuple[int | None, int]]  # (max_batch or None: every larger batch, head)


@dataclasses.dataclass(frozen=True)
class HeadChoice:
    vocab: int
    reason: str  # one line for the log


def load_policy(path: str | Path) -> list[tuple[int | None, int]]:
    """The ``batch_routes`` of a policy written by ``plan --out``: (max_batch or None, head)
    pairs in increasing max_batch, None (every larger batch) last. A route's ``b_max`` and
    ``fits`` (whether its batches fit beside its head on the planned device) are checked but not
    acted on: the engine's own batch limit decides here. The policy's other fields are
    ``plan``'s record of how it decided and are not read."""
    data = load_json(path, POLICY_KIND)
    where = f"policy {str(path)!r}"
    require(data, ("batch_routes",), where=where)
    routes = a_list(data["batch_routes"], where=f"{where}: batch_routes", nonempty=True)
    out: list[tuple[int | None, int]] = []
    for i, r in enumerate(routes):
        at = f"{where}: batch_routes[{i}]"
        closed(an_object(r, where=at), ("max_batch", "head", "b_max", "fits"), where=at)
        require(r, ("head",), where=at)
        if "b_max" in r:
            integer(r["b_max"], where=f"{at}.b_max", minimum=0)
        if "fits" in r and not isinstance(r["fits"], bool):
            raise UserError(f"{at}.fits must be true or false, got {r['fits']!r}")
        head = integer(r["head"], where=f"{at}.head", maximum=VOCAB_MAX)
        bound = r.get("max_batch")
        if bound is not None:
            bound = integer(bound, where=f"{at}.max_batch")
            last = out[-1][0] if out else 0  # never None: a null bound before here was refused
            if last is not None and bound <= last:
                raise UserError(
                    f"{at}.max_batch={bound} must be above the previous route's ({last}): "
                    "routes go in increasing max_batch, null last"
                )
        elif i != len(routes) - 1:
            raise UserError(f"{at}.max_batch is null (every larger batch) but is not the last")
        out.append((bound, head))
    return out


def choose_head(
    heads: Sequence[int],
    head: int | Literal["auto"],
    *,
    batch: int,
    routes: Routes | None = None,
) -> HeadChoice:
    """The head to serve a batch with: ``head`` itself (one of ``heads``); for ``"auto"`` the
    route of a policy for this batch size, snapped to the nearest of the run's heads in log V
    (ties to the larger), or without a policy the largest head."""
    heads = tuple(sorted(heads))
    listed = ", ".join(map(str, heads))
    if head != "auto":
        if head not in heads:
            raise UserError(
                f"{{head}} {head} is not one of the run's heads ({listed})", settings=["head"]
            )
        return HeadChoice(int(head), f"head {head} (asked for)")
    if routes is None:
        return HeadChoice(heads[-1], f"head auto: the largest of the run's heads ({listed})")
    i = next((i for i, r in enumerate(routes) if r[0] is None or batch <= r[0]), len(routes) - 1)
    bound_b, want = routes[i]
    if bound_b is not None:
        bound = f"B <= {bound_b}"
    else:
        bound = f"B > {routes[i - 1][0]}" if i else "every batch"
    vocab = _snap(heads, want)
    note = "" if vocab == want else f", the run's nearest head in log V ({listed})"
    return HeadChoice(
        vocab, f"head auto: the policy routes B={batch} ({bound}) to {want}: serving {vocab}{note}"
    )


def _snap(heads: Sequence[int], want: int) -> int:
    """The head nearest ``want`` in log V, ties to the larger."""
    return min(heads, key=lambda v: (abs(math.log(v / want)), -v))


def shift_head(heads: Sequence[int], head: int, offset: int) -> int:
    """The head ``offset`` levels above ``head`` among ``heads`` (below for a negative
    offset), clamped to the smallest and largest."""
    order = sorted(heads)
    i = min(max(order.index(head) + offset, 0), len(order) - 1)
    return order[i]


def offset_bounds(heads: Sequence[int], routes: Routes, max_batch: int) -> tuple[int, int]:
    """(lowest, highest) offsets that still change the head of some batch size 1..max_batch:
    below, every routed head is already the smallest; above, every one is the largest."""
    order = sorted(heads)
    routed = {
        order.index(choose_head(order, "auto", batch=b, routes=routes).vocab)
        for b in range(1, max_batch + 1)
    }
    return -max(routed), len(order) - 1 - min(routed)


@dataclasses.dataclass(frozen=True)
class RoutedBatch:
    """The router's decision for one batch."""

    routed: HeadChoice  # the policy's route for B, snapped to the run's heads
    offset: int  # the controller's offset in levels
    head: int  # routed.vocab shifted by offset, clamped: the head that serves the batch

    @property
    def reason(self) -> str:
        """One line for the switch log."""
        note = f"; offset {self.offset:+d}: serving {self.head}" if self.offset else ""
        return self.routed.reason + note


def route_batch(heads: Sequence[int], routes: Routes, *, batch: int, offset: int) -> RoutedBatch:
    """The head of a batch of ``batch`` requests: the policy's route shifted by ``offset``
    (``router_step`` on the host), with the route's reason."""
    table = RouteTable.of(heads, routes)
    _, decision = router_step(table, np.int32(-1), Routing(np.int32(batch), np.int32(offset)))
    routed = choose_head(heads, "auto", batch=batch, routes=routes)
    return RoutedBatch(routed, offset, table.heads[int(decision.head)])


# ---- the router as a pure function ---------------------------------------------------------------

NO_BOUND = 2**31 - 1  # the bound of a route for every larger batch (batches are int32)


@dataclasses.dataclass(frozen=True)
class RouteTable:
    """A policy's batch routes over a run's heads, as ``router_step`` reads them (static under
    jit)."""

    heads: tuple[int, ...]  # the run's heads, increasing
    bounds: tuple[int, ...]  # each route's max_batch, increasing (NO_BOUND: every larger batch)
    routed: tuple[int, ...]  # each route's head snapped to the run's nearest: an index in heads

    @classmethod
    def of(cls, heads: Sequence[int], routes: Routes) -> RouteTable:
        order = tuple(sorted(heads))
        bounds = tuple(NO_BOUND if b is None else b for b, _ in routes)
        return cls(order, bounds, tuple(order.index(_snap(order, v)) for _, v in routes))


class Routing(NamedTuple):
    """What the router decides on: the batch size and the controller's offset."""

    batch: Any  # B
    offset: Any  # levels


class RouteDecision(NamedTuple):
    routed: Any  # the policy's route for B: an index in the table's heads
    head: Any  # the head that serves: routed shifted by the offset, clamped (an index)
    switched: Any  # bool: not the head the last batch kept


def router_step(table: RouteTable, last: Any, obs: Routing, *, xp=np) -> tuple[Any, RouteDecision]:
    """The router's step: the route for ``obs.batch`` (the first whose bound holds it, else the
    last), shifted by ``obs.offset`` levels within the heads, and whether it switches from
    ``last`` (the head index the last batch kept; -1: none yet), which it returns as the new
    state. Pure: numpy or, jitted, jax.numpy (``xp``)."""
    i = xp.minimum(xp.searchsorted(xp.asarray(table.bounds), obs.batch), len(table.bounds) - 1)
    routed = xp.asarray(table.routed, xp.int32)[i]
    head = xp.clip(routed + obs.offset, 0, len(table.heads) - 1).astype(xp.int32)
    switched = (last >= 0) & (head != last)
    return head, RouteDecision(routed, head, switched)
