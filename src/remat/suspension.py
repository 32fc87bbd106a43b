"""Switching every applied plan off in this thread, e.g. while a block is measured alone.

:func:`suspend_all` is entered by code that runs blocks outside the step (the profiler, the meta estimator);
the runtime's hooks ask :func:`all_suspended` and do nothing while it is true. The state is per thread, so a
measurement in one thread does not switch plans off in another.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_STATE = threading.local()


@contextmanager
def suspend_all() -> Iterator[None]:
    """Within this context every applied plan is ignored in this thread (blocks run as without remat)."""
    _STATE.suspended = getattr(_STATE, "suspended", 0) + 1
    try:
        yield
    finally:
        _STATE.suspended -= 1


def all_suspended() -> bool:
    """Whether this thread is inside :func:`suspend_all`."""
    return getattr(_STATE, "suspended", 0) > 0
