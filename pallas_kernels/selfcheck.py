"""Check every Pallas kernel against its pure-jnp reference at a few shapes.

``run_all(interpret=False)`` is what ``benchmarks/gpu_check.py`` calls on a GPU (compiled Triton
kernels at GPT-2's odd vocabulary and larger shapes); ``run_all(interpret=True)`` runs small
shapes through the interpreter on CPU. A kernel that fails to lower or run gives a row with
``ok=False`` and the error, so one broken kernel does not hide the others.

Tolerances (as in the tests): float32 results within 1e-5 (abs + rel) of the HIGHEST f32 reference,
bf16 within 1e-4; gradients within 1e-5 (f32) or 2^-8 (bf16) of the array's scale (the kernel rounds
dlogits to bf16 for its second matmul). Ids must match exactly, except where the reference's own
values at the two ids are within tolerance (float32 near-ties).
"""

from __future__ import annotations

import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import noise
from pallas_kernels.fused_decode import DecodeBlocks, fused_decode, fused_decode_reference
from pallas_kernels.fused_topk import TopKBlocks, fused_topk, fused_topk_reference
from pallas_kernels.linear_ce import (
    CEBlocks,
    linear_ce_bwd,
    linear_ce_bwd_reference,
    linear_ce_fwd,
    linear_ce_fwd_reference,
)
from pallas_kernels.tiled_decode import TiledBlocks, tiled_decode

VALUE_TOL = {"float32": 1e-5, "bfloat16": 1e-4}  # as in the kernel tests
GRAD_TOL = {"float32": 1e-5, "bfloat16": 2.0**-8}

# (B or N, V, D) per kernel: GPT-2's odd V = 50,257 on GPU, small ragged ones in the interpreter.
GPU_SHAPES = {
    "fused_decode": [(1, 50257, 768), (3, 50257, 768), (37, 1000, 100)],
    "tiled_decode": [(513, 50257, 768), (64, 32000, 4096)],
    "fused_topk": [(3, 50257, 768)],
    "linear_ce": [(513, 50257, 768)],
}
INTERPRET_SHAPES = {
    "fused_decode": [(3, 1000, 100)],
    "tiled_decode": [(37, 1000, 100)],
    "fused_topk": [(3, 1000, 100)],
    "linear_ce": [(37, 1000, 100)],
}


def _inputs(shape, dtype, seed):
    batch, vocab, d_model = shape
    kh, kw = jax.random.split(jax.random.key(seed))
    h = jax.random.normal(kh, (batch, d_model), jnp.float32)
    w = jax.random.normal(kw, (vocab, d_model), jnp.float32) * (3.0 / d_model**0.5)
    return h.astype(dtype), w.astype(dtype)


def _err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0))


def _within(a, b, tol) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return bool(np.all(np.abs(a - b) <= tol * (1 + np.abs(b))))


def _ids_ok(ids, ref_ids, ref_scores_bv, tol) -> bool:
    """Ids equal, or the reference scores at both ids agree within tol (a float32 near-tie)."""
    ids, ref_ids = np.asarray(ids), np.asarray(ref_ids)
    if ids.shape != ref_ids.shape or (ids < 0).any() or (ids >= ref_scores_bv.shape[1]).any():
        return False
    rows = np.arange(ids.shape[0])[:, None] if ids.ndim == 2 else np.arange(ids.shape[0])
    mine = ref_scores_bv[rows, ids]
    theirs = ref_scores_bv[rows, ref_ids]
    return bool(np.all((ids == ref_ids) | (np.abs(mine - theirs) <= tol * (1 + np.abs(theirs)))))


def _ref_logits(h, w):
    return np.asarray(
        jnp.einsum("bd,vd->bv", h, w, precision="highest", preferred_element_type=jnp.float32),
        np.float64,
    )


INTERPRET_BLOCKS = {
    "fused_decode": DecodeBlocks(block_v=128, block_b=16, block_d=32),
    "tiled_decode": TiledBlocks(block_b=16, block_v=128, block_d=32, tiles_per_program=3),
    "fused_topk": TopKBlocks(block_v=128, block_b=16, block_d=32),
    "linear_ce": CEBlocks(block_n=16, block_v=128, block_d=32, dh_splits=3),
}
KERNELS = {
    "fused_decode": (fused_decode, DecodeBlocks),
    "tiled_decode": (tiled_decode, TiledBlocks),
}


def _check_decode(name, shape, dtype, interpret, seed):
    kernel, blocks_cls = KERNELS[name]
    h, w = _inputs(shape, dtype, seed)
    seeds = noise.seeds_from_key(jax.random.key(seed + 1))
    inv_t = 0.8
    blocks = INTERPRET_BLOCKS[name] if interpret else blocks_cls.default(*shape, dtype)
    out = kernel(h, w, seeds, inv_temperature=inv_t, blocks=blocks, interpret=interpret)
    ref = fused_decode_reference(h, w, seeds, inv_temperature=inv_t)
    tol = VALUE_TOL[jnp.dtype(dtype).name]
    logits = _ref_logits(h, w)
    rows = jnp.arange(shape[0], dtype=jnp.int32)[:, None]
    toks = jnp.arange(shape[1], dtype=jnp.int32)[None, :]
    scores = logits * inv_t + np.asarray(noise.gumbel(seeds, rows, toks), np.float64)
    err = max(_err(out.max_b, ref.max_b), _err(out.lse_b, ref.lse_b))
    ok = (
        _within(out.max_b, ref.max_b, tol)
        and _within(out.lse_b, ref.lse_b, tol)
        and _ids_ok(out.argmax_b, ref.argmax_b, logits, tol)
        and _ids_ok(out.sample_b, ref.sample_b, scores, tol)
    )
    return err, ok, blocks


def _check_topk(shape, dtype, interpret, seed, k=10):
    h, w = _inputs(shape, dtype, seed)
    blocks = INTERPRET_BLOCKS["fused_topk"] if interpret else TopKBlocks.default(*shape, dtype)
    vals, ids = fused_topk(h, w, k, blocks=blocks, interpret=interpret)
    rvals, rids = fused_topk_reference(h, w, k)
    tol = VALUE_TOL[jnp.dtype(dtype).name]
    ok = _within(vals, rvals, tol) and _ids_ok(ids, rids, _ref_logits(h, w), tol)
    return _err(vals, rvals), ok, blocks


def _check_linear_ce(shape, dtype, interpret, seed):
    h, w = _inputs(shape, dtype, seed)
    n_rows, vocab, _ = shape
    labels = jax.random.randint(jax.random.key(seed + 2), (n_rows,), -1, vocab, jnp.int32)
    g_lse = jax.random.normal(jax.random.key(seed + 3), (n_rows,), jnp.float32)
    g_target = -g_lse
    blocks = INTERPRET_BLOCKS["linear_ce"] if interpret else CEBlocks.default(*shape, dtype)
    lse, target = linear_ce_fwd(h, w, labels, blocks=blocks, interpret=interpret)
    rlse, rtarget = linear_ce_fwd_reference(h, w, labels)
    dh, dw = linear_ce_bwd(h, w, labels, lse, g_lse, g_target, blocks=blocks, interpret=interpret)
    rdh, rdw = linear_ce_bwd_reference(h, w, labels, rlse, g_lse, g_target)
    name = jnp.dtype(dtype).name
    tol, gtol = VALUE_TOL[name], GRAD_TOL[name]
    scale_h = float(np.max(np.abs(np.asarray(rdh)))) or 1.0
    scale_w = float(np.max(np.abs(np.asarray(rdw)))) or 1.0
    err = max(_err(lse, rlse), _err(target, rtarget), _err(dh, rdh), _err(dw, rdw))
    ok = (
        _within(lse, rlse, tol)
        and _within(target, rtarget, tol)
        and _err(dh, rdh) <= gtol * scale_h
        and _err(dw, rdw) <= gtol * scale_w
    )
    return err, ok, blocks


def _row(kernel, shape, dtype, check) -> dict:
    row = {"kernel": kernel, "shape": list(shape), "dtype": jnp.dtype(dtype).name}
    try:
        err, ok, blocks = check()
        row.update(max_abs_err=err, ok=bool(ok), blocks=repr(blocks))
    except Exception as e:  # a kernel that does not lower or run is a failed row, not a crash
        row.update(max_abs_err=float("nan"), ok=False, error=f"{type(e).__name__}: {e}")
        row["traceback"] = traceback.format_exc(limit=5)
    return row


def run_all(interpret: bool, kernels: tuple[str, ...] | None = None) -> list[dict]:
    """Check each kernel against its reference; rows {kernel, shape, dtype, max_abs_err, ok}.

    ``kernels`` limits the run to some of fused_decode, tiled_decode, fused_topk, linear_ce.
    Extra keys: ``blocks`` (the tiling used) and, on failure to run, ``error`` / ``traceback``.
    """
    shapes = INTERPRET_SHAPES if interpret else GPU_SHAPES
    checks = {
        "fused_decode": lambda s, t, seed: _check_decode("fused_decode", s, t, interpret, seed),
        "tiled_decode": lambda s, t, seed: _check_decode("tiled_decode", s, t, interpret, seed),
        "fused_topk": lambda s, t, seed: _check_topk(s, t, interpret, seed),
        "linear_ce": lambda s, t, seed: _check_linear_ce(s, t, interpret, seed),
    }
    rows = []
    for seed, dtype in enumerate((jnp.float32, jnp.bfloat16)):
        for kernel, check in checks.items():
            if kernels is not None and kernel not in kernels:
                continue
            for shape in shapes[kernel]:
                rows.append(
                    _row(kernel, shape, dtype, lambda c=check, s=shape, t=dtype, r=seed: c(s, t, r))
                )
    return rows


if __name__ == "__main__":
    import json
    import sys

    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    results = run_all(interpret=not on_gpu)
    for r in results:
        r.pop("traceback", None)
        print(json.dumps(r))
    sys.exit(0 if all(r["ok"] for r in results) else 1)
