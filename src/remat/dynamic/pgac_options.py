"""Checks of :class:`remat.PGAC`'s constructor options, run before anything is installed on the model."""

from __future__ import annotations

from typing import Any

from .schedules import NEEDS_LENGTH

SYNC_MODES = (None, "local", "global")


def check_options(
    alpha: float,
    q: float,
    every: int,
    sync: str | None,
    total_steps: int | None,
    measure_every: int | None,
    history_limit: int,
) -> None:
    """Raise ValueError naming the first option out of its range and the range it must be in."""
    if not (isinstance(alpha, int | float) and 0.0 <= alpha < 1.0):
        raise ValueError(f"alpha is the EMA decay and must be in [0, 1), got {alpha!r}")
    if not (isinstance(q, int | float) and 0.0 <= q <= 1.0):
        raise ValueError(f"q is the quantile of the scores that sets the threshold and must be in [0, 1], got {q!r}")
    if not _is_int(every) or every < 1:
        raise ValueError(f"every (score every that many steps) must be an int >= 1, got {every!r}")
    if sync not in SYNC_MODES:
        raise ValueError(f"sync must be None (one process), 'local' (a mask per rank) or 'global', got {sync!r}")
    if total_steps is not None and (not _is_int(total_steps) or total_steps < 1):
        raise ValueError(f"total_steps must be a positive int (optimizer steps), got {total_steps!r}")
    if measure_every is not None and (not _is_int(measure_every) or measure_every < 0):
        raise ValueError(f"measure must be None or an int >= 0 (measure every that many steps), got {measure_every!r}")
    if not _is_int(history_limit) or history_limit < 0:
        raise ValueError(
            f"history_limit is the number of step records kept and must be an int >= 0 (0: none), got {history_limit!r}"
        )


def check_length(schedule: Any, total_steps: int | None) -> None:
    """Raise ValueError when ``schedule`` runs over the training length and ``total_steps`` is not given."""
    if isinstance(schedule, NEEDS_LENGTH) and total_steps is None:
        raise ValueError(f"gamma={schedule!r} runs over the training length: pass total_steps= (optimizer steps)")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
