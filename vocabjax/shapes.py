"""Model shapes: decoder-only transformer presets and loading a shape from JSON or TOML.

The cost model needs only the matmul dimensions; ``n_nonembedding`` counts attention and MLP
weights (GQA and GLU aware). Norm weights and biases are left out: under 0.1% of any preset.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vocabjax.errors import UserError
from vocabjax.profiles import VOCAB_MAX, boolean, closed, integer, load_data, text


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only transformer; the vocabulary is the swept variable."""

    name: str  # preset or file name
    d_model: int  # D, residual width
    n_layers: int  # L
    n_heads: int  # H, query heads
    n_kv_heads: int  # K, key/value heads (K < H is grouped-query attention)
    d_ff: int  # F, MLP hidden width
    glu: bool = False  # gated MLP (SwiGLU): three D x F matrices instead of two
    head_dim: int | None = None  # Dh; defaults to D / H
    native_vocab: int | None = None  # the vocabulary the published model shipped with
    source: str = ""  # where the numbers come from

    def __post_init__(self) -> None:
        _check_fields(dataclasses.asdict(self), where=f"model {self.name!r}:")
        if self.n_heads % self.n_kv_heads:
            raise UserError(
                f"model {self.name!r}: n_heads={self.n_heads} must be a multiple of "
                f"n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim is None and self.d_model % self.n_heads:
            raise UserError(
                f"model {self.name!r}: d_model={self.d_model} is not divisible by "
                f"n_heads={self.n_heads}; give head_dim"
            )

    @property
    def dh(self) -> int:
        """Head dimension Dh."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def attn_params_per_layer(self) -> int:
        """Q and O projections (D x H Dh each) plus K and V (D x K Dh each)."""
        return (
            2 * self.d_model * self.n_heads * self.dh + 2 * self.d_model * self.n_kv_heads * self.dh
        )

    @property
    def mlp_params_per_layer(self) -> int:
        return (3 if self.glu else 2) * self.d_model * self.d_ff

    @property
    def n_nonembedding(self) -> int:
        """N_nv: attention + MLP weights over all layers."""
        return self.n_layers * (self.attn_params_per_layer + self.mlp_params_per_layer)

    @property
    def kv_elements_per_token(self) -> int:
        """K and V cache elements one token adds: 2 L K Dh."""
        return 2 * self.n_layers * self.n_kv_heads * self.dh

    def n_params(self, vocab: int, *, tied: bool = False) -> int:
        """Total weights at vocabulary ``vocab`` (embedding + head, tied or not)."""
        return self.n_nonembedding + (1 if tied else 2) * vocab * self.d_model

    def to_json(self) -> dict[str, Any]:
        return {"schema": 1, "kind": "shape", **dataclasses.asdict(self)}


_DIMS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")
_DIM_MAX = 2**31 - 1  # sizes enter jax shapes as int32


def _check_fields(data: Mapping[str, Any], *, where: str) -> None:
    """The type and range of each field present; ``where`` ends with the separator (":")."""
    for field in _DIMS:
        if field in data:
            integer(data[field], where=f"{where} {field}", maximum=_DIM_MAX)
    for field in ("head_dim", "native_vocab"):
        if data.get(field) is not None:
            bound = VOCAB_MAX if field == "native_vocab" else _DIM_MAX
            integer(data[field], where=f"{where} {field}", maximum=bound)
    if "glu" in data:
        boolean(data["glu"], where=f"{where} glu")
    for field in ("name", "source"):
        if field in data:
            text(data[field], where=f"{where} {field}", empty=field == "source")


def _gpt(name, d, layers, heads, *, native_vocab=None, source) -> ModelShape:
    return ModelShape(
        name, d, layers, heads, heads, 4 * d, native_vocab=native_vocab, source=source
    )


BUILTIN_SHAPES: Mapping[str, ModelShape] = {
    s.name: s
    for s in (
        # The paper's three scales are given by parameter count only; these GPT shapes (MHA,
        # 4D MLP) are chosen to land on them: 85M, 1.51B and 2.28B non-embedding weights.
        _gpt("paper-100m", 768, 12, 12, source="paper scale ~100M; GPT-2-small-like shape"),
        _gpt("paper-1.5b", 2048, 30, 16, source="paper scale ~1.5B; shape chosen to match N_nv"),
        _gpt("paper-2.3b", 2560, 29, 20, source="paper scale ~2.3B; shape chosen to match N_nv"),
        # GPT-2 (Radford et al. 2019, Table 2; HF gpt2 / gpt2-medium config.json).
        # Not a published model: small enough that `python cli.py train` with its defaults
        # measures three heads in about a minute on two CPU cores (0.39M non-embedding weights).
        _gpt("tiny", 128, 2, 4, source="vocabjax: the CPU-sized default of `train`"),
        # Not a published model: the next scale up for quality studies on a CPU, 4.72M
        # non-embedding weights (the low end of 5-20M, where a 2-core CPU still trains it in
        # minutes; docs/training.md has its measured tokens/s).
        _gpt("small", 256, 6, 4, source="vocabjax: a CPU-sized second scale for quality studies"),
        _gpt("gpt2-small", 768, 12, 12, native_vocab=50257, source="HF gpt2 config.json"),
        _gpt("gpt2-medium", 1024, 24, 16, native_vocab=50257, source="HF gpt2-medium config.json"),
        # Llama 3 family (HF meta-llama config.json: hidden_size, num_hidden_layers,
        # num_attention_heads, num_key_value_heads, intermediate_size, head_dim).
        ModelShape(
            "llama-1b",
            2048,
            16,
            32,
            8,
            8192,
            glu=True,
            head_dim=64,
            native_vocab=128256,
            source="HF meta-llama/Llama-3.2-1B config.json",
        ),
        ModelShape(
            "llama-8b",
            4096,
            32,
            32,
            8,
            14336,
            glu=True,
            head_dim=128,
            native_vocab=128256,
            source="HF meta-llama/Llama-3.1-8B config.json",
        ),
        ModelShape(
            "llama-70b",
            8192,
            80,
            64,
            8,
            28672,
            glu=True,
            head_dim=128,
            native_vocab=128256,
            source="HF meta-llama/Llama-3.1-70B config.json",
        ),
    )
}

DEFAULT_MODEL = "paper-1.5b"

_FIELDS = tuple(f.name for f in dataclasses.fields(ModelShape))


def shape_from_mapping(
    data: Mapping[str, Any], *, name: str, where: str | None = None
) -> ModelShape:
    """A shape from a mapping with ModelShape's field names (``schema`` 1 and ``kind`` "shape"
    allowed); ``where`` (default ``name``) names the file in messages."""
    where = where or name
    if not isinstance(data, Mapping):
        raise UserError(f"{where}: a model shape must be a table/object")
    if data.get("schema", 1) != 1 or data.get("kind", "shape") != "shape":
        raise UserError(
            f"{where}: expected a model shape (schema 1, kind 'shape'), found schema "
            f"{data.get('schema')!r}, kind {data.get('kind')!r}"
        )
    data = {k: v for k, v in data.items() if k not in ("schema", "kind")}
    closed(data, _FIELDS, where=where)
    missing = [f for f in ("d_model", "n_layers", "n_heads", "d_ff") if f not in data]
    if missing:
        raise UserError(f"{where}: missing field(s) {', '.join(missing)}")
    _check_fields(data, where=f"{where}:")
    data.setdefault("n_kv_heads", data["n_heads"])
    data.setdefault("name", name)
    try:
        return ModelShape(**data)
    except UserError as exc:  # the relations between fields (heads, d_model / n_heads)
        reason = str(exc).removeprefix(f"model {data['name']!r}: ")
        raise UserError(f"{where}: {reason}") from None


def load_shape(name_or_path: str | os.PathLike) -> ModelShape:
    """A builtin preset by name, or a shape from a ``.json`` or ``.toml`` file."""
    key = str(name_or_path)
    if key.lower() in BUILTIN_SHAPES:
        return BUILTIN_SHAPES[key.lower()]
    path = Path(key)
    if path.suffix.lower() in (".json", ".toml") or path.exists():
        what = f"model file {key!r}"
        data = load_data(path, what=what, invalid="does not parse")
        return shape_from_mapping(data, name=path.stem, where=what)
    known = ", ".join(BUILTIN_SHAPES)
    raise UserError(f"unknown model {key!r} (builtin: {known}; or a .json/.toml shape file)")
