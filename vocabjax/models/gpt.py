"""A decoder-only GPT in Flax NNX with nested vocabulary heads on one backbone.

    model = GPT(GPTConfig(load_shape("tiny"), max_vocab=4096, max_seq=128), rngs=nnx.Rngs(0))
    h_btd = model(ids_bt)                      # final normed hidden states
    loss = model.loss(ids_bt, labels_bt, vocab=1024)   # head V = 1024: rows W[:1024]
    caches = model.init_cache(batch=2, max_len=128)    # per-layer K/V for serving
    h_btd, caches = model.cached(ids_bt, caches, start_b)   # ids at positions start_b + t

Architecture (chosen for a small, dependable training measurement, close to Llama's block):
pre-RMSNorm blocks, causal self-attention with grouped-query heads (``n_kv_heads`` K of them, each
shared by H / K query heads), learned absolute position embeddings (at most ``max_seq`` positions;
simpler than RoPE and enough for the short contexts a vocabulary measurement trains on), a
SwiGLU (``shape.glu``) or GELU MLP, no biases, no dropout, and a final RMSNorm.

Nested heads (DESIGN.md): one token embedding table of ``max_vocab`` rows serves every level
(level V_j's ids are all < V_j), and one unembedding matrix ``W`` (max_vocab x D) whose prefix
``W[:V_j]`` is the head of level V_j. ``W`` is its own matrix unless ``tie_embeddings``.
Separate heads (``heads_kind="separate"``, the paper's Improvement 7): the same backbone and
embedding, and one matrix ``W_j`` (V_j x D) per head size in ``heads``; :meth:`GPT.alignment`
measures how far their shared rows (token ids < V_i in heads i < j) have drifted apart.
The training loss goes through :func:`vocabjax.unembed.linear_cross_entropy`, so it never holds
the N x V logits unless ``impl="xla"`` asks for them.

Initialisation: normal(0.02) for embeddings and matrices; the two projections that write into
the residual stream (attention output, MLP down) use 0.02 / sqrt(2 L) (GPT-2). Parameters are
float32; ``compute_dtype="bf16"`` runs the matmuls in bfloat16 with float32 accumulation, norms,
softmax and residual stream in float32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from vocabjax.errors import UserError
from vocabjax.shapes import ModelShape
from vocabjax.unembed import Impl, linear_cross_entropy

ComputeDtype = Literal["f32", "bf16"]
HeadsKind = Literal["nested", "separate"]
HEADS_KINDS: tuple[str, ...] = ("nested", "separate")
_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
INIT_STD = 0.02  # GPT-2's initialiser range

# nnx.List holds sub-modules in flax >= 0.12; a plain list does in older versions.
_ModuleList = getattr(nnx, "List", list)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Everything needed to rebuild the model (run.json stores it)."""

    shape: ModelShape  # backbone dimensions
    max_vocab: int  # rows of the embedding and of W: the largest head
    max_seq: int  # learned positions: the longest input sequence
    tie_embeddings: bool = False  # use the embedding table as W (one V x D matrix fewer)
    compute_dtype: ComputeDtype = "f32"  # matmul dtype; parameters stay float32
    norm_eps: float = 1e-5  # RMSNorm epsilon
    heads_kind: HeadsKind = "nested"  # prefixes W[:V] of one matrix, or one matrix per head
    heads: tuple[int, ...] = ()  # the head sizes of separate heads (the last is max_vocab)

    def __post_init__(self) -> None:
        for field in ("max_vocab", "max_seq"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UserError(f"{field}={value!r} must be a positive integer")
        if self.compute_dtype not in _DTYPES:
            raise UserError(f"compute_dtype={self.compute_dtype!r} must be f32 or bf16")
        if self.heads_kind not in HEADS_KINDS:
            raise UserError(f"heads_kind={self.heads_kind!r} must be nested or separate")
        if self.heads_kind == "separate":
            heads = tuple(self.heads)
            if not heads or list(heads) != sorted(set(heads)) or heads[-1] != self.max_vocab:
                raise UserError(
                    f"separate heads={list(heads)} must be increasing and end at "
                    f"max_vocab={self.max_vocab}"
                )
            if self.tie_embeddings:
                raise UserError("separate heads are their own matrices: they cannot be tied")
            object.__setattr__(self, "heads", heads)

    @property
    def dtype(self):
        return _DTYPES[self.compute_dtype]

    def n_params(self) -> int:
        """Every weight: backbone, norms, positions, embedding and (untied) W."""
        s = self.shape
        norms = (2 * s.n_layers + 1) * s.d_model
        unembed = 0 if self.tie_embeddings else self.max_vocab
        if self.heads_kind == "separate":
            unembed = sum(self.heads)
        tables = (self.max_vocab + unembed) * s.d_model
        return s.n_nonembedding + norms + self.max_seq * s.d_model + tables


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32))


def _mm(x: jax.Array, w: jax.Array, dtype) -> jax.Array:
    """x @ w in ``dtype`` with float32 results."""
    return jnp.matmul(x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    def __init__(self, d_model: int, eps: float) -> None:
        self.scale = nnx.Param(jnp.ones((d_model,), jnp.float32))
        self.eps = eps

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        x = x_btd.astype(jnp.float32)
        rms = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return x * rms * self.scale[...]


class Attention(nnx.Module):
    """Causal self-attention with H query heads and K key/value heads (GQA when K < H)."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs) -> None:
        s = config.shape
        out_std = INIT_STD / math.sqrt(2 * s.n_layers)
        self.n_heads, self.n_kv_heads, self.head_dim = s.n_heads, s.n_kv_heads, s.dh
        self.dtype = config.dtype
        self.w_q = _normal(rngs, (s.d_model, s.n_heads * s.dh), INIT_STD)
        self.w_k = _normal(rngs, (s.d_model, s.n_kv_heads * s.dh), INIT_STD)
        self.w_v = _normal(rngs, (s.d_model, s.n_kv_heads * s.dh), INIT_STD)
        self.w_o = _normal(rngs, (s.n_heads * s.dh, s.d_model), out_std)

    def _qkv(self, x_btd: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        b, t, _ = x_btd.shape
        k_heads, dh = self.n_kv_heads, self.head_dim
        group = self.n_heads // k_heads
        q = _mm(x_btd, self.w_q[...], self.dtype).reshape(b, t, k_heads, group, dh)
        k = _mm(x_btd, self.w_k[...], self.dtype).reshape(b, t, k_heads, dh)
        v = _mm(x_btd, self.w_v[...], self.dtype).reshape(b, t, k_heads, dh)
        return q, k, v

    def _attend(self, q, k_bskd, v_bskd, mask_bts: jax.Array) -> jax.Array:
        """Softmax attention of queries (B, T, K, G, Dh) over keys/values (B, S, K, Dh) where
        ``mask_bts`` holds; the output projection included."""
        b, t = q.shape[:2]
        scores = jnp.einsum(
            "btkgd,bskd->bkgts",
            q.astype(self.dtype),
            k_bskd.astype(self.dtype),
            preferred_element_type=jnp.float32,
        ) / math.sqrt(self.head_dim)
        scores = jnp.where(mask_bts[:, None, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum(
            "bkgts,bskd->btkgd",
            probs.astype(self.dtype),
            v_bskd.astype(self.dtype),
            preferred_element_type=jnp.float32,
        )
        return _mm(out.reshape(b, t, self.n_heads * self.head_dim), self.w_o[...], self.dtype)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        t = x_btd.shape[1]
        q, k, v = self._qkv(x_btd)
        causal_ts = jnp.tril(jnp.ones((t, t), dtype=bool))
        return self._attend(q, k, v, causal_ts[None])

    def cached(
        self,
        x_btd: jax.Array,
        cache: LayerCache,
        start_b: jax.Array,
        *,
        fresh: bool = False,
        window: int | None = None,
    ) -> tuple[jax.Array, LayerCache]:
        """Attention of T new tokens at positions ``start_b + t`` (one start per sequence):
        their K/V are written into ``cache`` there, and each attends to cache positions up to
        its own. Positions past a sequence's end may hold anything: they are masked until a
        later call overwrites them.

        Both options skip positions the mask would drop, so the scores are the same:
        ``fresh``, the caller's promise that ``start_b`` is 0: nothing precedes the new tokens
        and they attend among themselves, T x T rather than T x the cache's length (a prefill
        of 16 tokens into a 2,048-position cache reads 16 keys per query, not 2,048);
        ``window`` (static), the promise that every new token's position is below it: the
        attention reads the cache's first ``window`` positions only (decode steps of sequences
        that end within 128 positions of a 2,048-position cache read 128)."""
        t = x_btd.shape[1]
        q, k, v = self._qkv(x_btd)
        cache = LayerCache(_write(cache.k_bskd, k, start_b), _write(cache.v_bskd, v, start_b))
        if fresh:
            causal_tt = jnp.tril(jnp.ones((t, t), dtype=bool))
            k_new, v_new = (x.astype(cache.k_bskd.dtype) for x in (k, v))  # as the cache holds them
            return self._attend(q, k_new, v_new, causal_tt[None]), cache
        s = cache.k_bskd.shape[1] if window is None else min(window, cache.k_bskd.shape[1])
        pos_bt = start_b[:, None] + jnp.arange(t, dtype=start_b.dtype)
        mask_bts = jnp.arange(s, dtype=start_b.dtype)[None, None, :] <= pos_bt[:, :, None]
        return self._attend(q, cache.k_bskd[:, :s], cache.v_bskd[:, :s], mask_bts), cache


class LayerCache(NamedTuple):
    """One layer's key and value cache, (B, max_len, K, Dh) in the compute dtype."""

    k_bskd: jax.Array
    v_bskd: jax.Array


def _write(cache_bskd: jax.Array, new_btkd: jax.Array, start_b: jax.Array) -> jax.Array:
    """``cache[b, start_b[b] : start_b[b] + T] = new[b]`` for every b (T + start <= max_len)."""

    def one(cache_skd, new_tkd, start):
        return jax.lax.dynamic_update_slice(
            cache_skd, new_tkd.astype(cache_skd.dtype), (start, 0, 0)
        )

    return jax.vmap(one)(cache_bskd, new_btkd, start_b)


class MLP(nnx.Module):
    """SwiGLU (``glu``): (silu(x W_gate) * x W_up) W_down; otherwise gelu(x W_in) W_out."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs) -> None:
        s = config.shape
        self.glu = s.glu
        self.dtype = config.dtype
        self.w_in = _normal(rngs, (s.d_model, s.d_ff), INIT_STD)
        if s.glu:
            self.w_gate = _normal(rngs, (s.d_model, s.d_ff), INIT_STD)
        self.w_out = _normal(rngs, (s.d_ff, s.d_model), INIT_STD / math.sqrt(2 * s.n_layers))

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        up = _mm(x_btd, self.w_in[...], self.dtype)
        if self.glu:
            act = jax.nn.silu(_mm(x_btd, self.w_gate[...], self.dtype)) * up
        else:
            act = jax.nn.gelu(up)
        return _mm(act, self.w_out[...], self.dtype)


class Block(nnx.Module):
    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs) -> None:
        d = config.shape.d_model
        self.attn_norm = RMSNorm(d, config.norm_eps)
        self.attn = Attention(config, rngs=rngs)
        self.mlp_norm = RMSNorm(d, config.norm_eps)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        x_btd = x_btd + self.attn(self.attn_norm(x_btd))
        return x_btd + self.mlp(self.mlp_norm(x_btd))

    def cached(
        self, x_btd: jax.Array, cache: LayerCache, start_b: jax.Array, **options
    ) -> tuple[jax.Array, LayerCache]:
        a, cache = self.attn.cached(self.attn_norm(x_btd), cache, start_b, **options)
        x_btd = x_btd + a
        return x_btd + self.mlp(self.mlp_norm(x_btd)), cache


class GPT(nnx.Module):
    """The backbone plus the nested heads ``W[:V]`` for every V <= ``config.max_vocab``, or one
    matrix per head of ``config.heads`` when they are separate."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs) -> None:
        s = config.shape
        self.config = config
        self.embed = _normal(rngs, (config.max_vocab, s.d_model), INIT_STD)
        self.pos = _normal(rngs, (config.max_seq, s.d_model), INIT_STD)
        self.blocks = _ModuleList([Block(config, rngs=rngs) for _ in range(s.n_layers)])
        self.final_norm = RMSNorm(s.d_model, config.norm_eps)
        if config.heads_kind == "separate":
            self.heads = _ModuleList(
                [_normal(rngs, (v, s.d_model), INIT_STD) for v in config.heads]
            )
        elif not config.tie_embeddings:
            self.unembed = _normal(rngs, (config.max_vocab, s.d_model), INIT_STD)

    def __call__(self, ids_bt: jax.Array) -> jax.Array:
        """Final normed hidden states (B, T, D), float32, of token ids (B, T)."""
        if ids_bt.ndim != 2:
            raise UserError(f"ids must be (B, T), got shape {tuple(ids_bt.shape)}")
        t = ids_bt.shape[1]
        if t > self.config.max_seq:
            raise UserError(f"sequence length {t} is above max_seq={self.config.max_seq}")
        x_btd = jnp.take(self.embed[...], ids_bt, axis=0) + self.pos[...][:t]
        for block in self.blocks:
            x_btd = block(x_btd)
        return self.final_norm(x_btd)

    def init_cache(self, batch: int, max_len: int | None = None) -> tuple[LayerCache, ...]:
        """Zeroed K/V caches, one per layer, of ``max_len`` positions (default ``max_seq``)."""
        c, s = self.config, self.config.shape
        max_len = c.max_seq if max_len is None else max_len
        if not 0 < max_len <= c.max_seq:
            raise UserError(f"cache {max_len=} must be in 1..max_seq={c.max_seq}")
        zeros = jnp.zeros((batch, max_len, s.n_kv_heads, s.dh), c.dtype)
        return tuple(LayerCache(zeros, zeros) for _ in range(s.n_layers))

    def cached(
        self,
        ids_bt: jax.Array,
        caches: tuple[LayerCache, ...],
        start_b: jax.Array,
        *,
        fresh: bool = False,
        window: int | None = None,
    ) -> tuple[jax.Array, tuple[LayerCache, ...]]:
        """Final normed hidden states (B, T, D) of tokens ``ids_bt`` at positions ``start_b[b]
        + t``, attending to the cached keys and values before them; returns the updated caches.

        Prefill: ``start_b = 0`` and the (right-padded) prompts, with ``fresh=True`` (the
        prompts attend among themselves, not over the whole cache: ``Attention.cached``);
        decode: T = 1 and ``start_b`` = each sequence's length so far, with ``window`` a bound
        on every position the call reaches when the caller knows one (the attention then reads
        that many cache positions, not all of them). The caller keeps ``start_b + T <=
        max_len`` of the caches (<= ``max_seq``). Row b of the result equals ``self(ids)[b]``
        at the same positions when the cache holds that row's earlier tokens.
        """
        if ids_bt.ndim != 2 or start_b.shape != ids_bt.shape[:1]:
            raise UserError(
                f"ids must be (B, T) and start (B,), got {tuple(ids_bt.shape)} and "
                f"{tuple(start_b.shape)}"
            )
        if len(caches) != len(self.blocks):
            raise UserError(f"{len(caches)} caches for {len(self.blocks)} layers")
        if window is not None and window <= 0:
            raise UserError(f"attention window {window!r} must be a positive number of positions")
        t = ids_bt.shape[1]
        pos_bt = start_b[:, None] + jnp.arange(t, dtype=start_b.dtype)
        x_btd = jnp.take(self.embed[...], ids_bt, axis=0) + jnp.take(
            self.pos[...], pos_bt, axis=0, mode="clip"
        )
        out = []
        for block, cache in zip(self.blocks, caches, strict=True):
            x_btd, cache = block.cached(x_btd, cache, start_b, fresh=fresh, window=window)
            out.append(cache)
        return self.final_norm(x_btd), tuple(out)

    def head(self, vocab: int) -> jax.Array:
        """W_vd of the head of size ``vocab``: the first ``vocab`` rows of the one matrix, or
        that head's own matrix when heads are separate."""
        c = self.config
        if c.heads_kind == "separate":
            if vocab not in c.heads:
                raise UserError(f"head {vocab=} is not one of the separate heads {list(c.heads)}")
            return self.heads[c.heads.index(vocab)][...].astype(c.dtype)
        if not 0 < vocab <= c.max_vocab:
            raise UserError(f"head {vocab=} must be in 1..max_vocab={c.max_vocab}")
        w = self.embed if c.tie_embeddings else self.unembed
        return w[...][:vocab].astype(c.dtype)

    def alignment(self) -> jax.Array:
        """How far separate heads have drifted apart: over every pair of heads i < j, the
        squared distance between the rows they share, relative to their size,
        ``|W_j[:V_i] - W_i|^2 / ((|W_j[:V_i]|^2 + |W_i|^2) / 2)``, averaged over pairs. 0 when
        the shared rows are equal (nested heads always; a single head), about 2 for unrelated
        rows (heads drawn independently)."""
        c = self.config
        if c.heads_kind != "separate" or len(c.heads) < 2:
            return jnp.zeros((), jnp.float32)
        w = [m[...] for m in self.heads]
        pairs = []
        for i in range(len(w)):
            for j in range(i + 1, len(w)):
                shared_vd = w[j][: c.heads[i]]
                size = 0.5 * (jnp.sum(jnp.square(shared_vd)) + jnp.sum(jnp.square(w[i])))
                pairs.append(jnp.sum(jnp.square(shared_vd - w[i])) / (size + 1e-12))
        return jnp.mean(jnp.stack(pairs))

    def logits(self, h_btd: jax.Array, vocab: int) -> jax.Array:
        """Logits (B, T, vocab) of head ``vocab``, float32 (materialized: for tests and demos)."""
        w_vd = self.head(vocab)
        return jnp.einsum(
            "btd,vd->btv",
            h_btd.astype(w_vd.dtype),
            w_vd,
            preferred_element_type=jnp.float32,
            precision=jax.lax.Precision.HIGHEST,
        )

    def loss(
        self,
        ids_bt: jax.Array,
        labels_bt: jax.Array,
        vocab: int,
        *,
        impl: Impl = "auto",
        reduction: Literal["mean", "sum", "none"] = "mean",
    ) -> jax.Array:
        """Cross-entropy (nats) of head ``vocab`` predicting ``labels`` from ``ids``."""
        return head_loss(self(ids_bt), self.head(vocab), labels_bt, impl=impl, reduction=reduction)


def head_loss(
    h_btd: jax.Array,
    w_vd: jax.Array,
    labels_bt: jax.Array,
    *,
    impl: Impl = "auto",
    reduction: Literal["mean", "sum", "none"] = "mean",
) -> jax.Array:
    """linear_cross_entropy of hidden states (B, T, D) against a head W (V, D); labels equal to
    -100 are left out."""
    d = h_btd.shape[-1]
    out = linear_cross_entropy(
        h_btd.reshape(-1, d), w_vd, labels_bt.reshape(-1), impl=impl, reduction=reduction
    )
    return out.reshape(labels_bt.shape) if reduction == "none" else out
