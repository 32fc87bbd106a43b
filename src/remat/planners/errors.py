"""Errors raised by planners (a module of its own so every planner can import it without cycles)."""

from __future__ import annotations


class BudgetError(ValueError):
    """No plan of the requested kind fits the byte budget; ``floor`` is the least peak (bytes) that fits, when
    known."""

    def __init__(self, *args: object, floor: int | None = None) -> None:
        super().__init__(*args)
        self.floor = floor
