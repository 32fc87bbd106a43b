"""Offload that overlaps compute: what a block saves for backward is copied to host memory on a side stream as
soon as it is saved, and copied back on another side stream one block ahead of its backward.

:class:`OffloadQueue` is one per applied model (the runtime's handle owns it). Each offloaded block call gets a
:class:`BlockCopies` and, around its forward, the saved-tensor hooks of :meth:`OffloadQueue.saving`. The copies
run on a :class:`CopyEngine`:

* :class:`CudaCopies`: a device-to-host stream and a host-to-device stream per device. A saved tensor is copied
  into pinned host memory on the first after an event on the compute stream, and copied back on the second into
  memory with the sizes and strides it was saved with (compiled backward graphs assert them). The compute stream
  waits on a copy's event only where it needs the copy's result, so it stalls only where a copy is late.
* :class:`SameMemory`: the CPU (and ``meta``): host and device are one memory, nothing is copied, and the queue's
  bookkeeping runs as it does on CUDA with every copy finished at once.

Invariant 1: at most two offloaded block calls hold device memory for their copies to the host: the block running
and the one before it. When block ``j`` starts (:meth:`OffloadQueue.block_started`), every earlier offloaded call
but ``j - 1``'s is released: the compute stream waits for its copies, then the device tensors are dropped. When the
model's forward ends (:meth:`OffloadQueue.forward_ended`) every call is released. So an offloaded block's saved
bytes are alive through its own forward and the next block's, never longer.

Invariant 2: at most two offloaded calls hold copies back on the device: the one whose backward runs and the one
before it. A call's copy back starts when the gradient of the output of the block called right after it is computed
(that block's backward is about to run, and hides the copy); the block's backward takes the copies from its unpack
hooks, each after its event, and the queue drops its own reference once every pack of the tensor has been unpacked.
A call not copied back ahead (the last block of the forward, whose backward comes first) is copied back on the
compute stream where it is unpacked.

Parameters, buffers and the block's tensor arguments (and views of them: a linear layer saves its weight
transposed) are not copied: they are alive anyway, so a copy would free
nothing. :class:`QueueStats` counts what the invariants bound (the most calls holding device copies at once, the
most calls copied back ahead) and where the compute stream waited.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_flatten

MAX_CALLS_IN_FLIGHT = 2  # invariant 1


class CopyEngine(Protocol):
    """Where copies run and how the compute stream waits for them."""

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start a copy of ``tensor`` into host memory; return the host tensor and a token for its end."""

    def to_device(self, host: torch.Tensor, saved: SavedTensor) -> tuple[torch.Tensor, Any]:
        """Start the copy of ``host`` back to ``saved``'s device, sizes and strides; return it and a token."""

    def finished(self, token: Any) -> bool:
        """Whether the copy of ``token`` has finished (without waiting)."""

    def wait(self, token: Any) -> None:
        """Make the compute stream wait for the copy of ``token``."""

    def adopt(self, tensor: torch.Tensor) -> None:
        """``tensor`` (copied back on a side stream) is used on the compute stream from now on."""


class SameMemory:
    """Host and device are one memory (CPU, ``meta``): nothing is copied, every copy has finished."""

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    def to_device(self, host: torch.Tensor, saved: SavedTensor) -> tuple[torch.Tensor, Any]:
        return host, None

    def finished(self, token: Any) -> bool:
        return True

    def wait(self, token: Any) -> None:
        return None

    def adopt(self, tensor: torch.Tensor) -> None:
        return None


class CudaCopies:
    """Copies on two side streams of one CUDA device, ordered against the compute stream by events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.outward = torch.cuda.Stream(device)
        self.inward = torch.cuda.Stream(device)

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        tensor.record_stream(self.outward)  # freed before the copy ends, its memory waits for it
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        self.outward.wait_event(produced)
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
        with torch.cuda.stream(self.outward):
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.outward)
        return host, done

    def to_device(self, host: torch.Tensor, saved: SavedTensor) -> tuple[torch.Tensor, Any]:
        if saved.to_host_token is not None:
            self.inward.wait_event(saved.to_host_token)
        with torch.cuda.stream(self.inward):
            back = torch.empty_strided(saved.size, saved.stride, dtype=host.dtype, device=self.device)
            back.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.inward)
        return back, done

    def finished(self, token: Any) -> bool:
        return token is None or token.query()

    def wait(self, token: Any) -> None:
        if token is not None:
            torch.cuda.current_stream(self.device).wait_event(token)

    def adopt(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(torch.cuda.current_stream(self.device))  # the side stream's memory, used here


_CUDA_ENGINES: dict[torch.device, CudaCopies] = {}


def engine_for(device: torch.device) -> CopyEngine:
    """The copy engine of ``device``: its side streams on CUDA (made once per device), else :class:`SameMemory`."""
    if device.type != "cuda":
        return SameMemory()
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _CUDA_ENGINES:
        _CUDA_ENGINES[device] = CudaCopies(device)
    return _CUDA_ENGINES[device]


@dataclass
class SavedTensor:
    """One tensor a block saved: its host copy, what it goes back as, and the copies' tokens."""

    host: torch.Tensor
    device: torch.device
    size: torch.Size
    stride: tuple[int, ...]
    engine: CopyEngine
    source: torch.Tensor | None = None  # the device tensor, held until its copy to the host has finished
    to_host_token: Any = None
    back: torch.Tensor | None = None  # copied back ahead of need (invariant 2)
    back_token: Any = None
    packs: int = 1  # autograd saved this tensor this many times in the call
    unpacks: int = 0

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()


@dataclass
class BlockCopies:
    """What one offloaded block call saved, in order."""

    label: str
    call: int  # the call's position among the forward's block calls
    saved: list[SavedTensor] = field(default_factory=list)
    by_source: dict[int, SavedTensor] = field(default_factory=dict)  # id of a held device tensor -> its copy
    holds_device: bool = True  # some copy to the host may still read device memory
    copied_back: bool = False

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.saved)


@dataclass
class QueueStats:
    """What the queue did, for the bounds of invariants 1 and 2 and for where the compute stream waited."""

    most_calls_in_flight: int = 0  # offloaded calls holding device memory for copies to the host at once
    most_bytes_in_flight: int = 0
    most_calls_copied_back: int = 0  # calls holding copies back on the device at once (invariant 2)
    released_waiting: int = 0  # calls released before their copies were seen finished (the compute stream waited)
    copied_back_ahead: int = 0  # unpacks served from a copy made ahead of need
    copied_back_late: int = 0  # unpacks copied back on the compute stream
    bytes_to_host: int = 0


class OffloadQueue:
    """The offloaded block calls of a model's forward and their copies (invariants 1 and 2)."""

    def __init__(self, engine: Callable[[torch.device], CopyEngine] = engine_for) -> None:
        self.engine_for = engine
        self.stats = QueueStats()
        self._calls: list[BlockCopies] = []  # this forward's offloaded calls, in forward order
        self._in_flight: list[BlockCopies] = []
        self._position = -1  # the block call now running (block_started counts them)

    # ----- forward -----
    def forward_started(self) -> None:
        """A new forward: the previous forward's calls stay with their backward (their packed tensors)."""
        self._release_all()
        self._calls = []
        self._position = -1

    def block_started(self) -> None:
        """A block call starts: release every offloaded call before the previous one (invariant 1)."""
        self._position += 1
        keep_from = self._position - 1
        for call in [c for c in self._in_flight if c.call < keep_from]:
            self._release(call)
        for call in [c for c in self._in_flight if self._copies_finished(c)]:
            self._release(call, waited=False)

    def forward_ended(self) -> None:
        """The model's forward returned: release every call (invariant 1)."""
        self._release_all()

    @contextlib.contextmanager
    def saving(self, label: str, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
        """Saved-tensor hooks for one offloaded call of ``module`` on ``args``/``kwargs``, the block call now
        running (after :meth:`block_started`)."""
        call = BlockCopies(label, self._position)
        self._calls.append(call)
        self._in_flight.append(call)
        resident = {_storage(t) for t in block_tensors(module, args, kwargs)}
        stats = self.stats

        def pack(tensor: torch.Tensor) -> Any:
            if _storage(tensor) in resident:
                return tensor  # a parameter, a buffer, an input or a view of one: alive anyway, a copy frees nothing
            again = call.by_source.get(id(tensor)) if call.holds_device else None
            if again is not None and again.source is tensor:
                again.packs += 1
                return call, again
            engine = self.engine_for(tensor.device)
            host, token = engine.to_host(tensor)
            saved = SavedTensor(host, tensor.device, tensor.size(), tensor.stride(), engine, tensor, token)
            call.saved.append(saved)
            call.by_source[id(tensor)] = saved
            stats.bytes_to_host += saved.nbytes
            self._note_in_flight()
            return call, saved

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            owner, saved = packed
            return self._unpacked(owner, saved)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def copy_back_after(self, output: Any) -> None:
        """The block call now ending produced ``output``: where the call before it was offloaded, its copy back
        starts when the gradient of ``output`` is computed (invariant 2)."""
        before = next((c for c in reversed(self._calls[-2:]) if c.call == self._position - 1), None)
        if before is None:
            return
        tensor = next((t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if tensor is None:
            return

        def start(grad: torch.Tensor) -> None:
            self._copy_back(before)

        tensor.register_hook(start)

    # ----- backward -----
    def _copy_back(self, call: BlockCopies) -> None:
        if call.copied_back:
            return
        self._release(call)
        for saved in call.saved:
            if saved.back is None:
                saved.back, saved.back_token = saved.engine.to_device(saved.host, saved)
        call.copied_back = True
        holding = sum(1 for c in self._calls if any(s.back is not None for s in c.saved))
        self.stats.most_calls_copied_back = max(self.stats.most_calls_copied_back, holding)

    def _unpacked(self, call: BlockCopies, saved: SavedTensor) -> torch.Tensor:
        self._release(call)  # a backward of a call still in flight (a backward inside the forward)
        saved.unpacks += 1
        if saved.back is not None:
            back = saved.back
            saved.engine.wait(saved.back_token)
            saved.engine.adopt(back)
            if saved.unpacks >= saved.packs:  # the last use: the graph holds it now (retain_graph copies again)
                saved.back = saved.back_token = None
                saved.unpacks = 0
            self.stats.copied_back_ahead += 1
            return back
        self.stats.copied_back_late += 1
        saved.unpacks %= saved.packs
        return restored(saved.host, saved.device, saved.size, saved.stride)

    # ----- releasing -----
    def _copies_finished(self, call: BlockCopies) -> bool:
        return all(s.engine.finished(s.to_host_token) for s in call.saved)

    def _release(self, call: BlockCopies, *, waited: bool = True) -> None:
        """Drop the device tensors of ``call``'s copies to the host, the compute stream waiting for them first."""
        if not call.holds_device:
            return
        if waited and not self._copies_finished(call):
            self.stats.released_waiting += 1
        for saved in call.saved:
            saved.engine.wait(saved.to_host_token)
            saved.source = None
        call.by_source.clear()
        call.holds_device = False
        if call in self._in_flight:
            self._in_flight.remove(call)

    def _release_all(self) -> None:
        for call in list(self._in_flight):
            self._release(call)

    def _note_in_flight(self) -> None:
        stats = self.stats
        stats.most_calls_in_flight = max(stats.most_calls_in_flight, len(self._in_flight))
        held = sum(s.nbytes for c in self._in_flight for s in c.saved if s.source is not None)
        stats.most_bytes_in_flight = max(stats.most_bytes_in_flight, held)


def restored(host: torch.Tensor, device: torch.device, size: torch.Size, stride: tuple[int, ...]) -> torch.Tensor:
    """``host`` on ``device`` with the sizes and strides it was saved with (compiled backward graphs assert them),
    copied on the current stream; ``host`` itself where it is that already."""
    if host.device == device and host.stride() == stride:
        return host
    back = torch.empty_strided(size, stride, dtype=host.dtype, device=device)
    back.copy_(host, non_blocking=host.is_pinned())
    return back


def _storage(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a wrapper subclass): its own identity
        return id(tensor)


def block_tensors(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors that exist before ``module`` runs on ``args``/``kwargs``: its parameters, buffers and tensor
    arguments (a wrapper with a ``module`` attribute, as the profiler's timer, is looked through). Storing them
    elsewhere (offloaded, compressed) would free nothing."""
    inner = getattr(module, "module", module)
    tensors: list[torch.Tensor] = []
    if isinstance(inner, torch.nn.Module):
        tensors += list(inner.parameters()) + list(inner.buffers())
    return tensors + [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]


__all__ = [
    "MAX_CALLS_IN_FLIGHT",
    "BlockCopies",
    "CopyEngine",
    "CudaCopies",
    "OffloadQueue",
    "QueueStats",
    "SameMemory",
    "SavedTensor",
    "block_tensors",
    "engine_for",
    "restored",
]
