"""Switching every applied plan off in this thread, e.g. while a block is measured alone.

:func:`suspend_all` is entered by code that runs blocks outside the step (the profiler, the meta estimator);
the runtime's hooks ask :func:`all_suspended` and do nothing while it is true. The state is per thread, so a
measurement in one thread does not switch plans off in another. :func:`counting` is the per-thread counter
it uses, shared with the runtime (a handle's own suspension and recomputation counters).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_STATE = threading.local()


@contextmanager
def counting(local: threading.local, name: str) -> Iterator[None]:
    """Count ``local.<name>`` up while the context runs; restored on every exit, exceptions included."""
    setattr(local, name, getattr(local, name, 0) + 1)
    try:
        yield
    finally:
        setattr(local, name, getattr(local, name) - 1)


def suspend_all() -> contextlib.AbstractContextManager[None]:
    """Within this context every applied plan is ignored in this thread (blocks run as without remat)."""
    return counting(_STATE, "suspended")


def all_suspended() -> bool:
    """Whether this thread is inside :func:`suspend_all`."""
    return getattr(_STATE, "suspended", 0) > 0
