"""PGAC-Q: PGAC with a third state per block, store compressed, between storing exactly and recomputing.

Everything of :class:`remat.PGAC` carries over (scores, EMA, quantile threshold, gamma schedules, DDP sync,
budget, pipeline thresholds, state_dict); what changes is the mask. Blocks are ranked by their impact on the
update, ``rank="score"`` (the EMA of ``||dL/da * a||``, PGAC's score) or ``rank="error"`` (the gradient
error the profile measured for the block under the compress action); ``tau = gamma * Quantile_q(ranking)``.
Blocks ranked at or above ``tau`` are kept, the others (the lowest-impact ones, which PGAC recomputes) are
stored compressed; the budget then recomputes the kept blocks of lowest impact and, if that is not enough, the
compressed blocks of highest impact, and below what exact plans reach the optimal planner places compressed
blocks (:mod:`.q_mask`).

Lossy: compressed blocks change the gradients (:mod:`remat.checkpointing.compression`, ``docs/lossy.md``). With
``compress=None`` nothing is compressed and PGAC-Q is PGAC, decision for decision.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...core import CHECKPOINT, KEEP, Action, CostTable, compress_action_of
from .controller import PGAC
from .mask import MaskFitter
from .q_mask import QuantizedMaskFitter, state_of

RANKINGS = ("score", "error")


def compress_action(compress: str) -> str:
    """``"int8"``, ``"int8:matmul"`` or ``"compress:int8"`` -> the action string (ValueError naming the choices)."""
    if not isinstance(compress, str) or not compress:
        raise ValueError(
            f"compress must be a format such as 'int8' or 'fp8' (or None: no compression), got {compress!r}"
        )
    return compress_action_of(compress)


class PGACQ(PGAC):
    """PGAC whose blocks are kept, stored compressed or recomputed, chosen by their gradient impact.

    >>> pgacq = remat.PGACQ(model, 0.3, compress="int8").attach(optimizer)

    ``compress``: the format of compressed blocks (``"int8"``, ``"int8_channel"``, ``"fp8"``, ``"fp8_tensor"``,
    optionally with a policy, ``"int8:matmul"``), or None to compress nothing (then it is PGAC). ``rank``:
    ``"score"`` ranks blocks by the EMA gradient score, ``"error"`` by the profiled gradient error under the
    compress action (static: the mask then changes only with gamma and the budget). Every other argument is
    :class:`remat.PGAC`'s. With ``costs=None`` the first step profiles keep, checkpoint and the compress
    action (with its gradient error); a given cost table must have them (``remat.profile(..., lossy=...)``).
    Budgets below what exact plans reach are allowed where compressed storage reaches them.
    """

    def __init__(
        self,
        model: nn.Module,
        budget: int | float | str | None,
        *,
        compress: str | None = "int8",
        rank: str = "score",
        **options: Any,
    ) -> None:
        if rank not in RANKINGS:
            raise ValueError(
                f"rank must be 'score' (EMA of ||dL/da * a||) or 'error' (the profiled gradient error), got {rank!r}"
            )
        self.compress = compress_action(compress) if compress is not None else None
        if rank == "error" and self.compress is None:
            raise ValueError("rank='error' ranks blocks by the error of compressing them: give compress= a format")
        self.rank = rank
        if self.compress is not None:
            self.profiled_actions = (KEEP, CHECKPOINT, self.compress)
        super().__init__(model, budget, **options)

    @property
    def states(self) -> dict[str, str]:
        """Block FQN -> ``"keep"``, ``"compress"`` or ``"recompute"`` in the next step."""
        return {f: state_of(a) for f, a in self.handle.plan.actions.items()}

    @property
    def compressed(self) -> dict[str, bool]:
        """Block FQN -> True where the block's saved tensors are stored compressed in the next step."""
        return {f: Action.parse(a).is_lossy for f, a in self.handle.plan.actions.items()}

    def state_dict(self) -> dict[str, Any]:
        """:meth:`PGAC.state_dict` with the compress action and the ranking (plain values)."""
        state = super().state_dict()
        state.update(compress=self.compress, rank=self.rank)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` of a PGAC-Q with the same ``compress`` and ``rank``."""
        saved = (state.get("compress"), state.get("rank", "score")) if isinstance(state, dict) else None
        if saved is not None and saved != (self.compress, self.rank):
            raise ValueError(
                f"this state is of a PGAC-Q with compress={saved[0]!r}, rank={saved[1]!r}; this one has "
                f"compress={self.compress!r}, rank={self.rank!r}: load it into a PGAC-Q made with the same options"
            )
        super().load_state_dict(state)

    def _ranking(self) -> list[float]:
        if self.rank == "score" or self.costs is None:
            return self._ema
        assert self.compress is not None
        return [float(row.grad_error.get(self.compress, 0.0)) for row in self.costs.blocks]

    def _make_fitter(self, costs: CostTable) -> Any:
        if self.compress is None:
            return MaskFitter(costs, self.budget_bytes, fqns=self.fqns)
        if costs.fqns != self.fqns:
            raise ValueError(
                "PGAC-Q needs its blocks in the order the step runs them; this model runs its chains in another "
                f"order ({costs.fqns[0]} first). Use remat.PGAC, or remat.plan(costs, 'optimal', budget, "
                "allow_lossy=True) for a static lossy plan"
            )
        return QuantizedMaskFitter(costs, self.budget_bytes, self.compress)


__all__ = ["RANKINGS", "PGACQ", "compress_action"]
