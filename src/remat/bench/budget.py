"""The bench's activation memory budget: ``--budget`` read as a fraction of the no-checkpoint peak or as a size,
then resolved to bytes against the profile of every seed, refusing a budget no plan can reach."""

from __future__ import annotations

import math
from typing import Any

from ..core import CostTable, format_bytes, normalize_budget
from ..planning import no_checkpoint_peak
from .config import BenchError
from .static_plans import budget_fraction


def parse_budget(text: str) -> float | int:
    """``"0.5"`` or ``"50%"`` -> 0.5 (a fraction of the no-checkpoint peak); ``"2GiB"`` or ``"1000000"`` -> bytes."""
    try:
        return normalize_budget(str(text))  # type: ignore[return-value]  # never None for a string
    except (ValueError, TypeError) as err:
        raise BenchError(f"--budget {text!r}: {err}") from None


def resolve_bench_budget(spec: float | int, costs_by_seed: dict[int, CostTable]) -> dict[str, Any]:
    """The budget in bytes (a fraction is of seed 0's predicted no-checkpoint peak); raises BenchError when
    no plan reaches it on some seed's model and batch."""
    from ..planning import minimum_peak_bytes

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
