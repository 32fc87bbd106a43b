"""The one simulator: the peak activation memory, recompute time and step time of a plan's actions on a
cost table (the actions' grammar: :mod:`remat.core.actions`).

Every planner and every report predicts through :func:`simulate`; the per-unit terms it sums are in
:mod:`remat.planning.unit_terms`. Memory is accounted as a ledger: a unit retains ``retained`` bytes after its forward,
and while the unit's own forward or backward runs the live bytes rise to ``prefix + peak`` where ``prefix``
is what the units before it retain. The head (loss) runs with everything retained; what it leaves alive
(``head_retained_bytes``, less what the stem held only for the model's forward) is counted in every unit's
backward, which runs after it, and in none of their forwards.
When any unit is not ``keep``, the blocks' other arguments the runtime holds for recomputation are counted in
each unit's peak, those alive at its rows (:meth:`remat.core.costs.CostTable.held_args_per_row`: an argument only
later blocks take is freed before the unit's backward), and all of them (``held_args_bytes``) in the head's.

A table of several chains (:attr:`remat.core.costs.CostTable.chain_lengths`) is one ledger: the chains' units in
the order the step runs them, with each chain's ``between_bytes`` added to the prefix after its last unit (alive
through every later chain's forward and backward, freed before the earlier chain's backward), and each chain's
``backward_bytes`` added to the peak of its units. A group may not span two chains: each chain's blocks are
called from their own stack.

Time is a sum: a step keeping everything takes every block's ``fwd_s + bwd_s`` plus ``outside_s`` (the stem,
head and loss, when the table knows it), and each unit adds its time cost (recomputation plus overhead, see
:mod:`remat.planning.unit_terms`)::

    step_s = sum of blocks' (fwd_s + bwd_s) + outside_s + sum of units' (recompute_s + overhead_s)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..core import KEEP, SINGLE, CostTable, Unit, parse_budget, units_from_actions
from .plan_files import chain_mismatch
from .unit_terms import unit_terms


@dataclass(frozen=True)
class Simulation:
    peak_bytes: int
    recompute_s: float
    retained_bytes: int
    reexecutions: tuple[int, ...]
    unit_peaks: tuple[int, ...]
    overhead_s: float = 0.0  # the units' overheads beyond their recomputation
    time_cost_s: float = 0.0  # the units' recomputation plus overhead, summed unit by unit (what optimal minimises)
    step_s: float = 0.0  # the predicted step: blocks kept, outside_s when known, plus time_cost_s
    deferred: int = 0  # blocks re-run ahead of a later block's backward (see remat.planning.unit_terms)


def simulate(costs: CostTable, actions: dict[str, str] | list[str]) -> Simulation:
    """Predict peak activation bytes, recompute seconds and step seconds of running ``actions`` on ``costs``."""
    if isinstance(actions, dict):
        problem = chain_mismatch(list(actions), costs.fqns, "the cost table's chain")
        if problem:
            raise ValueError(problem)
        actions = list(actions.values())
    if len(actions) != len(costs):
        raise ValueError(f"plan has {len(actions)} actions for a chain of {len(costs)} blocks")
    prefix = 0
    peak = 0
    recompute = overhead = time_cost = 0.0
    reexec: list[int] = []
    deferred = 0
    unit_peaks = []
    units = units_from_actions(actions)
    holds = any(not (u.kind == SINGLE and u.action == KEEP) for u in units)
    held_rows = costs.held_args_per_row() if holds else [0] * len(costs)
    between = costs.between_after()
    if between:
        check_within_chains(costs, units)
    backward_extra = costs.backward_bytes_per_row()
    for unit in units:
        terms = unit_terms(costs, unit)
        rows = slice(unit.start, unit.end + 1)
        unit_peak = terms.peak + max(held_rows[rows]) + max(backward_extra[rows])
        peak = max(peak, prefix + unit_peak)
        unit_peaks.append(unit_peak)
        prefix += terms.retained + between.get(unit.end, 0)
        recompute += terms.recompute_s
        overhead += terms.overhead_s
        time_cost += terms.time_cost_s
        reexec.extend(terms.reexecutions)
        deferred += terms.deferred
    peak = max(peak, prefix + costs.head_bytes + (costs.held_args_bytes if holds else 0)) + costs.stem_bytes
    step = keep_step_s(costs) + time_cost
    return Simulation(
        int(peak), recompute, int(prefix), tuple(reexec), tuple(unit_peaks), overhead, time_cost, step, deferred
    )


def keep_step_s(costs: CostTable) -> float:
    """Predicted seconds of a step keeping everything: every block's forward and backward, plus ``outside_s``
    when the table knows it."""
    return sum(b.fwd_s + b.bwd_s for b in costs.blocks) + (costs.outside_s or 0.0)


def check_within_chains(costs: CostTable, units: Sequence[Unit]) -> None:
    """Raise ValueError when a group of ``units`` spans two chains of ``costs``."""
    chain_of = costs.chain_index()
    for unit in units:
        if chain_of[unit.start] != chain_of[unit.end]:
            first, last = costs.blocks[unit.start].fqn, costs.blocks[unit.end].fqn
            raise ValueError(
                f"a group runs from {first!r} to {last!r}, across two chains; a segment or memory-poor group "
                "must lie within one chain: give the blocks of each chain their own group ids"
            )


def no_checkpoint_peak(costs: CostTable) -> int:
    """Predicted peak activation bytes with every block kept (the memory-rich reference)."""
    return simulate(costs, [KEEP] * len(costs)).peak_bytes


def resolve_budget(budget: int | float | str | None, costs: CostTable | None = None) -> int | None:
    """Turn a budget into bytes: an int is bytes, a string like "1.5GiB" is parsed, and a float in (0, 1]
    is a fraction of the no-checkpoint activation memory predicted from ``costs`` (rules: :mod:`remat.core.sizes`)."""
    return parse_budget(budget, no_checkpoint_peak(costs) if costs is not None else None)


__all__ = ["Simulation", "check_within_chains", "keep_step_s", "no_checkpoint_peak", "resolve_budget", "simulate"]
