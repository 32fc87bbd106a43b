"""An eager plan within a byte budget chosen by its measured step time, where the profile cannot tell.

``remat.plan(costs, "optimal", budget)`` is the fastest plan *under the profile's figures*. Where two actions
of a block cost nearly the same, a profile taken on a busy machine can rank them the wrong way round
(``docs/results/measured-fit.md``): on the peers benchmark's Llama (fp32, 2-core CPU) checkpointing a block and
the per-operator policy ``all_but_pointwise_saveable`` differ by 1.5-2 ms a block in whole steps, the profile's
three rounds read that gap anywhere from 0.3 to 1.2 ms, and a profile that put the policy first had ``optimal``
run ``CCCAKK`` at 1.04x the step of ``CCCCKK``, which also fits; on its GPT-2 at 50%, four of six fresh profiles
put the policy on one block, 1.006-1.018x slower.

:func:`fit` plans ``optimal`` twice, over every action the profile measured and over those without per-operator
policies (checkpoints, segments, memory-poor groups, offload), and where the two plans differ runs them on the
caller's step: each one's peak by ``remat.measure`` (the live-tensor tracker), then, where both fit, their
steps in interleaved rounds (:func:`remat.training_step.ratios_to_first`). It keeps the faster plan whose
measured peak fits and leaves it applied. Where both plans are the same, two steps measure its peak.

Invariants, enforced here:

1. A plan is kept only where its *measured* peak fits the budget; the budget is resolved as ``remat.plan``
   resolves it (a fraction is of the profile's predicted no-checkpoint peak).
2. The model ends with the chosen plan applied (``PlanFit.handle``) and nothing else; its parameter gradients
   and the RNG state are as they were. After an error the model is as it came.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from .actions import plan_choices
from .block_run import GradsRestored
from .blocks import BlocksArg, resolve_blocks
from .costs import SELECTIVE_PREFIX, CostTable
from .lossy_actions import is_lossy
from .memory import measure, model_device
from .planners import plan as make_plan
from .planners.errors import BudgetError
from .policies import PROFILED_BY_DEFAULT
from .precision import AutocastArg, autocast_spec
from .profiler import profile
from .runtime import RematHandle, apply
from .simulator import Plan, resolve_budget
from .sizes import format_bytes
from .training_step import Batch, ratios_text, ratios_to_first, timed_step

MENU, CHECKPOINTS = "optimal", "optimal without per-operator policies"


@dataclass(frozen=True)
class PlanTrial:
    """One candidate plan as measured: its name, the plan, its measured peak activation bytes, its step's
    per-round ratios to the first fitting candidate's, and ``refused``: why it is not kept (empty where it fits)."""

    name: str
    plan: Plan
    peak_bytes: int | None = None
    ratios: tuple[float, ...] = ()
    refused: str = ""

    @property
    def step_ratio(self) -> float | None:
        """Median of the per-round step ratios to the first fitting candidate's step."""
        return statistics.median(self.ratios) if self.ratios else None


@dataclass(frozen=True)
class PlanFit:
    """The plan chosen for ``max_bytes``, applied (``handle``), every candidate as measured, and the profile."""

    max_bytes: int
    chosen: PlanTrial
    trials: tuple[PlanTrial, ...]
    costs: CostTable = field(repr=False)
    handle: RematHandle = field(repr=False)

    @property
    def plan(self) -> Plan:
        return self.chosen.plan

    @property
    def passed_over(self) -> PlanTrial | None:
        """The candidate not kept, where two ran (None where both ``optimal`` plans were the same)."""
        return next((t for t in self.trials if t is not self.chosen), None)

    def passed_over_text(self) -> str:
        """What the candidate not kept measured: over the budget, or its step over the kept plan's ("" where one
        plan ran)."""
        other = self.passed_over
        if other is None:
            return ""
        if other.refused:
            return f"measured over: {other.refused}"
        return f"its step {(other.step_ratio or 1.0) / (self.chosen.step_ratio or 1.0):.3f}x the kept one's"

    def describe(self) -> str:
        lines = [f"plan within {format_bytes(self.max_bytes)}: {self.chosen.name}"]
        for t in self.trials:
            peak = f"peak {format_bytes(t.peak_bytes)}" if t.peak_bytes is not None else "not measured"
            step = f", step {ratios_text(t.ratios)}" if t.ratios else ""
            verdict = f", {t.refused}" if t.refused else ""
            mark = "  <- chosen" if t is self.chosen else ""
            lines.append(f"  {t.name} ({t.plan.action_counts()}): {peak}{step}{verdict}{mark}")
        return "\n".join(lines)


def fit(
    model: nn.Module,
    batch: Batch,
    max_bytes: int | float | str,
    *,
    costs: CostTable | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    blocks: BlocksArg = None,
    policies: str | tuple[str, ...] = PROFILED_BY_DEFAULT,
    autocast: AutocastArg = None,
    rounds: int = 5,
    clock: Callable[[], float] = time.perf_counter,
    holds_output: bool = True,
    set_to_none: bool = True,
) -> PlanFit:
    """Apply to ``model`` the faster of its two ``optimal`` plans within ``max_bytes`` by measured step time
    (module docstring): bytes, a string like ``"2GiB"``, or a fraction of the predicted no-checkpoint peak.

    ``costs``: the model's profile on this batch and settings, else taken here (``remat.profile`` with
    ``policies``). ``rounds``: timed steps per candidate, head to head. ``loss_fn``, ``blocks``, ``autocast``,
    ``clock``, ``holds_output`` are :func:`remat.profile`'s; ``set_to_none`` is how the loop clears gradients.
    Raises :class:`remat.BudgetError` (naming the least peak) where no plan is predicted to fit, or where every
    candidate measures over the budget."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: at least one timed step per plan is needed")
    chain = resolve_blocks(model, blocks)
    if costs is None:
        costs = profile(model, batch, loss_fn=loss_fn, blocks=chain, policies=policies, autocast=autocast,
                        clock=clock, holds_output=holds_output)  # fmt: skip
    limit = resolve_budget(max_bytes, costs)
    if limit is None:
        raise ValueError("max_bytes is None: give bytes, a string like '2GiB' or a fraction in (0, 1]")
    candidates = _candidates(costs, limit)
    device = model_device(model)
    spec = autocast_spec(autocast, device.type)
    handle = apply(model, candidates[0].plan, blocks=chain)
    try:
        with GradsRestored(model), torch.random.fork_rng(devices=[] if device.type == "cpu" else None,
                                                         device_type=device.type):  # fmt: skip

            def step(trial: PlanTrial) -> float:
                handle.set_plan(trial.plan)
                torch.manual_seed(0)  # every candidate draws what the others draw
                return timed_step(model, batch, loss_fn, spec, clock, holds_output, set_to_none)

            trials = _head_to_head(_peaks(candidates, step, limit, device), step, rounds)
        kept = [t for t in trials if not t.refused]
        if not kept:
            least = min(t.peak_bytes or 0 for t in trials)
            raise BudgetError(
                f"every plan predicted to fit {format_bytes(limit)} measured over it (least {format_bytes(least)}): "
                "give a lower budget to plan for, or profile again on a quieter machine",
                floor=least,
            )
        chosen = min(kept, key=lambda t: t.step_ratio if t.step_ratio is not None else 1.0)
        handle.set_plan(chosen.plan)
    except BaseException:
        handle.remove()
        raise
    return PlanFit(limit, chosen, tuple(trials), costs, handle)


def _candidates(costs: CostTable, limit: int) -> list[PlanTrial]:
    """``optimal`` over every action, then over those without per-operator policies where that plan differs and
    some plan of them fits (raises ``BudgetError`` where none of the first fits)."""
    menu = make_plan(costs, "optimal", limit)
    trials = [PlanTrial(MENU, menu)]
    exact = [a for a in plan_choices(costs) if not a.startswith(SELECTIVE_PREFIX) and not is_lossy(a)]
    try:
        plain = make_plan(costs, "optimal", limit, actions=exact)
    except BudgetError:
        return trials
    if plain.actions != menu.actions:
        trials.append(PlanTrial(CHECKPOINTS, plain))
    return trials


def _peaks(
    candidates: list[PlanTrial], step: Callable[[PlanTrial], float], limit: int, device: torch.device
) -> list[PlanTrial]:
    """Each candidate's measured peak (one warm-up step, then one under the tracker), refused where over."""
    measured = []
    for trial in candidates:
        step(trial)
        with measure(device) as meter:
            step(trial)
        peak = meter.activation_bytes
        refused = f"measured over {format_bytes(limit)}" if peak > limit else ""
        measured.append(PlanTrial(trial.name, trial.plan, peak, refused=refused))
    return measured


def _head_to_head(trials: list[PlanTrial], step: Callable[[PlanTrial], float], rounds: int) -> list[PlanTrial]:
    """The steps of the trials that fit, in interleaved rounds, as ratios to the first one's (where two fit)."""
    kept = [i for i, t in enumerate(trials) if not t.refused]
    if len(kept) < 2:
        return trials
    ratios = ratios_to_first(kept, lambda i: step(trials[i]), rounds)
    return [replace(t, ratios=ratios[i]) if i in ratios else t for i, t in enumerate(trials)]
