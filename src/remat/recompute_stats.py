"""What a handle counts while training: block re-executions in backward and the seconds they took."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class RecomputeStats:
    """Block re-executions in backward and the seconds they took, per block FQN."""

    fqns: list[str]
    calls: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls = {f: 0 for f in self.fqns}
        self.seconds = {f: 0.0 for f in self.fqns}

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def started(self, fqn: str, main: torch.Tensor | None) -> tuple[float, torch.device | None] | None:
        """Count a re-execution of ``fqn``; with ``main`` (its main input: timing is on), the clock reading to
        give :meth:`stopped`, taken after the device's queued work where ``main`` is on CUDA."""
        self.calls[fqn] += 1
        if main is None:
            return None
        device = main.device if main.is_cuda else None
        if device is not None:
            torch.cuda.synchronize(device)
        return time.perf_counter(), device

    def stopped(self, fqn: str, started: tuple[float, torch.device | None] | None) -> None:
        """Add the seconds since :meth:`started` (nothing when it was not timed)."""
        if started is None:
            return
        start, device = started
        if device is not None:
            torch.cuda.synchronize(device)
        self.seconds[fqn] += time.perf_counter() - start
