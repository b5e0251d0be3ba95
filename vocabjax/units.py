"""Parsing of the sizes and lists the command line accepts (``8k``, ``65536``, ``262k``, ``1m``)."""

from __future__ import annotations

import math
import re

from vocabjax.errors import UserError

_SUFFIX = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)\s*$", re.IGNORECASE)
# Vocabulary sizes are quoted loosely: "65k" means 65,536 and "262k" means 262,144. A size written
# with a suffix that lands within this fraction of a power of two is taken as that power of two.
_SNAP = 0.03


def parse_size(text: str | int, *, what: str = "size") -> int:
    """``"8k"`` -> 8192, ``"65k"`` -> 65536, ``"1m"`` -> 1048576, ``"50257"`` -> 50257.

    ``k``/``m``/``g`` are binary multiples; a suffixed value within 3% of a power of two snaps to
    it (as vocabulary sizes are usually quoted); a plain integer is taken exactly.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE_RE.match(str(text))
        if not match:
            raise UserError(f"{what} {text!r} is not a size (examples: 8k, 65536, 262k, 1m)")
        number, suffix = float(match.group(1)), match.group(2).lower()
        raw = number * _SUFFIX[suffix]
        if suffix:
            p2 = 2 ** round(math.log2(raw)) if raw > 0 else 0
            value = p2 if p2 and abs(raw - p2) <= _SNAP * p2 else round(raw)
        else:
            if number != int(number):
                raise UserError(f"{what} {text!r} must be a whole number")
            value = int(number)
    if value <= 0:
        raise UserError(f"{what} must be positive, got {text!r}")
    return value


def parse_size_list(text: str, *, what: str = "size") -> list[int]:
    """``"8k,32k,262k"`` -> ``[8192, 32768, 262144]`` (order kept, duplicates dropped)."""
    items = [t for t in str(text).split(",") if t.strip()]
    if not items:
        raise UserError(f"{what} list {text!r} is empty")
    return list(dict.fromkeys(parse_size(t, what=what) for t in items))


def parse_float_list(text: str, *, what: str, minimum: float = 0.0) -> list[float]:
    """``"0,1,10"`` -> ``[0.0, 1.0, 10.0]``; NaN, infinities and values below ``minimum`` fail."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise UserError(f"{what} list {text!r} is empty")
    out = []
    for item in items:
        try:
            value = float(item)
        except ValueError:
            raise UserError(f"{what} {item!r} is not a number") from None
        if not math.isfinite(value):
            raise UserError(f"{what} must be finite, got {item!r}")
        if value < minimum:
            raise UserError(f"{what} must be >= {minimum:g}, got {item!r}")
        out.append(value)
    return list(dict.fromkeys(out))
