"""A plan on a live model: ``remat.apply`` installs hooks once, ``handle.set_plan`` switches plans between steps
without re-wrapping, ``handle.remove()`` undoes it; what copying a hooked model does; recompute statistics.

* :mod:`.handle`: :func:`apply` and :class:`RematHandle`, whose rules are Notes [1]-[8] there (segments,
  memory-poor groups, RNG replay, hooks installed once, what ``set_plan`` may change, teardown, autocast, blocks
  called more than once);
* :mod:`.applied`: one plan per model, a deep copy the plain model (pickling refused while hooked), every plan
  switched off while a block is measured alone (:func:`suspend_all`);
* :mod:`.recompute_stats`: block re-executions in backward and their seconds.
"""

from __future__ import annotations

from . import applied
from .applied import Counting, HandleHook, OwnsHooks, all_suspended, owner_of, suspend_all
from .handle import RematHandle, apply
from .recompute_stats import RecomputeStats

__all__ = [
    "Counting",
    "HandleHook",
    "OwnsHooks",
    "all_suspended",
    "suspend_all",
    "RecomputeStats",
    "RematHandle",
    "applied",
    "apply",
    "owner_of",
]
