"""Snapshots of the RNG states a block draws from, so recomputation replays the same random numbers: the CPU's,
the accelerator's, and every registered extra stream.

Frameworks keep named RNG streams of their own beside torch's: Megatron-Core's CUDA RNG tracker
(``get_cuda_rng_tracker()``, whose ``fork()`` swaps a named state in around attention dropout so that tensor-parallel
ranks draw alike) and DeepSpeed's model-parallel tracker of the same pattern. A block that draws inside such a
fork advances the named state, so a recomputation must start from the state the forward started from, or its
dropout masks differ. :func:`register_stream` adds a stream (its ``get_states`` and ``set_states``); every
:class:`RngSnapshot` then holds its states and :meth:`RngSnapshot.restore` puts them back, and :class:`Forked`
leaves them, as the CPU's, as they were around a recomputation. Megatron-Core's and DeepSpeed's trackers are
streams of their own with nothing to register: they are read where their module has been imported (no import
here).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import get_device_states, set_device_states


def _device_type(tensors: Sequence[Any]) -> str:
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_cpu and not t.is_meta:
            return t.device.type
    return "cuda"


_STREAMS: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}

# Trackers of named RNG states read where their framework is imported: module -> the function returning the tracker.
_TRACKERS = (
    ("megatron.core.tensor_parallel.random", "get_cuda_rng_tracker"),
    ("deepspeed.runtime.activation_checkpointing.checkpointing", "get_cuda_rng_tracker"),
)


def register_stream(name: str, get_states: Callable[[], Any], set_states: Callable[[Any], None]) -> None:
    """Replay the RNG stream ``name`` in recomputation: ``get_states()`` returns its state (copied if it is a
    tensor the stream mutates in place), ``set_states(states)`` puts it back."""
    _STREAMS[name] = (get_states, set_states)


def unregister_stream(name: str) -> None:
    """Stop replaying ``name`` (registered by :func:`register_stream`)."""
    _STREAMS.pop(name, None)


def _streams() -> dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]:
    """The registered streams and the trackers of the frameworks imported so far."""
    streams = dict(_STREAMS)
    for module_name, getter in _TRACKERS:
        module = sys.modules.get(module_name)
        if module is None or not hasattr(module, getter):
            continue
        tracker = getattr(module, getter)()
        if hasattr(tracker, "get_states") and hasattr(tracker, "set_states"):
            streams.setdefault(module_name, (tracker.get_states, tracker.set_states))
    return streams


def _copied(states: Any) -> Any:
    if isinstance(states, torch.Tensor):
        return states.clone()
    if isinstance(states, dict):
        return {k: _copied(v) for k, v in states.items()}
    return states


def _take_streams() -> dict[str, Any]:
    streams = _streams()
    if not streams:
        return {}
    with _disable_current_modes():  # a copy of a state is no operator of the block (selective regions record them)
        return {name: _copied(get()) for name, (get, _) in streams.items()}


def _restore_streams(states: dict[str, Any]) -> None:
    streams = _streams()
    with _disable_current_modes():
        for name, value in states.items():
            if name in streams:
                streams[name][1](_copied(value))  # a copy: the stream may advance what it is given in place


@dataclass
class RngSnapshot:
    cpu: torch.Tensor
    devices: list[int]
    device_states: list[torch.Tensor]
    device_type: str
    streams: dict[str, Any] = field(default_factory=dict)  # the registered streams' and trackers' states

    @classmethod
    def take(cls, *tensors: Any) -> RngSnapshot:
        device_type = _device_type(tensors)
        module = getattr(torch, device_type, None)
        if module is not None and getattr(module, "_initialized", False):
            devices, states = get_device_states(*tensors)
        else:
            devices, states = [], []
        return cls(torch.get_rng_state(), devices, states, device_type, _take_streams())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.devices:
            set_device_states(self.devices, self.device_states, device_type=self.device_type)
        if self.streams:
            _restore_streams(self.streams)


class Forked:
    """Run a block without disturbing the RNG streams of the surrounding code: the CPU's and those of
    ``devices`` are put back on exit, as ``torch.random.fork_rng(devices)`` does. A class, not a generator: it
    is entered around every recomputation."""

    __slots__ = ("devices", "device_type", "cpu", "device_states", "streams")

    def __init__(self, devices: list[int], device_type: str) -> None:
        self.devices, self.device_type = devices, device_type

    def __enter__(self) -> None:
        self.cpu = torch.get_rng_state()
        if self.devices:
            module = torch.get_device_module(self.device_type)
            self.device_states = [module.get_rng_state(d) for d in self.devices]
        self.streams = _take_streams()

    def __exit__(self, *exc: object) -> None:
        torch.set_rng_state(self.cpu)
        if self.devices:
            set_device_states(self.devices, self.device_states, device_type=self.device_type)
        if self.streams:
            _restore_streams(self.streams)
