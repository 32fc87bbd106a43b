"""Errors raised by planners (a module of its own so every planner can import it without cycles)."""

from __future__ import annotations


class BudgetError(ValueError):
    """No plan of the requested kind fits the byte budget."""
