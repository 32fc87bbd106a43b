"""The protocol between ``remat bench`` and the child processes it starts (the whole-process memory meter, the
torchrun sync sweep): children print one JSON record per line behind a prefix; the parent picks those lines out
of everything else the child prints."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

LINE_MARK = "REMAT "


def emit(record: dict[str, Any]) -> None:
    """Send ``record`` to the parent (child side)."""
    sys.stdout.write(LINE_MARK + json.dumps(record) + "\n")
    sys.stdout.flush()


def parse(line: str) -> dict[str, Any] | None:
    """The record on ``line``, or None for any other output of the child (parent side)."""
    if not line.startswith(LINE_MARK):
        return None
    return json.loads(line[len(LINE_MARK) :])


def child_env(**extra: str) -> dict[str, str]:
    """The parent's environment with ``extra`` and this source tree importable in the child."""
    env = {**os.environ, **extra}
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
