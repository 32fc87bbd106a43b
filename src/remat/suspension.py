"""Switching every applied plan off in this thread, e.g. while a block is measured alone.

:func:`suspend_all` is entered by code that runs blocks outside the step (the profiler, the meta estimator);
the runtime's hooks ask :func:`all_suspended` and do nothing while it is true. The state is per thread, so a
measurement in one thread does not switch plans off in another. :class:`Counting` is the per-thread counter
it uses, shared with the runtime (a handle's own suspension and recomputation counters).
"""

from __future__ import annotations

import contextlib
import threading

_STATE = threading.local()


class Counting:
    """Count ``local.<name>`` up while the context runs; restored on every exit, exceptions included. A class,
    not a generator: it is entered around every recomputation, where a generator's frames cost."""

    __slots__ = ("local", "name")

    def __init__(self, local: threading.local, name: str) -> None:
        self.local, self.name = local, name

    def __enter__(self) -> None:
        setattr(self.local, self.name, getattr(self.local, self.name, 0) + 1)

    def __exit__(self, *exc: object) -> None:
        setattr(self.local, self.name, getattr(self.local, self.name) - 1)


def suspend_all() -> contextlib.AbstractContextManager[None]:
    """Within this context every applied plan is ignored in this thread (blocks run as without remat)."""
    return Counting(_STATE, "suspended")


def all_suspended() -> bool:
    """Whether this thread is inside :func:`suspend_all`."""
    return getattr(_STATE, "suspended", 0) > 0
