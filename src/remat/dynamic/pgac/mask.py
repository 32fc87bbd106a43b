"""PGAC's mask arithmetic as pure functions of numbers and a CostTable: the q-quantile threshold, the score
mask, and fitting a mask to a byte budget through the shared simulator (:func:`remat.planning.simulator.simulate`).

Fitting follows PGAC section 2.1's constraint ``M_act(c) <= M_budget``:

1. the score mask stores block ``l`` (action ``keep``) when ``score_l >= tau`` and recomputes it
   (``checkpoint``) otherwise;
2. while the predicted peak exceeds the budget, the stored block of lowest score is recomputed instead
   (ties: the block that frees the most bytes per second of recompute goes first). The number of blocks to
   drop is found by bisection, each probe one simulation;
3. when every block is recomputed and the plan still does not fit, consecutive recomputed blocks are
   merged into segments (``segment:<id>``), trying every uniform segment length and keeping the lowest
   predicted peak (all of them re-run each block once, so they cost the same recompute time);
4. when no segmentation fits either, the memory-poor plan and the optimal planner (when installed) are
   tried and the fitting one of least recompute is used. A budget below :func:`minimum_peak_bytes` raises
   :class:`BudgetError` naming the minimum.

PGAC's plans are exact: a cost table that also holds lossy ``compress:`` costs is planned with its exact
actions only (floor and planner included); :mod:`.q_mask` is the fitter that compresses.

Results are cached by the stored set and its drop order, so a mask that repeats costs a dict lookup.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ...core import CHECKPOINT, KEEP, Action, BudgetError, CostTable, format_bytes, plan_choices
from ...planning import memory_poor, minimum_peak_bytes, optimal, per_chain, segments, simulate


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("quantile of an empty list")
    xs = sorted(values)
    h = (len(xs) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def threshold(scores: Sequence[float], q: float, gamma: float) -> float:
    """PGAC's ``tau = gamma * Quantile_q(scores)``."""
    return gamma * quantile(scores, q)


def score_mask(scores: Sequence[float], tau: float) -> list[bool]:
    """``c_l = 1`` (store) when ``score_l >= tau``."""
    return [s >= tau for s in scores]


@dataclass(frozen=True)
class FittedMask:
    """A mask turned into block actions that fit the budget, with the simulator's predictions."""

    actions: tuple[str, ...]
    peak_bytes: int
    recompute_s: float
    dropped: tuple[int, ...]  # blocks the score mask stored and the budget made recompute
    how: str  # "mask", "dropped", "segments" or "planner"

    @property
    def stored(self) -> tuple[bool, ...]:
        return tuple(a == KEEP for a in self.actions)


def exact_actions(costs: CostTable) -> list[str]:
    """The exact single actions plans on ``costs`` may use (each on the blocks that can run it), and the group
    kinds when every block has checkpoint."""
    return [a for a in plan_choices(costs) if Action.choice(a).is_exact]


def budget_error(costs: CostTable, budget_bytes: int) -> BudgetError:
    floor = minimum_peak_bytes(costs, exact_actions(costs))
    return BudgetError(
        f"the activation budget of {format_bytes(budget_bytes)} is below the minimum any plan reaches on this "
        f"model and batch, {format_bytes(floor)} ({floor} bytes). Raise the budget to at least that, or lower "
        "the batch size or sequence length."
    )


class MaskFitter:
    """Fits score masks to ``budget_bytes`` on ``costs`` (see the module docstring); ``None`` = no budget.

    ``fqns``: the order masks, scores and fitted actions are given in, when it is not the table's: a table of
    several chains lists them in the order the step runs them (CLIP's vision tower first), a model in module
    order. Each chain's blocks are consecutive in both, so groups stay whole."""

    def __init__(
        self, costs: CostTable, budget_bytes: int | None, cache_size: int = 1024, fqns: Sequence[str] | None = None
    ) -> None:
        if len(costs) == 0:
            raise ValueError("the cost table has no blocks")
        if fqns is not None:
            self.check_blocks(costs, fqns)
        # self._index[j]: where the table's row j sits in the caller's order
        self._index = [list(fqns).index(f) for f in costs.fqns] if fqns is not None else list(range(len(costs)))
        self.costs = costs
        self.budget = budget_bytes
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[int, ...], FittedMask] = OrderedDict()
        self._all_recomputed: FittedMask | None = None
        self.simulations = 0
        if budget_bytes is not None and budget_bytes < minimum_peak_bytes(costs, exact_actions(costs)):
            raise budget_error(costs, budget_bytes)
        # Bytes freed per second added to the step when a block goes from keep to checkpoint (the tie-break).
        self._efficiency = [row.bytes_freed_per_second(CHECKPOINT) for row in costs.blocks]

    @staticmethod
    def check_blocks(costs: CostTable, fqns: Sequence[str]) -> None:
        """Raise ValueError when ``costs`` does not describe the blocks ``fqns`` (in any chain order)."""
        if sorted(fqns) != sorted(costs.fqns):
            raise ValueError(
                f"the cost table describes the chain {costs.fqns}, but PGAC manages {list(fqns)}; profile the same "
                "model with the same blocks"
            )

    def _sim(self, actions: list[str]) -> tuple[int, float]:
        self.simulations += 1
        sim = simulate(self.costs, actions)
        return sim.peak_bytes, sim.recompute_s

    def drop_order(self, stored: Sequence[bool], scores: Sequence[float]) -> tuple[int, ...]:
        """Stored blocks in the order the budget recomputes them: lowest score first."""
        idx = [i for i, s in enumerate(stored) if s]
        return tuple(sorted(idx, key=lambda i: (scores[i], -self._efficiency[i], i)))

    def fit(self, stored: Sequence[bool], scores: Sequence[float]) -> FittedMask:
        """The fitted mask of ``stored`` (lowest ``scores`` recomputed first), in the caller's block order."""
        if len(stored) != len(self.costs) or len(scores) != len(self.costs):
            raise ValueError(f"mask and scores must have one entry per block ({len(self.costs)})")
        at = self._index
        fitted = self._fit_in_table_order([stored[i] for i in at], [scores[i] for i in at])
        if at == sorted(at):
            return fitted
        actions = [""] * len(at)
        for j, action in enumerate(fitted.actions):
            actions[at[j]] = action
        dropped = tuple(at[j] for j in fitted.dropped)
        return FittedMask(tuple(actions), fitted.peak_bytes, fitted.recompute_s, dropped, fitted.how)

    def _fit_in_table_order(self, stored: Sequence[bool], scores: Sequence[float]) -> FittedMask:
        order = self.drop_order(stored, scores)
        cached = self._cache.get(order)
        if cached is not None:
            self._cache.move_to_end(order)
            return cached
        fitted = self._fit(order)
        self._cache[order] = fitted
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return fitted

    def _actions(self, order: tuple[int, ...], dropped: int) -> list[str]:
        actions = [CHECKPOINT] * len(self.costs)
        for i in order[dropped:]:
            actions[i] = KEEP
        return actions

    def _fit(self, order: tuple[int, ...]) -> FittedMask:
        actions = self._actions(order, 0)
        peak, rec = self._sim(actions)
        if self.budget is None or peak <= self.budget:
            return FittedMask(tuple(actions), peak, rec, (), "mask")
        if order:
            full = self._actions(order, len(order))
            peak_full, rec_full = self._sim(full)
            if peak_full <= self.budget:
                lo, hi = 0, len(order)  # lo does not fit, hi fits
                best = (full, peak_full, rec_full)
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    candidate = self._actions(order, mid)
                    p, r = self._sim(candidate)
                    if p <= self.budget:
                        hi, best = mid, (candidate, p, r)
                    else:
                        lo = mid
                return FittedMask(tuple(best[0]), best[1], best[2], order[:hi], "dropped")
        fitted = self._fit_all_recomputed()
        return FittedMask(fitted.actions, fitted.peak_bytes, fitted.recompute_s, order, fitted.how)

    def _fit_all_recomputed(self) -> FittedMask:
        if self._all_recomputed is not None:
            return self._all_recomputed
        assert self.budget is not None
        longest = max(len(chain) for chain in self.costs.chains)
        best: tuple[int, float, list[str]] | None = None
        for k in range(2, longest + 1):
            actions = per_chain(self.costs, lambda n, k=k: segments(n, k))
            peak, rec = self._sim(actions)
            if peak <= self.budget and (best is None or (peak, rec) < (best[0], best[1])):
                best = (peak, rec, actions)
        how = "segments"
        if best is None:
            how = "planner"
            candidates = [memory_poor(self.costs)]
            with contextlib.suppress(BudgetError):
                candidates.append(optimal(self.costs, self.budget, actions=exact_actions(self.costs)))
            for plan in candidates:
                peak, rec = plan.predicted_peak_bytes, plan.predicted_recompute_s
                if peak <= self.budget and (best is None or (rec, peak) < (best[1], best[0])):
                    best = (peak, rec, list(plan.actions.values()))
        if best is None:
            raise budget_error(self.costs, self.budget)
        self._all_recomputed = FittedMask(tuple(best[2]), best[0], best[1], (), how)
        return self._all_recomputed
