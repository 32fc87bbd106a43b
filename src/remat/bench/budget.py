"""The bench's activation memory budget: ``--budget`` read as a fraction of the no-checkpoint peak or as a size,
then resolved to bytes against the profile of every seed, refusing a budget no plan can reach."""

from __future__ import annotations

import math
from typing import Any

from ..costs import CostTable
from ..simulator import no_checkpoint_peak
from ..sizes import format_bytes, parse_bytes
from .config import BenchError
from .static_plans import budget_fraction


def parse_budget(text: str) -> float | int:
    """``"0.5"`` -> 0.5 (a fraction of the no-checkpoint peak); ``"2GiB"`` or ``"1000000"`` -> bytes."""
    text = str(text).strip()
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is None:
        try:
            value = parse_bytes(text)
        except (ValueError, TypeError) as err:
            raise BenchError(f"--budget {text!r}: {err}") from None
        if value <= 0:
            raise BenchError(f"--budget {text!r} is zero bytes; give a positive size like '2GiB' or a fraction")
        return value
    if number <= 0:
        raise BenchError(f"--budget must be positive, got {text}")
    if number <= 1.0:
        return number
    if number.is_integer() and "." not in text:
        return int(number)
    raise BenchError(
        f"--budget {text}: a fraction of the no-checkpoint activation memory must be in (0, 1]; write a size "
        "with a unit (e.g. '1.5GiB') for bytes"
    )


def resolve_bench_budget(spec: float | int, costs_by_seed: dict[int, CostTable]) -> dict[str, Any]:
    """The budget in bytes (a fraction is of seed 0's predicted no-checkpoint peak); raises BenchError when
    no plan reaches it on some seed's model and batch."""
    from ..planners import minimum_peak_bytes

    reference = no_checkpoint_peak(costs_by_seed[0])
    budget_bytes = int(spec * reference) if isinstance(spec, float) else int(spec)
    floors = {seed: minimum_peak_bytes(costs) for seed, costs in costs_by_seed.items()}
    worst = max(floors.values())
    if budget_bytes < worst:
        raise BenchError(
            f"budget {format_bytes(budget_bytes)} is below the least activation memory any plan reaches on this "
            f"model and batch ({format_bytes(worst)}, {worst / reference:.0%} of the no-checkpoint "
            f"{format_bytes(reference)}); use --budget {math.ceil(100 * worst / reference) / 100:.2f} or more, a "
            "smaller --batch-size/--seq-len, or more --layers"
        )
    return {
        "spec": spec,
        "bytes": budget_bytes,
        "fraction": budget_fraction(costs_by_seed[0], budget_bytes),
        "no_checkpoint_predicted_bytes": reference,
        "min_feasible_bytes": worst,
    }
