"""The strategies the harness compares, written ``name`` or ``name:key=value,key=value``, and the controller
that runs each of them in a training loop.

Static strategies (``none``, ``full``, ``every_k``, ``sqrt``, ``memory_poor``, ``random``, ``optimal``) get one
plan from the run's CostTable through ``remat.plan(..., strict=False)``; the plan's prediction and whether it
fits the budget are recorded. ``pgac`` is :class:`remat.PGAC` attached to the optimizer, ``dtr`` is
:class:`remat.DTR` around each step, and ``compile_budget`` is ``torch.compile`` with
``torch._functorch.config.activation_memory_budget`` set to the budget's fraction of the no-checkpoint
activation memory (the outside reference; it runs in a child process, see :mod:`remat.bench.procmem`).

A controller has one job per training run: install the strategy on the model, say how to run the forward,
wrap the step, hand over the recompute seconds of each step and remove itself afterwards.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..costs import KEEP, CostTable
from ..simulator import Plan, no_checkpoint_peak

STATIC = ("none", "full", "every_k", "sqrt", "memory_poor", "random", "optimal")
DYNAMIC = ("pgac", "dtr")
COMPILED = ("compile_budget",)
KNOWN = STATIC + DYNAMIC + COMPILED
# Everything except the compiled reference runs the model's own eager kernels, so its losses must equal the
# no-checkpoint run's exactly; compiled kernels may differ by floating-point rounding.
EXACT = STATIC + DYNAMIC

OPTIONS: dict[str, tuple[str, ...]] = {
    "none": (),
    "full": (),
    "every_k": ("k",),
    "sqrt": (),
    "memory_poor": (),
    "random": ("fraction", "seed"),
    "optimal": ("resolution", "max_segment"),
    "pgac": ("alpha", "q", "gamma", "sync", "every"),
    "dtr": ("heuristic",),
    "compile_budget": ("fraction",),
}
DEFAULT_STRATEGIES = "none,full,every_k,sqrt,random,optimal,pgac,dtr"
SWEEPABLE = ("q", "alpha", "gamma", "sync")


class StrategyError(ValueError):
    """A strategy string names an unknown strategy or option."""


def parse_value(text: str) -> Any:
    """``"3"`` -> 3, ``"0.5"`` -> 0.5, ``"true"`` -> True, ``"none"`` -> None, anything else stays a string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


@dataclass(frozen=True)
class StrategySpec:
    """One strategy to run: its name and options. ``label`` names it in every result file."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def opts(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def label(self) -> str:
        if not self.options:
            return self.name
        return f"{self.name}[{','.join(f'{k}={v}' for k, v in self.options)}]"

    @property
    def exact(self) -> bool:
        return self.name in EXACT

    def with_option(self, key: str, value: Any) -> StrategySpec:
        opts = self.opts
        opts[key] = value
        return StrategySpec(self.name, tuple(opts.items()))


def make_spec(name: str, options: dict[str, Any] | None = None) -> StrategySpec:
    """A checked :class:`StrategySpec`."""
    if name not in KNOWN:
        raise StrategyError(f"unknown strategy {name!r}; known strategies: {', '.join(KNOWN)}")
    options = dict(options or {})
    bad = [k for k in options if k not in OPTIONS[name]]
    if bad:
        allowed = ", ".join(OPTIONS[name]) or "none"
        raise StrategyError(f"strategy {name!r} has no option {', '.join(bad)}; its options: {allowed}")
    return StrategySpec(name, tuple(options.items()))


def parse_strategies(text: str) -> list[StrategySpec]:
    """Parse ``"none,full,pgac:q=0.3,alpha=0.8,gamma=linear,dtr"``.

    Strategies are separated by commas; ``name:key=value`` starts a strategy's options and each following
    ``key=value`` item adds one more to the same strategy.
    """
    specs: list[tuple[str, dict[str, Any]]] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        if "=" in item and ":" not in item:
            if not specs:
                raise StrategyError(f"option {item!r} comes before any strategy in {text!r}")
            key, value = item.split("=", 1)
            specs[-1][1][key.strip()] = parse_value(value)
            continue
        name, _, option = item.partition(":")
        options: dict[str, Any] = {}
        if option:
            if "=" not in option:
                raise StrategyError(f"cannot read {item!r}: write options as {name}:key=value")
            key, value = option.split("=", 1)
            options[key.strip()] = parse_value(value)
        specs.append((name.strip(), options))
    if not specs:
        raise StrategyError(f"no strategies in {text!r}; known strategies: {', '.join(KNOWN)}")
    result = [make_spec(name, options) for name, options in specs]
    labels = [s.label for s in result]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise StrategyError(f"strategy {', '.join(dupes)} is listed twice; give each once")
    return result


def parse_sweep(text: str) -> tuple[str, list[Any]]:
    """``"q=0.25,0.5,0.75"`` -> ``("q", [0.25, 0.5, 0.75])``: an ablation of one PGAC option."""
    key, sep, values = text.partition("=")
    key = key.strip()
    if not sep or key not in SWEEPABLE:
        raise StrategyError(
            f"cannot read sweep {text!r}: write KEY=V1,V2,... with KEY one of {', '.join(SWEEPABLE)}"
        )
    parsed = [parse_value(v) for v in values.split(",") if v.strip()]
    if len(parsed) < 2:
        raise StrategyError(f"sweep {text!r} needs at least two values to compare")
    if key == "sync":
        bad = [v for v in parsed if v not in ("local", "global")]
        if bad:
            raise StrategyError(f"sync takes 'local' or 'global', got {bad}")
    return key, parsed


# ------------------------------------------------------------------------------------------- static plans


def static_plan(spec: StrategySpec, costs: CostTable, budget_bytes: int, seed: int) -> Plan:
    """The plan of a static strategy at the budget (never raises for a plan that does not fit)."""
    import remat

    opts = spec.opts
    if spec.name == "every_k" and "k" not in opts:
        return uniform_plan(costs, budget_bytes)
    if spec.name == "random":
        opts.setdefault("fraction", 0.5)
        opts.setdefault("seed", seed)
    return remat.plan(costs, spec.name, budget_bytes, strict=False, **opts)


def uniform_plan(costs: CostTable, budget_bytes: int) -> Plan:
    """Static uniform checkpointing at the budget: ``every_k`` with the segment length ``k`` (2..L) whose
    predicted peak fits, fastest predicted first, then lowest peak; the lowest-peak ``k`` when none fits."""
    import remat

    n = len(costs)
    plans = [remat.plan(costs, "every_k", budget_bytes, strict=False, k=k) for k in range(min(2, n), n + 1)]
    fitting = [p for p in plans if p.fits]
    if fitting:
        return min(fitting, key=lambda p: (round(p.predicted_recompute_s, 9), p.predicted_peak_bytes))
    return min(plans, key=lambda p: p.predicted_peak_bytes)


def budget_fraction(costs: CostTable, budget_bytes: int) -> float:
    """The budget as a fraction of the predicted no-checkpoint activation peak (capped at 1)."""
    return min(1.0, budget_bytes / max(1, no_checkpoint_peak(costs)))


# -------------------------------------------------------------------------------------------- controllers


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
    """A fixed plan applied once with :func:`remat.apply` (no hooks at all for a plan that keeps everything)."""

    def __init__(self, spec: StrategySpec, plan: Plan) -> None:
        super().__init__(spec)
        self.plan = plan
        self.handle: Any = None

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        import remat

        if any(a != KEEP for a in self.plan.actions.values()):
            self.handle = remat.apply(model, self.plan)

    def take_step_stats(self) -> dict[str, Any]:
        stored = sum(a == KEEP for a in self.plan.actions.values())
        if self.handle is None:
            return {"recompute_time_s": 0.0, "recompute_calls": 0, "stored_blocks": stored}
        stats = self.handle.stats
        out = {"recompute_time_s": stats.total_seconds, "recompute_calls": stats.total_calls, "stored_blocks": stored}
        stats.reset()
        return out

    def run_info(self) -> dict[str, Any]:
        return {"plan": plan_record(self.plan)}

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class PGACController(Controller):
    """:class:`remat.PGAC` attached to the optimizer, planning from the run's measured CostTable."""

    def __init__(self, spec: StrategySpec, costs: CostTable, budget_bytes: int, total_steps: int) -> None:
        super().__init__(spec)
        self.costs, self.budget_bytes, self.total_steps = costs, budget_bytes, total_steps
        self.pgac: Any = None

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        import remat

        opts = self.spec.opts
        # One process has no other ranks to agree with: "local" and "global" give the same mask here (the
        # distributed comparison is the sync sweep, remat.bench.ddp_sweep).
        opts.pop("sync", None)
        self.pgac = remat.PGAC(
            model, self.budget_bytes, costs=self.costs, total_steps=self.total_steps, measure=0, **opts
        ).attach(optimizer)
        self._ran = dict(self.pgac.plan.actions)

    def take_step_stats(self) -> dict[str, Any]:
        stats = self.pgac.handle.stats
        ran = self.pgac.history[-1].actions if self.pgac.history else tuple(self._ran.values())
        out = {
            "recompute_time_s": stats.total_seconds,
            "recompute_calls": stats.total_calls,
            "stored_blocks": sum(a == KEEP for a in ran),
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
        return {"plan": plan_record(self.pgac.plan), "fqns": list(self.pgac.fqns), "history": history}

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
        return {"dtr": {"steps": s.steps, "evictions": s.evictions, "rematerializations": s.rematerializations,
                        "recompute_s": s.recompute_s, "peak_tracked_bytes": s.peak_tracked_bytes,
                        "over_budget_ops": s.over_budget_ops, "heuristic": self.dtr.heuristic}}


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


def plan_record(plan: Plan) -> dict[str, Any]:
    return {
        "strategy": plan.strategy,
        "actions": dict(plan.actions),
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_recompute_s": plan.predicted_recompute_s,
        "budget_bytes": plan.budget_bytes,
        "fits": plan.fits,
        "options": {k: v for k, v in plan.options.items() if isinstance(v, int | float | str | bool | None)},
    }


def make_controller(
    spec: StrategySpec, costs: CostTable, budget_bytes: int, seed: int, total_steps: int
) -> Controller:
    """The controller of ``spec`` for one run."""
    if spec.name in STATIC:
        return StaticController(spec, static_plan(spec, costs, budget_bytes, seed))
    if spec.name == "pgac":
        return PGACController(spec, costs, budget_bytes, total_steps)
    if spec.name == "dtr":
        return DTRController(spec, budget_bytes)
    if spec.name == "compile_budget":
        return CompileController(spec, budget_fraction(costs, budget_bytes))
    raise StrategyError(f"unknown strategy {spec.name!r}")


def check_available(specs: list[StrategySpec]) -> None:
    """Import what the strategies need, so a missing piece fails before any training."""
    names = {s.name for s in specs}
    needs = {"pgac": "remat.dynamic.pgac", "dtr": "remat.dynamic.dtr", "optimal": "remat.planners.optimal"}
    import importlib

    for name, module in needs.items():
        if name in names:
            try:
                importlib.import_module(module)
            except ImportError as err:
                raise StrategyError(f"strategy {name!r} needs {module}, which cannot be imported: {err}") from err
    for spec in specs:
        if spec.name == "pgac":
            opts = spec.opts
            alpha, q, every = opts.get("alpha", 0.9), opts.get("q", 0.5), opts.get("every", 1)
            if not (isinstance(alpha, int | float) and 0.0 <= alpha < 1.0):
                raise StrategyError(f"pgac:alpha is the EMA decay and must be in [0, 1), got {alpha!r}")
            if not (isinstance(q, int | float) and 0.0 <= q <= 1.0):
                raise StrategyError(f"pgac:q is the quantile of the scores and must be in [0, 1], got {q!r}")
            if not (isinstance(every, int) and every >= 1):
                raise StrategyError(f"pgac:every (score every that many steps) must be an int >= 1, got {every!r}")
            if opts.get("sync", "local") not in ("local", "global"):
                raise StrategyError(f"pgac:sync must be 'local' or 'global', got {opts['sync']!r}")
            if "gamma" in opts:
                from ..dynamic.schedules import make_schedule

                make_schedule(opts["gamma"])
        if spec.name == "dtr" and "heuristic" in spec.opts:
            from ..dynamic.dtr import HEURISTICS

            if spec.opts["heuristic"] not in HEURISTICS:
                raise StrategyError(
                    f"unknown DTR heuristic {spec.opts['heuristic']!r}; choose one of {', '.join(HEURISTICS)}"
                )
        if spec.name == "compile_budget" and "fraction" in spec.opts:
            f = spec.opts["fraction"]
            if not isinstance(f, int | float) or not 0.0 <= f <= 1.0:
                raise StrategyError(f"compile_budget:fraction must be in [0, 1], got {f!r}")
