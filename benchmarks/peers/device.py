"""Where the peers benchmark runs: the device check, the precision context, synchronisation around a timed
step, the CUDA allocator's peak meter and the device's name. Everything else in the benchmark is the same code
on ``cpu`` and ``cuda``; what differs between them is here.
"""

from __future__ import annotations

import contextlib
import platform
from typing import Any

import torch

DEVICES = ("cpu", "cuda")


def check_device(device: str) -> str:
    """``device`` if the benchmark can run there; raises ValueError naming the choices otherwise."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose from {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch.cuda.is_available() is False on this machine "
                         f"(torch {torch.__version__}); run with --device cpu, or on a machine with an NVIDIA GPU")
    return device


def precision_context(dtype: str, device: str = "cpu") -> contextlib.AbstractContextManager[Any]:
    """The context the forward runs in: nothing for fp32, ``torch.autocast(device, torch.bfloat16)`` for bf16."""
    if dtype == "bf16":
        return torch.autocast(device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def synchronize(device: str) -> None:
    """Wait for the device's queued work (a no-op on the CPU, whose work is done when the call returns)."""
    if device == "cuda":
        torch.cuda.synchronize()


class AllocatorPeak:
    """The CUDA caching allocator's peak over a ``with`` block, above what was allocated at its start.

    ``bytes`` is ``torch.cuda.max_memory_allocated()`` (after ``reset_peak_memory_stats()`` on entry) minus
    ``torch.cuda.memory_allocated()`` on entry: weights and gradients already allocated are left out, every
    tensor made inside (compiled code's included) is in. Only CUDA has this allocator; on any other device the
    meter refuses at construction.
    """

    def __init__(self, device: str) -> None:
        if device != "cuda":
            raise ValueError(f"the allocator meter reads torch.cuda's statistics and needs device 'cuda', got "
                             f"{device!r}; on the CPU measure with the whole-process meter "
                             "(remat.meters.process.ProcessPeakMeter) or remat.measure()")
        self.bytes: int | None = None
        self._start = 0

    def __enter__(self) -> AllocatorPeak:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self._start = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize()
        self.bytes = torch.cuda.max_memory_allocated() - self._start


def device_name(device: str) -> str:
    """The GPU's name on cuda; the CPU's model name (from /proc/cpuinfo where there is one) on cpu."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
