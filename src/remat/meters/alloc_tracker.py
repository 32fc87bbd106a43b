"""A live-bytes meter that sees what ``torch.compile``d code allocates: the allocator's own events.

:class:`~remat.meters.memory.LiveTensorTracker` is a ``TorchDispatchMode``: while one is active, dynamo runs compiled
frames eagerly, and from then on skips them (in torch 2.13 until ``torch._dynamo.reset()``), and inductor's
kernels allocate their buffers without passing through the dispatcher anyway. :class:`AllocationTracker` reads
the allocator instead: ``torch.profiler`` with ``profile_memory=True`` reports every allocation and free of the
device's allocator (CPU or CUDA), compiled code included, without changing how the code runs. It keeps the
reading interface of the live-tensor tracker (``mark``, ``bytes_at``, ``peak_between``, ``peak``,
``timeline``), so the byte terms of a block (:mod:`remat.profiling.block_bytes`) and :func:`remat.measure` read either.

Differences: the figures are allocation sizes (the allocator's, not the storages'); the events are read when
the ``with`` block exits, so the figures exist only after it; allocations not freed by then are the survivors.
Two cannot run at once (one profiler per process), nor one inside ``torch.profiler.profile``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .live_series import LiveBytesSeries

_MARK = "remat.mark:"

__all__ = ["AllocationTracker", "is_compiled"]


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module.compile()`` was called on ``module`` (its calls run a compiled forward)."""
    return getattr(module, "_compiled_call_impl", None) is not None


class AllocationTracker(LiveBytesSeries):
    """Allocations and frees of the allocator while the ``with`` block runs (``device``: whose allocator;
    None: every device's), with marks; figures readable after the block exits."""

    def __init__(self, device: str | torch.device | None = None) -> None:
        self.device_type = torch.device(device).type if device is not None else None
        super().__init__()
        self._profiler: Any = None
        self._survivors: set[int] = set()

    def __enter__(self) -> AllocationTracker:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device_type == "cuda" or (self.device_type is None and torch.cuda.is_available()):
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=activities, profile_memory=True)
        try:
            self._profiler.__enter__()
        except RuntimeError as err:
            raise RuntimeError(
                f"cannot start the allocation meter ({err}); it runs torch.profiler, and only one profiler "
                "runs at a time: measure outside any torch.profiler.profile and any other allocation meter"
            ) from err
        return self

    def __exit__(self, *exc: Any) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return
        profiler.__exit__(*exc)
        self._read(profiler.profiler.kineto_results.experimental_event_tree())

    def exit_anywhere(self) -> None:
        """Stop recording (for callers written for the live-tensor tracker)."""
        self.__exit__(None, None, None)

    def close(self) -> None:
        """Nothing more to do: the survivors are the allocations still alive when the block exited."""

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Ignore what is allocated inside (allocations are skipped by mark labels read back)."""
        self.mark("\0pause")
        try:
            yield
        finally:
            self.mark("\0resume")

    def mark(self, label: str) -> None:
        """Remember this moment under ``label`` (a label marked again refers to its latest mark)."""
        with torch.profiler.record_function(_MARK + label):
            pass

    def _read(self, roots: list[Any]) -> None:
        from torch._C._profiler import _EventType

        found: list[tuple[int, int, Any]] = []  # (time, order, event data)
        stack = list(roots)
        while stack:
            event = stack.pop()
            stack.extend(event.children)
            if event.tag == _EventType.Allocation:
                fields = event.extra_fields
                if self.device_type is None or fields.device.type == self.device_type:
                    found.append((event.start_time_ns, 1, (fields.ptr, fields.alloc_size)))
            elif event.tag == _EventType.TorchOp and event.name.startswith(_MARK):
                found.append((event.start_time_ns, 0, event.name[len(_MARK) :]))
        found.sort(key=lambda item: (item[0], item[1]))
        live: dict[int, tuple[int, int]] = {}  # pointer -> (allocation id, bytes)
        paused, next_id = False, 0
        for _, kind, data in found:
            if kind == 0:
                if data in ("\0pause", "\0resume"):
                    paused = data == "\0pause"
                else:
                    self._marks.append((data, len(self._events)))
                continue
            ptr, size = data
            if size > 0 and not paused:
                live[ptr] = (next_id, size)
                self._events.append((next_id, size))
                next_id += 1
            elif size < 0 and ptr in live:  # frees of memory allocated before the block are not ours
                alloc_id, nbytes = live.pop(ptr)
                self._events.append((alloc_id, -nbytes))
        self._survivors = {alloc_id for alloc_id, _ in live.values()}

    @property
    def survivors(self) -> set[int]:
        return set(self._survivors)
