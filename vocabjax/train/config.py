"""The configuration of a training run: what ``run.json`` holds, so that ``--resume`` (and later
``serve`` / ``generate``) can rebuild the model, the data order and the optimizer."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from vocabjax.corpus import BUILTINS
from vocabjax.errors import UserError
from vocabjax.models import HEADS_KINDS, GPTConfig, HeadsKind
from vocabjax.outputs import atomic_write_json
from vocabjax.profiles import (
    SCHEMA,
    VOCAB_MAX,
    a_list,
    an_object,
    boolean,
    closed,
    integer,
    load_json,
    number,
    one_of,
    require,
    text,
)
from vocabjax.shapes import BUILTIN_SHAPES, ModelShape, shape_from_mapping

RUN_FILE = "run.json"
RUN_KIND = "training_run"
TOKENIZER_DIR = "tokenizer"  # where an automatically trained tokenizer lives inside the run

Impl = Literal["auto", "xla", "chunked", "pallas"]
BUILTIN_TRAIN_BYTES = 2 * 2**20  # the default cap on the builtin corpus: encodes in seconds
DEFAULT_HEADS = (1024, 2048, 4096)
DEFAULT_SHAPE = "tiny"


def default_max_bytes(spec: str) -> int | None:
    """All of a user's corpus; 2 MiB of a builtin one (enough text for a minute's training)."""
    return BUILTIN_TRAIN_BYTES if spec in BUILTINS else None


def default_warmup(steps: int) -> int:
    """A tenth of the steps, at most 100."""
    return min(100, steps // 10)


@dataclasses.dataclass(frozen=True)
class CorpusSpec:
    """How the corpus was opened (``open_corpus`` arguments)."""

    spec: str  # a path, glob or a builtin corpus ("builtin", "builtin-prose")
    field: str = "text"  # .jsonl field / .parquet column
    held_out: float = 0.1  # fraction of documents held out (by content hash)
    max_bytes: int | None = None  # read at most this much text before the split


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that decides a run's parameters; ``run.json`` stores it."""

    shape: ModelShape  # the backbone
    heads: tuple[int, ...]  # head vocabulary sizes, increasing; the largest sizes the tables
    tokenizer: str  # nested tokenizer directory (relative paths are inside the run directory)
    corpus: CorpusSpec  # the text trained on (train part) and evaluated on (held-out part)
    steps: int  # optimizer steps in all (also the horizon of the cosine decay)
    seq_len: int = 128  # T: tokens per window the model sees (windows hold T + 1)
    batch: int = 8  # windows per head per step
    lr: float = 3e-3  # peak learning rate
    warmup: int = 20  # linear warm-up steps (then cosine decay to lr * min_lr_ratio)
    min_lr_ratio: float = 0.1  # the learning rate at the last step, relative to lr
    weight_decay: float = 0.1  # AdamW decay of the matrices (not of norms)
    clip: float = 1.0  # global gradient-norm clip
    b1: float = 0.9  # Adam beta1
    b2: float = 0.95  # Adam beta2
    seed: int = 0  # initial parameters and the order of the training windows
    tie_embeddings: bool = False  # W = the embedding table
    compute_dtype: Literal["f32", "bf16"] = "f32"  # matmul dtype (parameters stay f32)
    init_from: str | None = None  # a run at a larger V whose parameters, gathered, start this one
    heads_kind: HeadsKind = "nested"  # prefixes W[:V] of one matrix, or one matrix per head
    align_weight: float = 0.0  # weight of the separate heads' alignment loss (GPT.alignment)
    # Not part of the training maths (may change on --resume):
    impl: Impl = "auto"  # linear_cross_entropy implementation
    eval_tokens: int = 32768  # held-out tokens of the smallest head evaluated (same text for all)
    eval_bytes: int | None = None  # instead: the held-out part's first bytes (one text at any V)
    checkpoint_every: int = 100  # steps between checkpoints (0: only at the end)

    # Fields a resumed run may change; every other field must match run.json.
    MUTABLE = ("steps", "impl", "eval_tokens", "eval_bytes", "checkpoint_every")

    def __post_init__(self) -> None:
        heads = tuple(self.heads)
        if not heads:
            raise UserError("give at least one head size")
        if list(heads) != sorted(set(heads)):
            raise UserError(f"heads={list(heads)} must be distinct and increasing")
        positive = ("steps", "seq_len", "batch", "eval_tokens")
        if self.eval_bytes is not None:
            positive += ("eval_bytes",)
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UserError(f"{name}={value!r} must be a positive integer")
        for name in ("warmup", "checkpoint_every", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UserError(f"{name}={value!r} must be an integer >= 0")
        for name in ("lr", "clip"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise UserError(f"{name}={value!r} must be a finite number > 0")
        if not 0.0 <= self.weight_decay < 1.0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise UserError(
                f"weight_decay={self.weight_decay} must be in [0, 1) and "
                f"min_lr_ratio={self.min_lr_ratio} in [0, 1]"
            )
        if not (0.0 <= self.b1 < 1.0 and 0.0 <= self.b2 < 1.0):
            raise UserError(f"b1={self.b1} and b2={self.b2} must be in [0, 1)")
        if self.impl not in ("auto", "xla", "chunked", "pallas"):
            raise UserError(f"impl={self.impl!r} must be auto, xla, chunked or pallas")
        if not (math.isfinite(self.align_weight) and self.align_weight >= 0):
            raise UserError(f"align_weight={self.align_weight!r} must be a finite number >= 0")
        if self.heads_kind not in HEADS_KINDS:
            raise UserError(f"heads_kind={self.heads_kind!r} must be one of {HEADS_KINDS}")
        if self.align_weight and self.heads_kind != "separate":
            raise UserError(
                "{align_weight} aligns separate heads; nested heads share their rows already "
                "(give {heads_kind} separate)",
                settings=["align_weight", "heads_kind"],
            )
        if self.heads_kind == "separate" and self.tie_embeddings:
            raise UserError(
                "separate heads are their own matrices: they cannot be tied to the embedding",
                settings=["heads_kind", "tie_embeddings"],
            )
        if self.init_from is not None and len(heads) != 1:
            raise UserError(
                f"a run started from {{init_from}} trains one head, the pruned size; got "
                f"{{heads}} {list(heads)}",
                settings=["init_from", "heads"],
            )
        object.__setattr__(self, "heads", heads)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> RunConfig:
        """A run from settings named as ``resume_config`` takes them (fields, corpus fields as
        ``corpus.spec``, ``corpus.max_bytes``, ...). ``warmup`` and ``corpus.max_bytes`` of
        None take their defaults for the steps and the corpus; ``prune_to`` V is ``heads``
        (V,) of a run started from ``init_from``, whose model fields left None (``shape``,
        ``seq_len``, ``compute_dtype``, ``tie_embeddings``) are that run's."""
        top = {k: v for k, v in settings.items() if not k.startswith("corpus.")}
        corpus = {
            k.removeprefix("corpus."): v for k, v in settings.items() if k.startswith("corpus.")
        }
        if corpus.get("max_bytes") is None:
            corpus["max_bytes"] = default_max_bytes(corpus["spec"])
        if top.get("warmup") is None:
            top["warmup"] = default_warmup(top["steps"])
        prune_to = top.pop("prune_to", None)
        if prune_to is not None:
            if top.get("heads") not in (None, (prune_to,)):
                raise UserError(
                    "give {heads} or {prune_to}, not both (a pruned run trains one head)",
                    settings=["heads", "prune_to"],
                )
            top["heads"] = (prune_to,)
        if top.get("heads") is None:
            if top.get("init_from"):
                raise UserError(
                    "{init_from} needs {prune_to}: the vocabulary size to prune the run's to",
                    settings=["init_from", "prune_to"],
                )
            top["heads"] = DEFAULT_HEADS
        source = source_run(top["init_from"]) if top.get("init_from") else None
        for name in ("shape", "seq_len", "compute_dtype", "tie_embeddings"):
            if top.get(name) is None:
                top.pop(name, None)
                if source is not None:
                    top[name] = getattr(source, name)
        top.setdefault("shape", BUILTIN_SHAPES[DEFAULT_SHAPE])
        return cls(corpus=CorpusSpec(**corpus), **top)

    @property
    def max_vocab(self) -> int:
        return self.heads[-1]

    @property
    def model_config(self) -> GPTConfig:
        return GPTConfig(
            self.shape,
            max_vocab=self.max_vocab,
            max_seq=self.seq_len,
            tie_embeddings=self.tie_embeddings,
            compute_dtype=self.compute_dtype,
            heads_kind=self.heads_kind,
            heads=self.heads if self.heads_kind == "separate" else (),
        )

    def tokenizer_path(self, run_dir: str | Path) -> Path:
        path = Path(self.tokenizer)
        return path if path.is_absolute() else Path(run_dir) / path

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["shape"] = {k: v for k, v in self.shape.to_json().items() if k not in ("schema",)}
        data["heads"] = list(self.heads)
        return {"schema": SCHEMA, "kind": RUN_KIND, **data}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str) -> RunConfig:
        """``run.json``'s fields, each checked for its type (and the whole for its ranges);
        every problem is one UserError naming the file and the field."""
        data = {k: v for k, v in data.items() if k not in ("schema", "kind")}
        closed(data, _RUN_FIELDS, where=where)
        require(data, _RUN_REQUIRED, where=where)
        values = {k: _RUN_FIELDS[k](v, f"{where}: {k}") for k, v in data.items()}
        try:
            return cls(**values)
        except UserError as exc:  # the ranges and relations __post_init__ checks
            raise UserError(f"{where}: {exc}") from None

    def differences(self, other: RunConfig) -> list[str]:
        """Fields (outside ``MUTABLE``) whose values differ, as ``name: ours != theirs``."""
        out = []
        for field in dataclasses.fields(self):
            if field.name in self.MUTABLE:
                continue
            a, b = getattr(self, field.name), getattr(other, field.name)
            if a != b:
                out.append(f"{field.name}: {_show(a)} != {_show(b)}")
        return out


def _corpus(value: Any, where: str) -> CorpusSpec:
    value = an_object(value, where=where)
    closed(value, ("spec", "field", "held_out", "max_bytes"), where=where)
    require(value, ("spec",), where=where)
    held_out = number(value.get("held_out", 0.1), where=f"{where}.held_out")
    if not 0.0 < held_out < 1.0:
        raise UserError(f"{where}.held_out must be in (0, 1), got {held_out}")
    max_bytes = value.get("max_bytes")
    return CorpusSpec(
        spec=text(value["spec"], where=f"{where}.spec", empty=False),
        field=text(value.get("field", "text"), where=f"{where}.field", empty=False),
        held_out=held_out,
        max_bytes=None if max_bytes is None else integer(max_bytes, where=f"{where}.max_bytes"),
    )


def _heads(value: Any, where: str) -> tuple[int, ...]:
    value = a_list(value, where=where, nonempty=True)
    return tuple(integer(v, where=f"{where}[{i}]", maximum=VOCAB_MAX) for i, v in enumerate(value))


def _int_from(minimum: int) -> Callable[[Any, str], int]:
    return lambda value, where: integer(value, where=where, minimum=minimum)


# How run.json's fields are read: a checker per RunConfig field (value, where) -> value.
_RUN_FIELDS: dict[str, Callable[[Any, str], Any]] = {
    "shape": lambda value, where: shape_from_mapping(
        an_object(value, where=where), name="shape", where=where
    ),
    "heads": _heads,
    "tokenizer": lambda value, where: text(value, where=where, empty=False),
    "corpus": _corpus,
    **dict.fromkeys(("steps", "seq_len", "batch", "eval_tokens"), _int_from(1)),
    **dict.fromkeys(("warmup", "checkpoint_every", "seed"), _int_from(0)),
    **dict.fromkeys(
        ("lr", "min_lr_ratio", "weight_decay", "clip", "b1", "b2"),
        lambda value, where: number(value, where=where),
    ),
    "tie_embeddings": lambda value, where: boolean(value, where=where),
    "init_from": lambda value, where: None if value is None else text(value, where=where),
    "eval_bytes": lambda value, where: (
        None if value is None else integer(value, where=where, minimum=1)
    ),  # fmt: skip
    "heads_kind": lambda value, where: one_of(value, HEADS_KINDS, where=where),
    "align_weight": lambda value, where: number(value, where=where),
    "compute_dtype": lambda value, where: one_of(value, ("f32", "bf16"), where=where),
    "impl": lambda value, where: one_of(value, ("auto", "xla", "chunked", "pallas"), where=where),
}
_RUN_REQUIRED = tuple(
    f.name
    for f in dataclasses.fields(RunConfig)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
)


def _show(value: Any) -> str:
    if isinstance(value, ModelShape):
        return value.name
    return json.dumps(dataclasses.asdict(value)) if dataclasses.is_dataclass(value) else repr(value)


def write_run(run_dir: str | Path, config: RunConfig) -> Path:
    return atomic_write_json(Path(run_dir) / RUN_FILE, config.to_json())


def read_run(run_dir: str | Path) -> RunConfig:
    path = Path(run_dir) / RUN_FILE
    return RunConfig.from_json(load_json(path, RUN_KIND), where=str(path))


def source_run(run_dir: str | Path) -> RunConfig:
    """The configuration of the run ``init_from`` names."""
    if not (Path(run_dir) / RUN_FILE).is_file():
        raise UserError(
            f"{{init_from}} {run_dir} holds no {RUN_FILE}: give a run directory written by train",
            settings=["init_from"],
        )
    return read_run(run_dir)
