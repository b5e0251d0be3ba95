"""Every kernel lowers through the Pallas Triton GPU backend, checked on CPU.

``jit(...).trace(...).lower(lowering_platforms=("cuda",))`` runs the Pallas -> Triton IR lowering
without a GPU, so block shapes, masks and primitives the Triton backend rejects fail here. It
does not run Triton's own compiler (PTX, registers, shared memory): that needs a GPU
(``selfcheck.run_all(interpret=False)``). The kernels pick Triton through their
``plgpu.CompilerParams``, so this is the Triton lowering on every jax version, not Mosaic GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import (
    CEBlocks,
    DecodeBlocks,
    TiledBlocks,
    TopKBlocks,
    fused_decode,
    fused_topk,
    linear_ce_bwd,
    linear_ce_fwd,
    tiled_decode,
)

SD = jax.ShapeDtypeStruct
SHAPE = (3, 50257, 768)


# The GPU the lowering targets. jax >= 0.12 asks the abstract mesh for it when no GPU is attached
# (it reads the compute capability from the device kind); jax 0.10 ignores it and assumes sm_90,
# which is what an H100 is, so both versions lower for the same target.
TARGET_GPU = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")


def lower_cuda(fn, *args):
    mesh = jax.sharding.AbstractMesh((1,), ("_",), abstract_device=TARGET_GPU)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def specs(dtype, batch=SHAPE[0]):
    _, vocab, d_model = SHAPE
    return SD((batch, d_model), dtype), SD((vocab, d_model), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_candidate_lowers_to_triton(dtype):
    h, w = specs(dtype)
    seeds = SD((2,), jnp.uint32)
    rows_i, rows_f = SD((SHAPE[0],), jnp.int32), SD((SHAPE[0],), jnp.float32)
    args = (*SHAPE, dtype)
    for b in DecodeBlocks.candidates(*args):
        lower_cuda(functools.partial(fused_decode, blocks=b), h, w, seeds)
    lower_cuda(fused_decode, h, w)  # the variant without sampling
    for b in TiledBlocks.candidates(*args):
        lower_cuda(functools.partial(tiled_decode, blocks=b), h, w, seeds)
    for b in TopKBlocks.candidates(*args):
        lower_cuda(lambda h, w, b=b: fused_topk(h, w, 50, blocks=b), h, w)
    for b in [*CEBlocks.candidates(*args), CEBlocks(dh_splits=4)]:
        lower_cuda(functools.partial(linear_ce_fwd, blocks=b), h, w, rows_i)
        lower_cuda(functools.partial(linear_ce_bwd, blocks=b), h, w, rows_i, *[rows_f] * 3)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(8192, 65536, 512), (37, 1024, 100)])
def test_linear_ce_lowers_without_a_ragged_vocabulary(shape, dtype):
    """Tiles that divide V (and D, in the first shape) take the unmasked loads and stores."""
    n_rows, vocab, d_model = shape
    h, w = SD((n_rows, d_model), dtype), SD((vocab, d_model), dtype)
    rows_i, rows_f = SD((n_rows,), jnp.int32), SD((n_rows,), jnp.float32)
    for b in [*CEBlocks.candidates(*shape, dtype), CEBlocks(dh_splits=4)]:
        lower_cuda(functools.partial(linear_ce_fwd, blocks=b), h, w, rows_i)
        lower_cuda(functools.partial(linear_ce_bwd, blocks=b), h, w, rows_i, *[rows_f] * 3)


def test_float32_dots_are_ieee_not_tf32(monkeypatch, capsys):
    """Triton's default float32 dot is TF32; the kernels ask for IEEE (HIGHEST) instead."""
    monkeypatch.setattr(pl, "pallas_call", functools.partial(pl.pallas_call, debug=True))
    h, w = specs(jnp.float32)
    rows_i, rows_f = SD((SHAPE[0],), jnp.int32), SD((SHAPE[0],), jnp.float32)
    lower_cuda(fused_decode, h, w)
    lower_cuda(linear_ce_bwd, h, w, rows_i, rows_f, rows_f, rows_f)
    ir = capsys.readouterr().out
    assert ir.count("tt.dot") >= 3  # decode, dh (2 dots), dW (2 dots)
    assert "tf32" not in ir
