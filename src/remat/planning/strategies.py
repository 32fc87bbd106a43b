"""Planner registry and the ``remat.plan`` entry point.

Each planner is a pure function ``(CostTable, budget_bytes, **options) -> Plan``.

A second backward pass (``loss.backward(retain_graph=True)`` followed by another backward of the same graph, or
``torch.autograd.grad(..., create_graph=True)`` followed by a backward of the gradients: gradient penalties,
higher-order derivatives) passes through every block again. ``keep``, ``checkpoint``, ``offload``, segments and
memory-poor groups support it: a checkpointed block is recomputed again for each pass, and gradients are those
of training without checkpointing. A ``selective:<policy>`` block whose policy saves operator outputs does not
(rule 3 of :mod:`remat.core.actions`): torch's selective checkpointing hands out each saved output once, and the
second pass fails with ``RuntimeError: Trying to backward an extra time. You are only allowed to backward once
on any region computed under selective activation checkpoint.`` ``remat.plan(costs, "optimal", budget,
double_backward=True)`` restricts the optimal planner to the actions that allow it; the static strategies choose
none of the others.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..core import Action, BudgetError, CostTable, format_bytes, plan_choices
from . import lossy, optimal_plan, static
from .plan import Plan
from .simulator import resolve_budget

STRATEGIES: dict[str, Callable[..., Plan]] = {
    "none": static.none,
    "full": static.full,
    "every_k": static.every_k,
    "sqrt": static.sqrt,
    "memory_poor": static.memory_poor,
    "random": static.random,
    "optimal": optimal_plan.optimal,
}


def double_backward_actions(costs: CostTable, actions: Sequence[str] | None = None) -> list[str]:
    """The optimal planner's ``actions=`` for a step that runs a second backward: ``actions`` (default: every
    single-block action of ``costs`` and both group kinds) without the ones that fail a second pass."""
    choices = plan_choices(costs) if actions is None else actions
    return [a for a in choices if Action.choice(a).allows_double_backward]


def check_double_backward(actions: Sequence[str]) -> None:
    """Raise ValueError naming the actions of a plan that fail a second backward pass."""
    unsafe = sorted({a for a in actions if not Action.parse(a).allows_double_backward})
    if unsafe:
        raise ValueError(
            f"actions {unsafe} keep operator outputs under selective checkpointing, which allows one backward "
            "pass per forward; for retain_graph=True or create_graph=True plan with double_backward=True"
        )


def minimum_peak_bytes(costs: CostTable, actions: list[str] | None = None) -> int:
    """The least predicted peak activation memory any plan reaches on ``costs`` (with ``actions`` only: single
    actions and the group kinds ``"segment"``/``"memory_poor"``; default every profiled action and both kinds)."""
    return optimal_plan.min_peak_bytes(costs, actions)


def _refuse_unknown(strategy: str) -> None:
    if strategy not in STRATEGIES:
        known = ", ".join(sorted(STRATEGIES))
        raise ValueError(f"unknown strategy {strategy!r}; known strategies: {known}")


def plan_options(strategy: str) -> set[str]:
    """The options :func:`plan` takes for ``strategy`` (beyond ``costs`` and ``budget``)."""
    _refuse_unknown(strategy)
    parameters = inspect.signature(STRATEGIES[strategy]).parameters.values()
    named = {p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)} - {"costs", "budget"}
    if strategy == "optimal":
        named |= {"allow_lossy", "max_grad_error"}
    return named | {"double_backward", "strict"}


def check_plan_options(strategy: str, options: Mapping[str, Any], also: Iterable[str] = (), where: str = "") -> None:
    """Raise TypeError, naming what is taken, where ``options`` holds one that :func:`plan` does not take for
    ``strategy`` (nor one of ``also``, the caller's own): before any profile runs, not after."""
    allowed = plan_options(strategy) | set(also)
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(
            f"{where or 'remat.plan'}: unknown option{'s' if len(unknown) > 1 else ''} {unknown} for strategy "
            f"{strategy!r}; it takes {sorted(allowed)}"
        )


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
    plans only actions that allow a second backward pass (see above). Lossy
    ``compress:`` actions are planned only by strategy ``"optimal"`` with ``allow_lossy=True`` or an error
    budget ``max_grad_error=`` (:mod:`remat.planning.lossy`).
    """
    _refuse_unknown(strategy)
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


__all__ = [
    "STRATEGIES",
    "check_plan_options",
    "plan_options",
    "BudgetError",
    "check_double_backward",
    "double_backward_actions",
    "minimum_peak_bytes",
    "plan",
]
