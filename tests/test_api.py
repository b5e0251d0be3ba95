"""The public API (``import vocabjax as vj``): docs/api.md's examples run, sweeps agree with the
library and the CLI, "no V" is never an index, the grid function differentiates, imports stay
lazy."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

import vocabjax as vj
from vocabjax.costmodel import CostModel, Settings
from vocabjax.errors import UserError
from vocabjax.hardware import load_device
from vocabjax.lifecycle import NO_VOCAB, Grid
from vocabjax.lifecycle import sweep as lifecycle_sweep
from vocabjax.planning import make_plan, parse_workload, policy_json
from vocabjax.shapes import load_shape
from vocabjax.trainprofile import TrainingProfile

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "api.md"
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
WORKLOAD = "edge:b=1:share=0.5,dc:b=256:share=0.5"


def _blocks(text: str) -> list[tuple[str, int, str]]:
    """(info string, first line number, code) of every fenced block."""
    return [
        (m.group(1).strip(), text.count("\n", 0, m.start(2)) + 1, m.group(2))
        for m in FENCE.finditer(text)
    ]


# ---- docs/api.md ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_docs_api_examples_run():
    blocks = _blocks(DOC.read_text())
    run = [(line, code) for info, line, code in blocks if info == "python"]
    shown = [(line, code) for info, line, code in blocks if info == "python notest"]
    assert len(run) >= 8, "the guide lost its examples"
    namespace: dict = {"__name__": "docs_api"}
    for line, code in run:
        padded = "\n" * (line - 1) + code  # so a traceback names the line of docs/api.md
        exec(compile(padded, str(DOC), "exec"), namespace)
    for line, code in shown:  # needs a trained run: at least it parses and names real API
        compile("\n" * (line - 1) + code, str(DOC), "exec")
        for name in re.findall(r"\bvj\.(\w+)", code):
            assert hasattr(vj, name), f"{DOC}:{line} uses vj.{name}"


def test_readme_example_is_marked_short_and_runs_first():
    text = DOC.read_text()
    marked = re.search(
        r"<!-- readme-example:begin -->\n(.*?)<!-- readme-example:end -->", text, re.DOTALL
    )
    assert marked, "docs/api.md lost the README example markers"
    (info, _, code), *rest = _blocks(marked.group(1))
    assert info == "python" and not rest
    assert len(code.strip().splitlines()) <= 10
    first = next(c for i, _, c in _blocks(text) if i == "python")
    assert first == code  # so test_docs_api_examples_run executes it
    readme = (ROOT / "README.md").read_text()
    assert f"```python\n{code}```" in readme, "README's Python example differs from docs/api.md's"


# ---- sweep ---------------------------------------------------------------------------------------


def _model(device="a10g", shape="paper-100m", **settings):
    return CostModel(load_device(device), load_shape(shape), Settings(**settings))


def test_sweep_v_star_sizes_equal_lifecycle_and_brute_force():
    grid = Grid(vocab=(8192, 32768, 131072, 524288), batch=(1, 7, 256), lam=(0.0, 3.0, 300.0))
    res = vj.sweep(
        device="a10g", model="paper-100m", vocab=grid.vocab, batch=grid.batch, lam=grid.lam
    )
    lib = lifecycle_sweep(_model(), grid)
    np.testing.assert_array_equal(np.asarray(res.v_star), lib.v_star)
    np.testing.assert_array_equal(np.asarray(res.v_infer), lib.v_infer)
    assert res.v_train == lib.v_train
    assert isinstance(res.v_star, jax.Array) and res.v_star.dtype == jnp.int32
    for name in ("c_train", "c_infer", "j_star", "break_even", "b_max"):
        x = getattr(res, name)
        assert isinstance(x, jax.Array) and x.dtype == jnp.float32, name
        np.testing.assert_array_equal(np.asarray(x), getattr(lib, name).astype(np.float32))
    c_train, c_infer = np.asarray(res.c_train), np.asarray(res.c_infer)
    for bi in range(len(grid.batch)):
        for li, lam in enumerate(grid.lam):
            j = c_train + (lam * c_infer[:, bi] if lam > 0 else 0.0)
            assert int(res.v_star[bi, li]) == grid.vocab[int(np.argmin(j))]
    assert bool(res.found.all())


@pytest.mark.slow
def test_sweep_takes_names_objects_and_size_strings():
    by_name = vj.sweep(device="a10g", model="paper-100m", vocab="8k,32k", batch="1,64", lam="0,10")
    by_object = vj.sweep(
        device=load_device("a10g"),
        model=load_shape("paper-100m"),
        vocab=[8192, "32k"],
        batch=[np.int64(64), 1],
        lam=[10, 0.0],
    )
    assert by_name.grid == by_object.grid == Grid((8192, 32768), (1, 64), (0.0, 10.0))
    np.testing.assert_array_equal(by_name.v_star, by_object.v_star)
    one = vj.sweep(device="a10g", model="paper-100m", vocab="32k", batch=4, lam=1)
    assert one.grid == Grid((32768,), (4,), (1.0,))
    assert "a10g" in repr(one) and "v_star=[[32768]]" in repr(one)


def test_sweep_argument_errors_name_the_argument():
    with pytest.raises(TypeError, match="vocab 8192.0 must be an int"):
        vj.sweep(vocab=[8192.0])
    with pytest.raises(TypeError, match="unknown settings \\['cost_model'\\]"):
        vj.sweep(cost_model="full")  # the Settings field is `mode`; cost_model is a function
    with pytest.raises(TypeError, match="device must be a name, a path or a DeviceProfile"):
        vj.sweep(device=3)
    with pytest.raises(UserError, match="unknown device 'nope'"):
        vj.sweep(device="nope")
    with pytest.raises(UserError, match="vocab 1 is out of range 2..2147483647"):
        vj.sweep(vocab=1)
    with pytest.raises(UserError, match="lam must be >= 0"):
        vj.sweep(lam=-1)
    with pytest.raises(UserError, match="bpb_tolerance needs a training profile"):
        vj.sweep(bpb_tolerance=0.02)


@pytest.mark.slow
def test_sweep_equals_cli_json():
    from cli import main

    args = ["--vocab", "8k,64k,512k", "--batch", "1,256", "--lam", "0,100"]
    out = CliRunner().invoke(main, ["sweep", *args, "--device", "a10g", "--format", "json"])
    assert out.exit_code == 0, out.output
    res = vj.sweep(device="a10g", vocab="8k,64k,512k", batch="1,256", lam="0,100")
    assert res.rows() == json.loads(out.stdout)["table"]


# ---- "no V fits" ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_no_v_fits_is_no_size_and_no_index():
    res = vj.sweep(
        device="l4", model="llama-70b", vocab="32k,128k", batch="1,4", lam="0,1", cap_batch=True
    )
    assert res.v_star.tolist() == [[res.v_train, NO_VOCAB]] * 2  # training alone still fits
    assert res.found.tolist() == [[True, False], [True, False]]
    assert np.isinf(np.asarray(res.j_star[:, 1])).all()
    assert res.v_infer.tolist() == [NO_VOCAB, NO_VOCAB]
    at = np.asarray(res.at_v_star(res.c_train))
    assert np.isnan(at[:, 1]).all() and np.isfinite(at[:, 0]).all()
    assert not bool(res.band(0.5)[:, :, 1].any())
    assert res.rows()[1]["v_star"] is None
    with pytest.raises(UserError, match="vocab 0 has no grid index: no V is allowed or fits"):
        res.host.index(res.host.v_star)
    with pytest.raises(UserError, match="vocab 65536 has no grid index: not in the grid"):
        res.host.index(65536)
    t = res.grid.vocab.index(res.v_train)
    np.testing.assert_array_equal(res.host.index(res.host.v_star[:, 0]), [t, t])


@pytest.mark.slow
def test_nothing_allowed_leaves_no_training_optimum():
    # a quality bound measured only at V the grid does not hold: no V is allowed anywhere
    prof = TrainingProfile("t", (8192, 32768), None, (1.0, 0.9))
    res = vj.sweep(vocab="256k,512k", batch=1, lam="0,10", training=prof, bpb_tolerance=0.02)
    assert not bool(res.allowed.any()) and not bool(res.found.any())
    assert res.v_train == NO_VOCAB and res.v_infer.tolist() == [NO_VOCAB]
    assert np.isnan(np.asarray(res.at_v_star(res.c_infer))).all()


@pytest.mark.slow
def test_at_v_star_reads_v_and_vb_arrays():
    res = vj.sweep(device="a10g", model="paper-100m", vocab="8k,64k,512k", batch="1,256", lam=100)
    for bi in range(2):
        vi = res.grid.vocab.index(int(res.v_star[bi, 0]))
        assert float(res.at_v_star(res.c_train)[bi, 0]) == float(res.c_train[vi])
        assert float(res.at_v_star(res.c_infer)[bi, 0]) == float(res.c_infer[vi, bi])
    with pytest.raises(ValueError, match="expected \\[V\\]"):
        res.at_v_star(res.j_star)


# ---- the grid function ---------------------------------------------------------------------------


@pytest.mark.slow
def test_objective_is_the_sweeps_grid_and_differentiates():
    res = vj.sweep(
        device="a10g", model="paper-100m", vocab="8k,32k,256k", batch="1,64", lam="1,100"
    )
    j = res.j()
    assert j.shape == (3, 2, 2) and j.dtype == jnp.float32
    np.testing.assert_allclose(j.min(axis=0), res.j_star, rtol=4 * np.finfo(np.float32).eps)
    np.testing.assert_array_equal(res.vocab[jnp.argmin(j, axis=0)], res.v_star)
    v, b = res.vocab.astype(jnp.float32), res.batch.astype(jnp.float32)
    # J is linear in lambda > 0: dJ/dlambda is c_infer, on the diagonal of the Jacobian
    jac = jax.jacrev(lambda lam: res.objective(v, b, lam))(res.lam)  # [V, B, lam, lam]
    np.testing.assert_allclose(
        jnp.diagonal(jac, axis1=2, axis2=3), jnp.repeat(res.c_infer[:, :, None], 2, 2), rtol=1e-5
    )
    assert not bool(jnp.triu(jac, 1).any() | jnp.tril(jac, -1).any())
    dv = jax.grad(lambda v: res.objective(v, b, res.lam).sum())(v)
    assert bool(jnp.isfinite(dv).all()) and bool((dv != 0).any())
    lams = jnp.stack([res.lam, 10.0 * res.lam])
    stacked = jax.jit(jax.vmap(res.objective, in_axes=(None, None, 0)))(v, b, lams)
    np.testing.assert_allclose(stacked[0], j, rtol=1e-6)
    np.testing.assert_allclose(stacked[1], res.objective(v, b, 10.0 * res.lam), rtol=1e-6)


def test_objective_marks_disallowed_and_unfit_vocab_inf():
    f = vj.objective(device="l4", model="llama-70b", cap_batch=True)
    j = f(jnp.asarray([32768.0]), jnp.asarray([1.0]), jnp.asarray([0.0, 1.0]))
    assert math.isfinite(float(j[0, 0, 0])) and math.isinf(float(j[0, 0, 1]))


# ---- plan ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_plan_is_make_plan_with_names(tmp_path):
    vocab = (8192, 32768, 131072, 524288)
    d = vj.plan(workload=WORKLOAD, lam="100", vocab="8k,32k,128k,512k", mode="weights-only")
    cm = CostModel(
        load_device("a100-80gb"), load_shape("paper-1.5b"), Settings(mode="weights-only")
    )
    p = make_plan(cm, vocab, parse_workload(WORKLOAD), 100.0)
    assert d.policy == policy_json(p, cm, max_heads=3)
    assert d.single == vocab[p.single] and d.heads == tuple(vocab[i] for i in p.heads)
    assert d.routes == {c.name: vocab[r] for c, r in zip(p.classes, p.routes)}
    assert d.cost_per_byte == p.heads_cost
    path = d.save(tmp_path / "policy.json")
    assert json.loads(path.read_text()) == d.policy
    classes = [vj.TrafficClass("chat", batch=8, share=1.0)]
    assert len(vj.plan(workload=classes, lam=10, vocab="8k,32k").heads) == 1
    with pytest.raises(TypeError, match="workload items must be TrafficClass"):
        vj.plan(workload=[("chat", 8, 1.0)], lam=10)


# ---- the package ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_import_is_lazy():
    code = (
        "import sys, vocabjax as vj\n"
        "heavy = {'jax', 'flax', 'optax', 'tokenizers'}\n"
        "assert not heavy & set(sys.modules), heavy & set(sys.modules)\n"
        "assert vj.__version__\n"
        "vj.sweep, vj.plan, vj.load_device, vj.load_shape\n"
        "assert 'jax' in sys.modules\n"
        "assert not {'flax', 'optax', 'tokenizers'} & set(sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr


def test_names_are_the_library_objects():
    from vocabjax import api, hardware, planning, serving, shapes

    assert vj.plan is api.plan and planning.make_plan is make_plan
    assert vj.sweep is api.sweep and vj.objective is api.objective
    assert vj.load_device is hardware.load_device and vj.load_shape is shapes.load_shape
    assert vj.load_run is serving.load_run and vj.Engine is serving.Engine
    assert vj.unembed is sys.modules["vocabjax.unembed"] and callable(vj.unembed.greedy)
    assert sorted(vj.__all__) == sorted([*vj._LAZY, "__version__"]) == dir(vj)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        vj.nope  # noqa: B018
