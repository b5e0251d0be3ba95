"""Dispatch to the Pallas kernels of ``pallas_kernels/``: which kernel a decode runs and the
tile dataclass a dict of ``blocks`` (a profile row's, or a caller's) becomes.

The kernel modules are imported on first use: Pallas is slow to import.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any

from vocabjax.errors import UserError

# Above this batch the decode is compute-bound on every datasheet profile (ridge points 100-300
# FLOP/byte at bf16 mean B ~ 2 x ridge): the tiled kernel, which reuses W tiles across B, wins.
TILED_MIN_BATCH = 64


def module(name: str):
    """A kernel module of pallas_kernels/, imported on first use (Pallas is slow to import)."""
    return importlib.import_module(f"pallas_kernels.{name}")


def decode_kernel(batch: int, vocab: int, d_model: int, dtype: str, blocks: Any):
    """(kernel function, blocks instance): fused decode for small B, tiled for large B."""
    fused = module("fused_decode")
    tiled = module("tiled_decode")
    if isinstance(blocks, fused.DecodeBlocks):
        return fused.fused_decode, blocks
    if isinstance(blocks, tiled.TiledBlocks):
        return tiled.tiled_decode, blocks
    if isinstance(blocks, Mapping):
        blocks = dict(blocks)
        # Profile rows say which kernel their blocks belong to ("tiled": 0 or 1); a dict
        # without the key goes by batch size, as the default does.
        if blocks.pop("tiled", int(batch > TILED_MIN_BATCH)):
            return tiled.tiled_decode, (tiles(tiled.TiledBlocks, blocks) if blocks else None)
        return fused.fused_decode, (tiles(fused.DecodeBlocks, blocks) if blocks else None)
    if blocks is not None:
        raise UserError(f"impl='pallas' takes DecodeBlocks, TiledBlocks or a dict, got {blocks!r}")
    if batch > TILED_MIN_BATCH:
        return tiled.tiled_decode, None
    return fused.fused_decode, None


def tiles(cls: type, blocks: Mapping[str, Any]) -> Any:
    """A Pallas tile dataclass from a dict (a profile row's ``blocks``, or a caller's): a name
    the class lacks or a size it refuses is one UserError, not a TypeError from ``cls(**d)``."""
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(blocks) - set(fields))
    if unknown:
        raise UserError(
            f"impl='pallas' blocks {dict(blocks)} name {', '.join(map(str, unknown))}, which "
            f"{cls.__name__} lacks (it takes {', '.join(fields)})"
        )
    wrong = [k for k, v in blocks.items() if isinstance(v, bool) or not isinstance(v, int)]
    if wrong:
        raise UserError(f"impl='pallas' blocks {dict(blocks)}: {wrong[0]} must be an integer")
    try:
        return cls(**blocks)
    except ValueError as exc:  # the class's own checks (powers of two)
        raise UserError(f"impl='pallas' {cls.__name__}: {exc}") from None
