"""Byte sizes at the edges: parsing "1.5GiB"-style strings and formatting sizes for people."""

from __future__ import annotations

import pytest

from remat import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("4096", 4096),
        ("1.5GiB", 3 * 2**29),
        ("512 MiB", 512 * 2**20),
        (" 2GB ", 2 * 10**9),
        ("10kb", 10_000),
        ("10KiB", 10_240),
        ("3k", 3 * 1024),
        ("1M", 2**20),
        ("2g", 2 * 2**30),
        ("1TiB", 2**40),
        ("1e3", 1000),
        ("1.5e3 B", 1500),
        (".5KiB", 512),
        (1536.9, 1536),
    ],
)
def test_parse(text: int | float | str, expected: int) -> None:
    assert parse_bytes(text) == expected
    assert isinstance(parse_bytes(text), int)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (-1, ValueError, "cannot be negative"),
        (-0.5, ValueError, "cannot be negative"),
        (True, TypeError, "not a bool"),
        (None, TypeError, "got NoneType"),
        ("1.5 GiBs", ValueError, "unknown size unit 'gibs'"),
        ("lots", ValueError, "cannot read 'lots' as a size"),
        ("-1GiB", ValueError, "cannot read"),
        ("", ValueError, "cannot read"),
    ],
)
def test_parse_errors(value: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        parse_bytes(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (None, "n/a"),
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (3 * 2**20, "3.00 MiB"),
        (3 * 2**29, "1.50 GiB"),
        (5 * 2**40, "5120.00 GiB"),
        (-2048, "-2.00 KiB"),
        (12.7, "12 B"),
    ],
)
def test_format(n: float | None, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize("n", [1, 999, 4096, 123_456, 7 * 2**20 + 5, 3 * 2**30 + 17])
def test_format_then_parse_is_within_rounding(n: int) -> None:
    back = parse_bytes(format_bytes(n).replace(" ", ""))
    assert abs(back - n) <= 0.005 * n + 1
