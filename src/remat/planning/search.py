"""The optimal planner's search: least bytes any completion needs (``need``), memory prices for thinning, and
the left-to-right search over positions that keeps the Pareto front of partial plans at each one.

With ``P`` the bytes the units before a unit retain, a plan fits when every unit satisfies
``P + peak(unit) <= room`` (the budget less the stem) and the chain end satisfies ``P_total + head <= room``;
time cost (recomputation plus overhead) is a sum over units. So ``need[i]``, the least bytes above its
prefix that any plan of blocks ``i..`` needs, obeys
``need[i] = min over units u starting at i of max(peak(u), retained(u) + need[end(u) + 1])`` with
``need[n] = head``, and a prefix ``P`` at block ``i`` can be completed exactly when ``P + need[i]`` fits:
partial plans that cannot be completed are never created.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ..core import GROUP_KINDS, KEEP
from .chain_units import ChainUnits, Units
from .pareto import COLUMNS, Partials, pareto_front, thin

# Automatic limits (resolution=None, max_segment=None). The search creates about
# n * front size * units per partial plan candidates; fronts are thinned to keep that near WORK_TARGET,
# never below MIN_FRONT nor above EXACT_FRONT_LIMIT partial plans.
WORK_TARGET = 3_000_000
MIN_FRONT = 16
EXACT_FRONT_LIMIT = 4096
# Points of the memory-price grid (see memory_prices).
PRICE_GRID = 24
# Complete plans read for plan-level ties, nearest the fastest first (see Search.run).
TIE_CANDIDATES = 512


def suffix_need(chain: ChainUnits, max_segment: int) -> np.ndarray:
    """``need[i]``: the least bytes above its prefix that any plan of blocks ``i..n-1`` (groups of at most
    ``max_segment`` blocks) needs, the chain end's head included."""
    n = chain.n
    need = np.zeros(n + 1, dtype=np.int64)
    need[n] = chain.head
    for i in range(n - 1, -1, -1):
        units = chain.starting_at(i, max_segment)
        need[i] = np.maximum(units.peak, units.retained + need[units.end + 1]).min()
    return need


def memory_prices(chain: ChainUnits, room: int, need: np.ndarray, max_segment: int) -> list[float]:
    """Seconds per byte at which memory trades against time cost on this chain and budget.

    Pricing memory at ``price`` turns the search into a shortest path: each unit costs
    ``time + price * retained``. The smallest price on a geometric grid whose cheapest plan fits the budget
    estimates the marginal value of memory (a Lagrange multiplier); thinning keeps, per bucket, the best
    plans at that price and at half of it next to the fastest. Returns ``[0.0]`` when nothing needs one.
    """
    n = chain.n
    saving = chain.singles.keep[None, :] - chain.singles.retained
    useful = (saving > 0) & (chain.singles.time_cost_s > 0) & chain.singles.runs
    if not useful.any():
        return [0.0]
    ratios = chain.singles.time_cost_s[useful] / saving[useful]
    grid = np.concatenate(([0.0], np.geomspace(ratios.min() / 100, ratios.max() * 100, PRICE_GRID)))
    value = np.zeros((n + 1, len(grid)))
    plan_need = np.zeros((n + 1, len(grid)), dtype=np.int64)
    plan_need[n] = chain.head
    columns = np.arange(len(grid))
    for i in range(n - 1, -1, -1):
        u = chain.starting_at(i, max_segment)
        r, k, t, e = u.retained, u.peak, u.time, u.end
        cost = t[:, None] + grid[None, :] * r[:, None] + value[e + 1]
        cost[np.maximum(k, r + need[e + 1]) > room] = np.inf
        best = np.argmin(cost, axis=0)
        value[i] = cost[best, columns]
        plan_need[i] = np.maximum(k[best], r[best] + plan_need[e[best] + 1, columns])
    fits = np.flatnonzero(np.isfinite(value[0]) & (plan_need[0] <= room))
    price = grid[fits[0]] if len(fits) else grid[-1]
    return [0.0] if price == 0 else [0.0, price / 2, price]


def default_max_segment(n: int) -> int:
    """Every length on chains of up to 32 blocks; on longer ones fewer, down to 8 blocks. A longer group
    only saves the retained output of one split point, while every extra length costs search work that finer fronts use
    better; budgets that need longer groups get them (see :func:`remat.planning.optimal_plan.optimal`)."""
    return n if n <= 32 else max(8, 1024 // n)


def front_limit(chain: ChainUnits, max_segment: int) -> int:
    units_per_plan = len(chain.singles.actions) + len(chain.group_kinds) * (max_segment - 1)
    return int(np.clip(WORK_TARGET // (chain.n * units_per_plan), MIN_FRONT, EXACT_FRONT_LIMIT))


class Store:
    """Every kept partial plan, the front of each position stored after the one before and sorted by
    bytes, with ``key = position * (room + 1) + prefix`` so one binary search finds what fits in any
    front."""

    def __init__(self, n: int, room: int, capacity: int) -> None:
        capacity = max(capacity, 16)
        self.prefix = np.empty(capacity, dtype=np.int64)
        self.time = np.empty(capacity, dtype=np.float64)
        self.reexec = np.empty(capacity, dtype=np.int64)
        self.deferred = np.empty(capacity, dtype=np.int64)
        self.peak = np.empty(capacity, dtype=np.int64)
        self.parent = np.empty(capacity, dtype=np.int64)
        self.start = np.empty(capacity, dtype=np.int64)
        self.code = np.empty(capacity, dtype=np.int64)
        self.key = np.empty(capacity, dtype=np.int64)
        self.size = 0
        self.front_start = np.zeros(n + 2, dtype=np.int64)
        self.stride = room + 1

    def append(self, position: int, p: Partials) -> None:
        end = self.size + len(p.prefix)
        if end > len(self.key):
            grow = max(end, 2 * len(self.key))
            for name in (*COLUMNS, "key"):
                column = getattr(self, name)
                bigger = np.empty(grow, dtype=column.dtype)
                bigger[: self.size] = column[: self.size]
                setattr(self, name, bigger)
        for name in COLUMNS:
            getattr(self, name)[self.size : end] = getattr(p, name)
        self.key[self.size : end] = position * self.stride + p.prefix
        self.front_start[position] = self.size
        self.size = end
        self.front_start[position + 1] = end


@dataclass
class Search:
    """One search over a chain: the fronts of every position, thinned when they grow past ``front_limit`` (or
    to ``resolution`` bytes), and the counts that say whether the result is exact."""

    chain: ChainUnits
    room: int  # budget minus stem: what prefix + unit peak may reach
    need: np.ndarray
    max_segment: int
    resolution: int | None
    front_limit: int
    thinned: int = 0
    widest_bucket: int = 0
    stored: int = 0
    prices: list[float] | None = None  # memory prices for thinning, estimated on first need
    ties_s: float = 0.0  # the profile's noise: plans whose times differ within it are ties (see run, plans_tied)

    def run(self) -> list[tuple[int, int, int]]:
        """The chosen plan as units (start, end, code)."""
        chain = self.chain
        n = chain.n
        store = Store(n, self.room, (n + 1) * min(self.front_limit, 64))
        zero = np.zeros(1, dtype=np.int64)
        store.append(0, Partials(zero, np.zeros(1), zero, zero, zero, zero - 1, zero, zero))
        for pos in range(1, n + 1):
            units = chain.ending_at(pos - 1, self.max_segment)
            store.append(pos, self._settle(self._arrivals(pos - 1, units, store)))
        self.stored = store.size
        first = store.front_start[n]
        final = slice(first, store.front_start[n + 1])
        total_peak = np.maximum(store.peak[final], store.prefix[final] + chain.head)
        order = np.lexsort((total_peak, store.deferred[final], store.reexec[final], store.time[final]))
        best = self._units(store, first + int(order[0]))
        if self.ties_s <= 0:
            return best
        # Plan-level ties: a complete plan whose time is within the noise of the fastest's (plans_tied) is one the
        # noise could have put first; among those, a fixed order decides:
        # fewest deferred blocks (a segment's price is the profile's least certain figure), fewest re-executions,
        # lowest peak, then the blocks kept latest in the chain (recomputation on the earlier blocks, whose
        # activations wait longest), then time. Ties are not transitive: a far-off fastest plan ties with two
        # plans one of which is clearly faster than the other, and the slower one, first in the order, sits at
        # the edge of the tie window, in or out with each profile's noise. So the first in the order that no
        # tied plan beats beyond their own tie width is taken (the fastest is beaten by none).
        times = store.time[final]
        fastest = times[order[0]]
        best_actions = chain.actions_from_units(best)
        tied = []
        # plans_tied's width is at most 2 * noise * sqrt(2) * n (every block moved from one action to another);
        # the nearest TIE_CANDIDATES by time are read
        near = np.flatnonzero(times <= fastest + 2 * self.ties_s * math.sqrt(2) * n)
        for k in near[np.argsort(times[near], kind="stable")][:TIE_CANDIDATES]:
            units = self._units(store, first + int(k))
            actions = chain.actions_from_units(units)
            if plans_tied(self.ties_s, best_actions, actions, fastest, times[k]):
                kept = tuple(action == KEEP for action in actions)
                key = (store.deferred[first + k], store.reexec[first + k], total_peak[k], kept, times[k])
                tied.append((key, units, action_counts(actions), float(times[k])))
        tied.sort(key=lambda candidate: candidate[0])
        for _, units, counts, time_s in tied:
            if not any(other_s < time_s and not counts_tied(self.ties_s, other, counts, other_s, time_s)
                       for _, _, other, other_s in tied):  # fmt: skip
                return units
        return best

    def _units(self, store: Store, index: int) -> list[tuple[int, int, int]]:
        """The units (start, end, code) of the complete plan stored at ``index``, in chain order."""
        chosen = []
        pos = self.chain.n
        while pos > 0:
            start = int(store.start[index])
            chosen.append((start, pos - 1, int(store.code[index])))
            pos, index = start, int(store.parent[index])
        return chosen[::-1]

    def _arrivals(self, end: int, units: Units, store: Store) -> Partials:
        """The partial plans made by appending one of ``units`` (all ending at block ``end``) to a stored
        one such that the result can still be completed within the budget, without the ones a plan with
        fewer or equal bytes beats on time."""
        limit = np.maximum(self.room - np.maximum(units.peak, units.retained + self.need[end + 1]), -1)
        first = store.front_start[units.start]
        past = np.searchsorted(store.key[: store.size], units.start * store.stride + limit, "right")
        self._skip_memory_poor_beaten_by_segments(units, first, past)
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
        return Partials(
            prefix[order],
            sorted_time[maybe],
            store.reexec[parent] + units.reexec[unit],
            store.deferred[parent] + units.deferred[unit],
            np.maximum(store.peak[parent], store.prefix[parent] + units.peak[unit]),
            parent,
            units.start[unit],
            units.code[unit],
        )

    def _skip_memory_poor_beaten_by_segments(self, units: Units, first: np.ndarray, past: np.ndarray) -> None:
        """From a partial plan where segment ``s..e`` fits, memory-poor group ``s..e`` gives the same bytes with
        more re-executions and, unless the segment's deferred blocks are priced above the memory-poor group's
        inner re-runs, no less time; where so, only plans the segment does not fit need the memory-poor one
        (``units``: the singles, then the segments, then the memory-poor groups)."""
        kinds = self.chain.group_kinds
        if len(kinds) < 2:
            return
        n_single = int((units.code < len(self.chain.singles.actions)).sum())  # the singles this block can run
        n_groups = (len(units.start) - n_single) // 2
        segment = slice(n_single, n_single + n_groups)
        memory_poor = slice(n_single + n_groups, None)
        beaten = units.time[segment] <= units.time[memory_poor]
        first[memory_poor] = np.where(beaten, np.maximum(first[memory_poor], past[segment]), first[memory_poor])

    def _settle(self, p: Partials) -> Partials:
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
                self.prices = memory_prices(self.chain, self.room, self.need, self.max_segment)
            kept = thin(p.prefix, p.time, width, self.prices)
            if len(kept) < len(p.prefix):
                self.thinned += len(p.prefix) - len(kept)
                self.widest_bucket = max(self.widest_bucket, width)
                p = p.take(kept)
        return pareto_front(p)


def plans_tied(noise_s: float, faster: Iterable[str], slower: Iterable[str], faster_s: float, slower_s: float) -> bool:
    """Whether two plans' predicted steps tie under a profile noise of ``noise_s`` (invariant 1 of
    :mod:`remat.planning.optimal_plan`): the slower exceeds the faster by no more than twice the noise times the
    root of the summed squares of how many blocks each action has more in one plan than in the other (a segment or
    memory-poor group counted by its kind). An action's figure is shared by the blocks that cost the same, so its
    error enters once per block it has more; two plans with the same counts tie only where their times do."""

    return counts_tied(noise_s, action_counts(faster), action_counts(slower), faster_s, slower_s)


def action_counts(actions: Iterable[str]) -> Counter[str]:
    """How many blocks each action has in a plan, a group counted by its kind (what :func:`plans_tied` reads)."""
    return Counter(a.split(":")[0] if a.split(":")[0] in GROUP_KINDS else a for a in actions)


def counts_tied(noise_s: float, faster: Counter[str], slower: Counter[str], faster_s: float, slower_s: float) -> bool:
    """:func:`plans_tied` on the plans' :func:`action_counts`."""
    distance = math.sqrt(sum((faster[k] - slower[k]) ** 2 for k in set(faster) | set(slower)))
    return slower_s - faster_s <= 2 * noise_s * distance
