"""What a handle counts while training: block re-executions in backward and the seconds they took.

On the CPU a re-execution is timed by the host clock around it. On CUDA its work is queued, so the host clock
would time the launches only, and synchronising around every re-execution would stall the step (the host
could no longer queue ahead of the device). Each re-execution records a pair of CUDA events on its stream
instead, and the pairs are read when the seconds are asked for (``seconds``, ``total_seconds``), or where
more than :data:`PENDING_LIMIT` pairs wait, those already done, without waiting. Nothing here synchronises
within a step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

PENDING_LIMIT = 256  # event pairs kept before the finished ones are read (a loop that never reads the seconds)

Started = tuple[float, None] | tuple[None, Any] | None  # host clock reading, or a recorded CUDA start event


@dataclass
class RecomputeStats:
    """Block re-executions in backward and the seconds they took, per block FQN."""

    fqns: list[str]
    calls: dict[str, int] = field(default_factory=dict)
    _seconds: dict[str, float] = field(default_factory=dict)
    _pending: list[tuple[str, Any, Any]] = field(default_factory=list)  # (fqn, start event, end event)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls = {f: 0 for f in self.fqns}
        self._seconds = {f: 0.0 for f in self.fqns}
        self._pending = []

    @property
    def seconds(self) -> dict[str, float]:
        """Seconds of re-execution per block FQN (waits for the device's recorded re-executions to finish)."""
        self._read_events(wait=True)
        return self._seconds

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def started(self, fqn: str, main: torch.Tensor | None) -> Started:
        """Count a re-execution of ``fqn``; with ``main`` (its main input: timing is on), what to give
        :meth:`stopped`: the host clock, or a CUDA event recorded on the current stream where ``main`` is on
        CUDA."""
        self.calls[fqn] += 1
        if main is None:
            return None
        if main.is_cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return None, start
        return time.perf_counter(), None

    def stopped(self, fqn: str, started: Started) -> None:
        """Add the seconds since :meth:`started` (nothing when it was not timed; later, for CUDA events)."""
        if started is None:
            return
        clock, start = started
        if clock is not None:
            self._seconds[fqn] += time.perf_counter() - clock
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((fqn, start, end))
        if len(self._pending) > PENDING_LIMIT:
            self._read_events(wait=False)

    def _read_events(self, wait: bool) -> None:
        """Add the seconds of the recorded event pairs: all of them (``wait``), or those already done."""
        waiting = []
        for fqn, start, end in self._pending:
            if not wait and not end.query():
                waiting.append((fqn, start, end))
                continue
            end.synchronize()
            self._seconds[fqn] += start.elapsed_time(end) / 1e3
        self._pending = waiting
