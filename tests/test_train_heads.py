"""Separate heads in training: the loss (mean cross-entropy plus the weighted alignment) and its
gradient reaching every head, nested heads as the unchanged default, and a separate-heads run
that trains, serves and starts a pruned run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import HEADS, config, tok_dir  # noqa: F401  (tok_dir: a module fixture)

from vocabjax.errors import UserError
from vocabjax.train import RunConfig, init_params, load_checkpoint, train
from vocabjax.train.steps import make_loss


def batch(key: int, heads=HEADS, b: int = 2, t: int = 16) -> jax.Array:
    """One batch of random windows per head, each head's ids below its size."""
    keys = jax.random.split(jax.random.key(key), len(heads))
    return jnp.stack(
        [jax.random.randint(k, (b, t + 1), 0, v, dtype=jnp.int32) for k, v in zip(keys, heads)]
    )


@pytest.mark.slow
def test_the_loss_of_separate_heads_and_its_gradient_reach_every_head():
    cfg = config(heads_kind="separate", align_weight=0.5)
    fn, params = init_params(cfg)
    assert params["heads.0.value"].shape == (300, 32) and "unembed.value" not in params
    aligned = make_loss(fn, cfg.heads, cfg.impl, align_weight=cfg.align_weight)
    plain = make_loss(fn, cfg.heads, cfg.impl)

    @jax.jit
    def both(params, x):
        return [jax.value_and_grad(f, has_aux=True)(params, x) for f in (aligned, plain)]

    ((total, losses), grads), ((_, plain_losses), plain_grads) = both(params, batch(0))
    alignment = float(fn.model(params).alignment())
    assert float(total) == pytest.approx(float(jnp.mean(losses)) + 0.5 * alignment, rel=1e-6)
    np.testing.assert_array_equal(np.asarray(losses), np.asarray(plain_losses))
    for j in range(len(HEADS)):
        name = f"heads.{j}.value"
        assert np.abs(np.asarray(grads[name])).max() > 0, name
        # the alignment's own share of the gradient reaches every head too
        assert np.abs(np.asarray(grads[name]) - np.asarray(plain_grads[name])).max() > 0, name


def test_nested_heads_stay_the_default_and_their_loss_is_the_mean_cross_entropy():
    cfg = config()
    assert cfg.heads_kind == "nested" and cfg.align_weight == 0.0
    fn, params = init_params(cfg)
    assert "unembed.value" in params and not any(n.startswith("heads.") for n in params)
    total, losses = jax.jit(make_loss(fn, cfg.heads, cfg.impl))(params, batch(1))
    assert float(total) == float(jnp.mean(losses))
    assert cfg.model_config.heads == ()  # nested heads are prefixes: no sizes to keep
    with pytest.raises(UserError, match="align_weight aligns separate heads"):
        config(align_weight=0.1)
    with pytest.raises(UserError, match="align_weight=-1.0 must be a finite number >= 0"):
        config(heads_kind="separate", align_weight=-1.0)
    with pytest.raises(UserError, match="cannot be tied"):
        config(heads_kind="separate", tie_embeddings=True)


@pytest.mark.slow
def test_a_separate_heads_run_trains_serves_and_starts_a_pruned_run(tmp_path, tok_dir):  # noqa: F811
    from vocabjax.serving import load_run
    from vocabjax.train import resume_config
    from vocabjax.vocab import read_id_map

    cfg = config(tokenizer=str(tok_dir), heads_kind="separate", align_weight=0.5, steps=3)
    result = train(cfg, tmp_path / "sep", timing_repeats=1)
    assert [h.vocab for h in result.heads] == list(HEADS)
    assert all(np.isfinite(h.bpb) for h in result.heads)
    stored = resume_config(tmp_path / "sep", {})
    assert stored.heads_kind == "separate" and stored.align_weight == 0.5
    loaded = load_run(tmp_path / "sep")
    source = load_checkpoint(tmp_path / "sep").params
    np.testing.assert_array_equal(np.asarray(loaded.model.head(300)), source["heads.0.value"])
    # A pruned start gathers the largest head's own matrix into the new run's W.
    pruned = RunConfig(**{**vars(config()), "heads": (400,), "init_from": str(tmp_path / "sep")})
    train(pruned, tmp_path / "pruned", stop_after=0)
    start = load_checkpoint(tmp_path / "pruned").params
    rows = list(read_id_map(tmp_path / "pruned" / "tokenizer").new_to_old)
    np.testing.assert_array_equal(start["unembed.value"], source["heads.1.value"][rows])
    np.testing.assert_array_equal(start["embed.value"], source["embed.value"][rows])
