"""Byte sizes and budgets at the edges of the library: parsing "1.5GiB"-style strings, reading memory budgets
(bytes or a fraction of a reference), and printing sizes for people.

Inside remat every memory figure is an ``int`` number of bytes; this module is the only place that converts.
Every entry point that takes a budget (:func:`remat.plan`, :class:`remat.PGAC`, :class:`remat.DTR`, the
integrations, the command line and the bench) reads it with :func:`normalize_budget` or :func:`parse_budget`,
so one value means the same everywhere:

* an ``int`` (or a string of a whole number above 1, like ``"4096"`` or ``"1e9"``) is bytes;
* a string with a unit, like ``"1.5GiB"`` or ``"512 MiB"``, is bytes;
* a ``float`` in (0, 1], a number string in (0, 1] (``"0.5"``, ``"1"``) or a percentage (``"50%"``) is a
  fraction of the reference: the activation memory of the step without checkpointing;
* ``None`` is no budget.

Rejected, with a message that says what to write instead: bools, NaN and infinities, zero and negative
values, floats and percentages above 1 (100%), and number strings above 1 that are not whole (``"1.5"`` is
neither a fraction nor a byte count).
"""

from __future__ import annotations

import math
import numbers
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
        if not math.isfinite(value):
            raise ValueError(f"a size must be a finite number of bytes, got {value}")
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
    size = float(number) * _UNITS[unit]
    if not math.isfinite(size):
        raise ValueError(f"{value!r} is too large to be a size; write bytes or a string like '1.5GiB'")
    return int(size)


_PLAIN_NUMBER = re.compile(r"^[+-]?([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?|nan|inf|infinity)$", re.IGNORECASE)
_WHAT_TO_WRITE = (
    "give bytes (an int, or a string like '2GiB') or a fraction in (0, 1] of the no-checkpoint activation memory "
    "(a float like 0.5, or a string like '0.5' or '50%')"
)


def normalize_budget(value: int | float | str | None) -> int | float | None:
    """Check a budget and return it in one of two forms: ``int`` bytes or a ``float`` fraction in (0, 1].

    ``None`` stays ``None`` (no budget). Raises ``TypeError`` or ``ValueError`` naming what was wrong and what to
    write instead; the rules are in this module's docstring.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"a budget cannot be a bool ({value}); {_WHAT_TO_WRITE}")
    if isinstance(value, numbers.Integral):
        return _positive_bytes(int(value), value)
    if isinstance(value, numbers.Real):
        return _fraction(float(value), value)
    if not isinstance(value, str):
        raise TypeError(f"a budget cannot be a {type(value).__name__} ({value!r}); {_WHAT_TO_WRITE}")
    text = value.strip()
    if text.endswith("%"):
        number = text[:-1].strip()
        if not _PLAIN_NUMBER.match(number):
            raise ValueError(f"cannot read budget {value!r} as a percentage; write e.g. '50%'")
        percent = float(number)
        if not math.isfinite(percent) or not 0.0 < percent <= 100.0:
            raise ValueError(
                f"budget {value!r}: a percentage of the no-checkpoint activation memory must be in (0%, 100%]; "
                "write a size with a unit (e.g. '1.5GiB') for bytes"
            )
        return percent / 100.0
    if _PLAIN_NUMBER.match(text):
        number = float(text)
        if math.isfinite(number) and number > 1.0:
            if not number.is_integer():
                raise ValueError(
                    f"budget {value!r} is neither bytes nor a fraction: a fraction of the no-checkpoint activation "
                    "memory must be in (0, 1], and bytes are a whole number; write a size with a unit (e.g. "
                    f"'{text}GiB') for bytes"
                )
            return int(number)
        if number < 0.0:
            raise ValueError(f"a budget cannot be negative, got {value!r}; {_WHAT_TO_WRITE}")
        if number == 0.0:
            raise ValueError(f"a budget of {value!r} leaves no room for any activation; {_WHAT_TO_WRITE}")
        return _fraction(number, value)
    return _positive_bytes(parse_bytes(text), value)


def parse_budget(value: int | float | str | None, reference_bytes: int | None = None) -> int | None:
    """A budget in bytes: bytes as given, or a fraction of ``reference_bytes`` (the no-checkpoint activation
    memory). ``None`` stays ``None``. A fraction without a reference raises ``ValueError``."""
    budget = normalize_budget(value)
    if not isinstance(budget, float):
        return budget
    if reference_bytes is None:
        raise ValueError(
            f"budget {value!r} is a fraction of the no-checkpoint activation memory, which is not known here: it "
            "needs a cost table (pass costs=) to resolve it, or give bytes like '2GiB'"
        )
    return int(budget * reference_bytes)


def _positive_bytes(size: int, given: object) -> int:
    if size < 0:
        raise ValueError(f"a budget cannot be negative, got {given!r}; {_WHAT_TO_WRITE}")
    if size == 0:
        raise ValueError(f"a budget of {given!r} leaves no room for any activation; {_WHAT_TO_WRITE}")
    return size


def _fraction(number: float, given: object) -> float:
    if not math.isfinite(number):
        raise ValueError(f"budget {given!r} is not a finite number; {_WHAT_TO_WRITE}")
    if not 0.0 < number <= 1.0:
        raise ValueError(
            f"a fractional budget is a fraction of the no-checkpoint activation memory and must be in (0, 1], got "
            f"{given!r}; give bytes as an int or a string like '2GiB'"
        )
    return number


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


class BudgetError(ValueError):
    """No plan of the requested kind fits the byte budget; ``floor`` is the least peak (bytes) that fits, when
    known."""

    def __init__(self, *args: object, floor: int | None = None) -> None:
        super().__init__(*args)
        self.floor = floor
