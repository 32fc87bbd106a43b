"""Snapshots of the CPU and accelerator RNG states, so recomputation replays the same random numbers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import get_device_states, set_device_states


def _device_type(tensors: Sequence[Any]) -> str:
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_cpu and not t.is_meta:
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


class Forked:
    """Run a block without disturbing the RNG streams of the surrounding code: the CPU's and those of
    ``devices`` are put back on exit, as ``torch.random.fork_rng(devices)`` does. A class, not a generator: it
    is entered around every recomputation."""

    __slots__ = ("devices", "device_type", "cpu", "device_states")

    def __init__(self, devices: list[int], device_type: str) -> None:
        self.devices, self.device_type = devices, device_type

    def __enter__(self) -> None:
        self.cpu = torch.get_rng_state()
        if self.devices:
            module = torch.get_device_module(self.device_type)
            self.device_states = [module.get_rng_state(d) for d in self.devices]

    def __exit__(self, *exc: object) -> None:
        torch.set_rng_state(self.cpu)
        if self.devices:
            set_device_states(self.devices, self.device_states, device_type=self.device_type)
