"""The per-unit terms of the memory and time model, written once: a scalar form for one unit (the simulator's)
and a vectorised form over every unit of a chain (the planners'), side by side, tested against each other.

Per block ``m`` a unit reads: ``saved[a][m]`` (bytes saved under action ``a``; ``keep[m]`` and ``checkpointed[m]``
under ``keep`` and ``checkpoint``), ``output[m]``, ``fwd_temp[m]``,
``temp[m] = max(fwd_temp[m], bwd_temp[m] + bwd_extra[checkpoint][m])`` (a group recomputes as checkpoints do),
``bwd_extra[a][m]``, ``recompute[a][m]`` (``rerun[m]`` under ``checkpoint``), ``inner[m]`` (the block's forward
under ``torch.no_grad``, ``nograd_fwd_s``; ``rerun[m]`` where not measured), ``overhead[a][m]`` (what the
action adds to the step beyond its recomputation, see :mod:`remat.core.costs`; ``frame[m]`` under ``checkpoint``) and
``defer[m]`` (what the block adds when a segment re-runs it ahead of a later block's backward:
``CostTable.deferred_s_per_byte * keep[m]``).
Every peak is bytes above what the units before retain; its backward terms include ``head_retained`` (what the
head leaves alive while the chain's backward runs, or frees of the stem when negative), its forward terms do not
(the head has not run). A unit's time cost, the seconds it adds to a step that keeps
everything, is ``recompute + overhead``. A group's blocks run their forward as checkpointed blocks do (storing
nothing inside the group), so each adds its ``checkpoint`` overhead, once: a memory-poor group opens a frame
per block, a segment one frame for all, but the profile measures a frame together with the forward it wraps
and cannot tell the two apart.

A single block under action ``a``::

    retained   = saved[a]
    peak       = max(saved[a] + fwd_temp, keep + bwd_temp + bwd_extra[a] + head_retained)
    recompute  = recompute[a]
    overhead   = overhead[a]
    re-runs    = 0 for keep and offload, else 1
    deferred   = 0

``keep + bwd_temp + bwd_extra[a]`` is the block's backward peak under ``a`` as measured alone
(:mod:`remat.profiling.block_bytes`), a recomputation's forward transients included: ``temp`` there would count them
twice (Qwen3's blocks, whose attention is wider than the hidden state, were over-predicted by 16%). A group's blocks
re-run their forward inside its backward beside what the blocks before them rebuilt, so groups read ``temp``.

A group of blocks ``s..e``, with ``inside[m] = output[m-1]`` for ``m > s`` and ``0`` for ``m = s`` (the
group's own input belongs to the unit before)::

    retained              = checkpointed[e]
    forward peak          = max over m of  inside[m] + checkpointed[m] + fwd_temp[m]
    segment backward      = max over m of  (keep[s] + ... + keep[m]) + temp[m]
    memory_poor backward  = max over m of  keep[m] + inside[m] + temp[m]
    peak                  = max(forward peak, backward + head_retained)
    segment recompute     = rerun[s] + ... + rerun[e]
    memory_poor recompute = sum over m of (inner[s] + ... + inner[m-1] + rerun[m])
                            (block m's backward re-runs s..m-1 under no_grad, then m recording its graph)
    group overhead        = frame[s] + ... + frame[e], plus defer[s] + ... + defer[e-1] in a segment
    re-runs of block m    = 1 in a segment, e - m + 1 in a memory-poor group
    deferred              = e - s in a segment, 0 in a memory-poor group

When the model keeps every block's output to the end of the step (``outputs_kept``: Hugging Face's
``output_hidden_states`` collects them), a group's inner outputs are not freed: they add up to the sum of the
outputs of ``s..m-1`` (``kept[m]``): the forward peak reads ``kept[m]`` for ``inside[m]``, the group's backward
holds ``kept[e]`` beside its own bytes, and the group retains ``checkpointed[e] + kept[e]``. The outputs of the
unit's last block and of every later block of its chain but the chain's last are alive through the unit's
backward too (``held[e]``, :meth:`remat.core.costs.CostTable.held_outputs_per_row`; 0 without ``outputs_kept``): a
block's backward is measured with its output released, as a step that does not hold it runs. So every backward
term above (single or group) has ``held[e]`` added inside its ``max``.

``deferred`` counts the blocks that a unit re-runs ahead of a later block's backward: a segment re-runs all its blocks
before the first backward, so the recomputed activations of every block but its last wait while the later ones re-run
and run backward; a checkpoint or a memory-poor group runs each block's backward right after its re-run. Whole steps
measure a segment slower than checkpoints of its blocks, a cost a block timed alone does not show: on a 2-core Xeon
(``benchmarks/segments.py``) 1-2.6 ms per deferred block of the peers' GPT-2 (10.5 MiB saved per block, 140 ms steps)
and 0.6-1.5 ms per block of its Llama (6.5 MiB), about what reading a block's recomputed activations back from memory
instead of cache takes. ``defer`` prices it per byte those blocks save, at the rate the profile measured
(:mod:`remat.profiling.action_steps`); where the rate is 0 (not measured) a segment costs exactly what the checkpoints
of its blocks cost, and the optimal planner breaks ties in time towards fewer deferred blocks.

Invariant 1: every time term is read on a grid of 2**-30 s (:func:`on_time_grid`, under a nanosecond), so each
sum of terms, in any order and in either form, is exact: a segment and the checkpoints of the same blocks cost
exactly the same, and ties between plans are real ties, decided by the planner's order and not by rounding.
Sums of seconds also run left to right in both forms (``itertools.accumulate`` and ``np.cumsum``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np

from ..core import (
    CHECKPOINT,
    GROUP_KINDS,
    KEEP,
    MEMORY_POOR,
    OFFLOAD,
    PARTITION,
    SEGMENT,
    SINGLE,
    BlockCost,
    CostTable,
    Unit,
    kind_of,
)

TIME_GRID_S = 2.0**-30  # invariant 1: sums of multiples of this are exact below 2**23 s (97 days)


@dataclass(frozen=True)
class UnitTerms:
    retained: int
    peak: int
    recompute_s: float
    reexecutions: tuple[int, ...]  # block re-executions in backward, per block of the unit
    overhead_s: float = 0.0
    deferred: int = 0  # blocks re-run ahead of a later block's backward (a segment's blocks but its last)

    @property
    def time_cost_s(self) -> float:
        """Seconds the unit adds to a step that keeps everything: recomputation plus overhead."""
        return self.recompute_s + self.overhead_s


def on_time_grid(seconds: float) -> float:
    """``seconds`` rounded to the nearest multiple of :data:`TIME_GRID_S` (invariant 1)."""
    return round(seconds / TIME_GRID_S) * TIME_GRID_S


def temp_bytes(block: BlockCost) -> int:
    """``temp``: the larger of the block's forward temporaries and its backward's when it is recomputed (a group
    recomputes its blocks as checkpoints do, what a checkpoint's backward holds beyond keep's included)."""
    return max(block.fwd_temp_bytes, block.bwd_temp_bytes + block.bwd_extra_bytes.get(CHECKPOINT, 0))


def reruns(action: str) -> int:
    """How often a block under the single-block ``action`` re-runs in backward."""
    return 0 if kind_of(action) in (KEEP, OFFLOAD, PARTITION) else 1


def check_group_kind(kind: str) -> None:
    if kind not in GROUP_KINDS:
        raise ValueError(f"unknown group kind {kind!r}; use {SEGMENT!r} or {MEMORY_POOR!r}")


# ---------------------------------------------------------------- scalar form: one unit


def unit_terms(costs: CostTable, unit: Unit) -> UnitTerms:
    """Retained bytes, peak bytes above the prefix, recompute seconds and re-executions of one unit."""
    held = costs.held_outputs(unit.end)
    if unit.kind == SINGLE:
        return single_terms(costs.blocks[unit.start], unit.action, costs.head_retained_bytes, held)
    blocks = [BlockNumbers.of(b, costs.deferred_s_per_byte) for b in costs.blocks[unit.start : unit.end + 1]]
    return group_terms(blocks, unit.kind, costs.head_retained_bytes, costs.outputs_kept, held)


def single_terms(block: BlockCost, action: str, head_retained: int, held: int = 0) -> UnitTerms:
    """The terms of one block under the single-block ``action``; ``held``: the outputs the model holds through
    the block's backward (its own and later ones, see the module's notes)."""
    saved = block.saved(action)
    backward = block.saved(KEEP) + block.bwd_temp_bytes + block.bwd_extra_bytes.get(action, 0) + held
    peak = max(saved + block.fwd_temp_bytes, backward + head_retained)
    recompute = on_time_grid(block.recompute_s[action])
    return UnitTerms(saved, peak, recompute, (reruns(action),), on_time_grid(block.overhead_s.get(action, 0.0)))


@dataclass(frozen=True)
class BlockNumbers:
    """The numbers of one block that the group formulas read (a group re-runs its blocks as checkpoints)."""

    keep: int
    checkpointed: int
    output: int
    fwd_temp: int
    temp: int
    rerun: float
    frame: float = 0.0  # the block's overhead under checkpoint
    inner: float = 0.0  # the block's forward under no_grad (a memory-poor group's re-runs before the last)
    defer: float = 0.0  # what the block adds when a segment re-runs it ahead of a later block's backward

    @classmethod
    def of(cls, block: BlockCost, deferred_s_per_byte: float = 0.0) -> BlockNumbers:
        if CHECKPOINT not in block.recompute_s:
            raise KeyError(
                f"block {block.fqn!r} has no 'checkpoint' costs, which a segment or memory-poor group needs; "
                "profile with 'checkpoint' included"
            )
        return cls(
            keep=block.saved(KEEP),
            checkpointed=block.saved(CHECKPOINT),
            output=block.output_bytes,
            fwd_temp=block.fwd_temp_bytes,
            temp=temp_bytes(block),
            rerun=on_time_grid(block.recompute_s[CHECKPOINT]),
            frame=on_time_grid(block.overhead_s.get(CHECKPOINT, 0.0)),
            inner=on_time_grid(block.recompute_s[CHECKPOINT] if block.nograd_fwd_s is None else block.nograd_fwd_s),
            defer=on_time_grid(deferred_s_per_byte * block.saved(KEEP)),
        )


def group_terms(
    blocks: Sequence[BlockNumbers], kind: str, head_retained: int, outputs_kept: bool = False, held: int = 0
) -> UnitTerms:
    """The terms of a group (``kind`` SEGMENT or MEMORY_POOR) of the consecutive ``blocks``; with
    ``outputs_kept`` the model keeps every block's output (``inside`` sums the outputs before block ``m``) and
    holds ``held`` bytes of outputs from the group's last block on through its backward."""
    check_group_kind(kind)
    inside = [0] + [b.output for b in blocks[:-1]]
    kept = list(accumulate(inside)) if outputs_kept else [0] * len(blocks)  # outputs s..m-1 the model keeps
    forward_peak = max(max(inside[m], kept[m]) + b.checkpointed + b.fwd_temp for m, b in enumerate(blocks))
    if kind == SEGMENT:
        keeps_to = list(accumulate(b.keep for b in blocks))
        backward_peak = max(keeps_to[m] + b.temp for m, b in enumerate(blocks))
        recompute, reexecutions = sum(b.rerun for b in blocks), (1,) * len(blocks)
        deferred = len(blocks) - 1
        waits = sum(b.defer for b in blocks[:-1])
    else:
        backward_peak = max(b.keep + inside[m] + b.temp for m, b in enumerate(blocks))
        inner_before = [0.0, *accumulate(b.inner for b in blocks[:-1])]  # inner[s] + ... + inner[m-1]
        recompute = list(accumulate(before + b.rerun for before, b in zip(inner_before, blocks, strict=True)))[-1]
        reexecutions = tuple(len(blocks) - m for m in range(len(blocks)))
        deferred, waits = 0, 0.0
    overhead = list(accumulate(b.frame for b in blocks))[-1] + waits
    peak = max(forward_peak, backward_peak + kept[-1] + held + head_retained)
    retained = blocks[-1].checkpointed + kept[-1]
    return UnitTerms(retained, peak, recompute, reexecutions, overhead, deferred)


# ---------------------------------------------------------------- vectorised form: every unit of a chain


@dataclass(frozen=True)
class SingleTable:
    """The terms of every block under every action in ``actions``: arrays of shape (actions, blocks)."""

    actions: list[str]
    keep: np.ndarray  # (blocks,): bytes saved under keep, what the other actions save against
    retained: np.ndarray
    peak: np.ndarray
    recompute_s: np.ndarray
    reexecutions: np.ndarray  # (actions,): re-runs per block, the same for every block
    overhead_s: np.ndarray
    time_cost_s: np.ndarray  # recompute_s + overhead_s
    runs: np.ndarray  # (actions, blocks): the block has costs for the action; the other entries read as keep


def single_table(costs: CostTable, actions: Sequence[str]) -> SingleTable:
    """:func:`single_terms` of every block of ``costs`` under every one of ``actions`` at once. A block without
    costs for an action (one it cannot run, :meth:`CostTable.plannable_actions`) reads as keep there and is
    marked in ``runs``."""
    blocks, n, i64 = costs.blocks, len(costs), np.int64
    has = [set(b.actions) for b in blocks]
    runs = np.array([[a in has[j] for j in range(n)] for a in actions], dtype=bool).reshape(-1, n)

    def column(a: str, value: Callable[[BlockCost, str], Any]) -> list[Any]:
        return [value(b, a if a in has[j] else KEEP) for j, b in enumerate(blocks)]

    keep = np.array([b.saved(KEEP) for b in blocks], dtype=i64)
    fwd_temp = np.array([b.fwd_temp_bytes for b in blocks], dtype=i64)
    bwd_temp = np.array([b.bwd_temp_bytes for b in blocks], dtype=i64)
    saved = np.array([column(a, BlockCost.saved) for a in actions], dtype=i64).reshape(-1, n)
    bwd_extra = np.array([column(a, lambda b, a: b.bwd_extra_bytes.get(a, 0)) for a in actions], i64).reshape(-1, n)
    held = np.array(costs.held_outputs_per_row(), dtype=i64)
    peak = np.maximum(saved + fwd_temp, keep + bwd_temp + bwd_extra + held + int(costs.head_retained_bytes))
    recompute = np.array([column(a, lambda b, a: on_time_grid(b.recompute_s[a])) for a in actions], np.float64)
    overhead = np.array([column(a, lambda b, a: on_time_grid(b.overhead_s.get(a, 0.0))) for a in actions], np.float64)
    recompute, overhead = recompute.reshape(-1, n), overhead.reshape(-1, n)
    reexecutions = np.array([reruns(a) for a in actions], i64)
    time_cost = recompute + overhead
    return SingleTable(list(actions), keep, saved, peak, recompute, reexecutions, overhead, time_cost, runs)


@dataclass(frozen=True)
class ChainNumbers:
    """:class:`BlockNumbers` of every block of a chain, one array per number."""

    keep: np.ndarray
    checkpointed: np.ndarray
    output: np.ndarray
    fwd_temp: np.ndarray
    temp: np.ndarray
    rerun: np.ndarray
    frame: np.ndarray
    inner: np.ndarray
    defer: np.ndarray
    held: np.ndarray  # outputs held through the backward of a unit ending at the block (outputs_kept)

    @classmethod
    def of(cls, costs: CostTable) -> ChainNumbers:
        rows = [BlockNumbers.of(b, costs.deferred_s_per_byte) for b in costs.blocks]
        ints = {name: np.array([getattr(r, name) for r in rows], dtype=np.int64)
                for name in ("keep", "checkpointed", "output", "fwd_temp", "temp")}  # fmt: skip
        floats = {name: np.array([getattr(r, name) for r in rows], dtype=np.float64)
                  for name in ("rerun", "frame", "inner", "defer")}  # fmt: skip
        return cls(**ints, **floats, held=np.array(costs.held_outputs_per_row(), dtype=np.int64))


@dataclass(frozen=True)
class GroupTable:
    """The terms of groups ``s..s+j``, ``j < longest``, for a run of first blocks ``s``: arrays of shape
    (first blocks, longest), row ``r`` the group starting at the table's ``first`` block plus ``r``, column ``j``
    one less than the length. Entries with ``s + j`` past the chain's last block are meaningless."""

    first: int
    retained: np.ndarray
    peak: dict[str, np.ndarray]  # per group kind
    recompute_s: dict[str, np.ndarray]
    reexecutions: dict[str, np.ndarray]  # (longest,): re-runs summed over the group's blocks, per length
    deferred: dict[str, np.ndarray]  # (longest,): blocks re-run ahead of a later block's backward, per length
    overhead_s: dict[str, np.ndarray]
    time_cost_s: dict[str, np.ndarray]  # recompute_s + overhead_s


def _sums_before(values: np.ndarray) -> np.ndarray:
    """Per row, the running sums of ``values`` up to but excluding each column (``values[s] + ... +
    values[m-1]``, 0 in the first), summed left to right."""
    to = np.cumsum(values, axis=1)
    return np.concatenate([np.zeros((len(values), 1)), to[:, :-1]], axis=1)


def group_table(
    numbers: ChainNumbers,
    head_retained: int,
    longest: int,
    kinds: Sequence[str],
    first: int = 0,
    rows: int = -1,
    outputs_kept: bool = False,
) -> GroupTable:
    """:func:`group_terms` of every group of up to ``longest`` blocks, for each of the group ``kinds``, starting
    at each of the ``rows`` blocks from ``first`` on (``rows=-1``: every block from ``first`` to the end)."""
    for kind in kinds:
        check_group_kind(kind)
    n = len(numbers.keep)
    rows = n - first if rows < 0 else rows
    column = np.arange(longest)[None, :]
    starts = np.arange(first, first + rows)[:, None]
    block = np.minimum(starts + column, n - 1)  # block m of group (s, j); clamped past the end
    inside = np.where(column > 0, numbers.output[block - 1], 0)
    kept = np.cumsum(inside, axis=1) if outputs_kept else np.zeros_like(inside)  # outputs s..m-1 kept
    forward_peak = np.maximum.accumulate(
        np.maximum(inside, kept) + numbers.checkpointed[block] + numbers.fwd_temp[block], axis=1
    )
    length = np.arange(1, longest + 1, dtype=np.int64)
    table = GroupTable(first, numbers.checkpointed[block] + kept, {}, {}, {}, {}, {}, {})
    frames_to = np.cumsum(numbers.frame[block], axis=1)
    if SEGMENT in kinds:
        keeps_to = np.cumsum(numbers.keep[block], axis=1)
        backward = np.maximum.accumulate(keeps_to + numbers.temp[block], axis=1) + kept + numbers.held[block]
        table.peak[SEGMENT] = np.maximum(forward_peak, backward + head_retained)
        reruns_to = np.cumsum(numbers.rerun[block], axis=1)  # rerun[s] + ... + rerun[s + j]
        table.recompute_s[SEGMENT] = reruns_to
        table.reexecutions[SEGMENT] = length
        table.deferred[SEGMENT] = length - 1
        table.overhead_s[SEGMENT] = frames_to + _sums_before(numbers.defer[block])  # all but the last block's
        table.time_cost_s[SEGMENT] = reruns_to + table.overhead_s[SEGMENT]
    if MEMORY_POOR in kinds:
        backward = np.maximum.accumulate(numbers.keep[block] + inside + numbers.temp[block], axis=1)
        backward = backward + kept + numbers.held[block]
        table.peak[MEMORY_POOR] = np.maximum(forward_peak, backward + head_retained)
        inner_before = _sums_before(numbers.inner[block])
        table.recompute_s[MEMORY_POOR] = np.cumsum(inner_before + numbers.rerun[block], axis=1)
        table.reexecutions[MEMORY_POOR] = length * (length + 1) // 2
        table.deferred[MEMORY_POOR] = np.zeros(longest, dtype=np.int64)
        table.overhead_s[MEMORY_POOR] = frames_to
        table.time_cost_s[MEMORY_POOR] = table.recompute_s[MEMORY_POOR] + table.overhead_s[MEMORY_POOR]
    return table


__all__ = [
    "BlockNumbers",
    "ChainNumbers",
    "GroupTable",
    "SingleTable",
    "TIME_GRID_S",
    "UnitTerms",
    "group_table",
    "group_terms",
    "on_time_grid",
    "single_table",
    "single_terms",
    "unit_terms",
]
