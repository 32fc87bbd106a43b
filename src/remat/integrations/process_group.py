"""How many ranks a process group has: the session picks PGAC's global threshold when there is more than one."""

from __future__ import annotations

from typing import Any


def distributed_world(process_group: Any = None) -> int:
    """Number of ranks in ``process_group`` (1 when torch.distributed is not initialised)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)
