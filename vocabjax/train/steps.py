"""The jitted pieces of training: parameters as a flat ``{name: array}`` dict, the optimizer, the
training step over several heads, the held-out cross-entropy sum, and throughput timing.

The model is split once (``nnx.split``) and merged inside each jitted function, so the training
state is plain arrays: optax updates a dict, and a checkpoint is that dict plus the optimizer's
leaves.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from vocabjax.models import GPT, head_loss
from vocabjax.timing import TimingSettings, time_call
from vocabjax.train.config import RunConfig

Params = dict[str, jax.Array]


def _entry(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


@dataclasses.dataclass(frozen=True)
class Functional:
    """A model as (graph, named parameter arrays)."""

    graphdef: Any
    treedef: Any
    names: tuple[str, ...]  # "blocks.0.attn.w_q.value", ... in tree order

    @classmethod
    def of(cls, model: GPT) -> tuple[Functional, Params]:
        graphdef, state = nnx.split(model)
        flat, treedef = jax.tree_util.tree_flatten_with_path(state)
        names = tuple(".".join(_entry(k) for k in path) for path, _ in flat)
        if len(set(names)) != len(names):
            raise RuntimeError("two parameters flatten to the same name")
        return cls(graphdef, treedef, names), dict(zip(names, (x for _, x in flat), strict=True))

    def model(self, params: Params) -> GPT:
        state = jax.tree_util.tree_unflatten(self.treedef, [params[n] for n in self.names])
        return nnx.merge(self.graphdef, state)


def init_params(config: RunConfig) -> tuple[Functional, Params]:
    """Fresh parameters drawn from ``config.seed``."""
    return Functional.of(GPT(config.model_config, rngs=nnx.Rngs(config.seed)))


def learning_rate(config: RunConfig):
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine decay to ``lr *
    min_lr_ratio`` at the last step (``steps``)."""
    peak, warmup, steps = float(config.lr), config.warmup, config.steps
    floor = peak * config.min_lr_ratio

    def schedule(count):
        s = jnp.asarray(count).astype(jnp.float32)
        warm = peak * (s + 1.0) / max(warmup, 1)
        frac = jnp.clip((s - warmup) / max(steps - warmup - 1, 1), 0.0, 1.0)
        cosine = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(math.pi * frac))
        return jnp.where(s < warmup, warm, cosine)

    return schedule


def optimizer(config: RunConfig) -> optax.GradientTransformation:
    """Gradient clipping, then AdamW; matrices decay, norm scales do not."""
    return optax.chain(
        optax.clip_by_global_norm(config.clip),
        optax.adamw(
            learning_rate(config),
            b1=config.b1,
            b2=config.b2,
            weight_decay=config.weight_decay,
            mask=lambda params: {k: v.ndim >= 2 for k, v in params.items()},
        ),
    )


def make_loss(fn: Functional, heads: Sequence[int], impl: str, *, align_weight: float = 0.0):
    """``loss(params, batch_hbt) -> (total, losses_h)``: one batch per head (H, B, T + 1); the
    total is the mean over heads of each head's mean cross-entropy, plus ``align_weight`` times
    the separate heads' alignment (``GPT.alignment``). The heads' windows go through the
    backbone together, as one batch of H B windows."""
    heads = tuple(heads)

    def loss_fn(params: Params, batch_hbt: jax.Array):
        model = fn.model(params)
        n_heads, b, t1 = batch_hbt.shape
        ids = batch_hbt[..., :-1].reshape(n_heads * b, t1 - 1)
        h_hbtd = model(ids).reshape(n_heads, b, t1 - 1, -1)
        losses = jnp.stack(
            [
                head_loss(h_hbtd[j], model.head(v), batch_hbt[j, :, 1:], impl=impl)
                for j, v in enumerate(heads)
            ]
        )
        total = jnp.mean(losses)
        if align_weight:
            total = total + align_weight * model.alignment()
        return total, losses

    return loss_fn


def make_train_step(
    fn: Functional,
    heads: Sequence[int],
    tx: optax.GradientTransformation,
    impl: str,
    *,
    donate: bool = True,
    align_weight: float = 0.0,
    shardings: tuple[Any, Any, Any, Any] | None = None,
):
    """``step(params, opt_state, batch_hbt) -> (params, opt_state, losses_h)``: one optimizer
    step on ``make_loss``'s total. The step consumes (donates) the ``params`` and ``opt_state``
    it is given, unless ``donate=False`` (the baseline ``benchmarks/train_throughput.py
    --donation`` times it against). ``shardings`` (params, opt_state, batch, losses) lays the
    step out on a mesh (``vocabjax.train.mesh.Placement``); None keeps one device."""
    loss_fn = make_loss(fn, heads, impl, align_weight=align_weight)
    layout = {}
    if shardings is not None:
        p_sh, o_sh, b_sh, out_sh = shardings
        layout = dict(in_shardings=(p_sh, o_sh, b_sh), out_shardings=(p_sh, o_sh, out_sh))

    # params and opt_state are donated: XLA updates them in place instead of allocating a fresh
    # copy of every parameter and moment each step (docs/benchmarks.md, "Training throughput").
    @functools.partial(jax.jit, donate_argnums=(0, 1) if donate else (), **layout)
    def step(params: Params, opt_state, batch_hbt: jax.Array):
        (_, losses), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch_hbt)
        # optax's Adam bias correction raises a Python float to the int32 step count, which
        # strict dtype promotion (the tests' setting) refuses; the standard rules make it f32.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, opt_state, losses

    return step


def make_eval_step(fn: Functional, vocab: int, impl: str):
    """``nats(params, inputs_bt, labels_bt)``: the summed cross-entropy (nats) of head
    ``vocab`` over the labels that are not IGNORE."""

    @jax.jit
    def nats(params: Params, inputs_bt: jax.Array, labels_bt: jax.Array) -> jax.Array:
        model = fn.model(params)
        return head_loss(model(inputs_bt), model.head(vocab), labels_bt, impl=impl, reduction="sum")

    return nats


def all_finite(tree) -> bool:
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree) if _is_float(x))


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)


def stepping(step, params: Params, opt_state, batch_hbt: jax.Array) -> Callable[..., Any]:
    """A call that runs ``step`` once from where the previous call left off, starting on copies
    of ``params`` and ``opt_state`` (the step donates its state; the caller's arrays stay
    valid). Its arguments are ignored, so it fits ``vocabjax.timing``'s timers."""
    state = [jax.tree.map(jnp.copy, (params, opt_state))]

    def call(*_):
        new_params, new_opt, losses = step(*state[0], batch_hbt)
        state[0] = (new_params, new_opt)
        return losses, new_params

    return call


def time_step(step, params: Params, opt_state, batch_hbt: jax.Array, *, repeats: int) -> float:
    """Median wall seconds of one ``step`` after a compiling call (``timing.time_call``, every
    repeat kept however slow the step is), each call continuing from the last (``stepping``)."""
    settings = TimingSettings(warmup=1, repeats=repeats, min_repeats=repeats, slow_call_s=math.inf)
    return time_call(stepping(step, params, opt_state, batch_hbt), [()], settings)
