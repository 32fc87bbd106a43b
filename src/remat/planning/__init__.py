"""From a cost table to a plan: :class:`Plan`, the one simulator and memory model, plan files, and the planners,
pure functions ``(CostTable, budget, **options) -> Plan`` with no torch state and no I/O.

* :mod:`.plan`: :class:`Plan`; :mod:`.plan_files`: the JSON a plan is written to, checked on load;
* :mod:`.simulator`: :func:`simulate`, the predicted peak, recompute and step of a plan; :mod:`.unit_terms`: the
  per-unit terms it sums, scalar and vectorised side by side (invariant 1 there: times on a 2**-30 s grid);
* :mod:`.strategies`: ``remat.plan`` and the registry :data:`STRATEGIES`; :mod:`.static`: the static strategies;
  :mod:`.optimal_plan` with :mod:`.chain_units`, :mod:`.search` and :mod:`.pareto`: the optimal planner;
  :mod:`.lossy`: planning with lossy actions, only when asked;
* :mod:`.offload_overlap`: ``offload`` priced by the part of its copies the next block's compute leaves exposed;
* :mod:`.shape_plans`: a plan per input-shape bucket within one byte budget, and the refusal naming what fits;
* :mod:`.stages`: how a chain and its budget split over pipeline stages.
"""

from __future__ import annotations

from .lossy import plan_error
from .offload_overlap import exposed_copy_s, overlap_priced
from .optimal_plan import optimal
from .plan import Plan
from .search import plans_tied
from .shape_plans import Buckets, ShapeBudgetError, ShapePlans
from .simulator import Simulation, no_checkpoint_peak, resolve_budget, simulate
from .stages import SCHEDULES, check_schedule, in_flight, micro_batch_budget, split_stages, stage_costs, stage_share
from .static import memory_poor, per_chain, segments
from .strategies import STRATEGIES, check_plan_options, minimum_peak_bytes
from .strategies import plan as make_plan

__all__ = [
    "check_plan_options",
    "Buckets",
    "ShapeBudgetError",
    "ShapePlans",
    "plans_tied",
    "Plan",
    "SCHEDULES",
    "STRATEGIES",
    "Simulation",
    "check_schedule",
    "in_flight",
    "memory_poor",
    "micro_batch_budget",
    "minimum_peak_bytes",
    "no_checkpoint_peak",
    "make_plan",
    "optimal",
    "overlap_priced",
    "exposed_copy_s",
    "per_chain",
    "plan_error",
    "resolve_budget",
    "segments",
    "simulate",
    "split_stages",
    "stage_costs",
    "stage_share",
]
