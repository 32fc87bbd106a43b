"""Peak-memory meters: a live-tensor tracker (any device, exact per storage) and CUDA allocator statistics.

``measure()`` wraps a training step. On CPU it runs a :class:`LiveTensorTracker`, a ``TorchDispatchMode``
that records every storage created by an operator and when it dies (the one tracker of the package: the
profiler and the ``meta`` estimator measure blocks with it too). Its figures:

* ``peak_bytes``: the most bytes created inside the region that were alive at once (views, ``detach`` and
  in-place results share an existing storage and create none);
* ``activation_bytes``: the same, counting only storages that died before the region ended, i.e. the
  transient memory of the step (saved activations, gradients in flight), not the parameter gradients or
  outputs that outlive it.

On CUDA ``peak_bytes`` comes from ``torch.cuda.max_memory_allocated`` (it sees everything, compiled code
included) and ``activation_bytes`` from the tracker unless ``tracker=False``.

The tracker does not see allocations made inside ``torch.compile``d graphs (and makes dynamo run them
eagerly); ``measure(allocations=True)`` reads the allocator's own events instead
(:mod:`remat.meters.alloc_tracker`), which see compiled code. Both meters read their figures through
:class:`remat.meters.live_series.LiveBytesSeries`.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)
from torch.utils._pytree import tree_flatten

from .alloc_tracker import AllocationTracker
from .live_series import LiveBytesSeries

T = TypeVar("T")


def storage_key(t: torch.Tensor) -> int | None:
    """Identity of ``t``'s storage while it lives (``None`` when it has none). It is the storage's address in
    memory, so it works on ``meta`` too, where data pointers are all 0; a freed address may be reused."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def held_bytes(root: object, device: str | torch.device = "cpu", through: tuple[str, ...] = ("torch",)) -> int:
    """The bytes of every tensor storage on ``device`` that ``root`` holds, each storage once: followed through
    containers, tensors' gradients, and the attributes of objects whose classes come from the packages
    ``through`` (a DeepSpeed engine: ``("deepspeed", "torch")``). What a wrapper holds between steps, where no
    allocator says it (the CPU)."""
    dev = torch.device(device)
    seen: set[int] = set()
    storages: dict[int, int] = {}
    pending = [root]
    while pending:
        obj = pending.pop()
        if id(obj) in seen or isinstance(obj, str | bytes | int | float | bool | type(None)):
            continue
        seen.add(id(obj))
        if torch.is_tensor(obj):
            key = storage_key(obj)
            if obj.device == dev and key is not None:
                storages[key] = obj.untyped_storage().nbytes()
            if obj.grad is not None:
                pending.append(obj.grad)
        elif isinstance(obj, dict):
            pending += [*obj.keys(), *obj.values()]
        elif isinstance(obj, list | tuple | set | frozenset):
            pending += list(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in through:
            pending += list(vars(obj).values())
    return sum(storages.values())


class LiveTensorTracker(LiveBytesSeries, TorchDispatchMode):
    """Records allocation and death of every storage an operator creates while the mode is active.

    Works on every device, ``meta`` included (where storages have no data). Events are kept so that peaks can
    be computed afterwards excluding storages that outlive the region (its survivors: those still alive at
    :meth:`close`, such as parameter gradients); ``mark(label)`` notes the current position so figures at that
    moment can be read after the run.
    """

    def __init__(self, device: str | torch.device | None = None) -> None:
        LiveBytesSeries.__init__(self)
        TorchDispatchMode.__init__(self)
        self.device_type = torch.device(device).type if device is not None else None
        self._paused = 0
        self._live: dict[int, tuple[int, int]] = {}  # storage key -> (event id, nbytes)
        self._next_id = 0
        self._finalizers: list[weakref.finalize] = []
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self._closed = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if not self._closed and not self._paused:
            # Outputs that share an input's storage (views, in-place results, detach) were not created here.
            inputs = {storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set[int | None]) -> None:
        if self.device_type is not None and t.device.type != self.device_type:
            return
        key = storage_key(t)
        if key is None or key in inputs or key in self._live:
            return
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        event_id = self._next_id  # storage addresses are reused once freed; events get ids of their own
        self._next_id += 1
        self._live[key] = (event_id, nbytes)
        self._events.append((event_id, nbytes))
        self.live_bytes += nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        self._finalizers.append(weakref.finalize(storage, self._free, key))
        self.allocated(event_id, t)

    def allocated(self, event_id: int, t: torch.Tensor) -> None:
        """Called for each storage tracked, with its event id and the tensor that made it (nothing by default;
        a subclass can note what made it, to say later what the events at a mark or the peak were)."""

    def _free(self, key: int) -> None:
        event_id, nbytes = self._live.pop(key, (None, 0))
        if event_id is None or self._closed:
            return
        self._events.append((event_id, -nbytes))
        self.live_bytes -= nbytes

    def __exit__(self, *exc: object) -> None:
        """Leave this mode, wherever it is on the dispatch-mode stack. torch's own exit pops the top mode; a
        profiler's tracker entered inside the user's ``remat.measure()`` (a first step profiled by PGAC or a
        session) is still above it when the user's ends, and popping it instead would leave the user's tracker
        active for good. The modes above this one are taken off, this one exits, and they are put back in their
        order."""
        above = []
        stack = _get_current_dispatch_mode_stack()
        if any(m is self for m in stack):
            while _get_current_dispatch_mode_stack()[-1] is not self:
                above.append(_pop_mode())
        try:
            super().__exit__(*exc)
        finally:
            for mode in reversed(above):
                _push_mode(mode)

    def exit_anywhere(self) -> None:
        """Leave this mode if it is still active, wherever it is on the stack (modes entered after it stay, in
        their order, so the user's tracker keeps counting)."""
        if any(m is self for m in _get_current_dispatch_mode_stack()):
            self.__exit__(None, None, None)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Ignore allocations made inside (e.g. a measurement nested in the measured step)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def mark(self, label: str) -> None:
        """Remember this moment under ``label``; read it later with :meth:`bytes_at`. A label marked again
        refers to its latest mark."""
        self._marks.append((label, len(self._events)))

    def close(self) -> None:
        """Stop recording; storages still alive now are the survivors of the region."""
        self._closed = True
        for fin in self._finalizers:
            fin.detach()
        self._finalizers.clear()

    @property
    def survivors(self) -> set[int]:
        """Event ids of the storages alive (after :meth:`close`: alive when it was called)."""
        return {event_id for event_id, _ in self._live.values()}


class CompiledCodeIgnoringTracker(LiveTensorTracker):
    """A :class:`LiveTensorTracker` under which ``torch.compile``d code stays compiled: dynamo turns the mode
    off while it compiles and does not fall back to eager code for it (``ignore_compile_internals``). It does
    not see what compiled kernels allocate (:class:`remat.meters.alloc_tracker.AllocationTracker` does)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


@dataclass
class MemoryReport:
    """Figures of one measured region, in bytes."""

    device: str = "cpu"
    peak_bytes: int = 0
    activation_bytes: int = 0
    timeline: list[int] = field(default_factory=list)
    source: str = "tracker"


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@contextmanager
def measure(
    device: str | torch.device | None = None, *, tracker: bool = True, allocations: bool = False
) -> Iterator[MemoryReport]:
    """Measure peak memory and peak activation memory of the code inside the ``with`` block.

    >>> with remat.measure() as m:
    ...     model(x).sum().backward()
    >>> m.activation_bytes, m.peak_bytes

    ``allocations=True`` counts the allocator's allocations and frees (``torch.profiler``'s memory events,
    :class:`remat.meters.alloc_tracker.AllocationTracker`) instead of tracking storages with a dispatch mode: it sees
    what ``torch.compile``d code allocates and leaves compiled code compiled (the tracker makes dynamo run it
    eagerly). It cannot run inside ``torch.profiler.profile``; ``source`` reads ``"allocations"``.
    """
    dev = torch.device(device) if device is not None else torch.device("cuda" if _cuda_in_use() else "cpu")
    report = MemoryReport(device=str(dev))
    start_allocated = 0
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        start_allocated = torch.cuda.memory_allocated(dev)
    mode: LiveTensorTracker | AllocationTracker | None = None
    if allocations:
        mode = AllocationTracker(dev)
        report.source = "allocations"
    elif tracker or dev.type != "cuda":
        mode = LiveTensorTracker(dev)
    if mode is not None:
        mode.__enter__()
    try:
        yield report
    finally:
        if mode is not None:
            mode.exit_anywhere()  # a mode entered inside (PGAC's own meter) may still be active
            mode.close()
            report.activation_bytes = mode.peak(exclude_survivors=True)
            report.peak_bytes = mode.peak(exclude_survivors=False)
            report.timeline = mode.timeline()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            report.peak_bytes = torch.cuda.max_memory_allocated(dev) - start_allocated
            report.source = "cuda-allocator" + (f"+{'allocations' if allocations else 'tracker'}" if mode else "")
            if mode is None:
                report.activation_bytes = report.peak_bytes


def memory_given_back(device: torch.device) -> None:
    """After a step ran out of memory (``torch.OutOfMemoryError``), outside the handler whose traceback still holds
    the step's tensors: collect what cycles keep, and on CUDA hand the cached blocks back, so that a smaller step
    finds the memory whole."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def within_memory(call: Callable[[], T], device: torch.device) -> tuple[T | None, bool]:
    """``call()``'s result and False; or None and True where it ran out of ``device``'s memory
    (``torch.OutOfMemoryError``), what it held then given back (:func:`memory_given_back`, once the handler, whose
    traceback holds the call's tensors, has let go of them)."""
    try:
        return call(), False
    except torch.OutOfMemoryError:
        pass
    memory_given_back(device)
    return None, True


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (CPU for a model without parameters): whose memory to measure."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
