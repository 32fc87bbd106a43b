"""What the integrations ask about the distributed setting: how many ranks a process group has, and whether a
model was sharded with FSDP2. Shared by the session (which plans) and the DDP / FSDP2 helpers (which wrap)."""

from __future__ import annotations

from typing import Any

from torch import nn


def distributed_world(process_group: Any = None) -> int:
    """Number of ranks in ``process_group`` (1 when torch.distributed is not initialised)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` or one of its modules was sharded with FSDP2's ``fully_shard``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())
