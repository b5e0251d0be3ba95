"""vocabjax.timing: the timers call what they should, in the order they should, and block."""

from __future__ import annotations

import dataclasses
import mmap
import types

import jax.numpy as jnp
import numpy as np
import pytest

from vocabjax.timing import (
    Tally,
    TimingSettings,
    block,
    copy_probe,
    minor_faults,
    time_call,
    time_interleaved,
    time_rounds,
)

FAST = TimingSettings(warmup=1, repeats=3, min_repeats=3)


def test_time_call_rotates_inputs_and_takes_the_median():
    seen = []

    def fn(x):
        seen.append(int(x[0]))
        return x

    sets = [(jnp.full((2,), i),) for i in range(3)]
    t = time_call(fn, sets, dataclasses.replace(FAST, warmup=2, repeats=5))
    assert t >= 0 and set(seen) == {0, 1, 2} and len(seen) == 1 + 1 + 5


def test_time_interleaved_calls_every_candidate_each_round():
    calls = []

    def make(name):
        def fn(x):
            calls.append((name, int(x[0])))
            return x

        return fn

    sets = [(jnp.full((2,), i),) for i in range(2)]
    settings = dataclasses.replace(FAST, warmup=2, repeats=4)
    times = time_interleaved([make("a"), make("b")], sets, settings)
    assert len(times) == 2 and min(times) >= 0
    timed = calls[4:]  # one compile call and one warm-up call each
    assert [n for n, _ in timed] == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert {i for _, i in timed} == {0, 1}


def test_a_tally_counts_each_timed_call_of_each_function():
    """The tally reads its counter before and after every timed call (not the first call or
    the warm-up) and keeps each function's median per call."""
    count = [0.0]

    def make(step):
        def fn():
            count[0] += step
            return jnp.zeros(())

        return fn

    tally = Tally(lambda: count[0])
    time_interleaved(
        [make(1.0), make(5.0)], [()], dataclasses.replace(FAST, repeats=4), tally=tally
    )
    assert tally.counts == {0: [1.0] * 4, 1: [5.0] * 4}
    assert tally.medians(3) == [1.0, 5.0, None]


def test_minor_faults_counts_pages_touched_for_the_first_time():
    before = minor_faults()
    if before is None:
        pytest.skip("this platform does not count page faults")
    size, page = 64 * 2**20, mmap.PAGESIZE
    with mmap.mmap(-1, size) as fresh:  # anonymous memory, fresh from the kernel
        for offset in range(0, size, page):
            fresh[offset] = 1  # one byte written in every page
        assert minor_faults() - before >= 0.9 * size / page


class _Clock:
    """A stand-in for ``time.perf_counter`` that a call moves on by a scripted duration."""

    def __init__(self, durations):
        self.now, self.durations = 0.0, list(durations)

    def __call__(self) -> float:
        return self.now

    def call(self, *_):
        self.now += self.durations.pop(0)


def _clock(monkeypatch, durations) -> _Clock:
    from vocabjax import timing

    clock = _Clock(durations)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=clock))
    return clock


def test_the_compiling_call_is_not_timed_and_fastest_is_the_least_repeat(monkeypatch):
    clock = _clock(monkeypatch, [9.0, 0.3, 0.1, 0.2] * 2)  # compile, then three repeats
    settings = dataclasses.replace(FAST, slow_call_s=10.0)
    assert time_call(clock.call, [()], settings) == pytest.approx(0.2)
    assert time_call(clock.call, [()], settings, fastest=True) == pytest.approx(0.1)


def test_a_slow_function_gets_no_warm_up_and_min_repeats(monkeypatch):
    clock = _clock(monkeypatch, [5.0, 2.0, 3.0])
    settings = dataclasses.replace(FAST, warmup=3, repeats=9, min_repeats=2, slow_call_s=1.0)
    assert time_call(clock.call, [()], settings) == pytest.approx(2.5)
    assert not clock.durations  # the compiling call and two repeats, nothing more


def test_time_interleaved_gives_each_function_its_own_median(monkeypatch):
    # compile a, b; then rounds a b, b a, a b (warmup=1: no warm-up round)
    clock = _clock(monkeypatch, [1.0, 1.0, 0.1, 0.5, 0.6, 0.2, 0.3, 0.4])
    settings = dataclasses.replace(FAST, slow_call_s=10.0)
    times = time_interleaved([clock.call, clock.call], [()], settings)
    assert times == pytest.approx([0.2, 0.5])


def test_time_rounds_keeps_every_timed_call_of_each_function(monkeypatch):
    clock = _clock(monkeypatch, [1.0, 1.0, 0.1, 0.5, 0.6, 0.2, 0.3, 0.4])
    settings = dataclasses.replace(FAST, slow_call_s=10.0)
    rounds = time_rounds([clock.call, clock.call], [()], settings)
    assert rounds == [pytest.approx([0.1, 0.2, 0.3]), pytest.approx([0.5, 0.6, 0.4])]


def test_copy_probe_adds_one_per_call_in_place():
    step, moved = copy_probe(4096)
    assert moved == 2 * 4096
    step()
    np.testing.assert_array_equal(np.asarray(block(step())), np.full(1024, 2.0, np.float32))


def test_block_returns_its_tree():
    tree = {"a": jnp.ones(3), "b": [1, "text"]}
    assert block(tree) is tree


def test_between_runs_before_every_warm_up_and_timed_call_untimed():
    order = []

    def fn():
        order.append("call")
        return jnp.zeros(())

    def evict():
        order.append("evict")
        return jnp.zeros(())

    settings = dataclasses.replace(FAST, warmup=2, repeats=3)
    time_interleaved([fn, fn], [()], settings, between=evict)
    # two compiling calls, then (evict, call) for each of 2 warm-up and 6 timed calls
    assert order[:2] == ["call", "call"]
    assert order[2:] == ["evict", "call"] * 8


def test_cache_evictor_writes_a_buffer_of_its_size():
    from vocabjax.timing import cache_evictor, last_level_cache_bytes

    evict = cache_evictor(4096)
    first, second = np.asarray(evict()), np.asarray(evict())
    assert first.nbytes == 4096 and np.all(second == first + 1)
    llc = last_level_cache_bytes()
    assert llc is None or llc >= 2**10
