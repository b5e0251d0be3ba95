"""The quality controller and the router as pure steps, (state, observation) -> (state,
decision): jitted in a ``lax.scan`` over a recorded sequence, they decide what their host
callers (``QualityController``, ``route_batch``) decide."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from vocabjax.serving import (
    ControllerConfig,
    Observation,
    QualityController,
    RouteTable,
    Routing,
    Thresholds,
    controller_init,
    controller_step,
    route_batch,
    router_step,
)
from vocabjax.serving.controller import window_mean


def recorded(seed: int = 0, n: int = 400) -> tuple[list[tuple[float, int, float]], list]:
    """A served sequence as a server feeds its controller, and the host controller's state
    after each observation: batches of 1-4 requests whose bits per byte drift between easy,
    middling and hard text, each batch served at the offset it was admitted with (so a move in
    mid-batch leaves the rest stale), prompt bytes as weights, now and then a NaN."""
    rng = np.random.default_rng(seed)
    host = QualityController(Thresholds(2.8, 2.0, "test"), window=6, lowest=-2, highest=2)
    level = np.repeat([2.4, 3.2, 2.4, 1.7, 2.5, 3.4, 1.6], n // 7 + 1)[:n]
    seen, after = [], []
    i = 0
    while i < n:
        offset = host.offset  # a batch keeps the offset it was admitted with
        for _ in range(min(int(rng.integers(1, 5)), n - i)):
            bpb = float(level[i] - 0.3 * offset + rng.normal(0, 0.3))
            if rng.random() < 0.02:
                bpb = float("nan")
            weight = float(rng.integers(128, 241))
            move = host.observe(bpb, offset, weight)
            seen.append((bpb, offset, weight))
            after.append((host.offset, host.filled, host.window_mean, move))
            i += 1
    return seen, after


def test_the_jitted_controller_decides_as_the_host_one():
    seen, after = recorded()
    moves = [m for *_, m in after if m is not None]
    assert {m.direction for m in moves} == {"up", "down"} and len(moves) >= 6  # teeth
    assert any(m.to_offset in (-2, 2) for m in moves)  # a bound is reached
    config = ControllerConfig(high=2.8, low=2.0, window=6, lowest=-2, highest=2)
    bpb, offsets, weights = (np.asarray(x) for x in zip(*seen, strict=True))
    obs = Observation(jnp.asarray(bpb, jnp.float32), jnp.asarray(offsets, jnp.int32),
                      jnp.asarray(weights, jnp.float32))  # fmt: skip

    @jax.jit
    def scan(obs):
        def body(state, o):
            state, d = controller_step(config, state, o, xp=jnp)
            return state, (state.offset, state.count, window_mean(state, xp=jnp), d.move, d.mean)

        return lax.scan(body, controller_init(config, xp=jnp), obs)[1]

    offset, count, mean, move, crossed = (np.asarray(x) for x in scan(obs))
    want_offset, want_count, want_mean, want_move = zip(*after)
    np.testing.assert_array_equal(offset, want_offset)
    np.testing.assert_array_equal(count, want_count)
    step = [0 if m is None else (1 if m.direction == "up" else -1) for m in want_move]
    np.testing.assert_array_equal(move, step)
    filled = np.asarray(want_count) > 0
    np.testing.assert_allclose(
        mean[filled], np.asarray([x for x in want_mean if x is not None]), rtol=2e-6
    )
    moved = np.asarray(step) != 0  # the mean that crossed a threshold, as the host reported it
    np.testing.assert_allclose(
        crossed[moved], [m.window_mean for m in want_move if m is not None], rtol=2e-6
    )


def test_the_jitted_router_decides_as_the_host_one():
    heads, routes = (300, 500, 800, 2000), [(1, 256), (4, 300), (16, 900), (None, 4096)]
    rng = np.random.default_rng(1)
    batch = rng.integers(1, 40, 200).astype(np.int32)
    offset = rng.integers(-3, 4, 200).astype(np.int32)
    host = [route_batch(heads, routes, batch=int(b), offset=int(k)) for b, k in zip(batch, offset)]
    table = RouteTable.of(heads, routes)
    assert table.routed == (0, 0, 2, 3)  # 256 -> 300, 900 -> 800 in log V

    @functools.partial(jax.jit, static_argnums=0)
    def scan(table, batch, offset):
        def body(last, obs):
            last, d = router_step(table, last, obs, xp=jnp)
            return last, (d.routed, d.head, d.switched)

        return lax.scan(body, jnp.int32(-1), Routing(batch, offset))[1]

    routed, head, switched = (np.asarray(x) for x in scan(table, batch, offset))
    assert [heads[i] for i in routed] == [r.routed.vocab for r in host]
    assert [heads[i] for i in head] == [r.head for r in host]
    chosen = [r.head for r in host]
    assert switched.tolist() == [False] + [a != b for a, b in zip(chosen, chosen[1:])]
    assert 20 < switched.sum() < 199  # both switches and stays
