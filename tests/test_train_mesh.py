"""Training on a device mesh (conftest forces 4 CPU devices): data-parallel and V-sharded runs
give the losses and parameters of one device, their arrays are laid out as asked, and a mesh
that does not divide the devices, the batch or a token table is refused before any work."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from test_train import config, tok_dir  # noqa: F401  (tok_dir: a module fixture)

from vocabjax.errors import UserError
from vocabjax.train import MeshSpec, load_checkpoint, train
from vocabjax.train.run import _Session

# Data-parallel sums the batch's gradients in another order: float32 rounding, a few steps on.
TOL = dict(rtol=2e-5, atol=2e-6)


def _state(run_dir):
    ck = load_checkpoint(run_dir)
    return ck.params, np.asarray(ck.meta["recent_losses"])


@pytest.mark.slow
def test_mesh_runs_give_one_devices_losses_parameters_and_bits_per_byte(tmp_path, tok_dir):  # noqa: F811
    assert len(jax.devices()) == 4
    cfg = config(tokenizer=str(tok_dir), steps=3, batch=4)
    one = train(cfg, tmp_path / "one", timing_repeats=1)
    params, losses = _state(tmp_path / "one")
    for spec in ("data=4", "data=2,model=2"):
        out = tmp_path / spec.replace(",", "_")
        # the V-sharded run is also measured: its evaluation must give one device's bpb
        measured = spec == "data=2,model=2"
        options = {"timing_repeats": 1} if measured else {"measure": False}
        result = train(cfg, out, mesh=MeshSpec.parse(spec), **options)
        assert "mesh data=" in result.device and "x 4" in result.device
        got_params, got_losses = _state(out)
        np.testing.assert_allclose(got_losses, losses, err_msg=spec, **TOL)
        assert set(got_params) == set(params)
        for name in params:
            np.testing.assert_allclose(
                got_params[name], params[name], err_msg=f"{spec} {name}", **TOL
            )
        if measured:
            for a, b in zip(one.heads, result.heads, strict=True):
                assert b.bpb == pytest.approx(a.bpb, rel=1e-5) and b.tokens_per_s > 0


def test_the_tables_are_split_along_v_and_the_rest_replicated(tmp_path, tok_dir):  # noqa: F811
    from vocabjax.corpus import open_corpus  # noqa: F401  (prepare opens the corpus itself)
    from vocabjax.train.mesh import Placement

    cfg = config(tokenizer=str(tok_dir), batch=4)
    spec = MeshSpec(2, 2)
    placement = Placement(spec.make(), frozenset({"embed.value", "unembed.value"}))
    session = _Session.prepare(cfg, tmp_path / "r", resume=False, log=lambda _: None,
                               placement=placement)  # fmt: skip
    embed = session.params["embed.value"]
    assert embed.sharding.spec == jax.sharding.PartitionSpec("model", None)
    assert {s.data.shape for s in embed.addressable_shards} == {(250, 32)}  # 500 rows / 2
    assert session.params["pos.value"].sharding.is_fully_replicated
    mu = session.opt_state[1][0].mu["unembed.value"]
    assert mu.sharding.spec == jax.sharding.PartitionSpec("model", None)


def test_a_mesh_that_does_not_divide_is_refused_before_any_work(tmp_path, tok_dir):  # noqa: F811
    cfg = config(tokenizer=str(tok_dir), batch=4)
    with pytest.raises(UserError, match=r"mesh data=3,model=1 \(3 devices\) does not divide the 4"):
        train(cfg, tmp_path / "x", mesh=MeshSpec(3))
    with pytest.raises(UserError, match="mesh data=4,model=1 does not divide batch 2"):
        train(config(tokenizer=str(tok_dir), batch=2), tmp_path / "x", mesh=MeshSpec(4))
    with pytest.raises(UserError, match="mesh data=1,model=4 does not divide the 402 rows of the"):
        train(config(tokenizer=str(tok_dir), heads=(300, 402)), tmp_path / "x", mesh=MeshSpec(1, 4))
    with pytest.raises(UserError, match="must read data=N or data=N,model=M"):
        MeshSpec.parse("model=2")
    assert MeshSpec.parse("data=2, model=2") == MeshSpec(2, 2)
    assert not (tmp_path / "x").exists()
