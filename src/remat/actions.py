"""The action vocabulary of plans and how a chain's block actions group into units.

A block's action is ``"keep"``, ``"checkpoint"``, ``"offload"``, ``"selective:<policy>"``, the lossy
``"compress:<format>[:<policy>]"`` and ``"checkpoint+compress:<format>"`` (:mod:`remat.lossy_actions`),
``"partition:<budget>"`` on a compiled block (torch's partitioner under that budget, :mod:`remat.compiled_partitions`),
or a group action:

* ``"segment:<id>"``: consecutive blocks with the same id form one segment, recomputed in backward from the
  segment's stored input (the input of its first block).
* ``"memory_poor:<id>"``: consecutive blocks with the same id form a memory-poor group: during backward every
  block's input is recomputed from the group's input, so nothing inside the group is ever stored.

The runtime handles a chain as units: a single block, a segment or a memory-poor group.

Memory-poor groups were once spelled ``"nested:<id>"`` (and the group kind ``"nested"`` in
``optimal(actions=...)``). :func:`current_action` is the one place that reads the old spelling: plans, plan
files, action lists and ``actions=`` options pass through it and come out as ``"memory_poor:<id>"`` (and
``"memory_poor"``); :class:`remat.Plan` and the optimal planner warn with a DeprecationWarning when they convert.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from .compiled_partitions import budget_of, is_partition
from .costs import CHECKPOINT, KEEP, OFFLOAD, SELECTIVE_PREFIX, CostTable
from .lossy_actions import is_lossy, validate_lossy

SEGMENT_PREFIX = "segment:"
MEMORY_POOR_PREFIX = "memory_poor:"
LEGACY_MEMORY_POOR = "nested"  # the old name of MEMORY_POOR, read by current_action
LEGACY_NESTED_PREFIX = LEGACY_MEMORY_POOR + ":"

# Unit kinds.
SINGLE = "single"
SEGMENT = "segment"
MEMORY_POOR = "memory_poor"
GROUP_KINDS = (SEGMENT, MEMORY_POOR)


@dataclass(frozen=True)
class Unit:
    """A run of blocks ``start..end`` (inclusive) handled as one piece by the runtime."""

    kind: str  # SINGLE, SEGMENT or MEMORY_POOR
    start: int
    end: int
    action: str  # the block action for SINGLE; "checkpoint" for the groups

    @property
    def size(self) -> int:
        return self.end - self.start + 1


def is_legacy(action: str) -> bool:
    """Whether ``action`` uses the old spelling of memory-poor groups (``"nested:<id>"`` or ``"nested"``)."""
    return action == LEGACY_MEMORY_POOR or action.startswith(LEGACY_NESTED_PREFIX)


def current_action(action: str) -> str:
    """``action`` in the current vocabulary: ``"nested:<id>"`` becomes ``"memory_poor:<id>"`` and the group kind
    ``"nested"`` becomes ``"memory_poor"``; every other action is returned as it is."""
    if is_legacy(action):
        return MEMORY_POOR + action[len(LEGACY_MEMORY_POOR) :]
    return action


def warn_legacy(where: str, stacklevel: int) -> None:
    """The DeprecationWarning of reading the old spelling in ``where`` (``stacklevel`` as for warnings.warn,
    counted from the caller)."""
    warnings.warn(
        f"{where} spells memory-poor groups the old way ('{LEGACY_NESTED_PREFIX}<id>', group kind "
        f"'{LEGACY_MEMORY_POOR}'); it was read as '{MEMORY_POOR_PREFIX}<id>' ('{MEMORY_POOR}'). Write the new "
        "spelling: the old one will stop being read.",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def validate_action(action: str) -> None:
    """Raise ValueError unless ``action`` is a block action (in the old spelling too, see :func:`current_action`)."""
    current = current_action(action)
    if current in (KEEP, CHECKPOINT, OFFLOAD):
        return
    if is_lossy(current):
        validate_lossy(current)
        return
    if is_partition(current):
        budget_of(current)
        return
    for prefix in (SELECTIVE_PREFIX, SEGMENT_PREFIX, MEMORY_POOR_PREFIX):
        if current.startswith(prefix) and len(current) > len(prefix):
            return
    raise ValueError(
        f"unknown action {action!r}; use 'keep', 'checkpoint', 'offload', 'selective:<policy>', "
        "'partition:<budget>', 'compress:<format>', 'checkpoint+compress:<format>', 'segment:<id>' or "
        "'memory_poor:<id>'"
    )


def units_from_actions(actions: list[str]) -> list[Unit]:
    """Group a chain-ordered list of block actions into runtime units."""
    units: list[Unit] = []
    actions = [current_action(a) for a in actions]
    i = 0
    while i < len(actions):
        action = actions[i]
        validate_action(action)
        if action.startswith(SEGMENT_PREFIX):
            kind = SEGMENT
        elif action.startswith(MEMORY_POOR_PREFIX):
            kind = MEMORY_POOR
        else:
            units.append(Unit(SINGLE, i, i, action))
            i += 1
            continue
        j = i
        while j + 1 < len(actions) and actions[j + 1] == action:
            j += 1
        units.append(Unit(kind, i, j, CHECKPOINT))
        i = j + 1
    return units


def plan_choices(costs: CostTable) -> list[str]:
    """What a plan on ``costs`` may choose among when not told: every plannable single-block action
    (:meth:`~remat.costs.CostTable.plannable_actions`, each on the blocks that run it), then both group kinds
    when every block has checkpoint costs (a group recomputes its blocks from its input)."""
    return [*costs.plannable_actions(), *(GROUP_KINDS if CHECKPOINT in costs.common_actions() else ())]
