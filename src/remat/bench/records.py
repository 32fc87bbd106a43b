"""The JSON-lines files of a results folder (``steps.jsonl``, ``runs.jsonl``, ``ddp.jsonl``): writing them a line
at a time so a killed run leaves every finished line on disk, reading them back, and rewriting them on resume."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch


def json_default(value: Any) -> Any:
    """``json.dumps(..., default=json_default)``: paths as strings, tensors as lists."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON line of ``path`` (a line cut short by a kill is skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class JsonlWriter:
    """Appends JSON lines and flushes each one, so a killed run leaves every finished line on disk."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, default=json_default) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def rewrite_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace ``path`` with ``rows`` (written to a temporary file first, so a kill leaves the old file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


def safe_name(label: str) -> str:
    """``label`` as a file name: runs of other characters than letters, digits, ``_.-`` become ``_``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_")
