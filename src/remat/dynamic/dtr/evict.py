"""Eviction under DTR's byte budget: which resident tensor goes first, and what happens when none can.

:class:`Evictor` is the part of :class:`~remat.dynamic.dtr.runtime.DTRRuntime` that makes room. Before an
operator runs, resident cells are evicted, smallest heuristic score first, until the tracked bytes plus the
operator's predicted outputs fit the budget (:meth:`Evictor.make_room`). A cell is a candidate only if DTR is the
sole owner of its storage (the storage's reference count tells), it is not in use or pending, and it can always
be recomputed: its record replays and each ancestor can be recomputed or is kept (anchored). When nothing can be
evicted DTR warns (once), or raises :class:`~remat.BudgetError` when ``strict``.
"""

from __future__ import annotations

import warnings
from typing import Any

from ...core import BudgetError, format_bytes
from .graph import Cell, storage_refs


class Evictor:
    """Mixin of :class:`DTRRuntime`; uses its ``hold``, its resident cells and counters."""

    budget: int | None
    score: Any
    strict: bool
    clock: int
    tracked: int
    held: dict[int, Cell]
    stats: Any

    def __init__(self) -> None:
        super().__init__()
        self._warned = False

    def make_room(self, incoming: int, func: Any) -> None:
        while self.tracked + incoming > self.budget:
            victim = self._pick()
            if victim is None:
                self._over_budget(incoming, func)
                return
            self.stats.evictions += 1
            if self.held.get(victim.key) is victim:
                del self.held[victim.key]
            victim.own = None  # DTR was the only owner: the storage dies here and _on_free accounts for it

    def _pick(self) -> Cell | None:
        best, best_score = None, float("inf")
        for cell in list(self.held.values()):
            if cell.locks or cell.anchored or cell.pending or storage_refs(cell.own) != 1:
                continue
            if not self._secure(cell) or cell.anchored:
                continue
            score = self.score(cell, self.clock)
            if score < best_score:
                best, best_score = cell, score
        return best

    def _secure(self, cell: Cell) -> bool:
        """Whether ``cell`` can always be recomputed: its record replays and every ancestor can be recomputed
        or is kept. Resident cells that cannot be recomputed are anchored (kept) once something needs them."""
        stack: list[tuple[Cell, bool]] = [(cell, False)]
        while stack:
            c, expanded = stack.pop()
            if c.secure or c.lost:
                continue
            rec = c.record
            ok = rec is not None and rec.replayable and all(r.tensor._version == r.version for r in rec.consts())
            if ok and not expanded:
                stack.append((c, True))
                stack.extend((p, False) for p in rec.parents() if not (p.secure or p.lost))
                continue
            if ok and all(p.secure for p in rec.parents()):
                c.secure = True
            elif c.resident:
                c.anchored = c.secure = True
                self.hold(c)
            else:
                c.lost = True
        return cell.secure

    def _over_budget(self, incoming: int, func: Any) -> None:
        self.stats.over_budget_ops += 1
        message = (
            f"DTR cannot keep tracked memory within the budget of {format_bytes(self.budget)} before {func}: "
            f"{format_bytes(self.tracked)} is resident and {format_bytes(incoming)} more is needed, but no "
            "resident tensor can be evicted (all are held by user code or autograd, in use, or cannot be "
            "recomputed). Raise the budget, use a smaller batch, or drop references to activations."
        )
        if self.strict:
            raise BudgetError(message)
        if not self._warned:
            self._warned = True
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def too_small(self, func: Any, in_bytes: int, out_bytes: int) -> BudgetError:
        need = in_bytes + out_bytes
        return BudgetError(
            f"the DTR budget of {format_bytes(self.budget)} is below what operator {func} needs: "
            f"{format_bytes(need)} at once ({format_bytes(in_bytes)} of inputs and {format_bytes(out_bytes)} "
            f"of outputs). Give a budget of at least {format_bytes(need)} (bytes, a string like '64MiB', or "
            "a larger fraction), or a smaller batch."
        )

    # provided by DTRRuntime
    def hold(self, cell: Cell) -> None:  # pragma: no cover
        raise NotImplementedError
