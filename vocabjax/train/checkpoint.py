"""Checkpoints: the parameters, the optimizer state and where the data order stands, written as
one directory (``state.npz`` + ``meta.json``) built beside the old one and swapped in by rename,
so a run killed midway leaves the previous checkpoint whole."""

from __future__ import annotations

import dataclasses
import zipfile
from pathlib import Path
from typing import Any

import jax
import numpy as np

from vocabjax.errors import UserError
from vocabjax.outputs import atomic_directory, atomic_write_json, save_npz
from vocabjax.profiles import SCHEMA, a_list, integer, load_json, number, require

CHECKPOINT = "checkpoint"
STATE = "state.npz"
META = "meta.json"
META_KIND = "checkpoint"


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    step: int  # optimizer steps done
    params: dict[str, np.ndarray]
    opt_leaves: list[np.ndarray]  # jax.tree.leaves of the optimizer state
    meta: dict[str, Any]  # step, seed, windows consumed per head, recent losses, ...


def save_checkpoint(run_dir: str | Path, step: int, params, opt_state, meta: dict) -> Path:
    """Write ``run_dir/checkpoint`` atomically (a temporary sibling renamed into place)."""
    arrays = {f"param:{k}": np.asarray(v) for k, v in params.items()}
    for i, leaf in enumerate(jax.tree.leaves(opt_state)):
        arrays[f"opt:{i:06d}"] = np.asarray(leaf)
    path = Path(run_dir) / CHECKPOINT
    with atomic_directory(path) as tmp:
        save_npz(tmp / STATE, arrays)
        atomic_write_json(tmp / META, {"schema": SCHEMA, "kind": META_KIND, **meta, "step": step})
    return path


def checkpoint_dir(run_dir: str | Path) -> Path | None:
    """The checkpoint directory, or the previous one a kill left between the two renames."""
    run_dir = Path(run_dir)
    for name in (CHECKPOINT, f".{CHECKPOINT}.old"):
        if (run_dir / name / META).is_file() and (run_dir / name / STATE).is_file():
            return run_dir / name
    return None


def load_checkpoint(run_dir: str | Path) -> Checkpoint | None:
    """The run's checkpoint, or None when it has none yet."""
    path = checkpoint_dir(run_dir)
    if path is None:
        return None
    meta = read_meta(path / META)
    try:
        # Our own file handle: np.load leaks its own when the zip directory is unreadable.
        with open(path / STATE, "rb") as f, np.load(f) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # truncated, overwritten
        raise UserError(f"{path / STATE} is not a readable checkpoint ({exc})") from None
    params = {k.removeprefix("param:"): v for k, v in arrays.items() if k.startswith("param:")}
    opt = [arrays[k] for k in sorted(k for k in arrays if k.startswith("opt:"))]
    return Checkpoint(step=meta["step"], params=params, opt_leaves=opt, meta=meta)


def read_meta(path: Path) -> dict[str, Any]:
    """``meta.json``: ``step`` (required) and the fields ``train`` writes, each checked for its
    type; other fields are kept unread (open: a later trainer may record more)."""
    meta = load_json(path, META_KIND)
    where = str(path)
    require(meta, ("step",), where=where)
    integer(meta["step"], where=f"{where}: step", minimum=0)
    for key in ("seed", "windows_used"):
        if key in meta:
            integer(meta[key], where=f"{where}: {key}", minimum=0)
    for key in ("windows_per_epoch", "train_tokens"):
        if key in meta:
            for i, v in enumerate(a_list(meta[key], where=f"{where}: {key}")):
                integer(v, where=f"{where}: {key}[{i}]", minimum=0)
    widths = set()  # recent_losses: the last steps' losses, one list per step of one per head
    for i, step in enumerate(
        a_list(meta.get("recent_losses", []), where=f"{where}: recent_losses")
    ):
        at = f"{where}: recent_losses[{i}]"
        widths.add(len(a_list(step, where=at)))
        for j, v in enumerate(step):
            number(v, where=f"{at}[{j}]")
    if len(widths) > 1:
        raise UserError(f"{where}: recent_losses holds steps with different numbers of heads")
    return meta


def restore_params(checkpoint: Checkpoint, params_like: dict, *, where: str) -> dict:
    """The parameters of a checkpoint as jax arrays, checked against ``params_like`` (arrays or
    ``jax.ShapeDtypeStruct``s by name, e.g. of ``nnx.eval_shape``); a checkpoint that does not
    fit the model is one UserError. For serving, which needs no optimizer state."""
    if set(checkpoint.params) != set(params_like):
        raise UserError(f"{where}: the checkpoint's parameters do not match run.json's model")
    for k, like in params_like.items():
        if checkpoint.params[k].shape != like.shape:
            raise UserError(
                f"{where}: parameter {k} has shape {checkpoint.params[k].shape}, the model "
                f"{tuple(like.shape)}"
            )
    return {k: jax.numpy.asarray(checkpoint.params[k]) for k in params_like}


def restore(checkpoint: Checkpoint, params_like: dict, opt_like, *, where: str):
    """(params, opt_state) from a checkpoint, shaped like a fresh model's; a checkpoint that
    does not fit this run's model is one UserError."""
    params = restore_params(checkpoint, params_like, where=where)
    leaves, treedef = jax.tree.flatten(opt_like)
    if len(leaves) != len(checkpoint.opt_leaves) or any(
        np.shape(a) != np.shape(b) for a, b in zip(leaves, checkpoint.opt_leaves, strict=True)
    ):
        raise UserError(f"{where}: the checkpoint's optimizer state does not match this run")
    opt_state = jax.tree.unflatten(
        treedef,
        [
            jax.numpy.asarray(v, dtype=np.asarray(like).dtype)
            for v, like in zip(checkpoint.opt_leaves, leaves, strict=True)
        ],
    )
    return params, opt_state
