"""The reading side of a live-bytes meter, written once: allocation/free events with marks, and the figures
read from them (live bytes at a mark, peak between marks, peak, timeline), with or without the survivors.

Both meters record into it: :class:`remat.meters.memory.LiveTensorTracker` (storages created by operators, seen by
a dispatch mode) and :class:`remat.meters.alloc_tracker.AllocationTracker` (the allocator's own events)."""

from __future__ import annotations

__all__ = ["LiveBytesSeries"]


class LiveBytesSeries:
    """Events ``(event id, +bytes on allocation / -bytes on free)`` and marks ``(label, events before it)``;
    a subclass fills ``_events`` and ``_marks`` and says which event ids survive the region (``survivors``)."""

    def __init__(self) -> None:
        self._events: list[tuple[int, int]] = []
        self._marks: list[tuple[str, int]] = []

    @property
    def survivors(self) -> set[int]:
        """Event ids of the allocations still alive when the region ended."""
        raise NotImplementedError

    def marks(self) -> list[tuple[str, int]]:
        """Every mark in the order it was made, with the number of events recorded before it."""
        return list(self._marks)

    def has_mark(self, label: str) -> bool:
        return any(name == label for name, _ in self._marks)

    def _index(self, label: str) -> int:
        for name, index in reversed(self._marks):
            if name == label:
                return index
        raise KeyError(f"no mark named {label!r}")

    def _series(self, exclude_survivors: bool) -> list[int]:
        """Live bytes after each event (index i = after i events)."""
        skip = self.survivors if exclude_survivors else set()
        live, series = 0, [0]
        for event_id, delta in self._events:
            if event_id not in skip:
                live += delta
            series.append(live)
        return series

    def peak(self, exclude_survivors: bool = True) -> int:
        return max(self._series(exclude_survivors))

    def bytes_at(self, label: str, exclude_survivors: bool = True) -> int:
        return self._series(exclude_survivors)[self._index(label)]

    def peak_between(self, start: str, end: str, exclude_survivors: bool = True) -> int:
        return max(self._series(exclude_survivors)[self._index(start) : self._index(end) + 1])

    def summits_between(self, start: str, end: str, exclude_survivors: bool = True) -> list[int]:
        """Live bytes at every local maximum between the marks: each moment right before bytes are freed, and the
        last. Their largest is :meth:`peak_between`; runs of the same operators at other input shapes have the
        same summits in the same order, each growing with the shape as its tensors do, so the peak at a shape
        not run is the largest of the summits predicted there (:mod:`remat.core.shape_costs`)."""
        window = self._series(exclude_survivors)[self._index(start) : self._index(end) + 1]
        return [live for k, live in enumerate(window) if k + 1 == len(window) or window[k + 1] < live]

    def alive_at_peak(self, exclude_survivors: bool = True) -> set[int]:
        """Event ids of the allocations alive at the first moment live bytes reach :meth:`peak`."""
        skip = self.survivors if exclude_survivors else set()
        series = self._series(exclude_survivors)
        alive: set[int] = set()
        for event_id, delta in self._events[: series.index(max(series))]:
            if event_id in skip:
                continue
            if delta > 0:
                alive.add(event_id)
            else:
                alive.discard(event_id)
        return alive

    def written_between(self, start: str, end: str) -> int:
        """Bytes of all allocations made between the marks, survivors included (work the device does)."""
        return sum(delta for _, delta in self._events[self._index(start) : self._index(end)] if delta > 0)

    def timeline(self, exclude_survivors: bool = True) -> list[int]:
        """Live bytes after every allocation or free, for plots of memory over one step."""
        return self._series(exclude_survivors)
