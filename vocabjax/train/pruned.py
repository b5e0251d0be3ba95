"""Pruned initialisation (the paper's Improvement 6): a run starts from the parameters of another
run trained at a larger V, its embedding and head rows gathered through a pruned tokenizer's id
map (``w_new = w_old[new_to_old]``) and every other parameter copied, then trains at the small V
(one head, a fresh optimizer state).

    config = RunConfig(shape, heads=(4096,), tokenizer=None, corpus=..., steps=200,
                       init_from="runs/16k")
    train(config, "runs/16k-to-4k")   # prunes runs/16k's tokenizer to 4096 on the train part

With ``tokenizer`` set, it names a directory ``tokenizer prune`` wrote from the source run's
largest level: each pruned token must be the source's token at ``new_to_old``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from vocabjax.errors import UserError
from vocabjax.progress import Progress
from vocabjax.train.checkpoint import load_checkpoint
from vocabjax.train.config import TOKENIZER_DIR, RunConfig, source_run
from vocabjax.train.data import HeadTokenizer, head_tokenizer, specials_of, tokenizers_from_dir
from vocabjax.vocab import IdMap, LoadedTokenizer, Pruned, prune_texts, read_id_map

# Fields a pruned start keeps from its source run: the parameters must fit the same model.
KEPT = ("shape", "seq_len", "tie_embeddings", "compute_dtype")


@dataclasses.dataclass(frozen=True)
class Source:
    """The run a pruned start gathers from."""

    run_dir: Path
    config: RunConfig
    level: HeadTokenizer  # its largest head's level: the token each table row stands for
    params: dict[str, np.ndarray]  # its checkpoint's parameters, by name


def load_source(config: RunConfig) -> Source:
    """The run ``config.init_from`` names, checked against ``config``: the same model, and a
    pruned size no larger than its largest head."""
    run_dir = Path(config.init_from)
    stored = source_run(run_dir)
    vocab = config.heads[0]
    if vocab > stored.max_vocab:
        raise UserError(
            f"{{prune_to}} {vocab} is larger than the largest head of {{init_from}} {run_dir} "
            f"({stored.max_vocab}); pruning only removes tokens",
            settings=["prune_to", "init_from"],
        )
    for name in KEPT:
        ours, theirs = getattr(config, name), getattr(stored, name)
        if ours != theirs:
            show = (lambda x: x.name) if name == "shape" else repr
            raise UserError(
                f"{{{name}}} {show(ours)} differs from {show(theirs)} of {{init_from}} "
                f"{run_dir}; a pruned start keeps the source's model (leave {{{name}}} out)",
                settings=[name, "init_from"],
            )
    checkpoint = load_checkpoint(run_dir)
    if checkpoint is None:
        raise UserError(f"{{init_from}} {run_dir} holds no checkpoint yet", settings=["init_from"])
    (level,) = tokenizers_from_dir(stored.tokenizer_path(run_dir), [stored.max_vocab])
    return Source(run_dir, stored, level, checkpoint.params)


def prune_source(
    source: Source, texts: Iterable[str], vocab: int, *, corpus: str, progress: Progress
) -> tuple[Pruned, dict[str, Any], HeadTokenizer]:
    """The source's largest level pruned to ``vocab`` tokens by their use on ``texts``: the
    pruning, its id map's metadata, and the pruned level as a head."""
    name = f"{source.run_dir / TOKENIZER_DIR} level {source.config.max_vocab}"
    loaded = LoadedTokenizer(source.level.tokenizer, path=name, kind="hf")
    progress(f"pruning {name} to {vocab} tokens by their use on {corpus}")
    pruned, meta = prune_texts(loaded, texts, vocab, corpus=corpus)
    head = head_tokenizer(pruned.data, specials_of(pruned.data), where=f"pruned {name}")
    return pruned, meta, head


def check_pruned(source: Source, head: HeadTokenizer, tokenizer_dir: Path) -> IdMap:
    """The id map of a pruned tokenizer directory, checked to come from the source's level:
    the same size of source, and each pruned token the source's token at ``new_to_old``."""
    id_map = read_id_map(tokenizer_dir)
    mismatch = None
    if id_map.source_vocab != source.config.max_vocab:
        mismatch = (
            f"it was pruned from {id_map.source_vocab} tokens, the run's largest head has "
            f"{source.config.max_vocab}"
        )
    else:
        theirs, ours = source.level.tokenizer, head.tokenizer
        for new, old in enumerate(id_map.new_to_old):
            if ours.id_to_token(new) != theirs.id_to_token(old):
                mismatch = (
                    f"its token {new} is {ours.id_to_token(new)!r}, the run's token {old} "
                    f"{theirs.id_to_token(old)!r}"
                )
                break
    if mismatch:
        raise UserError(
            f"{{init_from}} {source.run_dir}: its tokenizer is not the source of the pruned "
            f"tokenizer {{tokenizer}} {tokenizer_dir} ({mismatch})",
            settings=["init_from", "tokenizer"],
        )
    return id_map


def head_name(config: RunConfig, index: int) -> str:
    """The parameter that holds head ``index``'s rows: W (or the embedding, tied) for nested
    heads, that head's own matrix for separate ones."""
    if config.heads_kind == "separate":
        return f"heads.{index}.value"
    return "embed.value" if config.tie_embeddings else "unembed.value"


def vocab_tables(config: RunConfig, source: RunConfig) -> dict[str, str]:
    """This run's parameters whose rows stand for token ids, each with the source's parameter
    its rows are gathered from: the embedding, and the head (the source's largest)."""
    return {
        "embed.value": "embed.value",
        head_name(config, 0): head_name(source, len(source.heads) - 1),
    }


def gather(
    source: Source, config: RunConfig, params_like: dict[str, Any], new_to_old: Iterable[int]
) -> dict[str, jnp.ndarray]:
    """``params_like``'s parameters taken from the source: the token tables' rows gathered by
    ``new_to_old``, every other parameter copied."""
    rows = np.asarray(list(new_to_old), dtype=np.int64)
    tables = vocab_tables(config, source.config)
    out = {}
    for name, like in params_like.items():
        value = source.params[tables.get(name, name)]
        value = value[rows] if name in tables else value
        if value.shape != tuple(like.shape):
            raise UserError(
                f"{{init_from}} {source.run_dir}: parameter {name} has shape {value.shape}, "
                f"this run's model {tuple(like.shape)}",
                settings=["init_from"],
            )
        out[name] = jnp.asarray(value, dtype=like.dtype)
    return out
