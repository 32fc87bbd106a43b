"""The benchmark scripts' modules (``benchmarks/<name>.py``) imported for the tests that check them: the
benchmarks folder is on the import path while the module is in use, as it is when the script runs."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def imported_benchmark(name: str) -> Iterator[ModuleType]:
    """For a fixture: ``yield from imported_benchmark("peers_table")``; the folder leaves the path afterwards."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
