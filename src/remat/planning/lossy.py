"""Planning with lossy storage: ``compress:<format>`` and ``checkpoint+compress:<format>`` actions are chosen
only when the user asks.

:func:`remat.plan` passes the optimal strategy through :func:`plan_optimal`:

* by default (``allow_lossy=False`` and no ``max_grad_error``) the search sees only exact actions, whatever
  the cost table holds; if no exact plan fits, the :class:`BudgetError` says which lossy setting would;
* with ``allow_lossy=True`` every profiled action is allowed and the planner minimises predicted time under
  the byte budget;
* with ``max_grad_error=e`` (which implies ``allow_lossy``) the plan's total gradient error, the sum of the
  measured ``grad_error`` of its lossy blocks, must also stay at most ``e``. The two budgets are met by
  Lagrangian relaxation: each lossy action's time is charged ``price * grad_error`` and the price is raised
  (by doubling, then bisection) until the plan fits the error budget. The result fits both budgets; it is the
  fastest such plan the search finds, not proven optimal (``Plan.options["exact"]`` is then False).

``Plan.options`` records ``lossy`` (whether lossy actions were allowed) and ``grad_error`` (the plan's total).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..core import INPUT_COMPRESS, Action, BudgetError, CostTable, format_bytes, plan_choices
from .optimal_plan import optimal
from .plan import Plan

PRICE_STEPS = 40  # doublings of the error price before a budget is declared out of reach
BISECTIONS = 24
ERROR_FIRST = 1e9  # seconds per unit of gradient error: a price above any step time


def lossy_actions_of(costs: CostTable) -> list[str]:
    """The lossy actions every block of ``costs`` was profiled under and that can save memory on it."""
    return [a for a in costs.common_actions() if Action.choice(a).is_lossy and usable(costs, a)]


def usable(costs: CostTable, action: str) -> bool:
    """False for ``checkpoint+compress:`` when the model keeps every block's output (``outputs_kept``): the
    input it compresses stays alive anyway, so the compressed copy would only add memory."""
    return not (costs.outputs_kept and Action.choice(action).kind == INPUT_COMPRESS)


def plan_error(costs: CostTable, plan: Plan) -> float:
    """The total gradient error of ``plan``: the sum of its lossy blocks' measured ``grad_error``."""
    total = 0.0
    for row, action in zip(costs.blocks, plan.actions.values(), strict=True):
        if Action.choice(action).is_lossy:
            if action not in row.grad_error:
                raise ValueError(
                    f"block {row.fqn!r} has no measured gradient error for {action!r}; profile it with "
                    "remat.profile(..., lossy=...) to plan with an error budget"
                )
            total += row.grad_error[action]
    return total


def _all_actions(costs: CostTable, actions: list[str] | None) -> list[str]:
    if actions is not None:
        return list(actions)
    return [a for a in plan_choices(costs) if usable(costs, a)]


def _priced(costs: CostTable, price: float) -> CostTable:
    """``costs`` with each lossy action's time raised by ``price`` seconds per unit of gradient error."""
    rows = []
    for row in costs.blocks:
        recompute = dict(row.recompute_s)
        for action, error in row.grad_error.items():
            if action in recompute:
                recompute[action] += price * error
        rows.append(replace(row, recompute_s=recompute))
    return replace(costs, blocks=rows)


def _lossy_hint(costs: CostTable, budget: int, actions: list[str]) -> str:
    """What would make ``budget`` feasible with lossy storage, for the message of an exact plan that fails."""
    lossy = lossy_actions_of(costs)
    if not lossy:
        return (
            " Storing activations compressed may reach below that: profile with remat.profile(..., "
            "lossy=('int8',)) and plan with allow_lossy=True (lossy: gradients are no longer exact)."
        )
    try:
        reached = optimal(costs, budget, actions=actions + [a for a in lossy if a not in actions])
    except BudgetError as error:
        return (
            f" Lossy storage ({', '.join(lossy)}) does not fit it either: its minimum is {format_bytes(error.floor)}."
        )
    error = plan_error(costs, reached)
    used = sorted({a for a in reached.actions.values() if Action.choice(a).is_lossy})
    # the least error that fits: with error priced far above any time, the search minimises error first
    least = plan_error(costs, optimal(_priced(costs, ERROR_FIRST), budget, actions=actions + lossy))
    return (
        f" With lossy storage it fits: allow_lossy=True gives a plan of {format_bytes(reached.predicted_peak_bytes)}"
        f" using {used} (total gradient error {error:.3g}), and max_grad_error={least:.3g} or more allows the least "
        "lossy plan that fits. Gradients are then no longer exact."
    )


def plan_optimal(
    costs: CostTable,
    budget: int,
    *,
    allow_lossy: bool = False,
    max_grad_error: float | None = None,
    actions: list[str] | None = None,
    **options: Any,
) -> Plan:
    """The optimal plan under ``budget`` bytes with lossy actions allowed as asked (see the module notes)."""
    if max_grad_error is not None and max_grad_error < 0:
        raise ValueError(f"max_grad_error is a sum of relative errors and must be >= 0, got {max_grad_error}")
    lossy = allow_lossy or max_grad_error is not None
    allowed = _all_actions(costs, actions)
    if not lossy:
        exact = [a for a in allowed if not Action.choice(a).is_lossy]
        try:
            result = optimal(costs, budget, actions=exact, **options)
        except BudgetError as error:
            raise BudgetError(str(error) + _lossy_hint(costs, budget, exact), floor=error.floor) from None
        result.options.update(lossy=False, grad_error=0.0)
        return result
    result = optimal(costs, budget, actions=allowed, **options)
    error = plan_error(costs, result)
    if max_grad_error is not None and error > max_grad_error:
        result, error = _within_error(costs, budget, allowed, max_grad_error, options)
    result.options.update(lossy=True, grad_error=error)
    return result


def _within_error(
    costs: CostTable, budget: int, allowed: list[str], max_error: float, options: dict[str, Any]
) -> tuple[Plan, float]:
    """The fastest plan found under both budgets by pricing gradient error (module notes)."""

    def solve(price: float) -> tuple[Plan, float]:
        priced = optimal(_priced(costs, price), budget, actions=allowed, **options)
        plan = Plan.from_actions(costs, priced.actions, "optimal", budget, **{**priced.options, "exact": False})
        return plan, plan_error(costs, plan)

    scale = max(max(r.fwd_s + r.bwd_s for r in costs.blocks), 1e-9) / max(
        min((e for r in costs.blocks for e in r.grad_error.values() if e > 0), default=1.0), 1e-12
    )
    low, high = 0.0, scale * 1e-3
    best = None
    for _ in range(PRICE_STEPS):
        plan, error = solve(high)
        if error <= max_error:
            best = (plan, error)
            break
        low, high = high, high * 2
    if best is None:
        raise BudgetError(
            f"no plan found within both a budget of {format_bytes(budget)} and max_grad_error={max_error:.3g}: "
            f"the least total gradient error reached under that byte budget is {error:.3g}. Raise "
            "max_grad_error, raise the byte budget, or profile a more accurate format (int8 before fp8)."
        )
    for _ in range(BISECTIONS):
        mid = (low + high) / 2
        plan, error = solve(mid)
        if error <= max_error:
            high, best = mid, (plan, error)
        else:
            low = mid
    return best


__all__ = ["lossy_actions_of", "plan_error", "plan_optimal", "usable"]
