"""The actions a block is profiled under: keep, checkpoint, the selective policies asked for, offload on CUDA
and the lossy actions asked for (:func:`remat.lossy_actions.lossy_actions`, checked before any block runs); on
a compiled block (``module.compile()``) only those that leave its compiled code compiled, and the partition
actions it was compiled for (:func:`compiled_block_actions`, :mod:`remat.compiled_partitions`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from . import policies as _policies
from .compiled_partitions import partition_actions
from .costs import CHECKPOINT, KEEP, OFFLOAD, SELECTIVE_PREFIX
from .lossy_actions import lossy_actions

__all__ = ["COMPILED_BLOCK_ACTIONS", "compiled_block_actions", "default_actions"]

# Actions whose regions open and close around a compiled forward with saved-tensor hooks only. A selective
# policy's dispatch mode sees only the few operators at the compiled graph's edge, not those inside it, so on
# a compiled block it is a checkpoint saving a few tensors more, not the policy its name says; a lossy action's
# compression is not profiled on compiled code.
COMPILED_BLOCK_ACTIONS = (KEEP, CHECKPOINT, OFFLOAD)


def default_actions(
    device: torch.device, policies: str | Iterable[str] = _policies.PROFILED_BY_DEFAULT, lossy: Iterable[str] = ()
) -> list[str]:
    """The actions a block is profiled under: keep, checkpoint, ``selective:<policy>`` for each of ``policies``
    (``"menu"`` for :data:`remat.policies.MENU`), offload on CUDA, and ``compress:<format>`` for each of
    ``lossy`` (formats or compress actions)."""
    actions = [KEEP, CHECKPOINT] + [SELECTIVE_PREFIX + name for name in _policies.expand(policies)]
    if device.type == "cuda":
        actions.append(OFFLOAD)
    return actions + lossy_actions(lossy)


def compiled_block_actions(
    fqn: str, actions: Sequence[str], asked: Sequence[str] = (), module: nn.Module | None = None
) -> list[str]:
    """Of ``actions``, those a compiled block can run (:data:`COMPILED_BLOCK_ACTIONS`), then the partition
    actions ``module`` was compiled for (:mod:`remat.compiled_partitions`); the per-op policies of the default set
    are left out. ``asked``: actions the caller named (``actions=``, ``lossy=``), refused with an error when the
    compiled block cannot run them."""
    partitions = partition_actions(module) if module is not None else []
    refused = [a for a in asked if a not in COMPILED_BLOCK_ACTIONS and a not in partitions]
    if refused:
        raise ValueError(
            f"block {fqn!r} is compiled (module.compile()) and cannot be profiled under {refused}: a per-op "
            "policy does not reach the operators inside compiled code, and compression is not profiled there. "
            f"Profile compiled blocks under {list(COMPILED_BLOCK_ACTIONS)} only, or profile before compiling"
        )
    chosen = [a for a in actions if a in COMPILED_BLOCK_ACTIONS]
    return chosen + [a for a in partitions if a not in chosen and (not asked or a in actions)]
