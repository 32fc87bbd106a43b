"""PGAC, gradient-aware proactive activation checkpointing (the proposal of ``000_*.txt``): per block the score
``s_l = ||dL/da_l * a_l||_2``, its EMA, a ``q``-quantile threshold scaled by the schedule ``gamma(t)``, and the
mask re-planned between optimizer steps under a byte budget; DDP and pipeline stages; PGAC-Q, whose blocks may
also be stored compressed.

* :mod:`.controller`: :class:`PGAC` (options, the data-parallel collectives, the update after each step);
* :mod:`.scores`: the gradient proxy from what backward produces; :mod:`.mask`: the threshold and the mask fitted
  to the budget as pure functions; :mod:`.schedules`: ``gamma(t)``; :mod:`.record`: one step's record and the
  learned schedule's reward; :mod:`.state`: the state saved in training checkpoints;
* :mod:`.pipeline`: masks per pipeline stage, decided from messages the pipeline sends anyway;
* :mod:`.q` and :mod:`.q_mask`: PGAC-Q's three states.

Rules: the update's steps 1-6 (:mod:`.controller`), the mask's fitting to the budget 1-4 (:mod:`.mask`) and
PGAC-Q's 1-4 (:mod:`.q_mask`).
"""

from __future__ import annotations

from .controller import PGAC
from .pipeline import simulate_pipeline_masks
from .q import PGACQ
from .record import StepRecord, step_reward
from .schedules import Constant, Cosine, FromFunction, LearnedGamma, Linear, Schedule, make_schedule

__all__ = [
    "PGAC",
    "PGACQ",
    "Constant",
    "Cosine",
    "FromFunction",
    "LearnedGamma",
    "Linear",
    "Schedule",
    "StepRecord",
    "make_schedule",
    "simulate_pipeline_masks",
    "step_reward",
]
