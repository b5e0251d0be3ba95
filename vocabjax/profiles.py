"""Reading the files vocabjax reads: one strict JSON/TOML parser, then typed field checks; every
problem is one ``UserError`` line naming the file and the field.

Every file vocabjax writes (device, compression and training profiles, policies, tokenizer
manifests, checkpoints' metadata) carries ``"schema": 1`` and a ``"kind"``; the writing itself
lives in ``vocabjax.outputs``.

The parser (``read_text`` + ``parse_json`` / ``parse_toml``, or ``load_json`` for a profile)
refuses, before any field is looked at:

- a file larger than ``MAX_FILE_BYTES`` (32 MiB), one holding a NUL byte (binary, or UTF-16),
  and one that is not UTF-8 (a leading byte-order mark is dropped);
- arrays and objects nested deeper than ``MAX_DEPTH`` (32; vocabjax's own files nest 4 deep),
  counted on the text before ``json.loads`` recurses into it;
- a key given twice in one object (``json`` would keep the last one without a word);
- ``NaN``, ``Infinity`` and numbers that overflow a float (``1e400``), and integers outside
  64 bits, which no field of any file needs and ``float()`` of which overflows later.

The field helpers take the ``where`` of the field itself (``f"{path}: head_dim"``) and return
the value checked: :func:`an_object`, :func:`a_list`, :func:`closed` (unknown keys, for closed
schemas), :func:`integer`, :func:`number`, :func:`positive_number`, :func:`text`,
:func:`boolean`, :func:`one_of`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import tomllib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vocabjax.errors import UserError
from vocabjax.outputs import SCHEMA, schemas
from vocabjax.units import VOCAB_RANGE

__all__ = [
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "SCHEMA",
    "VOCAB_MAX",
    "a_list",
    "an_object",
    "boolean",
    "check_profile",
    "closed",
    "integer",
    "field_name",
    "load_data",
    "load_json",
    "number",
    "one_of",
    "parse_json",
    "parse_toml",
    "positive_number",
    "read_text",
    "require",
    "show",
    "text",
    "vocab_points",
]

# The largest file read. The biggest a user writes by hand or by a tool is a serving trace
# (JSONL prompts); 32 MiB is 100k prompts of 300 bytes, and parsing it takes about a second.
MAX_FILE_BYTES = 32 * 2**20
MAX_DEPTH = 32  # nesting of arrays/objects; vocabjax's own files nest at most 4 deep
INT_RANGE = (-(2**63), 2**64 - 1)  # any int64 or uint64 (a seed); nothing else needs more
VOCAB_MAX = VOCAB_RANGE[1]  # token ids are int32 (training windows, decode)


# ---- the parser ---------------------------------------------------------------------------------


def read_text(path: str | os.PathLike, *, what: str) -> str:
    """The text of the file at ``path`` (``what`` names it in messages: "device profile 'x'"),
    within ``MAX_FILE_BYTES``, UTF-8, with no NUL byte."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{what} does not exist")
    if not path.is_file():
        raise UserError(f"{what} is not a regular file")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise UserError(f"{what} cannot be read ({exc.strerror or exc})") from None
    if len(data) > MAX_FILE_BYTES:
        raise UserError(
            f"{what} is larger than {MAX_FILE_BYTES >> 20} MiB, the most vocabjax reads"
        )
    nul = data.find(b"\0")
    if nul >= 0:
        raise UserError(f"{what} is not text (a NUL byte at offset {nul}: a binary or UTF-16 file)")
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise UserError(f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def parse_json(text: str, *, where: str, invalid: str = "is not valid JSON") -> Any:
    """``json.loads(text)`` with the refusals of the module doc; a syntax error is
    ``f"{where} {invalid} (...)"``."""
    _check_depth(text, where=where)
    try:
        return json.loads(
            text,
            object_pairs_hook=functools.partial(_object, where=where),
            parse_constant=functools.partial(_constant, where=where),
            parse_float=functools.partial(_float, where=where),
            parse_int=functools.partial(_int, where=where),
        )
    except json.JSONDecodeError as exc:
        raise UserError(f"{where} {invalid} ({exc})") from None
    except RecursionError:  # not reached after _check_depth; kept so that none can escape
        raise UserError(_too_deep(where)) from None


def parse_toml(text: str, *, where: str, invalid: str = "is not valid TOML") -> dict[str, Any]:
    """``tomllib.loads(text)`` with the refusals of the module doc (TOML refuses repeated keys
    itself)."""
    try:
        data = tomllib.loads(text, parse_float=functools.partial(_float, where=where))
    except UserError:
        raise
    except ValueError as exc:  # TOMLDecodeError, or int() of a literal of over 4,300 digits
        raise UserError(f"{where} {invalid} ({_cut(str(exc), 100)})") from None
    except RecursionError:  # tomllib recurses into nested inline arrays and tables
        raise UserError(_too_deep(where)) from None
    stack = [(data, 1)]
    while stack:  # depth and integer range of what tomllib built (it has no hooks for them)
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > MAX_DEPTH:
                raise UserError(_too_deep(where))
            items = value.values() if isinstance(value, dict) else value
            stack.extend((v, depth + 1) for v in items)
        elif isinstance(value, int) and not INT_RANGE[0] <= value <= INT_RANGE[1]:
            raise UserError(f"{where}: the integer {_cut(str(value))} does not fit in 64 bits")
    return data


def load_data(path: str | os.PathLike, *, what: str, invalid: str | None = None) -> Any:
    """A ``.toml`` file by ``parse_toml``, any other by ``parse_json``."""
    text_ = read_text(path, what=what)
    if Path(path).suffix.lower() == ".toml":
        return parse_toml(text_, where=what, invalid=invalid or "is not valid TOML")
    return parse_json(text_, where=what, invalid=invalid or "is not valid JSON")


def load_json(path: str | os.PathLike, kind: str) -> dict[str, Any]:
    """Read a profile of the given ``kind``; any problem is one ``UserError`` line."""
    what = f"{kind} profile {str(path)!r}"
    data = parse_json(read_text(path, what=what), where=what)
    return check_profile(data, kind, where=str(path))


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_OPEN = np.zeros(256, np.int8) - 1  # +1 for "[" and "{", -1 for "]" and "}"
_OPEN[[ord("["), ord("{")]] = 1


def _check_depth(text: str, *, where: str) -> None:
    """Refuse nesting deeper than MAX_DEPTH, counted on the brackets outside strings."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return
    brackets = np.frombuffer(_NOT_BRACKET.sub("", _STRING.sub("", text)).encode(), np.uint8)
    depth = 0
    for start in range(0, len(brackets), 1 << 20):  # bounded temporaries on a 32 MiB file
        running = depth + np.cumsum(_OPEN[brackets[start : start + (1 << 20)]], dtype=np.int64)
        if running.max() > MAX_DEPTH:
            raise UserError(_too_deep(where))
        depth = int(running[-1])


def _too_deep(where: str) -> str:
    return f"{where} nests arrays or objects more than {MAX_DEPTH} deep"


def _object(pairs: list[tuple[str, Any]], *, where: str) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        repeated = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise UserError(f"{where}: key {repeated!r} appears twice in one object")
    return out


def _constant(name: str, *, where: str) -> float:
    raise UserError(f"{where}: {name} is not a number vocabjax reads (numbers must be finite)")


def _float(literal: str, *, where: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise UserError(
            f"{where}: the number {_cut(literal)} overflows a float (numbers must be finite)"
        )
    return value


def _int(literal: str, *, where: str) -> int:
    lo, hi = INT_RANGE
    # The length test first: int() of a 5,000-digit literal is itself an error in Python.
    if len(literal.lstrip("-")) > 20 or not lo <= int(literal) <= hi:
        raise UserError(f"{where}: the integer {_cut(literal)} does not fit in 64 bits")
    return int(literal)


def _cut(literal: str, n: int = 24) -> str:
    return literal if len(literal) <= n else f"{literal[:n]}... ({len(literal)} characters)"


# ---- profiles -----------------------------------------------------------------------------------


def check_profile(data: Any, kind: str, *, where: str) -> dict[str, Any]:
    """Check ``schema`` and ``kind`` of an already parsed profile."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: a {kind} profile must be a JSON object")
    known = schemas(kind)
    if data.get("schema") not in known:
        reads = " or ".join(map(str, known))
        raise UserError(
            f"{where}: schema {show(data.get('schema'))} is not supported (vocabjax reads {reads})"
        )
    if data.get("kind") != kind:
        raise UserError(
            f"{where}: expected a {kind!r} profile, found kind {show(data.get('kind'))}"
        )
    return data


def require(data: Mapping[str, Any], fields: Iterable[str], *, where: str) -> None:
    """Fail with the names of the missing fields."""
    missing = [f for f in fields if f not in data]
    if missing:
        raise UserError(f"{where}: missing field(s) {', '.join(missing)}")


def vocab_points(
    data: Mapping[str, Any], fields: Iterable[str] = (), *, where: str
) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """The ``points`` list of a per-vocabulary profile: non-empty objects, each with an integer
    ``vocab`` in [1, VOCAB_MAX] and the given fields. Yields ``(where_of_point, point)``."""
    require(data, ("points",), where=where)
    points = data["points"]
    if not isinstance(points, list) or not points:
        raise UserError(f"{where}: points must be a non-empty list")
    fields = tuple(fields)
    for i, p in enumerate(points):
        at = f"{where}: points[{i}]"
        an_object(p, where=at)
        require(p, ("vocab", *fields), where=at)
        integer(p["vocab"], where=f"{at}.vocab", maximum=VOCAB_MAX)
        yield at, p


# ---- typed fields -------------------------------------------------------------------------------


def show(value: Any, n: int = 40) -> str:
    """``repr(value)``, cut to ``n`` characters (a field may hold a megabyte of text)."""
    if isinstance(value, list | dict) and len(value) > 8:
        return f"a {'list' if isinstance(value, list) else 'object'} of {len(value)} items"
    r = "null" if value is None else repr(value)
    return r if len(r) <= n else r[: n - 3] + "..."


_PLAIN_KEY = re.compile(r"[\w.+-]{1,40}", re.ASCII)


def field_name(name: Any) -> str:
    """A key as it reads in a message: bare when plain (``head_dim``), else quoted and cut, so a
    key holding a newline or a megabyte cannot break the one-line error."""
    return name if isinstance(name, str) and _PLAIN_KEY.fullmatch(name) else show(name)


def an_object(value: Any, *, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise UserError(f"{where} must be an object, got {show(value)}")
    return value


def a_list(value: Any, *, where: str, nonempty: bool = False) -> Sequence[Any]:
    if not isinstance(value, list) or (nonempty and not value):
        raise UserError(
            f"{where} must be a {'non-empty ' if nonempty else ''}list, got {show(value)}"
        )
    return value


def closed(data: Mapping[str, Any], allowed: Iterable[str], *, where: str) -> None:
    """Refuse keys outside ``allowed``: a misspelt field would otherwise be dropped unread."""
    allowed = tuple(allowed)
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        listed = ", ".join(field_name(k) for k in unknown[:5])
        more = ", ..." if len(unknown) > 5 else ""
        raise UserError(f"{where}: unknown field(s) {listed}{more} (known: {', '.join(allowed)})")


def integer(value: Any, *, where: str, minimum: int = 1, maximum: int | None = None) -> int:
    """An int (not a bool, not 3.0) in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        want = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise UserError(f"{where} must be {want}, got {show(value)}")
    if maximum is not None and value > maximum:
        raise UserError(f"{where} must be at most {maximum}, got {show(value)}")
    return value


def number(value: Any, *, where: str) -> float:
    """A finite int or float (not a bool), as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"{where} must be a number, got {show(value)}")
    try:
        out = float(value)
    except OverflowError:  # an int too large for a float (parse_json refuses these already)
        out = math.inf
    if not math.isfinite(out):
        raise UserError(f"{where} must be a finite number, got {show(value)}")
    return out


def positive_number(
    value: Any, *, where: str, allow_zero: bool = False, maximum: float | None = None
) -> float:
    """A finite number > 0 (or >= 0), at most ``maximum``, else one UserError naming the field."""
    out = number(value, where=where)
    if out < 0 or (out == 0 and not allow_zero):
        raise UserError(f"{where} must be {'>= 0' if allow_zero else '> 0'}, got {show(value)}")
    if maximum is not None and out > maximum:
        bound = int(maximum) if float(maximum).is_integer() else maximum
        raise UserError(
            f"{where} must be in {'[' if allow_zero else '('}0, {bound}], got {show(value)}"
        )
    return out


def text(value: Any, *, where: str, empty: bool = True) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise UserError(f"{where} must be {'' if empty else 'non-empty '}text, got {show(value)}")
    return value


def boolean(value: Any, *, where: str) -> bool:
    if not isinstance(value, bool):
        raise UserError(f"{where} must be true or false, got {show(value)}")
    return value


def one_of(value: Any, choices: Iterable[str], *, where: str) -> str:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise UserError(f"{where} must be one of {', '.join(choices)}, got {show(value)}")
    return value
