"""Seconds from FLOPs: the estimated time of work on a device, for cost tables made without running the model.

FLOPs are counted with ``torch.utils.flop_counter.FlopCounterMode`` (:func:`count_flops`, which works on the
``meta`` device); :func:`flops_time_model` divides them by a device's sustained FLOP/s and adds the bytes
written over its memory bandwidth. :data:`DEVICE_PRESETS` holds sustained figures of common accelerators.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils.flop_counter import FlopCounterMode


@dataclass(frozen=True)
class DeviceThroughput:
    """What a device sustains in training: FLOP/s, and bytes/s of memory traffic (``None``: not modelled)."""

    flops: float
    bandwidth: float | None = None
    name: str = "custom"


# Sustained, not peak: about half the dense peak FLOP/s and 80% of the memory bandwidth, which is what
# well-tuned training reaches. Estimates only.
DEVICE_PRESETS: dict[str, DeviceThroughput] = {
    "h100-bf16": DeviceThroughput(0.5 * 989e12, 0.8 * 3.35e12, "h100-bf16"),
    "h200-bf16": DeviceThroughput(0.5 * 989e12, 0.8 * 4.8e12, "h200-bf16"),
    "a100-bf16": DeviceThroughput(0.5 * 312e12, 0.8 * 2.0e12, "a100-bf16"),
    "a100-fp32": DeviceThroughput(0.5 * 19.5e12, 0.8 * 2.0e12, "a100-fp32"),
    "cpu": DeviceThroughput(1e11, 2e10, "cpu"),
}


def device_throughput(device_flops: float | str | DeviceThroughput) -> DeviceThroughput:
    """A :class:`DeviceThroughput` from a preset name, a number of FLOP/s, or one itself."""
    if isinstance(device_flops, DeviceThroughput):
        return device_flops
    if isinstance(device_flops, str):
        try:
            return DEVICE_PRESETS[device_flops]
        except KeyError:
            raise ValueError(
                f"unknown device preset {device_flops!r}; use one of {sorted(DEVICE_PRESETS)} or a number of FLOP/s"
            ) from None
    if device_flops <= 0:
        raise ValueError(f"device_flops must be positive FLOP/s, got {device_flops}")
    return DeviceThroughput(float(device_flops), None, f"{device_flops:.3g} FLOP/s")


def flops_time_model(
    flops: float, bytes_moved: float = 0.0, *, device_flops: float | str | DeviceThroughput = "h100-bf16"
) -> float:
    """Estimated seconds for work of ``flops`` FLOPs writing ``bytes_moved`` bytes: ``flops / FLOP/s`` plus,
    when the device has a bandwidth, ``bytes_moved / bandwidth`` (what elementwise work costs)."""
    device = device_throughput(device_flops)
    seconds = flops / device.flops
    if device.bandwidth:
        seconds += bytes_moved / device.bandwidth
    return seconds


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """Run ``fn(*args, **kwargs)`` (on any device, ``meta`` included) and return its result and FLOPs."""
    with FlopCounterMode(display=False) as counter:
        result = fn(*args, **kwargs)
    return result, int(counter.get_total_flops())
