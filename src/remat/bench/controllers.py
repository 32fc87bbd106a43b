"""The controller that runs one strategy in one training run: install the strategy on the model, say how to run
the forward, wrap the step, hand over the recompute seconds of each step and remove itself afterwards.

Static strategies are one plan applied with ``remat.apply`` (:class:`StaticController`); ``pgac`` is
:class:`remat.PGAC` attached to the optimizer, ``dtr`` is :class:`remat.DTR` around each step, and
``compile_budget`` is ``torch.compile`` with ``torch._functorch.config.activation_memory_budget``. The lossy
``compress`` and ``optimal_lossy`` are static plans; ``pgac_q`` is :class:`remat.PGACQ`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ..core import COMPRESS, KEEP, CostTable, ShapeCosts, kind_of, shape_of
from ..planning import Plan, ShapePlans, simulate
from .static_plans import budget_fraction, static_plan
from .strategies import STATIC, StrategyError, StrategySpec

LOSSY_STATIC = ("compress", "optimal_lossy")

SHAPE_TABLES = "shape_tables"  # costs.info: the profiles at the smaller shapes, with dynamic padding


def shape_costs_of(costs: CostTable) -> ShapeCosts | None:
    """The costs at every input shape where ``costs`` carries its smaller shapes' profiles (dynamic padding)."""
    saved = costs.info.get(SHAPE_TABLES)
    if not saved:
        return None
    reference = shape_of(costs.info["input_shapes"][costs.fqns[0]])
    tables = [costs, *(CostTable.from_dict(t) for t in saved["tables"])]
    return ShapeCosts(tables, [reference, *(tuple(s) for s in saved["shapes"])])


class Controller:
    """Runs one strategy in one training run. The default is the no-op of the ``none`` strategy."""

    def __init__(self, spec: StrategySpec) -> None:
        self.spec = spec

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Install the strategy on ``model`` (after the optimizer exists)."""

    def forward_fn(self, model: nn.Module) -> Any:
        """What the training loop calls for the forward (the model, or a compiled version of it)."""
        return model

    def step_context(self) -> contextlib.AbstractContextManager[Any]:
        """Context around the forward and backward of one step."""
        return contextlib.nullcontext()

    def take_step_stats(self) -> dict[str, Any]:
        """Recompute seconds and calls of the step that just ran (and strategy-specific figures)."""
        return {"recompute_time_s": 0.0, "recompute_calls": 0, "stored_blocks": None}

    def run_info(self) -> dict[str, Any]:
        """What to record about the strategy once the run ends (plan, history...)."""
        return {}

    def remove(self) -> None:
        """Leave the model as it was."""


class StaticController(Controller):
    """A fixed plan applied once with :func:`remat.apply` (no hooks at all for a plan that keeps everything), or,
    with ``shape_plans``, the plan of each batch's input shape within the budget (``optimal`` under dynamic
    padding)."""

    def __init__(self, spec: StrategySpec, plan: Plan, shape_plans: ShapePlans | None = None) -> None:
        super().__init__(spec)
        self.plan = plan
        self.shape_plans = shape_plans
        self.handle: Any = None

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        import remat

        if self.shape_plans is not None or any(a != KEEP for a in self.plan.actions.values()):
            self.handle = remat.apply(model, self.plan)
        if self.shape_plans is not None:
            self.handle.plan_per_shape(self.shape_plans)

    def take_step_stats(self) -> dict[str, Any]:
        if self.handle is not None:
            self.plan = self.handle.plan  # the plan of the step that ran (per shape)
        stored = sum(a == KEEP for a in self.plan.actions.values())
        if self.handle is None:
            return {"recompute_time_s": 0.0, "recompute_calls": 0, "stored_blocks": stored}
        stats = self.handle.stats
        out = {"recompute_time_s": stats.total_seconds, "recompute_calls": stats.total_calls, "stored_blocks": stored}
        stats.reset()
        return out

    def run_info(self) -> dict[str, Any]:
        if self.shape_plans is not None:
            return {"plan": plan_record(self.plan), "shape_plans": self.shape_plans.describe()}
        return {"plan": plan_record(self.plan)}

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class PGACController(Controller):
    """:class:`remat.PGAC` attached to the optimizer, planning from the run's measured CostTable."""

    def __init__(self, spec: StrategySpec, costs: CostTable, budget_bytes: int, total_steps: int,
                 shapes: ShapeCosts | None = None) -> None:  # fmt: skip
        super().__init__(spec)
        self.costs, self.budget_bytes, self.total_steps = costs, budget_bytes, total_steps
        self.shapes = shapes  # with dynamic padding: the mask fitted to each batch's shape
        self.pgac: Any = None

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        import remat

        opts = self.spec.opts
        # One process has no other ranks to agree with: "local" and "global" give the same mask here (the
        # distributed comparison is the sync sweep, remat.bench.ddp_sweep).
        opts.pop("sync", None)
        if self.spec.name == "pgac_q":
            opts["compress"] = opts.pop("format", self.spec.compress_format)
        cls = remat.PGACQ if self.spec.name == "pgac_q" else remat.PGAC
        self.pgac = cls(
            model, self.budget_bytes, costs=self.costs, total_steps=self.total_steps, measure=0, **opts
        ).attach(optimizer)
        if self.shapes is not None:
            self.pgac.plan_per_shape(self.shapes)
        self._ran = dict(self.pgac.plan.actions)

    def take_step_stats(self) -> dict[str, Any]:
        stats = self.pgac.handle.stats
        ran = self.pgac.history[-1].actions if self.pgac.history else tuple(self._ran.values())
        out = {
            "recompute_time_s": stats.total_seconds,
            "recompute_calls": stats.total_calls,
            "stored_blocks": sum(a == KEEP for a in ran),
            "compressed_blocks": sum(kind_of(a) == COMPRESS for a in ran),
            "tau": self.pgac.tau,
            "gamma": self.pgac.gamma,
        }
        stats.reset()
        return out

    def run_info(self) -> dict[str, Any]:
        history = [
            {
                "step": r.step,
                "actions": list(r.actions),
                "stored": [a == KEEP for a in r.actions],
                "score_mask": list(r.mask),
                "scores": list(r.scores),
                "tau": r.tau,
                "gamma": r.gamma,
                "predicted_peak_bytes": r.predicted_peak_bytes,
            }
            for r in self.pgac.history
        ]
        plan = plan_record(self.pgac.plan, self.costs)
        plan["pgac_scoring_s"] = scoring_s = self.pgac.own_seconds[0]
        if plan["predicted_step_s"] is not None:  # the scoring hooks run inside the measured forward+backward
            plan["predicted_step_s"] += scoring_s
        return {"plan": plan, "fqns": list(self.pgac.fqns), "history": history}

    def remove(self) -> None:
        if self.pgac is not None:
            self.pgac.remove()


class DTRController(Controller):
    """:class:`remat.DTR` around the forward and backward of every step, at the same byte budget."""

    def __init__(self, spec: StrategySpec, budget_bytes: int) -> None:
        super().__init__(spec)
        self.budget_bytes = budget_bytes
        self.dtr: Any = None

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        import remat

        self.dtr = remat.DTR(model, int(self.budget_bytes), **self.spec.opts)
        self._seen = 0

    def step_context(self) -> contextlib.AbstractContextManager[Any]:
        return self.dtr

    def take_step_stats(self) -> dict[str, Any]:
        stats = self.dtr.stats
        fresh = stats.steps > self._seen
        self._seen = stats.steps
        last = stats.last_step
        return {
            "recompute_time_s": last.recompute_s if fresh else 0.0,
            "recompute_calls": last.rematerializations if fresh else 0,
            "stored_blocks": None,
            "evictions": last.evictions if fresh else 0,
            "dtr_peak_tracked_bytes": last.peak_tracked_bytes if fresh else None,
            "dtr_over_budget_ops": last.over_budget_ops if fresh else 0,
        }

    def run_info(self) -> dict[str, Any]:
        s = self.dtr.stats
        return {
            "dtr": {
                "steps": s.steps,
                "evictions": s.evictions,
                "rematerializations": s.rematerializations,
                "recompute_s": s.recompute_s,
                "peak_tracked_bytes": s.peak_tracked_bytes,
                "over_budget_ops": s.over_budget_ops,
                "heuristic": self.dtr.heuristic,
            }
        }


class CompileController(Controller):
    """``torch.compile`` with ``activation_memory_budget``: the compiler's own min-cut rematerialization.

    Its recomputation happens inside compiled kernels, so no recompute seconds are reported (``None``)."""

    def __init__(self, spec: StrategySpec, fraction: float) -> None:
        super().__init__(spec)
        self.fraction = float(spec.opts.get("fraction", fraction))
        self.compiled: Any = None

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = self.fraction
        self.compiled = torch.compile(model)

    def forward_fn(self, model: nn.Module) -> Any:
        return self.compiled

    def take_step_stats(self) -> dict[str, Any]:
        return {"recompute_time_s": None, "recompute_calls": None, "stored_blocks": None}

    def run_info(self) -> dict[str, Any]:
        return {"activation_memory_budget": self.fraction}


def plan_record(plan: Plan, costs: CostTable | None = None) -> dict[str, Any]:
    """What a run records of its plan; with ``costs`` the predicted step is filled in for plans made without
    the simulator (PGAC's)."""
    step = plan.predicted_step_s
    if step is None and costs is not None and list(plan.actions) == costs.fqns:
        step = simulate(costs, plan.actions).step_s
    return {
        "strategy": plan.strategy,
        "actions": dict(plan.actions),
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_recompute_s": plan.predicted_recompute_s,
        "predicted_step_s": step,
        "budget_bytes": plan.budget_bytes,
        "fits": plan.fits,
        "options": {k: v for k, v in plan.options.items() if isinstance(v, int | float | str | bool | None)},
    }


def make_controller(spec: StrategySpec, costs: CostTable, budget_bytes: int, seed: int, total_steps: int) -> Controller:
    """The controller of ``spec`` for one run; where ``costs`` carries the costs at every shape (dynamic padding),
    ``optimal`` and PGAC plan each batch's shape within ``budget_bytes``."""
    shapes = shape_costs_of(costs)
    if spec.name in STATIC or spec.name in LOSSY_STATIC:
        plan = static_plan(spec, costs, budget_bytes, seed)
        per_shape = ShapePlans(shapes, budget_bytes) if shapes is not None and spec.name == "optimal" else None
        return StaticController(spec, plan, per_shape)
    if spec.name in ("pgac", "pgac_q"):
        return PGACController(spec, costs, budget_bytes, total_steps, shapes)
    if spec.name == "dtr":
        return DTRController(spec, budget_bytes)
    if spec.name == "compile_budget":
        return CompileController(spec, budget_fraction(costs, budget_bytes))
    raise StrategyError(f"unknown strategy {spec.name!r}")
