"""The :class:`Plan`: each block's action (by FQN, in chain order), with the simulator's predictions for it.

A plan's actions are action texts (:mod:`remat.core.actions`); it is written to and read from a plan file
(:mod:`remat.planning.plan_files`) and applied by :func:`remat.apply`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..core import (
    LAYER_DROP_GROUPS,
    Action,
    CostTable,
    Unit,
    current_action,
    format_bytes,
    is_legacy,
    units_from_actions,
    validate_action,
    warn_legacy,
)
from .plan_files import chain_mismatch, plan_fields
from .simulator import simulate
from .unit_terms import unit_terms


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
        if costs.info.get("layer_drop") and any(Action.choice(a).is_group for a in actions.values()):
            raise ValueError(
                f"the {strategy!r} plan groups blocks, and {LAYER_DROP_GROUPS}. Plan single-block actions ('full', "
                "'optimal'), or set the model's LayerDrop probabilities to 0 and profile it again"
            )
        if costs.chain_lengths:
            options.setdefault("chains", list(costs.chain_lengths))
        shapes = costs.info.get("input_shapes") or {}
        if costs.fqns and costs.fqns[0] in shapes:  # what the predictions hold for (see remat.runtime.handle)
            options.setdefault("planned_input", {"block": costs.fqns[0], "shape": list(shapes[costs.fqns[0]])})
        sim = simulate(costs, actions)
        return cls(dict(actions), strategy, budget_bytes, sim.peak_bytes, sim.recompute_s, dict(options), sim.step_s)

    @classmethod
    def from_named_actions(
        cls, costs: CostTable | None, actions: dict[str, str], strategy: str = "custom", budget_bytes: int | None = None
    ) -> Plan:
        """A plan of ``actions`` named by block, listed in their order (a model's chains in module order, say),
        predicted from ``costs`` where they are known: each action goes to the block that names it, whatever
        order the table lists its chains in."""
        if costs is None:
            return cls(dict(actions), strategy, budget_bytes)
        in_table_order = {f: actions[f] for f in costs.fqns} if set(actions) == set(costs.fqns) else actions
        return cls.from_actions(costs, in_table_order, strategy, budget_bytes).in_order(list(actions))

    def in_order(self, fqns: Sequence[str]) -> Plan:
        """This plan with its blocks listed in the order ``fqns`` (the chain's order) when it names the same blocks
        in another order (several chains listed in the order the step runs them, a plan file written by hand), and
        each group (segment, memory-poor group) stays one run of consecutive blocks in that order; else itself
        (:meth:`units_for` then says what is wrong). A block's action is keyed by its name, so the order of single
        actions carries nothing."""
        if list(self.actions) == list(fqns) or set(self.actions) != set(fqns) or len(self.actions) != len(fqns):
            return self
        actions = {fqn: self.actions[fqn] for fqn in fqns}
        texts = list(actions.values())
        for label in {text for text in texts if Action.choice(text).is_group}:
            where = [i for i, text in enumerate(texts) if text == label]
            if where[-1] - where[0] + 1 != len(where):
                return self
        return replace(self, actions=actions)

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
            if missing:
                raise ValueError(f"plan gives no action for blocks {missing} of the chain {list(fqns)}")
            raise ValueError(
                chain_mismatch(list(self.actions), list(fqns), "the model's chain")
                + "; a group (segment, memory-poor group) must be consecutive blocks of the chain"
            )
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
        is wrong and the shape a plan file has (:data:`remat.planning.plan_files.PLAN_FILE_SHAPE`)."""
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
        action_width = max([len(a) for a in self.actions.values()] + [6])
        header = f"{'block':<{width}}  {'action':<{action_width}}"
        noise = 0.0
        if costs is not None:
            header += f"  {'bytes kept':>12}  {'recompute ms':>12}  {'overhead ms':>11}"
            noise = float(self.options.get("time_noise_s", costs.info.get("time_noise_s", 0.0)) or 0.0)
            if noise > 0:
                lines.append(f"(an overhead within the profile's noise, {noise * 1e3:.3f} ms a block, reads 0)")
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
            line = f"{fqn:<{width}}  {action:<{action_width}}"
            if i in terms_by_block:
                kept, rec, over = terms_by_block[i]
                over = 0.0 if abs(over) <= noise else over  # a difference the profile cannot tell from 0
                line += f"  {format_bytes(kept):>12}  {rec * 1e3:>12.3f}  {over * 1e3:>11.3f}"
            lines.append(line)
        return "\n".join(lines)
