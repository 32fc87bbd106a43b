"""Plans and the one simulator that predicts their peak activation memory and recompute time.

A :class:`Plan` maps each block FQN (in chain order) to an action string:

* ``"keep"``: run normally, keep what autograd saves.
* ``"checkpoint"``: keep only the block's input; re-run the block in backward.
* ``"selective:<policy>"``: per-operator policy from :mod:`remat.policies` (e.g. ``selective:dots_saveable``).
* ``"offload"``: saved tensors go to host memory (``torch.autograd.graph.save_on_cpu``).
* ``"segment:<id>"``: consecutive blocks with the same id form one segment, recomputed in backward from the
  segment's stored input (the input of its first block). Only the segment's input and output stay alive.
* ``"nested:<id>"``: consecutive blocks with the same id form a memory-poor group: during backward every
  block's input is recomputed from the group's input, so nothing inside the group is ever stored.

Every planner and every report predicts through :func:`simulate`; the model it implements is in
:func:`unit_terms`. Memory is accounted as a ledger: a unit retains ``retained`` bytes after its forward,
and while the unit's own forward or backward runs the live bytes rise to ``prefix + peak`` where ``prefix``
is what the units before it retain. The head (loss) runs with everything retained; what it leaves alive
(``head_retained_bytes``) is counted in every unit's peak, since the backward of every unit runs after it.
When any unit is not ``keep``, the blocks' other arguments the runtime holds for recomputation
(``held_args_bytes``) are counted in every unit's peak and in the head's too (they may be freed before the
earliest units' backward, and they were alive in the head's forward anyway: the safe side).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .costs import CHECKPOINT, KEEP, OFFLOAD, SELECTIVE_PREFIX, CostTable
from .sizes import format_bytes, parse_budget

SEGMENT_PREFIX = "segment:"
NESTED_PREFIX = "nested:"


@dataclass(frozen=True)
class Unit:
    """A run of blocks ``start..end`` (inclusive) handled as one piece by the runtime."""

    kind: str  # "single", "segment" or "nested"
    start: int
    end: int
    action: str  # the block action for "single"; "checkpoint" for the groups

    @property
    def size(self) -> int:
        return self.end - self.start + 1


@dataclass(frozen=True)
class UnitTerms:
    retained: int
    peak: int
    recompute_s: float
    reexecutions: tuple[int, ...]  # block re-executions in backward, per block of the unit


def validate_action(action: str) -> None:
    if action in (KEEP, CHECKPOINT, OFFLOAD):
        return
    for prefix in (SELECTIVE_PREFIX, SEGMENT_PREFIX, NESTED_PREFIX):
        if action.startswith(prefix) and len(action) > len(prefix):
            return
    raise ValueError(
        f"unknown action {action!r}; use 'keep', 'checkpoint', 'offload', 'selective:<policy>', "
        "'segment:<id>' or 'nested:<id>'"
    )


def units_from_actions(actions: list[str]) -> list[Unit]:
    """Group a chain-ordered list of block actions into runtime units."""
    units: list[Unit] = []
    i = 0
    while i < len(actions):
        action = actions[i]
        validate_action(action)
        group = SEGMENT_PREFIX if action.startswith(SEGMENT_PREFIX) else None
        group = NESTED_PREFIX if action.startswith(NESTED_PREFIX) else group
        if group is None:
            units.append(Unit("single", i, i, action))
            i += 1
            continue
        j = i
        while j + 1 < len(actions) and actions[j + 1] == action:
            j += 1
        units.append(Unit("segment" if group == SEGMENT_PREFIX else "nested", i, j, CHECKPOINT))
        i = j + 1
    return units


def unit_terms(costs: CostTable, unit: Unit) -> UnitTerms:
    """Retained bytes, peak bytes above the prefix, recompute seconds and re-executions of one unit."""
    terms = _unit_terms(costs, unit)
    return UnitTerms(terms.retained, terms.peak + costs.head_retained_bytes, terms.recompute_s, terms.reexecutions)


def _unit_terms(costs: CostTable, unit: Unit) -> UnitTerms:
    blocks = costs.blocks
    b = blocks[unit.start : unit.end + 1]
    temp = [max(x.fwd_temp_bytes, x.bwd_temp_bytes) for x in b]
    if unit.kind == "single":
        x = b[0]
        saved = x.saved(unit.action)
        keep = x.saved(KEEP)
        peak = max(saved + x.fwd_temp_bytes, keep + temp[0] + x.bwd_extra_bytes.get(unit.action, 0))
        calls = 0 if unit.action in (KEEP, OFFLOAD) else 1
        return UnitTerms(saved, peak, x.recompute_s[unit.action], (calls,))
    rc = [x.recompute_s[CHECKPOINT] for x in b]
    ck = [x.saved(CHECKPOINT) for x in b]
    retained = ck[-1]
    fwd_peak = max(
        (b[m - 1].output_bytes if m else 0) + ck[m] + b[m].fwd_temp_bytes for m in range(len(b))
    )
    if unit.kind == "segment":
        running, bwd_peak = 0, 0
        for m, x in enumerate(b):
            running += x.saved(KEEP)
            bwd_peak = max(bwd_peak, running + temp[m])
        return UnitTerms(retained, max(fwd_peak, bwd_peak), sum(rc), (1,) * len(b))
    # nested: block m's backward re-runs blocks 0..m of the group from the group's input
    bwd_peak = max(
        x.saved(KEEP) + (b[m - 1].output_bytes if m else 0) + temp[m] for m, x in enumerate(b)
    )
    recompute = sum(sum(rc[: m + 1]) for m in range(len(b)))
    reexec = tuple(len(b) - m for m in range(len(b)))
    return UnitTerms(retained, max(fwd_peak, bwd_peak), recompute, reexec)


@dataclass(frozen=True)
class Simulation:
    peak_bytes: int
    recompute_s: float
    retained_bytes: int
    reexecutions: tuple[int, ...]
    unit_peaks: tuple[int, ...]


def simulate(costs: CostTable, actions: dict[str, str] | list[str]) -> Simulation:
    """Predict peak activation bytes and recompute seconds of running ``actions`` on ``costs``."""
    if isinstance(actions, dict):
        if list(actions) != costs.fqns:
            missing = [f for f in costs.fqns if f not in actions]
            extra = [f for f in actions if f not in costs.fqns]
            raise ValueError(
                f"plan does not match the cost table's chain (missing {missing}, unknown {extra}); "
                "plans must name every block in chain order"
            )
        actions = list(actions.values())
    if len(actions) != len(costs):
        raise ValueError(f"plan has {len(actions)} actions for a chain of {len(costs)} blocks")
    prefix = 0
    peak = 0
    recompute = 0.0
    reexec: list[int] = []
    unit_peaks = []
    units = units_from_actions(actions)
    held = costs.held_args_bytes if any(not (u.kind == "single" and u.action == KEEP) for u in units) else 0
    for unit in units:
        terms = unit_terms(costs, unit)
        peak = max(peak, prefix + terms.peak + held)
        unit_peaks.append(terms.peak + held)
        prefix += terms.retained
        recompute += terms.recompute_s
        reexec.extend(terms.reexecutions)
    peak = max(peak, prefix + costs.head_bytes + held) + costs.stem_bytes
    return Simulation(int(peak), recompute, int(prefix), tuple(reexec), tuple(unit_peaks))


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

    def __post_init__(self) -> None:
        for action in self.actions.values():
            validate_action(action)

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
        sim = simulate(costs, actions)
        return cls(dict(actions), strategy, budget_bytes, sim.peak_bytes, sim.recompute_s, dict(options))

    @property
    def fits(self) -> bool:
        """Whether the predicted peak is within the budget (True when there is no budget)."""
        if self.budget_bytes is None or self.predicted_peak_bytes is None:
            return True
        return self.predicted_peak_bytes <= self.budget_bytes

    def units(self) -> list[Unit]:
        return units_from_actions(list(self.actions.values()))

    def count(self, action: str) -> int:
        return sum(1 for a in self.actions.values() if a == action)

    def to_json(self) -> str:
        return json.dumps(
            {
                "strategy": self.strategy,
                "budget_bytes": self.budget_bytes,
                "predicted_peak_bytes": self.predicted_peak_bytes,
                "predicted_recompute_s": self.predicted_recompute_s,
                "options": self.options,
                "actions": self.actions,
            },
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        return cls(
            actions=dict(data["actions"]),
            strategy=data.get("strategy", "custom"),
            budget_bytes=data.get("budget_bytes"),
            predicted_peak_bytes=data.get("predicted_peak_bytes"),
            predicted_recompute_s=data.get("predicted_recompute_s"),
            options=data.get("options", {}),
        )

    def table(self, costs: CostTable | None = None) -> str:
        """A per-block table: action, bytes kept after forward and recompute seconds (with ``costs``)."""
        lines = [f"plan: {self.strategy}"]
        if self.budget_bytes is not None:
            lines[0] += f"  budget {format_bytes(self.budget_bytes)}"
        if self.predicted_peak_bytes is not None:
            lines[0] += f"  predicted peak {format_bytes(self.predicted_peak_bytes)}"
        if self.predicted_recompute_s is not None:
            lines[0] += f"  recompute {self.predicted_recompute_s * 1e3:.2f} ms"
        width = max([len(f) for f in self.actions] + [5])
        header = f"{'block':<{width}}  {'action':<24}"
        if costs is not None:
            header += f"  {'bytes kept':>12}  {'recompute ms':>12}"
        lines.append(header)
        terms_by_block: dict[int, tuple[int, float]] = {}
        if costs is not None:
            for unit in self.units():
                terms = unit_terms(costs, unit)
                for i in range(unit.start, unit.end + 1):
                    kept = terms.retained if i == unit.end else 0
                    share = terms.recompute_s / unit.size
                    terms_by_block[i] = (kept, share)
        for i, (fqn, action) in enumerate(self.actions.items()):
            line = f"{fqn:<{width}}  {action:<24}"
            if i in terms_by_block:
                kept, rec = terms_by_block[i]
                line += f"  {format_bytes(kept):>12}  {rec * 1e3:>12.3f}"
            lines.append(line)
        return "\n".join(lines)
