"""What a handle counts while training: block re-executions in backward and the seconds they took."""

from __future__ import annotations

from dataclasses import dataclass, field


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
