"""The actions a block is profiled under: keep, checkpoint, selective policies, offload on CUDA and the lossy
compress actions a user asks for."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import policies as _policies
from .costs import CHECKPOINT, KEEP, OFFLOAD, SELECTIVE_PREFIX
from .lossy_actions import COMPRESS_PREFIX, is_lossy, parse_compress


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


def lossy_actions(lossy: Iterable[str]) -> list[str]:
    """``compress:`` actions from formats (``"int8"``) or actions (``"compress:int8:matmul"``), checked."""
    if isinstance(lossy, str):
        lossy = (lossy,)
    actions = [f if is_lossy(f) else COMPRESS_PREFIX + f for f in lossy]
    for action in actions:
        parse_compress(action)
    return actions
