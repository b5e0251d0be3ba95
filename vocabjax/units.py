"""Parsing of the sizes and lists the command line accepts (``8k``, ``65536``, ``262k``, ``1m``),
and the range each kind of number may take.

Every parser takes keyword bounds and says them when a value falls outside:
``vocab 1 is out of range 2..2147483647``. Sizes are parsed exactly (integers, fractions), so a
number of any length is one UserError line, never an overflow.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from vocabjax.errors import UserError

# The bounds of each kind of number the command line takes, as (minimum, maximum).
SIZE_MAX = 2**63 - 1  # any size: the widest integer numpy and jax arrays hold (int64)
VOCAB_RANGE = (2, 2**31 - 1)  # ids are int32 (training windows, decode); 1 token says nothing
BATCH_RANGE = (1, 2**24)  # batches enter the cost grids as float32, exact up to 2**24
TOKENS_RANGE = (1, 2**31 - 1)  # token counts and positions are int32
STEPS_RANGE = (1, 2**31 - 1)  # optax counts optimizer steps in int32
BYTES_MAX = 2**50  # 1 PiB: past any corpus or sequence, and far inside float32 cost terms
BYTES_RANGE = (1, BYTES_MAX)
D_MODEL_RANGE = (1, 2**16)  # 8x the widest preset (llama-70b, 8192)
LAM_MAX = 1e12  # lambda = bytes served / bytes trained; lam * c_infer stays far inside float32

_SUFFIX = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
_SIZE_RE = re.compile(r"^\s*([0-9]+)(?:\.([0-9]+))?\s*([kmg]?)\s*$", re.IGNORECASE)
# More digits than any size in range has (SIZE_MAX has 19); longer numbers are not converted.
_MAX_DIGITS = 30
# Vocabulary sizes are quoted loosely: "65k" means 65,536 and "262k" means 262,144. A size written
# with a suffix that lands within this fraction of a power of two is taken as that power of two.
_SNAP = Fraction(3, 100)


def quote_input(text: object) -> str:
    """The user's text as a message quotes it: long inputs by their head and length."""
    text = str(text)
    if len(text) <= 40:
        return repr(text)
    return f"{text[:16]!r}... ({len(text)} characters)"


def _shown_int(digits: str) -> str:
    return digits if len(digits) <= 24 else f"{digits[:6]}...({len(digits)} digits)"


def _int_text(value: int) -> str:
    # str() of an int over 4300 digits raises (CPython's int_max_str_digits): say its size
    if value.bit_length() > 256:
        return f"<an integer of {value.bit_length()} bits>"
    return _shown_int(str(value))


def _shown_float(x: float) -> str:
    """``1e+12`` where that is exact, else every digit (``1125899906842624``)."""
    short = f"{x:g}"
    if float(short) == x or not float(x).is_integer():
        return short
    return str(int(x))


def _check_bounds(minimum: float, maximum: float) -> None:
    if not minimum <= maximum:
        raise ValueError(f"bounds {minimum=} > {maximum=}")


def _snap(raw: Fraction) -> int:
    """A suffixed size: the power of two within 3% of it, else the nearest integer."""
    if raw <= 0:
        return 0
    exponent = round(math.log2(raw))  # raw < 10**30 * 2**30, so log2 is finite
    if exponent >= 0:
        p2 = 2**exponent
        if abs(raw - p2) <= _SNAP * p2:
            return p2
    return round(raw)


def parse_size(
    text: str | int, *, what: str = "size", minimum: int = 1, maximum: int = SIZE_MAX
) -> int:
    """``"8k"`` -> 8192, ``"65k"`` -> 65536, ``"1m"`` -> 1048576, ``"50257"`` -> 50257.

    ``k``/``m``/``g`` are binary multiples; a suffixed value within 3% of a power of two snaps to
    it (as vocabulary sizes are usually quoted); a plain integer is taken exactly. The value must
    lie in ``minimum..maximum`` (inclusive; sizes are positive, so ``minimum >= 1``).
    """
    _check_bounds(minimum, maximum)
    if minimum < 1:
        raise ValueError(f"sizes are positive: {minimum=} must be >= 1")
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE_RE.match(str(text))
        if not match:
            raise UserError(
                f"{what} {quote_input(text)} is not a size (examples: 8k, 65536, 262k, 1m)"
            )
        whole, frac, suffix = match.groups()
        whole, frac = whole.lstrip("0") or "0", (frac or "").rstrip("0")
        if not suffix and frac:
            raise UserError(f"{what} {quote_input(text)} must be a whole number")
        if len(whole) > _MAX_DIGITS:
            raise UserError(
                f"{what} {_shown_int(whole)}{suffix} is out of range {minimum}..{maximum}"
            )
        if len(frac) > _MAX_DIGITS:
            raise UserError(
                f"{what} {quote_input(text)} has more than {_MAX_DIGITS} decimal places"
            )
        if suffix:
            raw = Fraction(int(whole + frac), 10 ** len(frac)) * _SUFFIX[suffix.lower()]
            value = _snap(raw)
        else:
            value = int(whole)
    if value <= 0:
        got = quote_input(text) if isinstance(text, str) else _int_text(value)
        raise UserError(f"{what} must be positive, got {got}")
    if not minimum <= value <= maximum:
        raise UserError(f"{what} {_int_text(value)} is out of range {minimum}..{maximum}")
    return value


def parse_size_list(
    text: str, *, what: str = "size", minimum: int = 1, maximum: int = SIZE_MAX
) -> list[int]:
    """``"8k,32k,262k"`` -> ``[8192, 32768, 262144]`` (order kept, duplicates dropped); every
    item in ``minimum..maximum``."""
    items = [t for t in str(text).split(",") if t.strip()]
    if not items:
        raise UserError(f"{what} list {quote_input(text)} is empty")
    sizes = (parse_size(t, what=what, minimum=minimum, maximum=maximum) for t in items)
    return list(dict.fromkeys(sizes))


def parse_float(
    text: str | float, *, what: str, minimum: float = 0.0, maximum: float = math.inf
) -> float:
    """``"1e3"`` -> 1000.0; NaN, infinities and values outside ``minimum..maximum`` fail."""
    _check_bounds(minimum, maximum)
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise UserError(f"{what} {quote_input(text)} is not a number") from None
    if not math.isfinite(value):
        raise UserError(f"{what} must be finite, got {quote_input(text)}")
    if value < minimum:
        raise UserError(f"{what} must be >= {_shown_float(minimum)}, got {quote_input(text)}")
    if value > maximum:
        raise UserError(f"{what} must be <= {_shown_float(maximum)}, got {quote_input(text)}")
    return value


def parse_float_list(
    text: str, *, what: str, minimum: float = 0.0, maximum: float = math.inf
) -> list[float]:
    """``"0,1,10"`` -> ``[0.0, 1.0, 10.0]``; each item as :func:`parse_float` takes it."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise UserError(f"{what} list {quote_input(text)} is empty")
    values = (parse_float(t, what=what, minimum=minimum, maximum=maximum) for t in items)
    return list(dict.fromkeys(values))
