"""What an ``offload`` costs where its copies overlap compute: the part of each copy that the neighbouring block's
compute cannot hide, and the device memory its copies hold while they run.

The runtime copies an offloaded block's saved tensors to the host on a side stream while the next block's forward
runs, and back while the next block's backward runs (:mod:`remat.checkpointing.offload_streams`, invariants 1 and 2).
So for block ``i`` of a chain, with ``moved = saved[keep] - saved[offload]`` bytes, bandwidths measured each way
(``CostTable.copy_bytes_per_s``) and block ``i + 1``'s forward and backward under keep as the windows::

    exposed forward   = max(0, moved / to_host   - fwd_s[i + 1])     -> overhead_s["offload"]
    exposed backward  = max(0, moved / to_device - bwd_s[i + 1])     -> recompute_s["offload"]
    in flight         = saved[keep][i + 1] + max(fwd_temp, bwd_temp)[i + 1] - bwd_temp[i]
                                                          -> bwd_extra_bytes["offload"] (at least as measured)

A chain's last block has no window (its copy back comes first in backward and is not made ahead). The windows are
the neighbour's keep times, the least compute it runs whatever its action, and two offloaded neighbours each get
one block's compute for their copies, which is what one copy engine each way serves in a row. ``in flight`` is what
the copies hold on the device beyond what the block's own unit counts: its moved bytes stay alive through the next
block's forward (until the copies end) and come back during the next block's backward, beside that block's own
peak; counted in the offloaded block's unit peak, as a unit's peak is bytes above what the units before retain.
A table without bandwidths (the CPU, where nothing is copied; estimates) is returned as it is.
"""

from __future__ import annotations

import dataclasses

from ..core import KEEP, OFFLOAD, BlockCost, CostTable


def exposed_copy_s(moved_bytes: float, bytes_per_s: float, window_s: float) -> float:
    """Seconds of a copy of ``moved_bytes`` at ``bytes_per_s`` that ``window_s`` of compute beside it does not hide."""
    if bytes_per_s <= 0:
        raise ValueError(f"a copy bandwidth must be positive, got {bytes_per_s} bytes/s")
    return max(0.0, moved_bytes / bytes_per_s - window_s)


def overlap_priced(costs: CostTable) -> CostTable:
    """``costs`` with each ``offload`` priced by its copies' exposed parts and the memory they hold in flight (the
    module's docstring); the measured figures stay in ``fwd_s_by_action`` / ``bwd_s_by_action``."""
    bandwidth = costs.copy_bytes_per_s
    if not bandwidth:
        return costs
    to_host, to_device = bandwidth["to_host"], bandwidth["to_device"]
    rows = list(costs.blocks)
    for chain in costs.chains:
        for i in chain:
            row = rows[i]
            if OFFLOAD not in row.recompute_s or OFFLOAD not in row.saved_bytes:
                continue
            following = costs.blocks[i + 1] if i + 1 in chain else None
            moved = max(0, row.saved(KEEP) - row.saved(OFFLOAD))
            out_exposed = exposed_copy_s(moved, to_host, following.fwd_s if following else 0.0)
            back_exposed = exposed_copy_s(moved, to_device, following.bwd_s if following else 0.0)
            in_flight = 0
            if following is not None:
                beside = following.saved(KEEP) + max(following.fwd_temp_bytes, following.bwd_temp_bytes)
                in_flight = beside - row.bwd_temp_bytes
            rows[i] = _priced(row, out_exposed, back_exposed, in_flight)
    priced = dataclasses.replace(costs, blocks=rows, info={**costs.info, "offload_priced": "overlap"})
    return priced


def _priced(row: BlockCost, out_exposed: float, back_exposed: float, in_flight: int) -> BlockCost:
    return dataclasses.replace(
        row,
        recompute_s={**row.recompute_s, OFFLOAD: back_exposed},
        overhead_s={**row.overhead_s, OFFLOAD: out_exposed},
        bwd_extra_bytes={**row.bwd_extra_bytes, OFFLOAD: max(row.bwd_extra_bytes.get(OFFLOAD, 0), in_flight)},
    )


__all__ = ["exposed_copy_s", "overlap_priced"]
