"""From timed runs of one block under each action to the time terms of its :class:`remat.core.costs.BlockCost`.

The runs come from :func:`remat.profiling.block_timing.time_actions`: round ``r`` ran every action once, so each
action's run ``r`` is paired with keep's run ``r``. Per round, an action's recomputation is:

* ``checkpoint``, ``checkpoint+compress:`` and ``recompute+compress:``: keep's forward (the block runs again
  as it ran the first time; compressing and restoring fall into the overhead);
* ``offload``, ``compress:<format>`` and ``partition:<budget>``: the whole difference from keep (the copies or
  the compression in forward, the copies back or the decompression in backward; what the compiled backward
  recomputes of a partitioned block);
* a selective policy that offloads: its timed recomputation plus its forward's excess over keep's (the
  copies to host the forward queued);
* any other selective policy: its timed recomputation, at most keep's forward.

and its overhead ``fwd_a + bwd_a - recompute_a - (fwd_keep + bwd_keep)`` (see :mod:`remat.core.costs`). Each term is the
median over rounds. Where the rounds timed a forward under ``torch.no_grad`` too, its median, at most the
checkpoint's recomputation, is the block's ``nograd_fwd_s``. The overhead may be negative, down to ``-recompute_a``:
a checkpointed forward saves nothing for backward and runs faster than a kept one, and the recomputation right
before the block's backward finds its weights in cache. Flooring every block's overhead at 0 would add the positive
half of each block's timing noise to every plan's prediction; flooring the time cost (``recompute + overhead``) at 0
keeps only what matters to a plan, that no action makes a step faster than keeping.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ..checkpointing import policies as _policies
from ..core import CHECKPOINT, COMPRESS, INPUT_COMPRESS, KEEP, OFFLOAD, PARTITION, RECOMPUTE_COMPRESS, Action
from .block_timing import NO_GRAD_FORWARD, Timing


@dataclass(frozen=True)
class ActionTimes:
    """The time terms of one block: keep's medians and, per action, the medians of the other terms."""

    fwd_s: float
    bwd_s: float
    recompute_s: dict[str, float]
    fwd_s_by_action: dict[str, float]
    bwd_s_by_action: dict[str, float]
    overhead_s: dict[str, float]
    nograd_fwd_s: float | None = None


def recompute_of(action: str, run: Timing, keep: Timing) -> float:
    """The recomputation seconds of one run of ``action``, paired with keep's run of the same round."""
    fwd, bwd, recompute = run
    keep_fwd, keep_bwd, _ = keep
    parsed = Action.parse(action)
    if parsed.kind == KEEP:
        return 0.0
    if parsed.kind in (CHECKPOINT, INPUT_COMPRESS, RECOMPUTE_COMPRESS):
        return keep_fwd
    if parsed.kind in (OFFLOAD, COMPRESS, PARTITION):
        return max((fwd - keep_fwd) + (bwd - keep_bwd), 0.0)
    if _policies.get(parsed.policy).offload is not None:
        return recompute + max(fwd - keep_fwd, 0.0)
    return min(recompute, keep_fwd)


def action_times(runs: dict[str, Sequence[Timing]]) -> ActionTimes:
    """The time terms from ``runs[action]``, one timing per round for every action (keep among them), and
    from ``runs[NO_GRAD_FORWARD]`` where it is there."""
    runs = dict(runs)
    no_grad = runs.pop(NO_GRAD_FORWARD, None)
    keep_runs = runs[KEEP]
    recompute: dict[str, float] = {}
    overhead: dict[str, float] = {}
    for action, action_runs in runs.items():
        if len(action_runs) != len(keep_runs):
            raise ValueError(f"action {action!r} has {len(action_runs)} timed runs and keep {len(keep_runs)}")
        paired = [recompute_of(action, run, keep) for run, keep in zip(action_runs, keep_runs, strict=True)]
        excess = [
            run[0] + run[1] - rec - (keep[0] + keep[1])
            for run, keep, rec in zip(action_runs, keep_runs, paired, strict=True)
        ]
        recompute[action] = statistics.median(paired)
        overhead[action] = 0.0 if action == KEEP else max(statistics.median(excess), -recompute[action])
    nograd_fwd_s = None
    if no_grad and CHECKPOINT in recompute:
        nograd_fwd_s = min(statistics.median(run[0] for run in no_grad), recompute[CHECKPOINT])
    return ActionTimes(
        fwd_s=statistics.median(run[0] for run in keep_runs),
        bwd_s=statistics.median(run[1] for run in keep_runs),
        recompute_s=recompute,
        fwd_s_by_action={a: statistics.median(run[0] for run in r) for a, r in runs.items()},
        bwd_s_by_action={a: statistics.median(run[1] for run in r) for a, r in runs.items()},
        overhead_s=overhead,
        nograd_fwd_s=nograd_fwd_s,
    )


__all__ = ["ActionTimes", "action_times", "recompute_of"]
