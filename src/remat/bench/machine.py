"""The machine a bench runs on: described in words for every figure and report, its load average, and the
default number of intra-op threads."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Any

import torch


def default_threads() -> int:
    """Intra-op threads when ``--threads`` is 0: half the cores."""
    return max(1, (os.cpu_count() or 2) // 2)


def environment(device: str) -> dict[str, Any]:
    """The machine, in words, for every figure and report."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    env: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    with contextlib.suppress(ImportError):
        import transformers

        env["transformers"] = transformers.__version__
    gpu = f"{env['gpu']}, " if "gpu" in env else ""
    env["machine"] = f"{gpu}{cpu} ({env['cores']} cores), torch {torch.__version__}"
    return env


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, or None where the system has none."""
    try:
        return list(os.getloadavg())
    except OSError:
        return None
