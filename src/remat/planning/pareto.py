"""Fronts of partial plans for the optimal planner's search: partial plans as columns, the exact Pareto front
by (bytes, time cost: recomputation plus overhead), and thinning a front by bucketing its bytes.

A partial plan with more bytes and no less time (then no fewer re-executions, then no fewer deferred blocks,
then no lower peak) can never lead to a better plan, so dropping it is exact. Thinning merges partial plans
whose bytes share a bucket, keeping per bucket the fastest one and the best ones at estimated prices of memory;
merged plans keep their exact byte counts, so thinning can only miss a better plan, never exceed a budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Partials:
    """Partial plans as columns. ``parent`` indexes the stored partial plan it extends, ``start`` is the
    position its last unit starts at, ``code`` that unit: a single action index, or ``len(singles)`` plus
    the group kind index."""

    prefix: np.ndarray  # bytes retained by the units so far
    time: np.ndarray  # time-cost seconds so far
    reexec: np.ndarray  # block re-executions in backward so far
    deferred: np.ndarray  # blocks re-run ahead of a later block's backward so far (remat.planning.unit_terms)
    peak: np.ndarray  # highest prefix + unit peak so far
    parent: np.ndarray
    start: np.ndarray
    code: np.ndarray

    def take(self, index: np.ndarray) -> Partials:
        return Partials(*(getattr(self, name)[index] for name in COLUMNS))


COLUMNS = ("prefix", "time", "reexec", "deferred", "peak", "parent", "start", "code")


def pareto_front(p: Partials) -> Partials:
    """The partial plans no other one matches or beats both in bytes and in (time, re-executions, deferred
    blocks, peak) order, sorted by bytes."""
    if len(p.prefix) <= 1:
        return p
    p = p.take(np.lexsort((p.peak, p.deferred, p.reexec, p.time, p.prefix)))
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
    by_key = np.lexsort((p.peak, p.deferred, p.reexec, p.time))
    changed = np.zeros(len(by_key), dtype=bool)
    changed[0] = True
    for column in (p.time, p.reexec, p.deferred, p.peak):
        keyed = column[by_key]
        changed[1:] |= keyed[1:] != keyed[:-1]
    rank = np.empty(len(by_key), dtype=np.int64)
    rank[by_key] = np.cumsum(changed)
    survives = np.empty(len(rank), dtype=bool)
    survives[0] = True
    survives[1:] = rank[1:] < np.minimum.accumulate(rank)[:-1]
    return p.take(survives)


def thin(prefix: np.ndarray, time: np.ndarray, width: int, prices: list[float]) -> np.ndarray:
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


__all__ = ["COLUMNS", "Partials", "pareto_front", "thin"]
