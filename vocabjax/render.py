"""Rendering of result rows as table, JSON, CSV or Markdown (the ``--format`` of every command)."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

Format = Literal["table", "json", "csv", "markdown"]
FORMATS: tuple[str, ...] = ("table", "json", "csv", "markdown")


def human_size(n: int) -> str:
    """8192 -> '8k', 65536 -> '64k', 262144 -> '256k', 1048576 -> '1m', 50257 -> '50257'."""
    n = int(n)
    for div, suffix in ((1024**2, "m"), (1024, "k")):
        if n >= div and n % div == 0:
            return f"{n // div}{suffix}"
    return str(n)


def approx_size(n: int) -> str:
    """``human_size`` where exact, else three digits: 46336 -> '45.2k', 1400000 -> '1.34m'."""
    n = int(n)
    exact = human_size(n)
    if exact != str(n) or n < 1024:
        return exact
    div, suffix = (1024**2, "m") if n >= 1024**2 else (1024, "k")
    return f"{n / div:.3g}{suffix}"


def v_star_cell(row: Mapping[str, Any], *, share: float | None = None) -> str:
    """A sweep row's V* as ``64k [45.2k..123k]*``: V*, its band, * where B was capped at what
    fits (! where B does not fit and was not capped), and the ensemble's ``share`` if given."""
    if row["v_star"] is None:
        return "-"
    mark = "*" if row["batch_capped"] else "" if row["fits"] else "!"
    cell = (
        f"{approx_size(row['v_star'])} [{approx_size(row['v_low'])}..{approx_size(row['v_high'])}]"
    )
    return cell + mark + ("" if share is None else f" {100 * share:.0f}%")


def fmt_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value == 0:
            return "0"
        if abs(value) >= 1e5 or abs(value) < 1e-3:
            return f"{value:.3e}"
        return f"{value:.4g}"
    return str(value)


def _columns(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None) -> list[str]:
    if columns is not None:
        return list(columns)
    seen: dict[str, None] = {}
    for row in rows:
        seen.update(dict.fromkeys(row))
    return list(seen)


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A plain text table with right-aligned numbers."""
    cols = _columns(rows, columns)
    cells = [[fmt_value(r.get(c)) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def markdown(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    cols = _columns(rows, columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---:" for _ in cols) + "|"]
    lines += ["| " + " | ".join(fmt_value(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def csv_text(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    cols = _columns(rows, columns)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({c: row.get(c) for c in cols})
    return buf.getvalue().rstrip("\n")


def json_text(obj: Any) -> str:
    return json.dumps(obj, indent=2, allow_nan=False)


def rows(rows_: Sequence[Mapping[str, Any]], fmt: str, columns: Sequence[str] | None = None) -> str:
    """Render rows in a non-JSON format."""
    if fmt == "table":
        return table(rows_, columns)
    if fmt == "markdown":
        return markdown(rows_, columns)
    if fmt == "csv":
        return csv_text(rows_, columns)
    raise ValueError(f"unknown format {fmt!r}")


def pivot(
    rows_: Sequence[Mapping[str, Any]],
    *,
    index: str,
    columns: str,
    value: str,
    index_label: str | None = None,
    column_label=lambda c: str(c),
    cell=lambda v: v,
) -> list[dict[str, Any]]:
    """Reshape long rows into one row per ``index`` value, one column per ``columns`` value."""
    col_values = list(dict.fromkeys(r[columns] for r in rows_))
    out: dict[Any, dict[str, Any]] = {}
    for r in rows_:
        row = out.setdefault(r[index], {index_label or index: r[index]})
        row[column_label(r[columns])] = cell(r[value])
    for row in out.values():
        for c in col_values:
            row.setdefault(column_label(c), None)
    return list(out.values())
