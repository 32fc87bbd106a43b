"""One reading of a memory budget everywhere: bytes or a fraction of the no-checkpoint activation memory.

The rules live in :mod:`remat.core.sizes`; these tests pin them and check that every entry point (remat.plan, PGAC,
DTR, the integrations' sessions, the bench) gives the same value the same meaning and rejects the same
mistakes before any work is done.
"""

from __future__ import annotations

import math

import pytest
import torch

import remat
from remat.bench.budget import parse_budget as bench_budget
from remat.bench.config import BenchError
from remat.core import normalize_budget, parse_budget, parse_bytes
from remat.integrations.lightning import RematCallback
from remat.integrations.session import check_strategy
from remat.planning import no_checkpoint_peak


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("1e9", 10**9),
        ("2GiB", 2 * 2**30),
        (" 512 MiB ", 512 * 2**20),
        (0.5, 0.5),
        (1.0, 1.0),
        ("0.5", 0.5),
        (".25", 0.25),
        ("1", 1.0),
        ("50%", 0.5),
        ("100 %", 1.0),
        ("12.5%", 0.125),
        (None, None),
    ],
)
def test_budget_forms(value: object, expected: object) -> None:
    got = normalize_budget(value)  # type: ignore[arg-type]
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        (float("nan"), ValueError, "not a finite number"),
        (float("inf"), ValueError, "not a finite number"),
        ("nan", ValueError, "not a finite number"),
        ("inf", ValueError, "not a finite number"),
        ("1e999", ValueError, "not a finite number"),
        (1.5, ValueError, r"must be in \(0, 1\]"),
        (0.0, ValueError, r"must be in \(0, 1\]"),
        (-0.2, ValueError, r"must be in \(0, 1\]"),
        ("1.5", ValueError, "neither bytes nor a fraction"),
        ("150%", ValueError, r"must be in \(0%, 100%\]"),
        ("0%", ValueError, r"must be in \(0%, 100%\]"),
        ("half%", ValueError, "as a percentage"),
        (0, ValueError, "no room for any activation"),
        ("0", ValueError, "no room for any activation"),
        ("0B", ValueError, "no room for any activation"),
        (-5, ValueError, "cannot be negative"),
        ("-1", ValueError, "cannot be negative"),
        ("-0.5", ValueError, "cannot be negative"),
        (True, TypeError, "cannot be a bool"),
        ([1], TypeError, "cannot be a list"),
        ("lots", ValueError, "cannot read 'lots'"),
        ("2 GiBs", ValueError, "unknown size unit"),
    ],
)
def test_budget_mistakes_are_rejected_with_what_to_write(value: object, error: type, words: str) -> None:
    with pytest.raises(error, match=words) as info:
        normalize_budget(value)  # type: ignore[arg-type]
    if "unknown size unit" not in words and "cannot read" not in words and "percentage" not in words:
        assert "GiB" in str(info.value)  # the message says how to write bytes instead


def test_numpy_numbers_are_numbers() -> None:
    np = pytest.importorskip("numpy")
    assert normalize_budget(np.int64(4096)) == 4096
    assert normalize_budget(np.float32(0.25)) == 0.25
    with pytest.raises(ValueError, match="not a finite number"):
        normalize_budget(np.float64("nan"))


def test_parse_budget_resolves_fractions_against_the_reference() -> None:
    assert parse_budget("0.5", reference_bytes=1000) == 500
    assert parse_budget("25%", reference_bytes=1000) == 250
    assert parse_budget(0.125, reference_bytes=1000) == 125
    assert parse_budget("2KiB", reference_bytes=1000) == 2048  # bytes ignore the reference
    assert parse_budget(None) is None
    with pytest.raises(ValueError, match="needs a cost table"):
        parse_budget("0.5")


@pytest.mark.parametrize(("value", "words"), [(float("nan"), "finite"), (float("inf"), "finite"), ("1e999", "large")])
def test_parse_bytes_rejects_non_finite_sizes(value: object, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_bytes(value)  # type: ignore[arg-type]


def _costs(n: int = 4, prefix: str = "b") -> remat.CostTable:
    rows = [
        remat.BlockCost(
            f"{prefix}{i}", 1e-3, 2e-3, 100, 100, {"keep": 1000, "checkpoint": 100}, {"keep": 0.0, "checkpoint": 1e-3}
        )
        for i in range(n)
    ]
    return remat.CostTable(rows)


@pytest.mark.parametrize("same_as_half", ["0.5", "50%", 0.5])
def test_plan_reads_fraction_strings_as_fractions(same_as_half: object) -> None:
    costs = _costs()
    plan = remat.plan(costs, "full", same_as_half)
    assert plan.budget_bytes == no_checkpoint_peak(costs) // 2 > 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "nan", 1.5, "1.5", 0, True])
def test_plan_rejects_bad_budgets(bad: object) -> None:
    with pytest.raises((ValueError, TypeError), match="budget"):
        remat.plan(_costs(), "optimal", bad)


class Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x).square().sum()


@pytest.mark.parametrize(
    ("bad", "words"), [(1.5, r"\(0, 1\]"), (float("nan"), "finite"), ("150%", "100%"), (0, "no room")]
)
def test_pgac_rejects_bad_budgets_before_anything_is_installed(bad: object, words: str) -> None:
    model = Chain()
    with pytest.raises(ValueError, match=words):
        remat.PGAC(model, bad)
    assert getattr(model, "_remat_handle", None) is None and not model._forward_pre_hooks
    pgac = remat.PGAC(model, None)
    with pytest.raises(ValueError, match=words):
        pgac.set_budget(bad)
    pgac.remove()


def test_pgac_reads_a_fraction_string_as_a_fraction() -> None:
    model = Chain()
    costs = _costs(prefix="blocks.")
    pgac = remat.PGAC(model, "0.5", costs=costs)
    assert pgac.budget_bytes == int(0.5 * no_checkpoint_peak(costs)) > 0
    pgac.set_budget("75%")
    assert pgac.budget_bytes == int(0.75 * no_checkpoint_peak(costs))
    pgac.remove()


def test_dtr_reads_the_same_budgets() -> None:
    dtr = remat.DTR(None, "0.5", baseline_bytes=1000)
    assert dtr.budget_bytes == 500
    assert remat.DTR(None, "50%", baseline_bytes=1000).budget_bytes == 500
    assert remat.DTR(None, "2KiB").budget_bytes == 2048
    for bad, words in [(float("nan"), "finite"), (1.5, r"\(0, 1\]"), ("1.5", "neither"), (0, "no room")]:
        with pytest.raises(ValueError, match=words):
            remat.DTR(None, bad)


def test_sessions_and_callbacks_check_budgets_before_training() -> None:
    check_strategy("optimal", "0.5")
    check_strategy("optimal", "50%")
    for bad, words in [(float("nan"), "finite"), (1.5, r"\(0, 1\]"), ("1.5", "neither"), (-1, "negative")]:
        with pytest.raises(ValueError, match=words):
            check_strategy("optimal", bad)
        with pytest.raises(ValueError, match=words):
            RematCallback("optimal", budget=bad)


def test_bench_budget_follows_the_same_rules() -> None:
    assert bench_budget("0.5") == 0.5 and bench_budget("50%") == 0.5 and bench_budget("2GiB") == 2 * 2**30
    assert bench_budget("1000000") == 10**6 and isinstance(bench_budget("1000000"), int)
    for bad in ("nan", "inf", "1.5", "0", "-1"):
        with pytest.raises(BenchError, match="--budget"):
            bench_budget(bad)


def test_fraction_of_the_reference_is_exact() -> None:
    assert parse_budget(1.0, reference_bytes=12345) == 12345
    assert parse_budget("1", reference_bytes=12345) == 12345
    assert math.isclose(normalize_budget("33.3%"), 0.333)  # type: ignore[arg-type]
