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
caller's step as the candidates of a :class:`~remat.fitting.trial.Fit` (rules 1-3 there), unless the profile
tells them apart (:func:`near_tie`: their predicted steps differ by more than its measured noise allows, as
the optimal planner reads ties: the plan over every action is then the one): each one's peak by
``remat.measure`` (the live-tensor tracker), then, where both fit, their steps head to head. It keeps the faster
plan whose measured peak fits and leaves it applied. Where both plans are the same, two steps measure its peak.

Invariants, enforced here:

1. The budget is resolved as ``remat.plan`` resolves it (a fraction is of the profile's predicted no-checkpoint
   peak).
2. The model ends with the chosen plan applied (``PlanFit.handle``) and nothing else; its parameter gradients
   and the RNG state are as they were. After an error the model is as it came.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import nn

from ..chains import resolve_blocks, timed_step
from ..checkpointing import PROFILED_BY_DEFAULT
from ..core import (
    SELECTIVE,
    Action,
    AutocastArg,
    Batch,
    BlocksArg,
    BudgetError,
    CostTable,
    StepSpec,
    autocast_spec,
    format_bytes,
    plan_choices,
)
from ..meters import model_device
from ..planning import Plan, make_plan, plans_tied, resolve_budget
from ..profiling import profile, step_aside
from ..runtime import RematHandle, apply
from .trial import Fit, Trial, fastest, head_to_head, over, peak_of, with_ratios

MENU, CHECKPOINTS = "optimal", "optimal without per-operator policies"


@dataclass(frozen=True)
class PlanFit(Fit):
    """The plan chosen for ``max_bytes``, applied (``handle``), every candidate as measured (one :class:`Trial`
    per ``optimal`` plan, ``trial.plan``), and the profile."""

    costs: CostTable = field(repr=False)
    handle: RematHandle = field(repr=False)

    heading: ClassVar[str] = "plan within {max_bytes}"

    @property
    def plan(self) -> Plan:
        assert self.chosen.plan is not None
        return self.chosen.plan

    @property
    def passed_over(self) -> Trial | None:
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


def fit(
    model: nn.Module,
    batch: Batch,
    max_bytes: int | float | str,
    *,
    costs: CostTable | None = None,
    step: StepSpec | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    blocks: BlocksArg = None,
    policies: str | tuple[str, ...] = PROFILED_BY_DEFAULT,
    autocast: AutocastArg = None,
    rounds: int = 5,
    clock: Callable[[], float] = time.perf_counter,
    holds_output: bool | None = None,
    set_to_none: bool = True,
) -> PlanFit:
    """Apply to ``model`` the faster of its two ``optimal`` plans within ``max_bytes`` by measured step time
    (module docstring): bytes, a string like ``"2GiB"``, or a fraction of the predicted no-checkpoint peak.

    ``costs``: the model's profile on this batch and settings, else taken here (``remat.profile`` with
    ``policies``). ``rounds``: at most this many timed steps per candidate, head to head (trial rule 2).
    ``step`` (or its fields ``loss_fn``, ``blocks``, ``autocast``, ``holds_output`` as keywords) and ``clock``
    are :func:`remat.profile`'s;
    ``set_to_none`` is how the loop clears gradients. Raises :class:`remat.BudgetError` (naming the least peak)
    where no plan is predicted to fit, or where every candidate measures over the budget."""
    spec = StepSpec.of(step, loss_fn=loss_fn, blocks=blocks, autocast=autocast, holds_output=holds_output)
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: at least one timed step per plan is needed")
    chain = resolve_blocks(model, spec.blocks)
    if costs is None:  # several chains are profiled as such (one joined list would be read as one chain)
        costs = profile(model, batch, step=spec, policies=policies, clock=clock)
    spec = replace(spec, blocks=chain)
    limit = resolve_budget(max_bytes, costs)
    if limit is None:
        raise ValueError("max_bytes is None: give bytes, a string like '2GiB' or a fraction in (0, 1]")
    candidates = candidate_trials(costs, limit)
    device = model_device(model)
    autocast_setting = autocast_spec(spec.autocast, device.type)
    assert candidates[0].plan is not None
    handle = apply(model, candidates[0].plan, blocks=chain)
    try:
        with step_aside(model):

            def run(trial: Trial) -> float:
                assert trial.plan is not None
                handle.set_plan(trial.plan)
                torch.manual_seed(0)  # every candidate draws what the others draw
                return timed_step(model, batch, spec.loss_fn, autocast_setting, clock, spec.holds_output, set_to_none)

            trials = []
            for trial in candidates:
                peak = peak_of(lambda trial=trial: run(trial), device)
                trials.append(replace(trial, peak_bytes=peak, refused=over(peak, limit)))
            fitting = [t for t in trials if t.fits]
            if len(fitting) > 1:
                by_label = {t.label: t for t in fitting}
                ratios = head_to_head(list(by_label), lambda label: run(by_label[label]), rounds, warm=False)
                trials = with_ratios(trials, ratios)
        chosen = fastest(trials)
        if chosen is None:
            least = min(t.peak_bytes or 0 for t in trials)
            raise BudgetError(
                f"every plan predicted to fit {format_bytes(limit)} measured over it (least {format_bytes(least)}): "
                "give a lower budget to plan for, or profile again on a quieter machine",
                floor=least,
            )
        handle.set_plan(chosen.plan)
    except BaseException:
        handle.remove()
        raise
    return PlanFit(limit, chosen, tuple(trials), costs, handle)


def candidate_trials(costs: CostTable, limit: int) -> list[Trial]:
    """``optimal`` over every action, then over those without per-operator policies where that plan differs and
    some plan of them fits (raises ``BudgetError`` where none of the first fits)."""
    menu = make_plan(costs, "optimal", limit)
    trials = [Trial(MENU, menu.action_counts(), plan=menu)]
    exact = [a for a in plan_choices(costs) if Action.choice(a).kind != SELECTIVE and Action.choice(a).is_exact]
    try:
        plain = make_plan(costs, "optimal", limit, actions=exact)
    except BudgetError:
        return trials
    if plain.actions != menu.actions and near_tie(costs, menu, plain):
        trials.append(Trial(CHECKPOINTS, plain.action_counts(), plan=plain))
    return trials


def near_tie(costs: CostTable, first: Plan, second: Plan) -> bool:
    """Whether ``costs`` cannot tell the two plans' steps apart: their predicted steps tie within the profile's
    measured noise (``info["time_noise_s"]``, :func:`remat.planning.search.plans_tied`). A table that records no
    noise tells no two plans apart."""
    noise = float(costs.info.get("time_noise_s", 0.0))
    if noise <= 0 or first.predicted_step_s is None or second.predicted_step_s is None:
        return True
    (faster, faster_s), (slower, slower_s) = sorted(
        [(first.actions, first.predicted_step_s), (second.actions, second.predicted_step_s)], key=lambda p: p[1]
    )
    return plans_tied(noise, faster.values(), slower.values(), faster_s, slower_s)
