"""Meters of a step's memory: the live-tensor tracker (every storage an operator creates, followed until it dies,
on any device, ``meta`` included), CUDA allocator statistics, and a meter of the allocator's own events that
sees inside code ``torch.compile`` compiled.

* :mod:`.memory`: :func:`measure` (``remat.measure``), :class:`LiveTensorTracker`, :class:`MemoryReport`,
  :func:`within_memory` and :func:`memory_given_back` for a step that runs out of memory;
* :mod:`.alloc_tracker`: :class:`AllocationTracker`, the allocator's events;
* :mod:`.live_series`: the reading side both share (live bytes at a mark, peak between marks, timelines);
* :mod:`.process`: the whole process's resident high-water mark, which sees every allocation (Linux).

Nothing here knows plans or checkpoints: profiles, fits and tests read their figures from these meters.
"""

from __future__ import annotations

from .alloc_tracker import AllocationTracker, is_compiled
from .memory import (
    CompiledCodeIgnoringTracker,
    LiveTensorTracker,
    MemoryReport,
    held_bytes,
    measure,
    memory_given_back,
    model_device,
    storage_key,
    within_memory,
)
from .process import CHILD_ENV, ProcessPeakMeter, peak_rss_bytes, process_meter_problem, reset_peak_rss

__all__ = [
    "CHILD_ENV",
    "ProcessPeakMeter",
    "peak_rss_bytes",
    "process_meter_problem",
    "reset_peak_rss",
    "AllocationTracker",
    "CompiledCodeIgnoringTracker",
    "LiveTensorTracker",
    "MemoryReport",
    "held_bytes",
    "is_compiled",
    "measure",
    "memory_given_back",
    "model_device",
    "storage_key",
    "within_memory",
]
