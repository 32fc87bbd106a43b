"""Static strategies as pure functions of a CostTable: memory-rich, full, every-k, sqrt(n), memory-poor and
random selection. No torch state and no I/O.

On a table of several chains the grouping strategies (every-k, sqrt, memory-poor) group each chain on its own:
a group never spans two chains, and group ids are numbered across the whole plan."""

from __future__ import annotations

import math
import random as _random
from collections.abc import Callable

from ..core import CHECKPOINT, KEEP, MEMORY_POOR, SEGMENT, Action, CostTable, regroup
from .plan import Plan


def none(costs: CostTable, budget: int | None = None) -> Plan:
    """Memory-rich: keep every activation, recompute nothing."""
    return Plan.from_actions(costs, [KEEP] * len(costs), "none", budget)


def full(costs: CostTable, budget: int | None = None) -> Plan:
    """Checkpoint every block (one stored input per block, each block re-run once in backward)."""
    return Plan.from_actions(costs, [CHECKPOINT] * len(costs), "full", budget)


def segments(n: int, k: int) -> list[str]:
    """Actions splitting ``n`` blocks into consecutive segments of ``k`` (the last one may be shorter)."""
    if k < 1:
        raise ValueError(f"segment length k must be at least 1, got {k}")
    if k == 1:
        return [CHECKPOINT] * n
    actions = []
    for i in range(n):
        seg = i // k
        size = min(k, n - seg * k)
        actions.append(CHECKPOINT if size == 1 else Action.group(SEGMENT, seg).text)
    return actions


def per_chain(costs: CostTable, actions_for: Callable[[int], list[str]]) -> list[str]:
    """``actions_for(n)`` applied to each chain of ``costs`` (``n`` its blocks), group ids renumbered so that no
    two chains share one."""
    actions: list[str] = []
    offset = 0
    for chain in costs.chains:
        renamed = regroup(actions_for(len(chain)), lambda kind, old, seen, offset=offset: offset + seen)
        actions += renamed
        offset += len({a for a in renamed if Action.parse(a).is_group})
    return actions


def every_k(costs: CostTable, budget: int | None = None, k: int = 2) -> Plan:
    """Static uniform checkpointing: store one input every ``k`` blocks and recompute each segment of ``k``
    blocks from it."""
    return Plan.from_actions(costs, per_chain(costs, lambda n: segments(n, int(k))), "every_k", budget, k=int(k))


def sqrt(costs: CostTable, budget: int | None = None) -> Plan:
    """Segments of about sqrt(L) blocks: O(sqrt L) memory for one extra forward (Chen et al. 2016); L is the
    longest chain's length."""
    k = max(1, round(math.sqrt(max(len(chain) for chain in costs.chains))))
    return Plan.from_actions(costs, per_chain(costs, lambda n: segments(n, k)), "sqrt", budget, k=k)


def memory_poor(costs: CostTable, budget: int | None = None) -> Plan:
    """Store nothing inside the chain: every block's activations are recomputed from the chain's input
    (O(1) memory, L(L-1)/2 block re-executions). The last block is kept: its backward follows its forward
    immediately, so storing it costs nothing at the peak."""
    actions = per_chain(costs, lambda n: ([Action.group(MEMORY_POOR, 0).text] * (n - 1) + [KEEP]) if n else [])
    return Plan.from_actions(costs, actions, "memory_poor", budget)


def random(costs: CostTable, budget: int | None = None, fraction: float = 0.5, seed: int = 0) -> Plan:
    """Checkpoint a random ``fraction`` of the blocks (the random-selection baseline)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    n = len(costs)
    rng = _random.Random(seed)
    chosen = set(rng.sample(range(n), round(fraction * n)))
    actions = [CHECKPOINT if i in chosen else KEEP for i in range(n)]
    return Plan.from_actions(costs, actions, "random", budget, fraction=fraction, seed=seed)
