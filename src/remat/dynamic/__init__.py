"""Dynamic controllers that observe training and change what is stored: PGAC (gradient-aware masks re-planned
between steps, :mod:`remat.dynamic.pgac`) and DTR (eviction inside a step, :mod:`remat.dynamic.dtr`).

Both sit above the profiler (PGAC profiles its first step when it is given no costs), the planners and the
runtime, whose handle PGAC switches between plans.
"""

from __future__ import annotations

from .dtr import DTR, HEURISTICS, DTRStats
from .pgac import PGAC, PGACQ, Schedule, StepRecord, make_schedule, simulate_pipeline_masks, step_reward

__all__ = [
    "DTR",
    "HEURISTICS",
    "PGAC",
    "PGACQ",
    "DTRStats",
    "Schedule",
    "StepRecord",
    "make_schedule",
    "simulate_pipeline_masks",
    "step_reward",
]
