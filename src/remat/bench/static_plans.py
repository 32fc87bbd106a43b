"""The plan a static strategy gets at the bench's budget, from the run's CostTable: ``remat.plan(...,
strict=False)`` (a plan that does not fit is kept and recorded as not fitting), and static uniform
checkpointing as the fastest ``every_k`` that fits, and the plans of the lossy static strategies (every block
compressed; the optimal plan with lossy actions allowed). Also the budget as a fraction of the no-checkpoint
peak."""

from __future__ import annotations

from ..core import COMPRESS, GROUP_KINDS, INPUT_COMPRESS, RECOMPUTE_COMPRESS, Action, CostTable
from ..planning import Plan, minimum_peak_bytes, no_checkpoint_peak
from .strategies import StrategySpec


def static_plan(spec: StrategySpec, costs: CostTable, budget_bytes: int, seed: int) -> Plan:
    """The plan of a static strategy at the budget (never raises for a plan that does not fit)."""
    import remat

    opts = spec.opts
    if spec.name in ("compress", "optimal_lossy"):
        return lossy_plan(spec, costs, budget_bytes)
    if spec.name == "every_k" and "k" not in opts:
        return uniform_plan(costs, budget_bytes)
    if spec.name == "random":
        opts.setdefault("fraction", 0.5)
        opts.setdefault("seed", seed)
    return remat.plan(costs, spec.name, budget_bytes, strict=False, **opts)


def lossy_plan(spec: StrategySpec, costs: CostTable, budget_bytes: int) -> Plan:
    """``compress``: every block under the spec's compress action (whatever the budget); ``optimal_lossy``: the
    optimal plan with the spec's format allowed (``compress:``, ``recompute+compress:``, ``checkpoint+compress:``;
    the least-peak plan, recorded as not fitting, when none fits)."""
    import remat

    fmt = str(spec.compress_format)
    action = Action(COMPRESS, fmt).text
    if spec.name == "compress":
        return Plan.from_actions(costs, [action] * len(costs), "compress", budget_bytes)
    # the spec's format only: compressed storage, compressed recomputation and (no policy) a compressed input
    lossy = {action, Action(RECOMPUTE_COMPRESS, fmt).text, Action(INPUT_COMPRESS, fmt).text}
    allowed = [a for a in costs.plannable_actions() if a in lossy or Action.parse(a).is_exact]
    allowed += list(GROUP_KINDS)
    options = {"max_grad_error": spec.opts["max_grad_error"]} if "max_grad_error" in spec.opts else {}
    try:
        return remat.plan(costs, "optimal", budget_bytes, allow_lossy=True, actions=allowed, **options)
    except remat.BudgetError:
        least = minimum_peak_bytes(costs, allowed)
        return remat.plan(costs, "optimal", least, allow_lossy=True, actions=allowed, **options)


def uniform_plan(costs: CostTable, budget_bytes: int) -> Plan:
    """Static uniform checkpointing at the budget: ``every_k`` with the segment length ``k`` (2..L) whose
    predicted peak fits, fastest predicted first, then lowest peak; the lowest-peak ``k`` when none fits."""
    import remat

    n = len(costs)
    plans = [remat.plan(costs, "every_k", budget_bytes, strict=False, k=k) for k in range(min(2, n), n + 1)]
    fitting = [p for p in plans if p.fits]
    if fitting:
        return min(fitting, key=lambda p: (round(p.predicted_step_s, 9), p.predicted_peak_bytes))
    return min(plans, key=lambda p: p.predicted_peak_bytes)


def budget_fraction(costs: CostTable, budget_bytes: int) -> float:
    """The budget as a fraction of the predicted no-checkpoint activation peak (capped at 1)."""
    return min(1.0, budget_bytes / max(1, no_checkpoint_peak(costs)))
