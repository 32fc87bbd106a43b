"""How numbers appear in the report and the claims table: means that skip missing values, milliseconds, signed
percentages, p-values and table cells (``n/a`` for what was not measured)."""

from __future__ import annotations

from typing import Any

from ..core import format_bytes


def mean_of(values: Any) -> float | None:
    data = [float(v) for v in values if v is not None]
    return sum(data) / len(data) if data else None


def to_ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds (None stays None)."""
    return None if seconds is None else seconds * 1e3


def fmt_ms(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value * 1e3:.{digits}f}"


def fmt_pct(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value * 100:+.{digits}f}%"


def fmt_p(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2g}" if value >= 1e-4 else "<1e-4"


def p_text(value: float | None) -> str:
    """``"p = 0.03"`` or ``"p < 1e-4"``."""
    if value is not None and value < 1e-4:
        return "p < 1e-4"
    return f"p = {fmt_p(value)}"


def cell(value: Any, kind: str = "") -> str:
    """One table cell: ``kind`` is "bytes", "ms", "pct", "bool" or "" (floats to 4 significant digits)."""
    if value is None or value == "":
        return "n/a"
    if kind == "bytes":
        return format_bytes(value)
    if kind == "ms":
        return f"{value:.2f}"
    if kind == "pct":
        return f"{value:.1%}"
    if kind == "bool":
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
