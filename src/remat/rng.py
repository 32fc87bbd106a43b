"""Snapshots of the CPU and accelerator RNG states, so recomputation replays the same random numbers."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import get_device_states, set_device_states


def _device_type(tensors: Sequence[Any]) -> str:
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta"):
            return t.device.type
    return "cuda"


@dataclass
class RngSnapshot:
    cpu: torch.Tensor
    devices: list[int]
    device_states: list[torch.Tensor]
    device_type: str

    @classmethod
    def take(cls, *tensors: Any) -> RngSnapshot:
        device_type = _device_type(tensors)
        module = getattr(torch, device_type, None)
        if module is not None and getattr(module, "_initialized", False):
            devices, states = get_device_states(*tensors)
        else:
            devices, states = [], []
        return cls(torch.get_rng_state(), devices, states, device_type)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.devices:
            set_device_states(self.devices, self.device_states, device_type=self.device_type)


@contextmanager
def forked(devices: list[int], device_type: str) -> Iterator[None]:
    """Run a block without disturbing the RNG streams of the surrounding code."""
    with torch.random.fork_rng(devices=devices, device_type=device_type):
        yield
