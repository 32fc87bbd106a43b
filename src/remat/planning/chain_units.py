"""The units the optimal planner chooses among, as numpy columns: every single-block action and every group
(segment or memory-poor) of a chain, with the terms of :mod:`remat.planning.unit_terms`' vectorised form, listed by the
block they start at or the block they end at. Also which actions a search may use, and plans back from units.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core import GROUP_KINDS, KEEP, LAYER_DROP_GROUPS, Action, CostTable
from .unit_terms import ChainNumbers, GroupTable, SingleTable, group_table, single_table

ROWS_AT_ONCE = 64  # group starts whose terms starting_at computes in one table


@dataclass
class Units:
    """Units as columns: the single actions first, then the groups of each kind in ``group_kinds`` order."""

    start: np.ndarray  # first block
    end: np.ndarray  # last block
    retained: np.ndarray
    peak: np.ndarray
    time: np.ndarray  # time cost: recomputation plus overhead
    reexec: np.ndarray  # block re-executions in backward, summed over the unit's blocks
    deferred: np.ndarray  # blocks re-run ahead of a later block's backward (a segment's blocks but its last)
    code: np.ndarray  # a single action index, or len(singles) plus the group kind index


@dataclass
class ChainUnits:
    """The single-action and group terms of one cost table, for searches with groups of at most ``longest``
    blocks (group tables are cached per ``longest``). ``numbers`` is None when no group kind is allowed."""

    singles: SingleTable
    group_kinds: list[str]
    numbers: ChainNumbers | None
    head: int
    stem: int
    head_retained: int
    between: np.ndarray  # (blocks,): bytes that become alive after a unit ending at the block (chains' ends)
    chain_of: np.ndarray  # (blocks,): the chain of each block; no group spans two
    backward_extra: np.ndarray  # (blocks,): a unit's peak adds the largest over its blocks (simulator's term)
    held_args: np.ndarray  # (blocks,): the held arguments alive at each block, added as backward_extra is
    outputs_kept: bool  # the model keeps every block's output (a group's inner outputs are not freed)
    _groups: dict[int, GroupTable] = field(default_factory=dict)
    _starting: dict[tuple[int, int], Units] = field(default_factory=dict)
    _rows: GroupTable | None = None  # the latest run of rows computed for starting_at

    @classmethod
    def from_costs(cls, costs: CostTable, actions: list[str] | None) -> ChainUnits:
        """The units of ``costs``, with the held arguments counted in every unit's peak (those alive at its rows,
        :meth:`CostTable.held_args_per_row`) and in the head's (all of them). The simulator counts them so for
        every plan that is not all ``keep``; keeping everything, the one plan this overestimates, is weighed on
        its own (:func:`remat.planning.optimal_plan.optimal`)."""
        singles, group_kinds = allowed_actions(costs, actions)
        numbers = ChainNumbers.of(costs) if group_kinds else None
        between = np.zeros(len(costs), dtype=np.int64)
        for end, gap in costs.between_after().items():
            between[end] = gap
        return cls(
            single_table(costs, singles), group_kinds, numbers, int(costs.head_bytes + costs.held_args_bytes),
            int(costs.stem_bytes), int(costs.head_retained_bytes), between,
            np.array(costs.chain_index(), dtype=np.int64), np.array(costs.backward_bytes_per_row(), dtype=np.int64),
            np.array(costs.held_args_per_row(), dtype=np.int64), costs.outputs_kept,
        )  # fmt: skip

    @property
    def n(self) -> int:
        return len(self.singles.keep)

    def groups(self, longest: int) -> GroupTable:
        """The groups of at most ``longest`` blocks starting at every block (cached per ``longest``)."""
        if longest not in self._groups:
            self._groups[longest] = self._group_table(longest)
        return self._groups[longest]

    def starting_at(self, start: int, longest: int) -> Units:
        """Every unit that starts at block ``start``, groups of at most ``longest`` blocks (cached: the bounds
        on what a plan needs read them once per pass over the chain)."""
        key = (start, longest)
        if key not in self._starting:
            length = min(self.n - start, longest) if self.group_kinds else 1
            picks = {}
            if length > 1:
                table, lengths = self._rows_for(start, longest), slice(1, length)
                row = start - table.first
                for kind in self.group_kinds:
                    picks[kind] = (
                        table.retained[row, lengths], table.peak[kind][row, lengths],
                        table.time_cost_s[kind][row, lengths], table.reexecutions[kind][lengths],
                        table.deferred[kind][lengths],
                    )  # fmt: skip
            starts = np.full(length - 1, start)
            self._starting[key] = self._collect(start, starts, starts + np.arange(1, length), picks)
        return self._starting[key]

    def _rows_for(self, start: int, longest: int) -> GroupTable:
        """A table holding the groups of up to ``longest`` blocks that start at ``start``. Passes run from the
        chain's end down, so the rows of the ROWS_AT_ONCE starts up to ``start`` are computed together."""
        table = self._rows
        if (
            table is None
            or not table.first <= start < table.first + len(table.retained)
            or table.retained.shape[1] < min(self.n - start, longest)
        ):
            first = max(0, start - ROWS_AT_ONCE + 1)
            table = self._rows = self._group_table(min(self.n - first, longest), first, start - first + 1)
        return table

    def ending_at(self, end: int, longest: int) -> Units:
        """Every unit that ends at block ``end``, groups of at most ``longest`` blocks."""
        starts = np.arange(max(0, end - longest + 1), end) if self.group_kinds else np.arange(0)
        picks = {}
        if len(starts):
            table = self.groups(min(longest, self.n))
            cells = (starts - table.first, end - starts)
            for kind in self.group_kinds:
                picks[kind] = (table.retained[cells], table.peak[kind][cells], table.time_cost_s[kind][cells],
                               table.reexecutions[kind][cells[1]], table.deferred[kind][cells[1]])  # fmt: skip
        return self._collect(end, starts, np.full(len(starts), end), picks)

    def _group_table(self, longest: int, first: int = 0, rows: int = -1) -> GroupTable:
        assert self.numbers is not None, "groups are only listed when a group kind is allowed"
        return group_table(self.numbers, self.head_retained, longest, self.group_kinds, first, rows, self.outputs_kept)

    def _collect(self, block: int, starts: np.ndarray, ends: np.ndarray, picks: dict[str, tuple]) -> Units:
        """The singles of ``block`` followed by the groups ``starts..ends`` of each kind, whose retained bytes,
        peaks, seconds, re-executions and deferred blocks ``picks`` holds per kind."""
        singles, i64 = self.singles, np.int64
        n_single = len(singles.actions)
        runs = singles.runs[:, block]  # the actions this block has costs for
        at = np.full(int(runs.sum()), block, dtype=i64)
        codes = np.arange(n_single, dtype=i64)[runs]
        column = (singles.retained, singles.peak, singles.time_cost_s)
        reexec, deferred = singles.reexecutions[runs], np.zeros(len(codes), dtype=i64)  # no single defers
        parts = [(at, at, *(terms[runs, block] for terms in column), reexec, deferred, codes)]
        within = self.chain_of[starts] == self.chain_of[ends]  # groups stay inside one chain
        for k, kind in enumerate(self.group_kinds if picks else ()):
            group = (starts, ends, *picks[kind], np.full(len(starts), n_single + k, dtype=i64))
            parts.append(tuple(np.asarray(column)[within] for column in group))
        units = Units(*(np.concatenate(column) for column in zip(*parts, strict=True)))
        units.retained = units.retained + self.between[units.end]  # alive from the next chain's start on
        units.peak = (units.peak + range_max(self.backward_extra, units.start, units.end)
                      + range_max(self.held_args, units.start, units.end))  # fmt: skip
        return units

    def actions_from_units(self, units: list[tuple[int, int, int]]) -> list[str]:
        """Block actions of the chosen units ``(start, end, code)``."""
        names = self.singles.actions
        actions: list[str] = []
        group_id = 0
        for start, end, code in units:
            if code < len(names):
                actions.append(names[code])
                continue
            kind = self.group_kinds[code - len(names)]
            actions.extend([Action.group(kind, group_id).text] * (end - start + 1))
            group_id += 1
        return actions


def allowed_actions(costs: CostTable, actions: list[str] | None) -> tuple[list[str], list[str]]:
    """The single actions and group kinds a search may use: ``actions`` checked against the cost table, or
    every plannable action (:meth:`CostTable.plannable_actions`, each used on the blocks that can run it) and
    both group kinds when ``actions`` is None."""
    available = costs.plannable_actions()
    common = costs.common_actions()
    if KEEP not in common:
        raise ValueError(
            f"the cost table has no 'keep' costs for every block (common actions: {common}); "
            "profile the model again, 'keep' is always measured"
        )
    groups_possible = costs.groups_allowed()
    if actions is None:
        return available, list(GROUP_KINDS) if groups_possible else []
    singles: list[str] = []
    groups: list[str] = []
    for action in actions:
        kind = action.rstrip(":")
        if kind in GROUP_KINDS:
            if costs.info.get("layer_drop"):
                raise ValueError(f"action {action!r} groups blocks, and {LAYER_DROP_GROUPS}; plan single-block actions")
            if not groups_possible:
                raise ValueError(
                    f"action {action!r} needs 'checkpoint' costs for every block, which the cost table lacks"
                )
            groups.append(kind)
        elif action in available:
            singles.append(action)
        else:
            raise ValueError(_not_plannable(costs, action, available))
    if not singles:
        raise ValueError(f"actions={actions!r} names no single-block action; include at least 'keep'")
    return [a for a in available if a in singles], [k for k in GROUP_KINDS if k in groups]


def _not_plannable(costs: CostTable, action: str, available: list[str]) -> str:
    """Why a plan cannot use ``action`` on ``costs``, and what to choose instead."""
    choose = f"choose among {available + list(GROUP_KINDS)}"
    refused = [b for b in costs.blocks if action in b.unavailable]
    if refused and len(refused) == len(costs.blocks):
        why = refused[0].unavailable[action]
        return f"action {action!r} cannot run on any block of the cost table ({why}); {choose}"
    missing = [b.fqn for b in costs.blocks if action not in b.actions and action not in b.unavailable]
    return (
        f"action {action!r} has no costs for blocks {missing[:3]}{' ...' if len(missing) > 3 else ''} of the "
        f"cost table; profile with it included (remat.profile(..., policies=...)) or {choose}"
    )


def range_max(values: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """``max(values[s : e + 1])`` for each pair of ``starts`` and ``ends`` (a sparse table of maxima over runs of
    2**j rows: two lookups per pair)."""
    if len(starts) == 0:
        return np.zeros(0, dtype=values.dtype)
    levels = [values]
    while 2 ** len(levels) <= len(values):
        half = 2 ** (len(levels) - 1)
        levels.append(np.maximum(levels[-1][:-half], levels[-1][half:]))
    j = np.floor(np.log2(ends - starts + 1)).astype(np.int64)
    out = np.empty(len(starts), dtype=values.dtype)
    for level in np.unique(j):
        pick = j == level
        table = levels[level]
        out[pick] = np.maximum(table[starts[pick]], table[ends[pick] - 2**level + 1])
    return out
