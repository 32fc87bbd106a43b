"""Whole-process peak memory, and the child process that runs ``compile_budget`` under it.

The live-tensor tracker of :func:`remat.measure` does not see allocations made inside ``torch.compile``d
code. On Linux the process's resident high-water mark does: in a process started with
``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0`` (so tensors freed by the allocator go back to the
operating system), writing ``5`` to ``/proc/self/clear_refs`` resets ``VmHWM`` to the current resident size;
after the step, ``VmHWM`` minus the resident size before it is the step's peak growth. That growth includes
the parameter gradients the step creates, which the tracker's ``activation_bytes`` leaves out, so the child
also measures one eager no-checkpoint step of the same model the same way, and reports rank against that.

``python -m remat.bench.procmem JOB_JSON`` is the child: it runs one training run (see
`remat.bench.train.execute_run`) and prints one ``REMAT {json}`` line per step and one for the run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .childproc import child_env, emit, parse

CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
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


def run_child(job: dict[str, Any], on_record: Callable[[dict[str, Any]], None], timeout_s: float | None = None
              ) -> dict[str, Any]:
    """Run ``job`` in a child process with the allocator settings above; every step record goes to
    ``on_record`` as it arrives; returns the run record (``status`` "failed" with the reason if it failed)."""
    env = child_env(**CHILD_ENV)
    cmd = [sys.executable, "-m", "remat.bench.procmem", json.dumps(job)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    run: dict[str, Any] | None = None
    assert proc.stdout is not None
    for line in proc.stdout:
        record = parse(line)
        if record is None:
            continue
        if record.get("record") == "run":
            run = record
        else:
            on_record(record)
    try:
        stderr = proc.communicate(timeout=timeout_s)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        stderr = proc.communicate()[1]
    if run is None:
        tail = "\n".join((stderr or "").strip().splitlines()[-15:])
        run = {"status": "failed", "error": f"the compile child exited with code {proc.returncode}: {tail}"}
    return run


def main(argv: list[str] | None = None) -> int:
    from .train import execute_child_job

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m remat.bench.procmem JOB_JSON (started by remat bench)", file=sys.stderr)
        return 2
    job = json.loads(args[0])
    run = execute_child_job(job, emit)
    run["record"] = "run"
    emit(run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
