"""PGAC's collectives for data parallel training (``sync="global"``): one all-reduce of the EMA scores per
update, and one broadcast of the measured CostTable after the profiling step, so every rank computes the
same threshold, mask and budget fit."""

from __future__ import annotations

from typing import Any

import torch

from ..costs import CostTable


def require_distributed() -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "sync='global' averages scores across ranks and needs torch.distributed initialised "
            "(dist.init_process_group) before PGAC is created; use sync=None in a single process"
        )


def all_reduce_mean(values: list[float], group: Any = None) -> list[float]:
    """The mean over the ranks of ``values``, in float64, with one all-reduce (CPU for gloo, the current CUDA
    device for NCCL). Every rank receives the same numbers."""
    import torch.distributed as dist

    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    t /= dist.get_world_size(group)
    return t.tolist()


def broadcast_costs(costs: CostTable, group: Any = None) -> CostTable:
    """The first rank's cost table, on every rank."""
    import torch.distributed as dist

    box = [costs.to_dict() if dist.get_rank(group) == 0 else None]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return CostTable.from_dict(box[0])
