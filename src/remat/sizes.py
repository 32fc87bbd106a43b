"""Byte sizes at the edges of the library: parsing "1.5GiB"-style strings and printing sizes for people.

Inside remat every memory figure is an ``int`` number of bytes; this module is the only place that converts.
"""

from __future__ import annotations

import re

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Return ``value`` as a whole number of bytes.

    Accepts an int (bytes), or a string such as ``"1.5GiB"``, ``"512 MiB"``, ``"2GB"`` or ``"4096"``.
    """
    if isinstance(value, bool):
        raise TypeError("a size must be a number of bytes or a string like '1.5GiB', not a bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return value
    if isinstance(value, float):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return int(value)
    if not isinstance(value, str):
        raise TypeError(f"a size must be an int or a string like '1.5GiB', got {type(value).__name__}")
    match = _PATTERN.match(value)
    if not match:
        raise ValueError(f"cannot read {value!r} as a size; write bytes or a string like '1.5GiB' or '512MiB'")
    number, unit = match.groups()
    unit = unit.lower() or "b"
    if unit not in _UNITS:
        known = ", ".join(["B", "KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB"])
        raise ValueError(f"unknown size unit {unit!r} in {value!r}; use one of {known}")
    return int(float(number) * _UNITS[unit])


def format_bytes(n: float | int | None) -> str:
    """Human-readable size with binary units, e.g. ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{int(n)} B"
