"""Prefilling ahead (``ServeConfig.prefill_ahead``), shared by the virtual clock's loop
(``continuous.py``) and the live server's (``live.py``): when more requests wait than rows are
free, the prefill of the requests that get a row also takes the next waiting prompts of the same
padded length (``ahead``); those without a row are staged on the device (``batching.Staged``)
and join rows at their head first come first served as rows free, ahead of any new prefill at
that head (``Stages``); requests routed to another head are prefilled meanwhile. So a busy
server prefills many prompts in one call instead of the one or two a stop frees.

    picks = ahead(16, buckets, need, joining=2, wait="rows", most=16, held_bytes=...,
                  running=..., b_max=..., kv_budget=...)
    staged, call = prefill(engine, joining_and_picked, head, score)
    batch.join_staged(staged, 2); stages.add(staged)      # the rest wait for rows
    stages.join(room, join)                               # later: as rows free
    head in stages.heads                                  # no new prefill at it before they join

A staged request holds memory from its prefill: its KV reservation counts against the budget
and its head's b_max as a running request's does (``ahead`` stages only within both), so
nothing holds more than the plan while it waits for a row. A request whose client leaves while
it is staged never joins (``Stages.cancel``), and a stage with none left is dropped, its caches
with it. A staged request's tokens are those it gets alone: the prefill and the join compute
each row on its own, and it draws with its own key.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

from vocabjax.serving.admission import Wait, admit_count
from vocabjax.serving.batching import Staged


def may_stage(wait: Wait | None, most: int, joining: int) -> bool:
    """Whether a prefill of ``joining`` requests can take any more (``ahead``): only while rows
    (not memory) hold the next waiting request back and ``most`` leaves room. A caller that is
    told no need not read its queue."""
    return wait == "rows" and most > joining


def ahead(
    bucket: int,
    buckets: Sequence[int],
    need_bytes: Sequence[int],
    *,
    joining: int,
    wait: Wait | None,
    most: int,
    held_bytes: int,
    running: int,
    b_max: int,
    kv_budget: int,
) -> list[int]:
    """Which other waiting requests (their prompts' padded lengths ``buckets`` and KV bytes
    ``need_bytes`` at the head, in arrival order) the prefill of ``joining`` requests padded to
    ``bucket`` also takes and stages, as positions in ``buckets``: none unless rows (not
    memory) hold the next waiting request back (``wait``, from ``admission.admit_count``); else
    the next ones padded to ``bucket`` (so that they add rows to the prefill, not length to every
    row), up to ``most`` in all with the joining ones and a power of two of rows (a prefill runs
    as one; padding rows would be work for nothing), within the KV budget and the head's
    ``b_max`` beside ``held_bytes`` and ``running`` (the joining requests counted in both)."""
    if not may_stage(wait, most, joining):
        return []
    fits = [p for p, b in enumerate(buckets) if b == bucket]
    extra, _ = admit_count(
        [need_bytes[p] for p in fits],
        held_bytes=held_bytes,
        running=0,
        max_batch=most - joining,
        b_max=b_max - running,
        kv_budget=kv_budget,
    )
    rows = 1 << ((joining + extra).bit_length() - 1)  # the largest power of two within them
    return fits[: max(rows - joining, 0)]


class Stages:
    """Staged prefills in the order they ran; their requests join rows in that order."""

    def __init__(self) -> None:
        self._queue: collections.deque[Staged] = collections.deque()

    def __bool__(self) -> bool:
        """Whether any request is staged."""
        return bool(self._queue)

    @property
    def heads(self) -> set[int]:
        """The heads with requests staged: a new prefill at one waits until they have joined."""
        return {staged.head for staged in self._queue}

    @property
    def left(self) -> int:
        """Requests staged, still to join."""
        return sum(staged.left for staged in self._queue)

    def add(self, staged: Staged) -> None:
        """Queue what is left of ``staged`` (nothing when all of it joined)."""
        if staged.left:
            self._queue.append(staged)

    def join(self, room: Callable[[Staged], int], join: Callable[[Staged, int], Any]) -> None:
        """Staged requests join rows at their head, first come first served at each head, while
        its rows are free: each stage in order joins its next ``min(left, room(stage))`` by
        ``join(stage, m)``, and once a stage finds no room (or too little for all it holds) the
        later stages of its head wait too. A stage whose requests have all joined is dropped."""
        full: set[int] = set()  # heads whose rows ran out this time
        for staged in list(self._queue):
            if staged.head in full:
                continue
            m = min(staged.left, room(staged))
            if m > 0:
                join(staged, m)
            if staged.left:
                full.add(staged.head)
            else:
                self._queue.remove(staged)

    def cancel(self, tag: Any) -> bool:
        """The staged request ``tag`` never joins (its client left); a stage left with none is
        dropped, its caches with it. False when no stage holds it."""
        for staged in self._queue:
            if staged.cancel(tag):
                if not staged.left:
                    self._queue.remove(staged)
                return True
        return False

    def clear(self) -> None:
        """Drop every stage (the loop failed or stopped)."""
        self._queue.clear()
