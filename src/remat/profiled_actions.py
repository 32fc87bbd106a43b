"""The actions a block is profiled under: keep, checkpoint, the selective policies asked for, offload on CUDA
and the lossy actions asked for (:func:`remat.lossy_actions.lossy_actions`, checked before any block runs)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import policies as _policies
from .costs import CHECKPOINT, KEEP, OFFLOAD, SELECTIVE_PREFIX
from .lossy_actions import lossy_actions

__all__ = ["default_actions"]


def default_actions(
    device: torch.device, policies: str | Iterable[str] = ("dots_saveable",), lossy: Iterable[str] = ()
) -> list[str]:
    """The actions a block is profiled under: keep, checkpoint, ``selective:<policy>`` for each of ``policies``
    (``"menu"`` for :data:`remat.policies.MENU`), offload on CUDA, and ``compress:<format>`` for each of
    ``lossy`` (formats or compress actions)."""
    actions = [KEEP, CHECKPOINT] + [SELECTIVE_PREFIX + name for name in _policies.expand(policies)]
    if device.type == "cuda":
        actions.append(OFFLOAD)
    return actions + lossy_actions(lossy)
