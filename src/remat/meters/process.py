"""Whole-process peak memory: the meter that sees what code ``torch.compile`` compiled allocates.

The live-tensor tracker of :func:`remat.measure` does not see allocations made inside ``torch.compile``d
code. On Linux the process's resident high-water mark does: in a process started with
``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0 MALLOC_TOP_PAD_=131072`` (so tensors freed by the
allocator go back to the operating system, and the heap grows by what is used), writing ``5`` to
``/proc/self/clear_refs`` resets ``VmHWM`` to the current resident size; after the step, ``VmHWM`` minus the
resident size before it is the step's peak growth. That growth includes the parameter gradients the step
creates, which the tracker's ``activation_bytes`` leaves out, so the child also measures one eager
no-checkpoint step of the same model the same way, and reports rank against that.

:func:`reset_peak_rss` and :func:`peak_rss_bytes` are the same two readings for a caller's own measurement, with
errors that say what to use instead where ``/proc`` lacks them (the bench's ``compile_budget`` run measures in a
child process started with :data:`CHILD_ENV`: :mod:`remat.bench.compile_child`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

# MALLOC_TOP_PAD_ at glibc's default (128 KiB) as well: a parent started with the timing settings (a top pad of
# 256 MiB) would otherwise pass its pad on, and the first sbrk of a step would lift the high-water mark by it.
CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_TOP_PAD_": "131072"}
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def process_meter_problem() -> str | None:
    """Why the whole-process meter cannot work in this process, or None when it can."""
    if not _STATUS.exists() or not _CLEAR_REFS.exists():
        return "no /proc/self/status or /proc/self/clear_refs (the whole-process meter needs Linux)"
    missing = [k for k, v in CHILD_ENV.items() if os.environ.get(k) != v]
    if missing:
        return f"the process was not started with {' '.join(f'{k}={CHILD_ENV[k]}' for k in missing)}"
    try:
        _CLEAR_REFS.write_text("5")
    except OSError as err:
        return f"cannot reset the high-water mark ({err})"
    return None


def _status_bytes(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+)\s+kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field} line")
    return int(match.group(1)) * 1024


class ProcessPeakMeter:
    """Peak resident growth of this process over a ``with`` block, in bytes (``activation_bytes``)."""

    method = "process-vmhwm"

    def __init__(self) -> None:
        self.activation_bytes = 0
        self.peak_bytes = 0
        self._start = 0

    def __enter__(self) -> ProcessPeakMeter:
        _CLEAR_REFS.write_text("5")
        self._start = _status_bytes("VmRSS")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.peak_bytes = _status_bytes("VmHWM")
        self.activation_bytes = max(0, self.peak_bytes - self._start)


def reset_peak_rss() -> None:
    """Reset this process's resident-memory high-water mark (Linux: ``5`` to ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as err:
        raise OSError(
            f"cannot reset the memory high-water mark ({err}); it needs Linux's /proc/self/clear_refs. "
            "On CUDA use torch.cuda.reset_peak_memory_stats() and torch.cuda.max_memory_allocated() instead"
        ) from err


def peak_rss_bytes() -> int:
    """This process's resident-memory high-water mark in bytes (``VmHWM``) since start or :func:`reset_peak_rss`."""
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError as err:
        raise OSError(f"cannot read {_STATUS} ({err}); the whole-process high-water mark needs Linux") from err
    raise OSError(f"{_STATUS} has no VmHWM line; the whole-process high-water mark needs Linux")
