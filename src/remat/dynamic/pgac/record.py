"""What one PGAC optimizer step did and decided (:class:`StepRecord`, one entry of ``PGAC.history``), PGAC's own
time per step read from them (:func:`own_seconds`), and the reward the learned gamma schedule takes from one
(:func:`step_reward`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    """What happened in optimizer step ``step`` and what PGAC decided at its end (one entry of ``history``).

    ``actions``, ``predicted_peak_bytes``, ``measured_peak_bytes`` and ``step_time_s`` describe the step that
    just ran; ``step_scores`` are its raw scores (None when not scored); ``scores`` (EMA after it), ``gamma``,
    ``tau``, ``mask`` (the threshold mask, True = stored, before the budget fit) and ``next_actions`` (the
    fitted plan) are the decision for the next step. ``update_s`` and ``scoring_s`` are PGAC's own seconds in
    the step: its update, and its gradient hooks in the backward passes. Tuples are in chain order (``PGAC.fqns``).
    """

    step: int
    scored: bool
    step_scores: tuple[float, ...] | None
    scores: tuple[float, ...]
    gamma: float
    tau: float
    mask: tuple[bool, ...]
    actions: tuple[str, ...]
    next_actions: tuple[str, ...]
    predicted_peak_bytes: int | None
    next_predicted_peak_bytes: int | None
    measured_peak_bytes: int | None
    step_time_s: float | None
    reward: float | None
    update_s: float
    scoring_s: float = 0.0


OWN_TIME_STEPS = 8  # how many recent steps own_seconds reads


def own_seconds(history: Iterable[StepRecord]) -> tuple[float, float]:
    """PGAC's own seconds per step over its last steps (up to :data:`OWN_TIME_STEPS`): in its gradient hooks, inside
    the backward (mean: with ``every`` > 1 only some steps score), and in its update, after the optimizer step
    (median); zeros before the first update. Host clock: on CUDA the scoring kernels run asynchronously, and the
    update's clock starts once the device has finished the work its scores need (the step's, not PGAC's own)."""
    recent = list(history)[-OWN_TIME_STEPS:]
    if not recent:
        return 0.0, 0.0
    return statistics.fmean(r.scoring_s for r in recent), statistics.median(r.update_s for r in recent)


def step_reward(step_s: float, peak_bytes: int | None, budget_bytes: int | None, penalty: float = 10.0) -> float:
    """The learned schedule's reward for one step: ``-log(step_s) - penalty * max(0, peak / budget - 1)``.

    ``-log`` of the step time is log throughput, so equal relative speed-ups are worth the same at any
    scale; the hinge costs ``penalty`` per unit of relative overshoot (10: 1% over the budget is as bad as
    a 10% slower step) and nothing below the budget.
    """
    reward = -math.log(step_s)
    if budget_bytes and peak_bytes is not None:
        reward -= penalty * max(0.0, peak_bytes / budget_bytes - 1.0)
    return reward
