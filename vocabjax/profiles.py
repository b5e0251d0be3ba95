"""JSON profiles: the schema version and reading with one-line errors.

Every file vocabjax writes (device, compression and training profiles, policies, tokenizer
manifests, checkpoints' metadata) carries ``"schema": 1`` and a ``"kind"``; the writing itself
lives in ``vocabjax.outputs``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from vocabjax.errors import UserError
from vocabjax.outputs import SCHEMA

__all__ = ["SCHEMA", "check_profile", "load_json", "positive_number", "require", "vocab_points"]


def load_json(path: str | os.PathLike, kind: str) -> dict[str, Any]:
    """Read a profile of the given ``kind``; any problem is one ``UserError`` line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{kind} profile {str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{kind} profile {str(path)!r} is not valid JSON ({exc})") from None
    return check_profile(data, kind, where=str(path))


def check_profile(data: Any, kind: str, *, where: str) -> dict[str, Any]:
    """Check ``schema`` and ``kind`` of an already parsed profile."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: a {kind} profile must be a JSON object")
    if data.get("schema") != SCHEMA:
        raise UserError(
            f"{where}: schema {data.get('schema')!r} is not supported (vocabjax reads {SCHEMA})"
        )
    if data.get("kind") != kind:
        raise UserError(f"{where}: expected a {kind!r} profile, found kind {data.get('kind')!r}")
    return data


def require(data: Mapping[str, Any], fields: Iterable[str], *, where: str) -> None:
    """Fail with the names of the missing fields."""
    missing = [f for f in fields if f not in data]
    if missing:
        raise UserError(f"{where}: missing field(s) {', '.join(missing)}")


def positive_number(value: Any, *, where: str, allow_zero: bool = False) -> float:
    """A finite number > 0 (or >= 0), else one UserError naming the field."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"{where} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise UserError(f"{where} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return value


def vocab_points(data: Mapping[str, Any], fields: Iterable[str] = (), *, where: str):
    """The ``points`` list of a per-vocabulary profile: non-empty objects, each with a positive
    integer ``vocab`` and the given fields. Yields ``(where_of_point, point)``."""
    require(data, ("points",), where=where)
    points = data["points"]
    if not isinstance(points, list) or not points:
        raise UserError(f"{where}: points must be a non-empty list")
    for i, p in enumerate(points):
        at = f"{where}: points[{i}]"
        if not isinstance(p, Mapping):
            raise UserError(f"{at} must be an object")
        require(p, ("vocab", *fields), where=at)
        v = p["vocab"]
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise UserError(f"{at}.vocab must be a positive integer")
        yield at, p
