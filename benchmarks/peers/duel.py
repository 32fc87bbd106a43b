"""The head-to-head rounds of the peers benchmark: remat's contender against the peers of its budget, alone.

At each budget and in each group (:data:`table.DUELS`), remat's contenders (``remat optimal`` and ``remat
fit``; on compiled code ``remat.fit(compile=True)``), each peer of that budget and remat's first contender again (the
A/A pair, key ``<key>#aa``) run round by round, the order reversed every other round; each step is one record of kind
``duel``. The rounds over every contender cannot resolve steps within 2% on a shared machine; these few can.

After ``duel_rounds`` rounds, blocks of :data:`DUEL_BLOCK` more run, up to ``duel_max_rounds`` in all, while the
95% interval of the median of remat's ratio to some peer that fits (:func:`remat.bench.stats.median_interval`)
still holds the speed target: a ratio near 1.02 gets the rounds it needs, one far from it stops early.
"""

from __future__ import annotations

from typing import Any, Protocol

from remat.bench import median_interval

from . import contenders as pc
from . import table as pt

DUEL_BLOCK = 8  # rounds added at a time while a ratio is unresolved


class Timer(Protocol):
    """What the rounds need of the unit's bench (``child.Bench``)."""

    job: dict[str, Any]
    memory: dict[str, dict[str, Any]]

    def timed(self, c: pc.Contender, seed: int) -> dict[str, float]: ...

    def emit(self, record: str, **fields: Any) -> None: ...


def duel_rounds(bench: Timer, cs: pc.ContenderSet) -> None:
    first = bench.job.get("duel_rounds", 0)
    most = bench.job.get("duel_max_rounds", first)  # under ``first``: the first rounds alone run
    if first == 0:
        return
    for budget in sorted({row.budget for row in cs.rows if row.budget is not None}):
        at = {row.name: row.key for row in cs.rows if row.budget == budget}
        for group, mine_names, peer_names in pt.DUELS:
            mines = list(dict.fromkeys(at[name] for name in mine_names if name in at))
            peers = [at[name] for name in peer_names if name in at]
            if not mines or not peers:
                continue
            slots = [*((key, key) for key in mines), *((key, key) for key in peers), (f"{mines[0]}#aa", mines[0])]
            fitting = [key for key in peers if fits(bench.memory, key, pt.REFERENCE[group], budget)]
            seconds: dict[str, list[float]] = {label: [] for label, _ in slots}
            r = 0
            while r < first or (r < most and unresolved(seconds, mines, fitting)):
                block = first if r == 0 else min(DUEL_BLOCK, most - r)
                for _ in range(block):
                    for label, key in slots if r % 2 == 0 else slots[::-1]:
                        fields = bench.timed(cs.contenders[key], bench.job["seed"] + 5000 + r)
                        seconds[label].append(fields.get("cpu_seconds", fields["seconds"]))
                        bench.emit("duel", budget=budget, key=label, round=r, **fields)
                    r += 1


def fits(memory: dict[str, dict[str, Any]], key: str, reference: str, budget: float) -> bool:
    """Whether the contender ``key`` fits ``budget`` by every meter that measured it (the table's rule)."""
    return bool(pt.fits_by_every_meter(budget, *pt.meter_ratios(memory[key], memory[reference])))


def unresolved(seconds: dict[str, list[float]], mines: list[str], peers: list[str]) -> bool:
    """Whether the step of one of remat's contenders over some peer's, round by round, has a 95% interval that
    holds the speed target."""
    for mine in mines:
        for peer in peers:
            ratios = [a / b for a, b in zip(seconds[mine], seconds[peer], strict=True) if b > 0]
            spread = median_interval(ratios)
            if pt.unresolved(spread.low, spread.high):
                return True
    return False
