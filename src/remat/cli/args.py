"""Argument types and early checks of the ``remat`` command.

Every value the command takes is checked before any model is built or profiled, so a mistake costs no
computation: the argparse types here turn a bad value into ``remat <command>: error: argument --x: ...``
(exit code 2), and :func:`check_output_file` / :func:`check_output_folder` find out whether results can be
written before the work that produces them starts.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

import torch

from ..core import normalize_budget, parse_bytes

# Floating dtypes a model can be cast to and run in (integer dtypes hold no gradients).
FLOAT_DTYPES = ("float32", "float64", "bfloat16", "float16")
DEVICE_TYPES = ("cpu", "cuda", "meta")


def positive_int(text: str) -> int:
    """An int of at least 1 (batch size, sequence length, layers, hidden size, heads, segment length)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def unit_fraction(text: str) -> float:
    """A float in [0, 1] (the share of blocks the ``random`` strategy checkpoints)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def budget(text: str) -> int | float:
    """A budget: bytes or a fraction of the no-checkpoint activation memory (rules: :mod:`remat.core.sizes`)."""
    try:
        value = normalize_budget(text)
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    assert value is not None  # a string is never read as "no budget"
    return value


def size(text: str) -> int:
    """A positive number of bytes, e.g. ``80GiB``."""
    try:
        value = parse_bytes(text)
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is zero bytes; give a positive size like '80GiB'")
    return value


def device(text: str) -> str:
    """``cpu``, ``meta``, or ``cuda``/``cuda:N`` when that GPU exists on this machine."""
    try:
        parsed = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; use one of cpu, cuda, cuda:N or meta") from None
    if parsed.type not in DEVICE_TYPES:
        raise argparse.ArgumentTypeError(f"device {text!r} is not supported; use one of cpu, cuda, cuda:N or meta")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text}: no CUDA device is available on this machine (torch.cuda.is_available() is False); use "
                "--device cpu, or --device meta to estimate without running"
            )
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise argparse.ArgumentTypeError(f"{text}: this machine has {count} CUDA device(s), cuda:0..{count - 1}")
    return text


def bytes_per_element(dtype: str) -> int:
    """Bytes of one element of the floating dtype named ``dtype`` (one of :data:`FLOAT_DTYPES`)."""
    return getattr(torch, dtype).itemsize


def check_output_file(path: str | None, flag: str = "--json") -> None:
    """Raise ValueError unless a file can be written at ``path`` (nothing is created or changed)."""
    if not path:
        return
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file path like {target / 'results.json'}")
    if target.exists():
        if not os.access(target, os.W_OK):
            raise ValueError(f"{flag} {path}: the file is not writable; choose another path")
        try:
            with target.open("a"):
                pass
        except OSError as err:
            raise ValueError(f"{flag} {path}: cannot write there ({err.strerror}); choose another path") from None
        return
    _check_creatable(target.parent, flag, path)


def check_output_folder(path: str | None, flag: str = "--out") -> None:
    """Raise ValueError unless ``path`` is, or can be made, a writable folder (nothing is created)."""
    if not path:
        return
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{flag} {path} exists and is not a folder; choose another path")
    _check_creatable(target if target.exists() else target.parent, flag, path)


def _check_creatable(folder: Path, flag: str, given: str) -> None:
    """Whether files can be created in ``folder`` once it and its missing parents are made."""
    existing = folder
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag} {given}: {existing} is a file, not a folder; choose another path")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise ValueError(
            f"{flag} {given}: cannot write in {existing} ({err.strerror or err}); choose a writable path"
        ) from None
