"""PGAC under pipeline parallelism, as a pure simulation: masks decided per stage, information crossing only
at stage boundaries, piggybacked on the activation and gradient messages the pipeline sends anyway.

A pipeline splits the chain into stages of consecutive blocks. A stage always stores the activation it
receives (its input), so a stage boundary is a fixed checkpoint and no segment can cross it: each stage fits
its own mask to its own device's budget with the rows of the cost table it owns.

``mode="local"``: each stage thresholds its own EMA scores, ``tau_p = gamma * Quantile_q(scores of stage p)``,
and plans its next step at once. Nothing is exchanged.

``mode="global"``: every stage uses the threshold of the whole chain, as single-process PGAC does, with no
collective:

* forward of step ``t``: stage ``p`` appends the EMA scores of its blocks (as they were after step ``t-1``) to
  the activation message it sends to stage ``p+1``; the last stage then holds the scores of the whole chain
  and computes ``tau_{t-1} = gamma * Quantile_q(all scores)``;
* backward of step ``t``: ``tau_{t-1}`` (one number) travels back with the gradient messages, to stage 0;
* each stage then sets its mask for step ``t+1`` from its own scores after step ``t-1`` and ``tau_{t-1}``.

So global masks are exactly the single-process masks, one step later (scores of step ``t-1`` decide step
``t+1`` instead of step ``t``), and the cost is ``sum_p end_p`` floats on forward messages plus one float per
backward message per step. Under 1F1B with micro-batches, the numbers ride on the first micro-batch's
messages. :func:`simulate_pipeline_masks` plays this protocol over a history of scores.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...core import CHECKPOINT, KEEP, CostTable, regroup
from ...planning import split_stages, stage_costs
from .mask import MaskFitter, quantile, score_mask


@dataclass(frozen=True)
class Message:
    """Numbers one stage sends its neighbour in step ``step``, on top of the activation or gradient."""

    step: int
    src: int
    dst: int
    direction: str  # "forward" (with the activation) or "backward" (with the gradient)
    floats: int


@dataclass
class PipelineRun:
    """Per step: each stage's block actions and the threshold it used; and every boundary message."""

    stages: list[tuple[int, int]]  # [start, end) of each stage
    actions: list[list[tuple[str, ...]]]  # actions[t][p]: actions of stage p's blocks in step t
    taus: list[list[float | None]]  # taus[t][p]: threshold that decided stage p's mask for step t
    messages: list[Message]

    def chain_actions(self, step: int) -> list[str]:
        """Actions of the whole chain in ``step``; group ids are made unique per stage."""
        out: list[str] = []
        for p, acts in enumerate(self.actions[step]):
            out += regroup(acts, lambda kind, old, seen, p=p: f"stage{p}.{old}")
        return out

    def mask(self, step: int) -> list[bool]:
        return [a == KEEP for a in self.chain_actions(step)]


def simulate_pipeline_masks(
    score_history: Sequence[Sequence[float]],
    stage_sizes: Sequence[int],
    *,
    q: float = 0.5,
    gamma: float | Callable[[int], float] = 1.0,
    mode: str = "global",
    costs: CostTable | None = None,
    budgets: Sequence[int | None] | None = None,
) -> PipelineRun:
    """Play PGAC's pipeline protocol over ``score_history[t]`` (the chain's EMA scores after step ``t``).

    Returns the actions every stage runs in steps ``0..len(score_history)``. With ``costs`` each stage's mask
    is fitted to ``budgets[p]`` bytes on its own rows; without, stored blocks ``keep`` and the others
    ``checkpoint``.
    """
    if mode not in ("global", "local"):
        raise ValueError(f"mode must be 'global' or 'local', got {mode!r}")
    if not score_history:
        raise ValueError("score_history is empty: give the EMA scores after each step")
    n = len(score_history[0])
    stages = split_stages(n, stage_sizes)
    if budgets is not None and len(budgets) != len(stages):
        raise ValueError(f"give one budget per stage ({len(stages)}), got {len(budgets)}")
    if costs is not None and len(costs) != n:
        raise ValueError(f"the cost table has {len(costs)} blocks but the scores have {n}")
    gamma_at = gamma if callable(gamma) else (lambda _t: float(gamma))
    fitters = [
        MaskFitter(stage_costs(costs, s, e), budgets[p] if budgets else None) if costs is not None else None
        for p, (s, e) in enumerate(stages)
    ]

    def plan_stage(p: int, scores: Sequence[float] | None, tau: float | None) -> tuple[str, ...]:
        s, e = stages[p]
        own = list(scores[s:e]) if scores is not None else [0.0] * (e - s)
        stored = score_mask(own, tau) if tau is not None else [True] * (e - s)
        if fitters[p] is None:
            return tuple(KEEP if c else CHECKPOINT for c in stored)
        return fitters[p].fit(stored, own).actions

    steps = len(score_history) + 1
    initial = [plan_stage(p, None, None) for p in range(len(stages))]
    actions: list[list[tuple[str, ...]]] = [initial]
    taus: list[list[float | None]] = [[None] * len(stages)]
    messages: list[Message] = []
    for t in range(1, steps):
        if mode == "local":
            scores = score_history[t - 1]
            step_taus = [gamma_at(t - 1) * quantile(list(scores[s:e]), q) for s, e in stages]
            actions.append([plan_stage(p, scores, step_taus[p]) for p in range(len(stages))])
            taus.append(step_taus)
            continue
        # Step t-1's forward carried the scores after step t-2 and its backward carried back their tau,
        # which decides step t.
        if t >= 2:
            scores = score_history[t - 2]
            tau = gamma_at(t - 2) * quantile(list(scores), q)
            actions.append([plan_stage(p, scores, tau) for p in range(len(stages))])
            taus.append([tau] * len(stages))
            for p in range(len(stages) - 1):
                messages.append(Message(t - 1, p, p + 1, "forward", stages[p][1]))
            for p in range(len(stages) - 1, 0, -1):
                messages.append(Message(t - 1, p, p - 1, "backward", 1))
        else:
            actions.append(initial)
            taus.append([None] * len(stages))
    return PipelineRun(stages, actions, taus, messages)
