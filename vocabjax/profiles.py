"""JSON profiles: the schema version, validation with one-line errors, and atomic writes.

Every file vocabjax writes (device, compression and training profiles, policies, tokenizer
manifests, checkpoints' metadata) carries ``"schema": 1`` and a ``"kind"``. Writes go to a
temporary file in the same directory and are renamed into place, so a run killed midway leaves
the previous file intact and never a half-written one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from vocabjax.errors import UserError

SCHEMA = 1


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``."""
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def _check_finite(obj: Any, where: str) -> None:
    if isinstance(obj, float) and not math.isfinite(obj):
        raise UserError(f"{where}: refusing to write a non-finite number ({obj})")
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _check_finite(v, f"{where}.{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _check_finite(v, f"{where}[{i}]")


def dumps(obj: Mapping[str, Any]) -> str:
    """JSON text of a profile; NaN and infinities are refused rather than written."""
    _check_finite(obj, "profile")
    return json.dumps(obj, indent=2, allow_nan=False) + "\n"


def atomic_write_json(path: str | os.PathLike, obj: Mapping[str, Any]) -> Path:
    """Write a profile dict (which must hold ``schema`` and ``kind``) atomically."""
    if obj.get("schema") != SCHEMA or "kind" not in obj:
        raise ValueError("a profile needs 'schema': 1 and a 'kind'")
    return atomic_write_text(path, dumps(obj))


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, overwrite: bool = True) -> Iterator[Path]:
    """Build a directory in a temporary sibling and move it into place only on success.

    On any exception the temporary directory is removed and ``path`` is untouched.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{path} exists and is not a directory")
    if path.exists() and not overwrite:
        raise UserError(f"{path} already exists")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
