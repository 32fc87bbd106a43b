"""PGAC-Q's three-state mask fitted to a byte budget: each block is stored exactly (``keep``), stored compressed
(``compress:<format>``) or recomputed (``checkpoint``), decided from a ranking of the blocks by their impact.

Fitting, with the ranking (the EMA of ``||dL/da * a||``, or the profiled gradient error) and the score mask
(``ranking_l >= tau``):

1. blocks the score mask stores are kept; the others, the lowest-impact ones, are stored compressed where
   PGAC recomputes them;
2. while the predicted peak exceeds the budget, the kept block of lowest impact is recomputed instead, as in
   PGAC (ties: the block that frees the most bytes per second of recompute goes first). High-impact blocks
   are never compressed by the budget: recomputing keeps their gradients exact;
3. when no block is kept and the plan still does not fit, the compressed block of highest impact is
   recomputed too, then the next highest, and so on;
4. when no such plan fits either (the budget is below what checkpointing every block reaches), the optimal
   planner is run over keep, checkpoint, the compress action, segments, memory-poor groups and (where profiled)
   ``recompute+compress:`` in the same format, and its plan
   is used: below the least exact peak that is where compression lets training go. A budget below the least
   that planner reaches raises :class:`BudgetError` naming that minimum.

So one mask holds all three states at once: the highest-impact blocks kept, the lowest compressed, and those
between recomputed as far as the budget demands. The peak is not monotone in steps 2-3 (a recomputed
block's backward may peak above a compressed one's), so the steps are taken one at a time and the first plan
that fits is used: the fewest changes from the score mask. Results are cached by the score mask and the
ranking's order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ...core import (
    CHECKPOINT,
    KEEP,
    MEMORY_POOR,
    RECOMPUTE_COMPRESS,
    SEGMENT,
    Action,
    BudgetError,
    CostTable,
    format_bytes,
)
from ...planning import optimal, simulate
from .mask import FittedMask

KEEP_STATE, COMPRESS_STATE, RECOMPUTE_STATE = "keep", "compress", "recompute"


def state_of(action: str) -> str:
    """The PGAC-Q state of a block ``action``: ``keep``, ``compress`` (a lossy action: ``compress:``, or
    ``recompute+compress:`` from the planner) or ``recompute`` (any exact non-keep action: checkpoint, segments,
    memory-poor groups)."""
    if action == KEEP:
        return KEEP_STATE
    return COMPRESS_STATE if Action.parse(action).is_lossy else RECOMPUTE_STATE


class QuantizedMaskFitter:
    """Fits three-state masks to ``budget_bytes`` on ``costs`` with compress action ``action`` (module notes);
    ``budget_bytes=None`` means no budget: the score mask is used as it is."""

    def __init__(self, costs: CostTable, budget_bytes: int | None, action: str, cache_size: int = 1024) -> None:
        if len(costs) == 0:
            raise ValueError("the cost table has no blocks")
        missing = [row.fqn for row in costs.blocks if action not in row.saved_bytes]
        if missing or CHECKPOINT not in costs.common_actions():
            raise ValueError(
                f"the cost table has no {action!r} and 'checkpoint' costs for blocks {missing or '(checkpoint)'}; "
                f"profile with remat.profile(model, batch, lossy=({action.split(':')[1]!r},)) or pass costs=None "
                "to measure them in the first step"
            )
        self.costs, self.budget, self.action = costs, budget_bytes, action
        # The planner may also recompute compressed (the same format and policy), never checkpoint+compress: the
        # gradient scorer holds every block's output, the input checkpoint+compress would free.
        recompute = Action(RECOMPUTE_COMPRESS, Action.parse(action).arg).text
        self.allowed = [KEEP, CHECKPOINT, action, *((SEGMENT, MEMORY_POOR) if costs.groups_allowed() else ())]
        self.allowed += [recompute] if recompute in costs.common_actions() else []
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[tuple[int, ...], tuple[int, ...]], FittedMask] = OrderedDict()
        self._planned: FittedMask | None = None
        self.simulations = 0
        # Bytes freed per second added to the step when a block goes from keep to checkpoint (the tie-break).
        self._efficiency = [row.bytes_freed_per_second(CHECKPOINT) for row in costs.blocks]
        if budget_bytes is not None:
            self._check_feasible()

    def _check_feasible(self) -> None:
        """Raise BudgetError now when even the last fitting step and the planner cannot meet the budget."""
        n = len(self.costs)
        assert self.budget is not None
        if self._sim([CHECKPOINT] * n)[0] > self.budget:
            self._plan_fallback(tuple(range(n)))

    def _sim(self, actions: list[str]) -> tuple[int, float]:
        self.simulations += 1
        sim = simulate(self.costs, actions)
        return sim.peak_bytes, sim.recompute_s

    def orders(self, stored: Sequence[bool], ranking: Sequence[float]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The kept blocks in the order they are recomputed (lowest impact first), then the compressed blocks in
        the order they are recomputed (highest impact first)."""
        up = sorted((i for i, s in enumerate(stored) if s), key=lambda i: (ranking[i], -self._efficiency[i], i))
        down = sorted((i for i, s in enumerate(stored) if not s), key=lambda i: (-ranking[i], i))
        return tuple(up), tuple(down)

    def fit(self, stored: Sequence[bool], ranking: Sequence[float]) -> FittedMask:
        if len(stored) != len(self.costs) or len(ranking) != len(self.costs):
            raise ValueError(f"mask and ranking must have one entry per block ({len(self.costs)})")
        up, down = self.orders(stored, ranking)
        key = (up, down)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        fitted = self._fit(tuple(bool(s) for s in stored), up, down)
        self._cache[key] = fitted
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return fitted

    def _fit(self, stored: tuple[bool, ...], up: tuple[int, ...], down: tuple[int, ...]) -> FittedMask:
        actions = [KEEP if s else self.action for s in stored]
        changed: list[int] = []
        how = "mask"
        steps = [(i, "kept recomputed") for i in up] + [(i, "compressed recomputed") for i in down]
        for k in range(len(steps) + 1):
            if k > 0:
                i, how = steps[k - 1]
                actions[i] = CHECKPOINT
                changed.append(i)
            peak, recompute = self._sim(actions)
            if self.budget is None or peak <= self.budget:
                return FittedMask(tuple(actions), peak, recompute, tuple(dict.fromkeys(changed)), how)
        return self._plan_fallback(tuple(dict.fromkeys(changed)))

    def _plan_fallback(self, changed: tuple[int, ...]) -> FittedMask:
        if self._planned is None:
            assert self.budget is not None
            try:
                plan = optimal(self.costs, self.budget, actions=self.allowed)
            except BudgetError as error:
                lossy = " and ".join(a for a in self.allowed if Action.choice(a).is_lossy)
                raise BudgetError(
                    f"the activation budget of {format_bytes(self.budget)} is below the minimum any plan of keep, "
                    f"checkpoint and {lossy} reaches on this model and batch, {format_bytes(error.floor)} "
                    f"({error.floor} bytes). Raise the budget to at least that, use a smaller format, or lower the "
                    "batch size or sequence length.",
                    floor=error.floor,
                ) from None
            actions = tuple(plan.actions.values())
            self._planned = FittedMask(actions, plan.predicted_peak_bytes, plan.predicted_recompute_s, (), "planner")
        p = self._planned
        return FittedMask(p.actions, p.peak_bytes, p.recompute_s, changed, p.how)


__all__ = ["COMPRESS_STATE", "KEEP_STATE", "RECOMPUTE_STATE", "QuantizedMaskFitter", "state_of"]
