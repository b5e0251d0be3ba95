"""The custom VJPs of the linear cross-entropy, shared by the chunked and Pallas backends.

``ce_total`` is the mean and sum losses' path: their per-token cotangents are known in the
forward, so under ``grad`` the forward computes dh and dW as it goes and the backward only
scales them. ``lse_target`` is ``reduction="none"``'s: it keeps h, W, labels and the (N,)
log-sum-exp, and its backward recomputes the logits tile by tile (nothing N x V is saved).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from vocabjax.unembed import chunked, pallas
from vocabjax.unembed.selector import dtype_name


@dataclasses.dataclass(frozen=True)
class CEBackend:
    """How (lse, target logit) and their gradient are computed; static (hashable)."""

    kind: str  # "chunked" or "pallas"
    blocks: Any  # chunked.ChunkBlocks for chunked, CEBlocks (or None) for pallas
    interpret: bool
    dtype: Any  # the weights' dtype (h is cast to it): the dtype of both gradients

    def fwd(self, h_nd, w_vd, labels_n):
        if self.kind == "chunked":
            return chunked.ce_fwd(h_nd, w_vd, labels_n, self.blocks.block_v)
        mod = pallas.module("linear_ce")
        return mod.linear_ce_fwd(h_nd, w_vd, labels_n, blocks=self.blocks, interpret=self.interpret)

    def bwd(self, h_nd, w_vd, labels_n, lse_n, g_lse_n, g_target_n):
        if self.kind == "chunked":
            return chunked.ce_bwd(
                h_nd, w_vd, labels_n, lse_n, g_lse_n, g_target_n, self.blocks.block_v
            )
        mod = pallas.module("linear_ce")
        return mod.linear_ce_bwd(
            h_nd,
            w_vd,
            labels_n,
            lse_n,
            g_lse_n,
            g_target_n,
            blocks=self.blocks,
            interpret=self.interpret,
        )

    def total_and_grad(self, h_nd, w_vd, labels_n, weight_n, z_loss: float):
        """``sum_n weight_n * (lse_n - target_n + z_loss * lse_n**2)`` and its float32 dh, dW.

        chunked: one pass over row tiles (``chunked.ce_grad``); pallas: the forward kernel,
        then the backward kernels with the per-token cotangents this sum gives."""
        if self.kind == "chunked":
            n, (vocab, d_model) = h_nd.shape[0], w_vd.shape
            block_n = self.blocks.block_n or chunked.ChunkBlocks.default_block_n(
                n, vocab, d_model, dtype_name(w_vd.dtype)
            )
            return chunked.ce_grad(h_nd, w_vd, labels_n, weight_n, z_loss, block_n)
        lse_n, target_n = self.fwd(h_nd, w_vd, labels_n)
        total = chunked.weighted_total(lse_n, target_n, weight_n, z_loss)
        g_lse_n, g_target_n = chunked.total_cotangents(lse_n, weight_n, z_loss)
        dh_nd, dw_vd = self.bwd(h_nd, w_vd, labels_n, lse_n, g_lse_n, g_target_n)
        return total, dh_nd, dw_vd


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def ce_total(backend: CEBackend, z_loss: float, h_nd, w_vd, labels_n, weight_n):
    """``sum_n weight_n * (lse_n - target_n + z_loss * lse_n**2)``, float32; ``h`` is in W's
    dtype and ``weight_n`` is a constant (no gradient). The mean and sum losses go through
    here: their per-token cotangents are known in the forward, so under ``grad`` the forward
    computes dh and dW as it goes and the backward only scales them (``lse_target``'s
    backward would recompute the logits)."""
    return chunked.weighted_total(*backend.fwd(h_nd, w_vd, labels_n), weight_n, z_loss)


def _ce_total_fwd(backend, z_loss, h_nd, w_vd, labels_n, weight_n):
    total, dh_nd, dw_vd = backend.total_and_grad(h_nd, w_vd, labels_n, weight_n, z_loss)
    return total, (dh_nd, dw_vd)


def _ce_total_bwd(backend, z_loss, residuals, g):
    dh_nd, dw_vd = residuals  # float32; cast to W's dtype after scaling (one rounding)
    return (g * dh_nd).astype(backend.dtype), (g * dw_vd).astype(backend.dtype), None, None


ce_total.defvjp(_ce_total_fwd, _ce_total_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def lse_target(backend: CEBackend, h_nd, w_vd, labels_n):
    """(logsumexp of the logits, the logit at ``labels``; 0 where label < 0), float32 (N,).

    The backward recomputes the logits tile by tile from h and W (nothing N x V is saved).
    """
    return backend.fwd(h_nd, w_vd, labels_n)


def _lse_target_fwd(backend, h_nd, w_vd, labels_n):
    lse_n, target_n = backend.fwd(h_nd, w_vd, labels_n)
    return (lse_n, target_n), (h_nd, w_vd, labels_n, lse_n)


def _lse_target_bwd(backend, residuals, cotangents):
    h_nd, w_vd, labels_n, lse_n = residuals
    g_lse_n, g_target_n = cotangents
    dh_nd, dw_vd = backend.bwd(
        h_nd,
        w_vd,
        labels_n,
        lse_n,
        g_lse_n.astype(jnp.float32),
        g_target_n.astype(jnp.float32),
    )
    return dh_nd.astype(h_nd.dtype), dw_vd.astype(w_vd.dtype), None


lse_target.defvjp(_lse_target_fwd, _lse_target_bwd)
