"""Staged requests (``staging.Stages``) join rows first come first served at each head: a
stage that finds no room at its head holds back the later stages of that head only."""

from __future__ import annotations

import dataclasses

from vocabjax.serving.staging import Stages


@dataclasses.dataclass(eq=False)
class Stage:
    """A stand-in for ``batching.Staged``: its head and the requests still to join."""

    head: int
    left: int


def test_stages_join_first_come_first_served_at_each_head():
    a1, b1, a2, b2 = Stage(500, 3), Stage(300, 2), Stage(500, 1), Stage(300, 1)
    stages = Stages()
    for s in (a1, b1, a2, b2):
        stages.add(s)
    room = {500: 1, 300: 5}
    joined = []

    def join(stage: Stage, m: int) -> None:
        joined.append((stage.head, m))
        stage.left -= m
        room[stage.head] -= m

    stages.join(lambda s: room[s.head], join)
    # a1 takes 500's one row and a2 waits behind it; 300's stages both join, in order
    assert joined == [(500, 1), (300, 2), (300, 1)]
    assert stages.heads == {500} and stages.left == 3
    room[500] = 3
    stages.join(lambda s: room[s.head], join)
    assert joined[3:] == [(500, 2), (500, 1)] and not stages and stages.heads == set()
