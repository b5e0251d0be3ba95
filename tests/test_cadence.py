"""How many stops a decode call waits for (``serving.cadence.stops_to_wait``): one round trip
to the host against the row-steps left idle, per freed row."""

from __future__ import annotations

import pytest

from vocabjax.serving.cadence import stops_to_wait


def test_a_free_round_trip_ends_the_call_at_the_first_stop():
    assert stops_to_wait([5, 1, 9], 3, round_trip_s=0.0, row_step_s=1e-3) == 1


def test_a_dear_round_trip_waits_for_every_row_wanted():
    assert stops_to_wait([5, 1, 9, 2], 3, round_trip_s=10.0, row_step_s=1e-3) == 3
    assert stops_to_wait([5, 1, 9, 2], 9, round_trip_s=10.0, row_step_s=1e-3) == 4  # all rows


def test_no_row_wanted_or_none_running_is_one_stop():
    assert stops_to_wait([5, 1], 0, round_trip_s=10.0, row_step_s=1e-3) == 1
    assert stops_to_wait([], 4, round_trip_s=10.0, row_step_s=1e-3) == 1


@pytest.mark.parametrize(
    ("round_trip", "want"),
    # left [1, 2, 10], an idle row-step 0.1: one stop costs rt; two (rt + 0.1) / 2;
    # three (rt + 0.1 * (9 + 8)) / 3
    [(0.05, 1), (1.0, 2), (3.0, 2), (4.0, 3)],
)
def test_the_cheapest_stops_per_freed_row(round_trip, want):
    assert stops_to_wait([10, 1, 2], 3, round_trip_s=round_trip, row_step_s=0.1) == want
