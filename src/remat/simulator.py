"""Plans and the one simulator that predicts their peak activation memory, recompute time and step time.

A :class:`Plan` maps each block FQN (in chain order) to an action string:

* ``"keep"``: run normally, keep what autograd saves.
* ``"checkpoint"``: keep only the block's input; re-run the block in backward.
* ``"selective:<policy>"``: per-operator policy from :mod:`remat.policies` (e.g. ``selective:dots_saveable``).
* ``"offload"``: saved tensors go to host memory (:func:`remat.host_copies.saved_on_host`).
* ``"segment:<id>"`` and ``"memory_poor:<id>"``: groups of consecutive blocks (see :mod:`remat.actions`).

Every planner and every report predicts through :func:`simulate`; the per-unit terms it sums are in
:mod:`remat.unit_terms`. Memory is accounted as a ledger: a unit retains ``retained`` bytes after its forward,
and while the unit's own forward or backward runs the live bytes rise to ``prefix + peak`` where ``prefix``
is what the units before it retain. The head (loss) runs with everything retained; what it leaves alive
(``head_retained_bytes``, less what the stem held only for the model's forward) is counted in every unit's
backward, which runs after it, and in none of their forwards.
When any unit is not ``keep``, the blocks' other arguments the runtime holds for recomputation
(``held_args_bytes``) are counted in every unit's peak and in the head's too (they may be freed before the
earliest units' backward, and they were alive in the head's forward anyway: the safe side).

A table of several chains (:attr:`remat.costs.CostTable.chain_lengths`) is one ledger: the chains' units in
the order the step runs them, with each chain's ``between_bytes`` added to the prefix after its last unit (alive
through every later chain's forward and backward, freed before the earlier chain's backward), and each chain's
``backward_bytes`` added to the peak of its units. A group may not span two chains: each chain's blocks are
called from their own stack.

Time is a sum: a step keeping everything takes every block's ``fwd_s + bwd_s`` plus ``outside_s`` (the stem,
head and loss, when the table knows it), and each unit adds its time cost (recomputation plus overhead, see
:mod:`remat.unit_terms`)::

    step_s = sum of blocks' (fwd_s + bwd_s) + outside_s + sum of units' (recompute_s + overhead_s)
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .actions import (
    MEMORY_POOR_PREFIX,
    SEGMENT_PREFIX,
    SINGLE,
    Unit,
    current_action,
    is_legacy,
    units_from_actions,
    validate_action,
    warn_legacy,
)
from .costs import KEEP, CostTable
from .plan_files import chain_mismatch, plan_fields
from .sizes import format_bytes, parse_budget
from .unit_terms import UnitTerms, unit_terms


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
    deferred: int = 0  # blocks re-run ahead of a later block's backward (see remat.unit_terms)


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
    held = costs.held_args_bytes if any(not (u.kind == SINGLE and u.action == KEEP) for u in units) else 0
    between = costs.between_after()
    if between:
        check_within_chains(costs, units)
    backward_extra = costs.backward_bytes_per_row()
    for unit in units:
        terms = unit_terms(costs, unit)
        unit_peak = terms.peak + held + max(backward_extra[unit.start : unit.end + 1])
        peak = max(peak, prefix + unit_peak)
        unit_peaks.append(unit_peak)
        prefix += terms.retained + between.get(unit.end, 0)
        recompute += terms.recompute_s
        overhead += terms.overhead_s
        time_cost += terms.time_cost_s
        reexec.extend(terms.reexecutions)
        deferred += terms.deferred
    peak = max(peak, prefix + costs.head_bytes + held) + costs.stem_bytes
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
    is a fraction of the no-checkpoint activation memory predicted from ``costs`` (rules: :mod:`remat.sizes`)."""
    return parse_budget(budget, no_checkpoint_peak(costs) if costs is not None else None)


@dataclass
class Plan:
    """Block FQN -> action, with the simulator's predictions for it."""

    actions: dict[str, str]
    strategy: str = "custom"
    budget_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    predicted_recompute_s: float | None = None
    options: dict[str, Any] = field(default_factory=dict)
    predicted_step_s: float | None = None

    def __post_init__(self) -> None:
        for fqn, action in self.actions.items():
            try:
                validate_action(action)
            except ValueError as error:
                raise ValueError(f"block {fqn!r}: {error}") from None
        if any(is_legacy(a) for a in self.actions.values()):
            warn_legacy("the plan", stacklevel=3)  # the caller of Plan(...)
            self.actions = {fqn: current_action(a) for fqn, a in self.actions.items()}

    @classmethod
    def from_actions(
        cls,
        costs: CostTable,
        actions: list[str] | dict[str, str],
        strategy: str = "custom",
        budget_bytes: int | None = None,
        **options: Any,
    ) -> Plan:
        if not isinstance(actions, dict):
            actions = dict(zip(costs.fqns, actions, strict=True))
        if costs.chain_lengths:
            options.setdefault("chains", list(costs.chain_lengths))
        sim = simulate(costs, actions)
        return cls(dict(actions), strategy, budget_bytes, sim.peak_bytes, sim.recompute_s, dict(options), sim.step_s)

    def in_order(self, fqns: Sequence[str]) -> Plan:
        """This plan with its blocks listed in the order ``fqns`` (a model's chains in module order) when it plans
        several chains (``options["chains"]``) listed in another order (the order the step runs them); else
        itself. Each chain moves as a whole, so its groups stay whole."""
        chains = self.options.get("chains")
        if not chains or list(self.actions) == list(fqns) or set(self.actions) != set(fqns):
            return self
        return replace(self, actions={fqn: self.actions[fqn] for fqn in fqns})

    @property
    def fits(self) -> bool:
        """Whether the predicted peak is within the budget (True when there is no budget)."""
        if self.budget_bytes is None or self.predicted_peak_bytes is None:
            return True
        return self.predicted_peak_bytes <= self.budget_bytes

    def units(self) -> list[Unit]:
        return units_from_actions(list(self.actions.values()))

    def action_counts(self) -> str:
        """The actions counted in the order they first appear, e.g. ``4 checkpoint, 2 keep``."""
        return ", ".join(f"{n} {action}" for action, n in Counter(self.actions.values()).items())

    def units_for(self, fqns: Sequence[str]) -> list[Unit]:
        """The plan's units, after checking that it gives an action for every block of ``fqns``, in order."""
        if list(self.actions) != list(fqns):
            unknown = [f for f in self.actions if f not in fqns]
            missing = [f for f in fqns if f not in self.actions]
            if unknown:
                raise ValueError(f"plan names blocks not in the model's chain: {unknown}; the chain is {list(fqns)}")
            raise ValueError(f"plan must give an action for every block in chain order; missing {missing}")
        return self.units()

    def count(self, action: str) -> int:
        return sum(1 for a in self.actions.values() if a == action)

    def to_json(self) -> str:
        return json.dumps(
            {
                "strategy": self.strategy,
                "budget_bytes": self.budget_bytes,
                "predicted_peak_bytes": self.predicted_peak_bytes,
                "predicted_recompute_s": self.predicted_recompute_s,
                "predicted_step_s": self.predicted_step_s,
                "options": self.options,
                "actions": self.actions,
            },
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str, fqns: Sequence[str] | None = None) -> Plan:
        """Read a plan written by :meth:`to_json`. With ``fqns`` (the chain's block FQNs in order, e.g.
        ``costs.fqns``) the plan must name exactly those blocks in that order. Raises ValueError naming what
        is wrong and the shape a plan file has (:data:`remat.plan_files.PLAN_FILE_SHAPE`)."""
        return cls(**plan_fields(text, fqns))

    def table(self, costs: CostTable | None = None) -> str:
        """A per-block table: action, bytes kept after forward, recompute and overhead seconds (with ``costs``)."""
        lines = [f"plan: {self.strategy}"]
        if self.budget_bytes is not None:
            lines[0] += f"  budget {format_bytes(self.budget_bytes)}"
        if self.predicted_peak_bytes is not None:
            lines[0] += f"  predicted peak {format_bytes(self.predicted_peak_bytes)}"
        if self.predicted_recompute_s is not None:
            lines[0] += f"  recompute {self.predicted_recompute_s * 1e3:.2f} ms"
        if self.predicted_step_s is not None:
            lines[0] += f"  step {self.predicted_step_s * 1e3:.2f} ms"
        width = max([len(f) for f in self.actions] + [5])
        header = f"{'block':<{width}}  {'action':<24}"
        if costs is not None:
            header += f"  {'bytes kept':>12}  {'recompute ms':>12}  {'overhead ms':>11}"
        lines.append(header)
        terms_by_block: dict[int, tuple[int, float, float]] = {}
        if costs is not None:
            for unit in self.units():
                terms = unit_terms(costs, unit)
                for i in range(unit.start, unit.end + 1):
                    kept = terms.retained if i == unit.end else 0
                    share = terms.recompute_s / unit.size
                    terms_by_block[i] = (kept, share, terms.overhead_s / unit.size)
        for i, (fqn, action) in enumerate(self.actions.items()):
            line = f"{fqn:<{width}}  {action:<24}"
            if i in terms_by_block:
                kept, rec, over = terms_by_block[i]
                line += f"  {format_bytes(kept):>12}  {rec * 1e3:>12.3f}  {over * 1e3:>11.3f}"
            lines.append(line)
        return "\n".join(lines)


# Plans' vocabulary and unit terms are re-exported: they were defined here before remat.actions and
# remat.unit_terms held them.
__all__ = [
    "MEMORY_POOR_PREFIX",
    "SEGMENT_PREFIX",
    "Plan",
    "Simulation",
    "Unit",
    "keep_step_s",
    "UnitTerms",
    "no_checkpoint_peak",
    "resolve_budget",
    "simulate",
    "unit_terms",
    "units_from_actions",
    "validate_action",
]
