"""The Poisson trace that benchmarks/serve.py serves: deterministic for a seed, single requests
and bursts at random arrivals, prompts and output lengths of many sizes, every prompt within the
room its generation leaves, no passage twice; a mix that cannot be is one error."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from vocabjax.errors import UserError
from vocabjax.serving.trace import PoissonMix, PromptRoom, poisson_trace


def room(limit: int) -> PromptRoom:
    """About 3 bytes a token, 96 positions for prompt and generation together."""
    return PromptRoom(tokens=lambda text: len(text.encode("utf-8")) // 3 + 1, max_tokens=97 - limit)


def test_a_poisson_trace_mixes_singles_and_bursts_of_many_lengths():
    mix = PoissonMix(requests=300, rate=50.0)
    trace = poisson_trace(3, room=room, mix=mix)
    assert trace == poisson_trace(3, room=room, mix=mix)  # deterministic
    assert trace != poisson_trace(4, room=room, mix=mix)
    assert len(trace) == 300 and len({r.id for r in trace}) == 300
    assert len({r.prompt for r in trace}) > 290  # no passage twice (a few begin alike)
    arrivals = np.asarray([r.arrival_s for r in trace])
    assert arrivals[0] == 0 and (np.diff(arrivals) >= 0).all()
    sizes = collections.Counter(arrivals.tolist())  # requests per arrival instant
    singles = [r for r in trace if r.phase == "single"]
    bursts = [r for r in trace if r.phase == "burst"]
    assert all(sizes[r.arrival_s] == 1 for r in singles)
    last = trace[-1].arrival_s  # the last burst may be cut short by the request count
    burst_sizes = sorted({sizes[r.arrival_s] for r in bursts if r.arrival_s != last})
    assert len(burst_sizes) > 3 and burst_sizes[0] >= 4 and burst_sizes[-1] <= 16
    # arrivals about 1 / rate apart: a Poisson process of 50 per second
    events = np.unique(arrivals)
    assert 0.6 / 50 < np.diff(events).mean() < 1.6 / 50
    assert 0.1 < len({r.arrival_s for r in bursts}) / len(events) < 0.4
    limits = np.asarray([r.max_new_tokens for r in trace])
    assert limits.min() >= 4 and limits.max() <= 64
    assert (limits <= 8).mean() > 0.15 and (limits >= 32).mean() > 0.15  # log-uniform: both ends
    nbytes = np.asarray([len(r.prompt.encode("utf-8")) for r in trace])
    assert nbytes.min() >= 16 and nbytes.max() <= 240 and nbytes.max() > 4 * nbytes.min()
    for r in trace:
        assert room(r.max_new_tokens).tokens(r.prompt) <= room(r.max_new_tokens).max_tokens


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": 0.0}, "needs requests >= 1 and a rate > 0"),
        ({"requests": 0}, "needs requests >= 1 and a rate > 0"),
        ({"burst_size": (5, 2)}, r"burst_size=\(5, 2\) must be 1 <= low <= high"),
        ({"prose_share": 1.5}, r"prose_share=1.5 must be in \[0, 1\]"),
    ],
)
def test_a_mix_that_cannot_be_is_one_error(kwargs, message):
    with pytest.raises(UserError, match=message):
        PoissonMix(**kwargs)
