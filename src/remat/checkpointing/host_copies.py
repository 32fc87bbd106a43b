"""Operator outputs that an offload policy keeps in host memory: copied there in forward, served from there in
recompute instead of running the operator again.

:func:`contexts` gives a pair of dispatch modes that sit under torch's selective-checkpoint modes, beside the draw log
of :mod:`remat.checkpointing.replayed_draws`. The policy tells torch to recompute the chosen operators, so torch caches
nothing of theirs on the device; in forward, :class:`StoreCopies` runs each chosen operator and keeps a copy of its
output; in recompute, :class:`ServeCopies` hands the copy back, moved to the output's device, in the forward's order,
instead of running the operator.

Where the copy goes depends on the output's device:

* CUDA: pinned host memory, copied on the device's side stream after an event on the compute stream
  (:mod:`remat.checkpointing.offload_streams`), so forward does not wait for it; it is made outside every dispatch
  mode, so no :class:`~remat.meters.memory.LiveTensorTracker` counts it as device memory (it is not). When the
  recompute starts, every copy back starts on the other side stream, and each output waits for its own where
  recompute reaches it: the copies overlap the operators it re-runs. The copies back are device memory and are
  seen.
* CPU and ``meta``: the copy stays in the same memory (there is no other memory to move it to), so an
  offload policy costs there what saving the same outputs costs, plus one copy. It is a copy, not the output
  itself, so that an in-place operator run on the output later in the region does not change what recompute
  gets.

:func:`saved_on_host` is the whole-block counterpart, the ``offload`` action's: saved-tensor hooks that move
everything autograd saves in a region to host memory and back with the sizes and strides it was saved with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map

from .offload_streams import SavedTensor, engine_for, restored

ON_DEVICE_TYPES = frozenset({"cpu", "meta"})


@dataclass
class HostCopy:
    """One output tensor's copy: in host memory on CUDA (copied on the device's side stream,
    :mod:`remat.checkpointing.offload_streams`), a clone where host and device are one memory."""

    saved: SavedTensor

    @classmethod
    def of(cls, t: torch.Tensor) -> HostCopy:
        engine = engine_for(t.device)
        if t.device.type in ON_DEVICE_TYPES:
            host, token = t.clone(), None
        else:
            with _disable_current_modes():  # host memory: no tracker of the device should count it
                host, token = engine.to_host(t)
        return cls(SavedTensor(host, t.device, t.size(), t.stride(), engine, None, token))

    def copy_back(self) -> None:
        """Start the copy back to the device (on CUDA, on the side stream), ahead of :meth:`on_device`."""
        saved = self.saved
        if saved.device.type not in ON_DEVICE_TYPES and saved.back is None:
            with _disable_current_modes():
                saved.back, saved.back_token = saved.engine.to_device(saved.host, saved)

    def on_device(self) -> torch.Tensor:
        saved = self.saved
        if saved.device.type in ON_DEVICE_TYPES:
            return saved.host.clone()  # a region recomputed twice (retain_graph) may mutate what it gets
        self.copy_back()
        back, token = saved.back, saved.back_token
        saved.back = saved.back_token = None  # a region recomputed twice copies again
        saved.engine.wait(token)
        saved.engine.adopt(back)
        return back

    @property
    def nbytes(self) -> int:
        return self.saved.nbytes


def _pack_to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.device, torch.Size, tuple[int, ...]]:
    if t.device.type == "cpu":
        return t, t.device, t.size(), t.stride()  # already in host memory, as save_on_cpu leaves it
    pinned = t.device.type == "cuda"
    host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pinned)
    host.copy_(t, non_blocking=pinned)
    return host, t.device, t.size(), t.stride()


def _unpack_from_host(packed: tuple[torch.Tensor, torch.device, torch.Size, tuple[int, ...]]) -> torch.Tensor:
    return restored(*packed)  # the strides the forward saved, not the host copy's dense ones


def saved_on_host() -> torch.autograd.graph.saved_tensors_hooks:
    """What autograd saves inside goes to host memory (pinned for CUDA tensors; a CPU tensor stays itself) and
    comes back for backward with the sizes and strides it was saved with. ``torch.autograd.graph.save_on_cpu``
    gives it back dense, which a compiled block's backward refuses for a saved view (``assert_size_stride``)."""
    return torch.autograd.graph.saved_tensors_hooks(_pack_to_host, _unpack_from_host)


@dataclass
class CopyLog:
    """The copies one region made in forward, in order: (operator, its outputs with tensors as HostCopy)."""

    entries: list[tuple[Any, Any]] = field(default_factory=list)

    @property
    def count(self) -> int:
        """Tensors copied."""
        return sum(1 for _, out in self.entries for leaf in _leaves(out) if isinstance(leaf, HostCopy))

    @property
    def nbytes(self) -> int:
        """Bytes copied."""
        return sum(leaf.nbytes for _, out in self.entries for leaf in _leaves(out) if isinstance(leaf, HostCopy))


def _leaves(tree: Any) -> list[Any]:
    found: list[Any] = []
    tree_map(found.append, tree)
    return found


def _copy_leaf(x: Any) -> Any:
    return HostCopy.of(x) if type(x) is torch.Tensor else x


def _restore_leaf(x: Any) -> Any:
    return x.on_device() if isinstance(x, HostCopy) else x


class StoreCopies(TorchDispatchMode):
    """Forward: run every op; keep a copy of the outputs of the ops ``chosen(op)`` accepts."""

    def __init__(self, chosen: Callable[[Any], bool], log: CopyLog) -> None:
        super().__init__()
        self.chosen = chosen
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if self.chosen(func):
            self.log.entries.append((func, tree_map(_copy_leaf, out)))
        return out


class ServeCopies(TorchDispatchMode):
    """Recompute: answer each chosen op with the forward's copy of its outputs, in order, without running it."""

    def __init__(self, chosen: Callable[[Any], bool], log: CopyLog) -> None:
        super().__init__()
        self.chosen = chosen
        self.log = log
        self.position = 0

    def __enter__(self) -> ServeCopies:
        self.position = 0  # a region may be recomputed more than once (retain_graph)
        for _, outputs in self.log.entries:  # every copy back starts now, overlapping the recomputation
            for leaf in _leaves(outputs):
                if isinstance(leaf, HostCopy):
                    leaf.copy_back()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if not self.chosen(func):
            return func(*args, **(kwargs or {}))
        if self.position >= len(self.log.entries):
            raise RuntimeError(
                f"a region under an offload policy ran {func} in recompute more often than in forward: "
                "its code must take the same path both times"
            )
        recorded, outputs = self.log.entries[self.position]
        self.position += 1
        if recorded is not func:
            raise RuntimeError(
                f"a region under an offload policy ran {func} in recompute where forward ran {recorded}: "
                "its code must take the same path both times"
            )
        return tree_map(_restore_leaf, outputs)


def contexts(chosen: Callable[[Any], bool]) -> tuple[StoreCopies, ServeCopies]:
    """A fresh (forward, recompute) pair sharing one log; enter each under torch's selective-checkpoint mode."""
    log = CopyLog()
    return StoreCopies(chosen, log), ServeCopies(chosen, log)
