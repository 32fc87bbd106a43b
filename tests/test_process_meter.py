"""The whole-process meter (``remat.meters.process``) in processes started as the benchmarks start them: the
allocator settings it needs are passed to the child whatever the parent runs with (a parent started with the
timing settings, whose 256 MiB top pad would lift the high-water mark by itself, included), a process started
otherwise is told why the meter cannot work, and the meter reads a step's growth."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from remat.bench.childproc import child_env
from remat.meters import CHILD_ENV

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="the meter needs Linux")

TIMING_ENV = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "17179869184",
              "MALLOC_TOP_PAD_": "268435456"}  # fmt: skip

# Tensors of 1 MiB, over the meter's mmap threshold, made and freed before the meter starts, then made again
# under it. With the meter's settings each is a mapping of its own, returned when freed, and the meter reads the
# 32 MiB again; with a large top pad glibc serves them from the heap's padded top and keeps it, and the meter
# reads (nearly) nothing.
PROBE = """
import torch
from remat.meters import ProcessPeakMeter, process_meter_problem
def small():
    return [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(32)]
problem = process_meter_problem()
print(problem)
del problem
xs = small()
del xs
with ProcessPeakMeter() as meter:
    xs = small()
    del xs
print(meter.activation_bytes)
"""


def _probe(env: dict[str, str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\n")


def test_a_child_gets_the_meters_settings_from_a_parent_started_with_the_timing_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in TIMING_ENV.items():
        monkeypatch.setenv(key, value)
    lines = _probe(child_env(**CHILD_ENV))
    assert lines[0] == "None"
    assert 30 << 20 <= int(lines[1]) <= 40 << 20  # the 32 MiB made again


def test_a_process_started_with_the_timing_settings_is_told_why_the_meter_cannot_work() -> None:
    lines = _probe(child_env(**{**CHILD_ENV, "MALLOC_TOP_PAD_": TIMING_ENV["MALLOC_TOP_PAD_"]}))
    assert lines[0] == "the process was not started with MALLOC_TOP_PAD_=131072"
    assert int(lines[1]) < 4 << 20  # what the meter would read: the freed heap was kept, nothing grew
