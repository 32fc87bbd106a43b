"""The optimal planner: the plan of least predicted recompute time whose predicted peak fits a byte budget.

It searches every plan the simulator in :mod:`remat.simulator` can express: per unit, a single-block action the
cost table has costs for (``keep``, ``checkpoint``, ``selective:<policy>``, ``offload``), a ``segment``
group of two or more blocks, or a ``nested`` (memory-poor) group of two or more blocks.

The simulator's structure makes this a prefix-constrained knapsack over a chain. With ``P`` the bytes the
units before a unit retain, a plan fits when every unit satisfies ``P + peak(unit) <= budget - stem`` and
the chain end satisfies ``P_total + head <= budget - stem``; recompute time is a sum over units. So:

* ``need[i]``, the least bytes above its prefix that any plan of blocks ``i..`` needs, obeys
  ``need[i] = min over units u starting at i of max(peak(u), retained(u) + need[end(u) + 1])`` with
  ``need[n] = head``. ``stem + need[0]`` is the minimum peak of any plan (:func:`min_peak_bytes`), and a
  prefix ``P`` at block ``i`` can be completed within the budget exactly when ``P + need[i]`` fits.
* The search runs left to right over positions, keeping at each position the Pareto front of partial plans
  by (prefix bytes, recompute seconds): a partial plan with more bytes and no less time can never lead to
  a better plan, so dropping it is exact. Partial plans that cannot be completed are never created.

Ties in recompute time go to fewer block re-executions in backward, then to the lower peak.

Exactness and long chains: the search is exact under the simulator unless a front had to be thinned or
group lengths were capped (``Plan.options["exact"]`` says which). Thinning rounds the memory axis: partial
plans whose prefix bytes fall in the same bucket are merged, keeping per bucket the fastest one and the
best ones at an estimated price of memory (a Lagrange multiplier, see :func:`_memory_prices`). Merged
partial plans keep their exact byte counts, so a returned plan never exceeds the budget; thinning can
only miss a better plan. ``resolution`` (bytes) sets the bucket width for every front; ``resolution=None``
keeps fronts exact while they stay small and sizes the buckets so that the work stays bounded (a chain of
1,000 blocks plans in well under a second). ``max_segment`` bounds group lengths: ``None`` allows every
length on chains of up to 32 blocks and fewer (down to 8) on longer ones, where a longer group saves only
the retained output of one split point; budgets that need longer groups get them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ..costs import CHECKPOINT, KEEP, OFFLOAD, CostTable
from ..simulator import NESTED_PREFIX, SEGMENT_PREFIX, Plan, simulate
from ..sizes import format_bytes
from .errors import BudgetError

SEGMENT = "segment"
NESTED = "nested"

# Automatic limits (resolution=None, max_segment=None). The search creates about
# n * front size * units per partial plan candidates; fronts are thinned to keep that near WORK_TARGET,
# never below MIN_FRONT nor above EXACT_FRONT_LIMIT partial plans.
WORK_TARGET = 3_000_000
MIN_FRONT = 16
EXACT_FRONT_LIMIT = 4096
# Points of the memory-price grid (see _memory_prices).
PRICE_GRID = 24


@dataclass
class _Chain:
    """Per-block numbers of a cost table as numpy arrays, in the terms :func:`remat.simulator.unit_terms` uses."""

    n: int
    singles: list[str]
    single_retained: np.ndarray  # (actions, n) int64
    single_peak: np.ndarray  # (actions, n) int64
    single_time: np.ndarray  # (actions, n) float64
    single_calls: np.ndarray  # (actions,) int64
    group_kinds: list[str]
    keep: np.ndarray
    checkpointed: np.ndarray
    output: np.ndarray
    fwd_temp: np.ndarray
    temp: np.ndarray
    rerun_s: np.ndarray
    head: int
    stem: int
    head_retained: int
    _units_from: dict[tuple[int, int], tuple[np.ndarray, ...]] = field(default_factory=dict)

    @classmethod
    def from_costs(cls, costs: CostTable, actions: list[str] | None) -> _Chain:
        singles, group_kinds = _allowed_actions(costs, actions)
        blocks = costs.blocks
        n = len(blocks)
        i64 = np.int64
        keep = np.array([b.saved(KEEP) for b in blocks], dtype=i64)
        fwd_temp = np.array([b.fwd_temp_bytes for b in blocks], dtype=i64)
        temp = np.array([max(b.fwd_temp_bytes, b.bwd_temp_bytes) for b in blocks], dtype=i64)
        retained = np.array([[b.saved(a) for b in blocks] for a in singles], dtype=i64).reshape(-1, n)
        bwd_extra = np.array(
            [[b.bwd_extra_bytes.get(a, 0) for b in blocks] for a in singles], dtype=i64
        ).reshape(-1, n)
        peak = np.maximum(retained + fwd_temp, keep + temp + bwd_extra) + int(costs.head_retained_bytes)
        time = np.array([[b.recompute_s[a] for b in blocks] for a in singles], dtype=np.float64)
        calls = np.array([0 if a in (KEEP, OFFLOAD) else 1 for a in singles], dtype=i64)
        if group_kinds:
            checkpointed = np.array([b.saved(CHECKPOINT) for b in blocks], dtype=i64)
            rerun_s = np.array([b.recompute_s[CHECKPOINT] for b in blocks], dtype=np.float64)
        else:
            checkpointed = np.zeros(n, dtype=i64)
            rerun_s = np.zeros(n, dtype=np.float64)
        output = np.array([b.output_bytes for b in blocks], dtype=i64)
        return cls(
            n, singles, retained, peak, time.reshape(-1, n), calls, group_kinds, keep, checkpointed,
            output, fwd_temp, temp, rerun_s, int(costs.head_bytes), int(costs.stem_bytes),
            int(costs.head_retained_bytes),
        )  # fmt: skip

    def group_terms(self, start: int, last: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Peak bytes and recompute seconds of every group ``start..j`` for ``j`` in ``start+1..last``, per
        group kind (mirrors :func:`remat.simulator.unit_terms`, summing in its order)."""
        span = slice(start, last + 1)
        output_before = np.concatenate(([0], self.output[start:last])).astype(np.int64)
        fwd_peak = np.maximum.accumulate(output_before + self.checkpointed[span] + self.fwd_temp[span])
        fwd_peak = fwd_peak + self.head_retained
        rerun = np.cumsum(self.rerun_s[span])
        terms = []
        for kind in self.group_kinds:
            if kind == SEGMENT:
                bwd_peak = np.maximum.accumulate(np.cumsum(self.keep[span]) + self.temp[span]) + self.head_retained
                terms.append((np.maximum(fwd_peak, bwd_peak)[1:], rerun[1:]))
            else:
                bwd_peak = np.maximum.accumulate(self.keep[span] + output_before + self.temp[span])
                bwd_peak = bwd_peak + self.head_retained
                terms.append((np.maximum(fwd_peak, bwd_peak)[1:], np.cumsum(rerun)[1:]))
        return terms

    def units_from(self, start: int, max_group: int) -> tuple[np.ndarray, ...]:
        """Retained bytes, peak bytes, recompute seconds and last block of every unit that starts at block
        ``start``: the single actions, then each group kind (cached; both backward passes use them)."""
        key = (start, max_group)
        if key not in self._units_from:
            parts = [(self.single_retained[:, start], self.single_peak[:, start], self.single_time[:, start],
                      np.full(len(self.singles), start))]  # fmt: skip
            last = min(self.n - 1, start + max_group - 1)
            if self.group_kinds and last > start:
                ends = np.arange(start + 1, last + 1)
                for peak, time in self.group_terms(start, last):
                    parts.append((self.checkpointed[ends], peak, time, ends))
            self._units_from[key] = tuple(np.concatenate(column) for column in zip(*parts))
        return self._units_from[key]


def _allowed_actions(costs: CostTable, actions: list[str] | None) -> tuple[list[str], list[str]]:
    available = costs.common_actions()
    if KEEP not in available:
        raise ValueError(
            f"the cost table has no 'keep' costs for every block (common actions: {available}); "
            "profile the model again, 'keep' is always measured"
        )
    groups_possible = CHECKPOINT in available
    if actions is None:
        return available, [SEGMENT, NESTED] if groups_possible else []
    singles: list[str] = []
    groups: list[str] = []
    for action in actions:
        kind = action.rstrip(":")
        if kind in (SEGMENT, NESTED):
            if not groups_possible:
                raise ValueError(
                    f"action {action!r} needs 'checkpoint' costs for every block, which the cost table lacks"
                )
            groups.append(kind)
        elif action in available:
            singles.append(action)
        else:
            raise ValueError(
                f"action {action!r} is not available for every block of the cost table; choose among "
                f"{available + [SEGMENT, NESTED]}"
            )
    if not singles:
        raise ValueError(f"actions={actions!r} names no single-block action; include at least 'keep'")
    return [a for a in available if a in singles], [k for k in (SEGMENT, NESTED) if k in groups]


def _suffix_need(chain: _Chain, max_group: int) -> np.ndarray:
    """``need[i]``: the least bytes above its prefix that any plan of blocks ``i..n-1`` (groups of at most
    ``max_group`` blocks) needs, the chain end's head included."""
    n = chain.n
    need = np.zeros(n + 1, dtype=np.int64)
    need[n] = chain.head
    for i in range(n - 1, -1, -1):
        retained, peak, _, end = chain.units_from(i, max_group)
        need[i] = np.maximum(peak, retained + need[end + 1]).min()
    return need


def _holding_arguments(costs: CostTable) -> CostTable:
    """``costs`` with the held arguments counted in every unit's peak and the head's. The simulator counts
    them so for every plan that is not all ``keep``; the search runs on this table, and keeping everything,
    the one plan it overestimates, is weighed on its own."""
    if not costs.held_args_bytes:
        return costs
    held = costs.held_args_bytes
    return replace(
        costs, head_bytes=costs.head_bytes + held, head_retained_bytes=costs.head_retained_bytes + held,
        held_args_bytes=0,
    )  # fmt: skip


def min_peak_bytes(costs: CostTable) -> int:
    """The least predicted peak activation bytes of any plan on ``costs`` (exact under the simulator)."""
    if len(costs) == 0:
        return int(costs.stem_bytes + costs.head_bytes)
    chain = _Chain.from_costs(_holding_arguments(costs), None)
    least = chain.stem + int(_suffix_need(chain, chain.n)[0])
    if costs.held_args_bytes:
        least = min(least, simulate(costs, [KEEP] * len(costs)).peak_bytes)
    return least


def _memory_prices(chain: _Chain, room: int, need: np.ndarray, max_group: int) -> list[float]:
    """Seconds per byte at which memory trades against recompute time on this chain and budget.

    Pricing memory at ``price`` turns the search into a shortest path: each unit costs
    ``time + price * retained``. The smallest price on a geometric grid whose cheapest plan fits the budget
    estimates the marginal value of memory (a Lagrange multiplier); thinning keeps, per bucket, the best
    plans at that price and at half of it next to the fastest. Returns ``[0.0]`` when nothing needs one.
    """
    n = chain.n
    saving = chain.keep[None, :] - chain.single_retained
    useful = (saving > 0) & (chain.single_time > 0)
    if not useful.any():
        return [0.0]
    ratios = chain.single_time[useful] / saving[useful]
    grid = np.concatenate(([0.0], np.geomspace(ratios.min() / 100, ratios.max() * 100, PRICE_GRID)))
    value = np.zeros((n + 1, len(grid)))
    plan_need = np.zeros((n + 1, len(grid)), dtype=np.int64)
    plan_need[n] = chain.head
    columns = np.arange(len(grid))
    for i in range(n - 1, -1, -1):
        r, k, t, e = chain.units_from(i, max_group)
        cost = t[:, None] + grid[None, :] * r[:, None] + value[e + 1]
        cost[np.maximum(k, r + need[e + 1]) > room] = np.inf
        best = np.argmin(cost, axis=0)
        value[i] = cost[best, columns]
        plan_need[i] = np.maximum(k[best], r[best] + plan_need[e[best] + 1, columns])
    fits = np.flatnonzero(np.isfinite(value[0]) & (plan_need[0] <= room))
    price = grid[fits[0]] if len(fits) else grid[-1]
    return [0.0] if price == 0 else [0.0, price / 2, price]


@dataclass
class _Partials:
    """Partial plans as columns. ``parent`` indexes the stored partial plan it extends, ``start`` is the
    position its last unit starts at, ``code`` that unit: a single action index, or ``len(singles)`` plus
    the group kind index."""

    prefix: np.ndarray  # bytes retained by the units so far
    time: np.ndarray  # recompute seconds so far
    reexec: np.ndarray  # block re-executions in backward so far
    peak: np.ndarray  # highest prefix + unit peak so far
    parent: np.ndarray
    start: np.ndarray
    code: np.ndarray

    def take(self, index: np.ndarray) -> _Partials:
        return _Partials(*(getattr(self, name)[index] for name in _COLUMNS))


_COLUMNS = ("prefix", "time", "reexec", "peak", "parent", "start", "code")


def _pareto(p: _Partials) -> _Partials:
    """The partial plans no other one matches or beats both in bytes and in (time, re-executions, peak)
    order, sorted by bytes."""
    if len(p.prefix) <= 1:
        return p
    p = p.take(np.lexsort((p.peak, p.reexec, p.time, p.prefix)))
    first_of_bytes = np.empty(len(p.prefix), dtype=bool)
    first_of_bytes[0] = True
    first_of_bytes[1:] = p.prefix[1:] != p.prefix[:-1]
    p = p.take(first_of_bytes)  # the best of each byte count
    fastest_before = np.minimum.accumulate(p.time)[:-1]
    if not (p.time[1:] == fastest_before).any():
        survives = np.empty(len(p.prefix), dtype=bool)
        survives[0] = True
        survives[1:] = p.time[1:] < fastest_before
        return p.take(survives)
    # Ties in time: compare whole keys through their rank.
    by_key = np.lexsort((p.peak, p.reexec, p.time))
    t, r, k = p.time[by_key], p.reexec[by_key], p.peak[by_key]
    changed = np.empty(len(by_key), dtype=bool)
    changed[0] = True
    changed[1:] = (t[1:] != t[:-1]) | (r[1:] != r[:-1]) | (k[1:] != k[:-1])
    rank = np.empty(len(by_key), dtype=np.int64)
    rank[by_key] = np.cumsum(changed)
    survives = np.empty(len(rank), dtype=bool)
    survives[0] = True
    survives[1:] = rank[1:] < np.minimum.accumulate(rank)[:-1]
    return p.take(survives)


def _thin(prefix: np.ndarray, time: np.ndarray, width: int, prices: list[float]) -> np.ndarray:
    """Indices kept when the partial plans whose bytes share a ``width``-wide bucket are merged: per
    bucket, the best by ``time + price * bytes`` for each memory price (price 0 keeps the fastest), plus
    the plan with the fewest bytes overall. ``prefix`` is sorted ascending and ``time`` never rises."""
    bucket = (prefix - prefix[0]) // width
    starts = np.flatnonzero(np.concatenate(([True], bucket[1:] != bucket[:-1])))
    last = np.concatenate((starts[1:] - 1, [len(prefix) - 1]))
    kept = np.zeros(len(prefix), dtype=bool)
    kept[0] = True  # the fewest bytes
    kept[last] = True  # the fastest of each bucket
    for price in prices:
        if price <= 0:
            continue
        value = time + price * prefix
        best = np.repeat(np.minimum.reduceat(value, starts), np.diff(np.concatenate((starts, [len(prefix)]))))
        at_best = np.flatnonzero(value <= best)
        last_at_best = np.concatenate((bucket[at_best][1:] != bucket[at_best][:-1], [True]))
        kept[at_best[last_at_best]] = True  # ties go to the faster plan
    return np.flatnonzero(kept)


class _Store:
    """Every kept partial plan, the front of each position stored after the one before and sorted by
    bytes, with ``key = position * (room + 1) + prefix`` so one binary search finds what fits in any
    front."""

    def __init__(self, n: int, room: int, capacity: int) -> None:
        capacity = max(capacity, 16)
        self.prefix = np.empty(capacity, dtype=np.int64)
        self.time = np.empty(capacity, dtype=np.float64)
        self.reexec = np.empty(capacity, dtype=np.int64)
        self.peak = np.empty(capacity, dtype=np.int64)
        self.parent = np.empty(capacity, dtype=np.int64)
        self.start = np.empty(capacity, dtype=np.int64)
        self.code = np.empty(capacity, dtype=np.int64)
        self.key = np.empty(capacity, dtype=np.int64)
        self.size = 0
        self.front_start = np.zeros(n + 2, dtype=np.int64)
        self.stride = room + 1

    def append(self, position: int, p: _Partials) -> None:
        end = self.size + len(p.prefix)
        if end > len(self.key):
            grow = max(end, 2 * len(self.key))
            for name in (*_COLUMNS, "key"):
                column = getattr(self, name)
                bigger = np.empty(grow, dtype=column.dtype)
                bigger[: self.size] = column[: self.size]
                setattr(self, name, bigger)
        for name in _COLUMNS:
            getattr(self, name)[self.size : end] = getattr(p, name)
        self.key[self.size : end] = position * self.stride + p.prefix
        self.front_start[position] = self.size
        self.size = end
        self.front_start[position + 1] = end


@dataclass
class _GroupAccumulators:
    """For every possible group start ``s``, the terms of group ``s..e`` as ``e`` advances one block at a
    time (the same sums and maxima as :func:`remat.simulator.unit_terms`, accumulated in its order)."""

    segment_time: np.ndarray
    nested_time: np.ndarray
    fwd_peak: np.ndarray
    segment_bwd: np.ndarray  # max over m of keep[0..m] + temp[m], as cumulative keep up to m+1 + temp[m]
    nested_bwd: np.ndarray

    @classmethod
    def empty(cls, n: int) -> _GroupAccumulators:
        i64 = np.int64
        return cls(np.zeros(n), np.zeros(n), np.zeros(n, i64), np.zeros(n, i64), np.zeros(n, i64))


@dataclass
class _Units:
    """The units that end at one block, as columns."""

    source: np.ndarray  # position (first block) the unit starts at
    retained: np.ndarray
    peak: np.ndarray
    time: np.ndarray
    reexec: np.ndarray
    code: np.ndarray


@dataclass
class _Search:
    chain: _Chain
    room: int  # budget minus stem: what prefix + unit peak may reach
    need: np.ndarray
    max_group: int
    resolution: int | None
    front_limit: int
    thinned: int = 0
    widest_bucket: int = 0
    stored: int = 0
    prices: list[float] | None = None  # memory prices for thinning, estimated on first need

    def run(self) -> list[tuple[int, int, int]]:
        """The chosen plan as units (start, end, code)."""
        chain = self.chain
        n = chain.n
        store = _Store(n, self.room, (n + 1) * min(self.front_limit, 64))
        zero = np.zeros(1, dtype=np.int64)
        store.append(0, _Partials(zero, np.zeros(1), zero, zero, zero - 1, zero, zero))
        acc = _GroupAccumulators.empty(n)
        keep_before = np.concatenate(([0], np.cumsum(chain.keep)))
        for pos in range(1, n + 1):
            units = self._units_ending_at(pos - 1, acc, keep_before)
            store.append(pos, self._settle(self._arrivals(pos - 1, units, store)))
        self.stored = store.size
        final = slice(store.front_start[n], store.front_start[n + 1])
        total_peak = np.maximum(store.peak[final], store.prefix[final] + chain.head)
        index = store.front_start[n] + int(np.lexsort((total_peak, store.reexec[final], store.time[final]))[0])
        chosen = []
        pos = n
        while pos > 0:
            start = int(store.start[index])
            chosen.append((start, pos - 1, int(store.code[index])))
            pos, index = start, int(store.parent[index])
        return chosen[::-1]

    def _units_ending_at(self, end: int, acc: _GroupAccumulators, keep_before: np.ndarray) -> _Units:
        chain, i64 = self.chain, np.int64
        n_single = len(chain.singles)
        parts = [
            _Units(
                np.full(n_single, end, dtype=i64),
                chain.single_retained[:, end],
                chain.single_peak[:, end],
                chain.single_time[:, end],
                chain.single_calls,
                np.arange(n_single, dtype=i64),
            )
        ]
        if chain.group_kinds:
            first_start = max(0, end - self.max_group + 1)
            self._advance(end, first_start, acc, keep_before)
            starts = np.arange(first_start, end, dtype=i64)
            lengths = end - starts + 1
            retained = np.full(len(starts), chain.checkpointed[end], dtype=i64)
            fwd_peak = acc.fwd_peak[first_start:end]
            for k, kind in enumerate(chain.group_kinds):
                if kind == SEGMENT:
                    bwd = acc.segment_bwd[first_start:end] - keep_before[first_start:end]
                    time, reexec = acc.segment_time[first_start:end], lengths
                else:
                    bwd = acc.nested_bwd[first_start:end]
                    time, reexec = acc.nested_time[first_start:end], lengths * (lengths + 1) // 2
                code = np.full(len(starts), n_single + k, dtype=i64)
                peak = np.maximum(fwd_peak, bwd) + chain.head_retained
                parts.append(_Units(starts, retained, peak, time.copy(), reexec, code))
        return _Units(*(np.concatenate([getattr(u, f) for u in parts]) for f in _Units.__dataclass_fields__))

    def _advance(self, end: int, first: int, acc: _GroupAccumulators, keep_before: np.ndarray) -> None:
        """Extend the open groups starting at ``first..end-1`` by block ``end``; open one at ``end``."""
        c, open_ = self.chain, slice(first, end)
        if first < end:
            acc.segment_time[open_] += c.rerun_s[end]
            acc.nested_time[open_] += acc.segment_time[open_]
            inner_fwd = c.output[end - 1] + c.checkpointed[end] + c.fwd_temp[end]
            np.maximum(acc.fwd_peak[open_], inner_fwd, out=acc.fwd_peak[open_])
            np.maximum(acc.segment_bwd[open_], keep_before[end + 1] + c.temp[end], out=acc.segment_bwd[open_])
            inner_bwd = c.keep[end] + c.output[end - 1] + c.temp[end]
            np.maximum(acc.nested_bwd[open_], inner_bwd, out=acc.nested_bwd[open_])
        acc.segment_time[end] = acc.nested_time[end] = c.rerun_s[end]
        acc.fwd_peak[end] = c.checkpointed[end] + c.fwd_temp[end]
        acc.segment_bwd[end] = keep_before[end + 1] + c.temp[end]
        acc.nested_bwd[end] = c.keep[end] + c.temp[end]

    def _arrivals(self, end: int, units: _Units, store: _Store) -> _Partials:
        """The partial plans made by appending one of ``units`` (all ending at block ``end``) to a stored
        one such that the result can still be completed within the budget, without the ones a plan with
        fewer or equal bytes beats on time."""
        limit = np.maximum(self.room - np.maximum(units.peak, units.retained + self.need[end + 1]), -1)
        first = store.front_start[units.source]
        past = np.searchsorted(store.key[: store.size], units.source * store.stride + limit, "right")
        self._skip_nested_beaten_by_segments(units, first, past)
        counts = np.maximum(past - first, 0)
        ends = np.cumsum(counts)
        total = int(ends[-1])
        parent = np.arange(total, dtype=np.int64) + np.repeat(first - (ends - counts), counts)
        prefix = store.prefix[parent] + np.repeat(units.retained, counts)
        time = store.time[parent] + np.repeat(units.time, counts)
        # Arrivals come in runs sorted by bytes, which a stable sort merges quickly.
        order = np.argsort(prefix, kind="stable")
        sorted_time = time[order]
        fastest_before = np.minimum.accumulate(sorted_time)
        maybe = np.empty(total, dtype=bool)
        maybe[:1] = True
        maybe[1:] = sorted_time[1:] <= fastest_before[:-1]
        order = order[maybe]
        unit = np.searchsorted(ends, order, side="right")
        parent = parent[order]
        return _Partials(
            prefix[order],
            sorted_time[maybe],
            store.reexec[parent] + units.reexec[unit],
            np.maximum(store.peak[parent], store.prefix[parent] + units.peak[unit]),
            parent,
            units.source[unit],
            units.code[unit],
        )

    def _skip_nested_beaten_by_segments(self, units: _Units, first: np.ndarray, past: np.ndarray) -> None:
        """From a partial plan where segment ``s..e`` fits, nested group ``s..e`` gives the same bytes with
        no less time and more re-executions, so only plans the segment does not fit need the nested one."""
        kinds = self.chain.group_kinds
        if len(kinds) < 2:
            return
        n_single = len(self.chain.singles)
        n_groups = (len(units.source) - n_single) // 2
        segment = slice(n_single, n_single + n_groups)
        nested = slice(n_single + n_groups, None)
        first[nested] = np.maximum(first[nested], past[segment])

    def _settle(self, p: _Partials) -> _Partials:
        """The front of one position: thinned first when too large (``p`` is sorted by bytes with time
        never rising), then made exact."""
        if self.resolution is not None:
            width = self.resolution
        elif len(p.prefix) > self.front_limit:
            # Up to three plans survive per bucket, so use half as many buckets as the limit.
            width = -(-(int(p.prefix[-1] - p.prefix[0]) + 1) // max(1, self.front_limit // 2))
        else:
            width = 1
        if width > 1 and len(p.prefix) > 1:
            if self.prices is None:
                self.prices = _memory_prices(self.chain, self.room, self.need, self.max_group)
            kept = _thin(p.prefix, p.time, width, self.prices)
            if len(kept) < len(p.prefix):
                self.thinned += len(p.prefix) - len(kept)
                self.widest_bucket = max(self.widest_bucket, width)
                p = p.take(kept)
        return _pareto(p)


def _actions_from_units(chain: _Chain, units: list[tuple[int, int, int]]) -> list[str]:
    actions: list[str] = []
    group_id = 0
    for start, end, code in units:
        if code < len(chain.singles):
            actions.append(chain.singles[code])
            continue
        kind = chain.group_kinds[code - len(chain.singles)]
        prefix = SEGMENT_PREFIX if kind == SEGMENT else NESTED_PREFIX
        actions.extend([f"{prefix}{group_id}"] * (end - start + 1))
        group_id += 1
    return actions


def _default_max_group(n: int) -> int:
    """Every length on chains of up to 32 blocks; on longer ones fewer, down to 8 blocks. A longer group
    only saves the retained output of one split point, while every extra length costs search work that
    finer fronts use better; budgets that need longer groups get them (see ``optimal``)."""
    return n if n <= 32 else max(8, 1024 // n)


def _front_limit(chain: _Chain, max_group: int) -> int:
    units_per_plan = len(chain.singles) + len(chain.group_kinds) * (max_group - 1)
    return int(np.clip(WORK_TARGET // (chain.n * units_per_plan), MIN_FRONT, EXACT_FRONT_LIMIT))


def _budget_error(budget: int, floor: int, detail: str = "") -> BudgetError:
    return BudgetError(
        f"no plan fits a budget of {format_bytes(budget)} ({budget} bytes): the minimum feasible peak on this "
        f"chain is {format_bytes(floor)} ({floor} bytes){detail}. Raise the budget to at least that, or shrink "
        "the batch or the sequence length.",
        floor=floor,
    )


def optimal(
    costs: CostTable,
    budget: int | None,
    *,
    actions: list[str] | None = None,
    resolution: int | None = None,
    max_segment: int | None = None,
) -> Plan:
    """The plan of least predicted recompute time whose predicted peak is at most ``budget`` bytes.

    ``actions`` restricts the choices: single-block actions from the cost table plus ``"segment"`` and
    ``"nested"`` for groups (default: every action of the table and both group kinds). ``resolution``
    (bytes) merges partial plans whose prefix bytes share a bucket of that width at every position (see the
    module notes; ``None`` = exact while fronts stay small, automatic widths on large ones). ``max_segment``
    caps the blocks in one group; ``None`` allows every length on chains of up to 32 blocks and fewer (down
    to 8) on longer ones, more where the budget can only be met with longer groups.

    Raises :class:`remat.planners.BudgetError` naming the minimum feasible peak when nothing fits.
    ``Plan.options`` records ``exact`` (True when the search proved the plan optimal under the simulator
    among the allowed actions and group lengths), ``max_segment`` (the group length searched),
    ``resolution`` (the widest bucket used when thinning, else None) and ``partial_plans`` (work done).
    """
    if budget is None:
        raise ValueError("the optimal planner needs a budget in bytes; pass budget=... (e.g. '2GiB')")
    if len(costs) == 0:
        raise ValueError("the cost table has no blocks; profile a model with at least one block")
    if resolution is not None and resolution < 1:
        raise ValueError(f"resolution is a bucket width in bytes and must be at least 1, got {resolution}")
    if max_segment is not None and max_segment < 1:
        raise ValueError(f"max_segment must be at least 1 block, got {max_segment}")
    budget = int(budget)
    keep_everything: Plan | None = None
    if costs.held_args_bytes and KEEP in _allowed_actions(costs, actions)[0]:
        keep_everything = Plan.from_actions(
            costs, [KEEP] * len(costs), "optimal", budget, exact=True, max_segment=1, resolution=None,
            partial_plans=0,
        )  # fmt: skip
    try:
        plan = _search(costs, budget, actions, resolution, max_segment)
    except BudgetError as error:
        if keep_everything is None or keep_everything.predicted_peak_bytes >= error.floor:
            raise
        if keep_everything.fits:
            return keep_everything
        raise _budget_error(budget, keep_everything.predicted_peak_bytes) from None
    # The search weighed keeping everything with the held arguments added; without them it may rank first.
    if keep_everything is not None and keep_everything.fits and _rank(costs, keep_everything) <= _rank(costs, plan):
        return keep_everything
    return plan


def _rank(costs: CostTable, plan: Plan) -> tuple[float, int, int]:
    """The search's order: least recompute time, then fewest block re-executions, then the lowest peak."""
    sim = simulate(costs, plan.actions)
    return sim.recompute_s, sum(sim.reexecutions), sim.peak_bytes


def _search(
    costs: CostTable, budget: int, actions: list[str] | None, resolution: int | None, max_segment: int | None
) -> Plan:
    """The optimal plan on ``costs`` with the held arguments counted in every unit (see
    :func:`_holding_arguments`), predicted on ``costs`` itself."""
    chain = _Chain.from_costs(_holding_arguments(costs), actions)
    n = chain.n
    room = budget - chain.stem
    max_group = min(n, max_segment) if max_segment is not None else _default_max_group(n)
    need = _suffix_need(chain, max_group)
    if room < need[0]:
        full_need = _suffix_need(chain, n) if max_group < n else need
        if room < full_need[0]:
            raise _budget_error(budget, chain.stem + int(full_need[0]))
        if max_segment is not None:
            floor = chain.stem + int(need[0])
            raise _budget_error(
                budget, floor, f" with groups of at most {max_group} blocks; longer groups reach "
                f"{format_bytes(chain.stem + int(full_need[0]))}, so raise max_segment",
            )  # fmt: skip
        while room < need[0]:  # this budget needs longer groups: double the length until it fits
            max_group = min(n, 2 * max_group)
            need = full_need if max_group == n else _suffix_need(chain, max_group)
        max_group = min(n, 2 * max_group)
        need = full_need if max_group == n else _suffix_need(chain, max_group)
    if (n + 1) * (room + 1) >= 2**62:
        raise ValueError(
            f"a budget of {format_bytes(budget)} is beyond what the optimal planner handles; every plan fits, "
            "so use strategy 'none' (keep everything)"
        )
    search = _Search(chain, room, need, max_group, resolution, _front_limit(chain, max_group))
    units = search.run()
    plan = Plan.from_actions(
        costs,
        _actions_from_units(chain, units),
        "optimal",
        budget,
        exact=search.thinned == 0 and (max_group == n or max_segment is not None),
        max_segment=max_group,
        resolution=search.widest_bucket or None,
        partial_plans=search.stored,
    )
    if plan.predicted_peak_bytes > budget:  # the search only builds plans that fit; this guards it
        raise AssertionError(
            f"internal error: optimal plan predicts {plan.predicted_peak_bytes} bytes above budget {budget}"
        )
    return plan


__all__ = ["min_peak_bytes", "optimal"]
