"""Planner registry and the ``remat.plan`` entry point.

Each planner is a pure function ``(CostTable, budget_bytes, **options) -> Plan``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..costs import CostTable
from ..double_backward import check_double_backward, double_backward_actions
from ..simulator import Plan, resolve_budget
from ..sizes import format_bytes
from . import lossy, optimal, static
from .errors import BudgetError

STRATEGIES: dict[str, Callable[..., Plan]] = {
    "none": static.none,
    "full": static.full,
    "every_k": static.every_k,
    "sqrt": static.sqrt,
    "memory_poor": static.memory_poor,
    "random": static.random,
    "optimal": optimal.optimal,
}


def minimum_peak_bytes(costs: CostTable, actions: list[str] | None = None) -> int:
    """The least predicted peak activation memory any plan reaches on ``costs`` (with ``actions`` only: single
    actions and the group kinds ``"segment"``/``"memory_poor"``; default every profiled action and both kinds)."""
    return optimal.min_peak_bytes(costs, actions)


def plan(
    costs: CostTable,
    strategy: str = "optimal",
    budget: int | float | str | None = None,
    *,
    strict: bool = True,
    **options: Any,
) -> Plan:
    """Make a :class:`Plan` for ``costs`` with ``strategy``.

    ``budget`` is bytes, a string like "1.5GiB", or a float in (0, 1] meaning a fraction of the
    no-checkpoint activation memory. With ``strict`` (the default) a plan whose predicted peak exceeds the
    budget raises :class:`BudgetError`, which names the minimum any plan reaches. ``double_backward=True``
    plans only actions that allow a second backward pass (:mod:`remat.double_backward`). Lossy
    ``compress:`` actions are planned only by strategy ``"optimal"`` with ``allow_lossy=True`` or an error
    budget ``max_grad_error=`` (:mod:`remat.planners.lossy`).
    """
    if strategy not in STRATEGIES:
        known = ", ".join(sorted(STRATEGIES))
        raise ValueError(f"unknown strategy {strategy!r}; known strategies: {known}")
    if len(costs) == 0:
        raise ValueError("the cost table has no blocks; profile a model with at least one block")
    budget_bytes = resolve_budget(budget, costs)
    if strategy == "optimal" and budget_bytes is None:
        raise ValueError("strategy 'optimal' needs a budget (bytes, a string like '2GiB' or a fraction)")
    double_backward = options.pop("double_backward", False)
    if double_backward and strategy == "optimal":
        options["actions"] = double_backward_actions(costs, options.get("actions"))
    if strategy == "optimal":
        result = lossy.plan_optimal(costs, budget_bytes, **options)
    elif options.pop("allow_lossy", False) or options.pop("max_grad_error", None) is not None:
        raise ValueError(f"strategy {strategy!r} plans exact actions only; lossy storage needs strategy 'optimal'")
    else:
        result = STRATEGIES[strategy](costs, budget_bytes, **options)
    if double_backward:
        check_double_backward(list(result.actions.values()))
    if strict and not result.fits:
        floor = minimum_peak_bytes(costs)
        raise BudgetError(
            f"strategy {strategy!r} predicts a peak of {format_bytes(result.predicted_peak_bytes)} of "
            f"activations, above the budget of {format_bytes(budget_bytes)}. The minimum any plan reaches on "
            f"this model and batch is {format_bytes(floor)}"
            + (" (budget below the feasible minimum)." if budget_bytes < floor else "; try strategy='optimal'.")
        )
    return result


__all__ = ["STRATEGIES", "BudgetError", "minimum_peak_bytes", "plan"]
