"""A machine's profiles kept on disk, so that a restarted run plans at once.

:func:`cached_profile` is :func:`~remat.profiling.profiler.profile` behind a cache keyed by everything a cost
table depends on: the model's structure (its printed module tree, every parameter's and buffer's name, shape,
dtype and ``requires_grad``), the batch's structure (the shapes and dtypes of its tensors), the training step
(blocks, autocast, whether the loop holds the output, the loss function's name), the per-operator policies
profiled, the device (its name and the CPU threads), and the torch and remat versions. Values are not in the key:
a profile measures shapes and times, not numbers.

The cache lives in ``$REMAT_CACHE_DIR`` (default ``~/.cache/remat/profiles``); ``REMAT_CACHE_DIR=off`` turns it
off. A table read back says so in ``info["cached_from"]``. A file that cannot be read is profiled again and
overwritten. :func:`keep_profile` writes a table that gained a measurement after it was kept (a segment's price,
measured once a plan needs it: :func:`~remat.profiling.profiler.price_segments`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import platform
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..chains import batch_structure
from ..core import Batch, CostTable, StepSpec
from ..meters import model_device

OFF = "off"


def cache_directory() -> Path | None:
    """Where profiles are kept (None where ``REMAT_CACHE_DIR=off``)."""
    setting = os.environ.get("REMAT_CACHE_DIR", "")
    if setting.lower() == OFF:
        return None
    return Path(setting) if setting else Path.home() / ".cache" / "remat" / "profiles"


def _blocks(blocks: Any) -> Any:
    if blocks is None or isinstance(blocks, str):
        return blocks
    return [_blocks(b) if isinstance(b, list) else (b[0] if isinstance(b, tuple) else b) for b in blocks]


def _remat_version() -> str:
    try:
        return importlib.metadata.version("remat")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "source"


def profile_key(model: nn.Module, batch: Batch, step: StepSpec, policies: str | Iterable[str]) -> str:
    """The cache key of ``model``'s profile on ``batch`` (module docstring)."""
    device = model_device(model)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    loss = step.loss_fn
    described = {
        "model": str(model),
        "parameters": [[n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in model.named_parameters()],
        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in model.named_buffers()],
        "training": model.training,
        "batch": batch_structure(batch),
        "blocks": _blocks(step.blocks),
        "autocast": repr(step.autocast),
        "holds_output": step.holds_output,
        "loss": getattr(loss, "__qualname__", repr(loss)) if loss is not None else None,
        "policies": policies if isinstance(policies, str) else sorted(policies),
        "device": [device.type, name, torch.get_num_threads()],
        "versions": [torch.__version__, _remat_version()],
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cached_profile(
    model: nn.Module,
    batch: Batch,
    *,
    step: StepSpec,
    policies: str | Iterable[str],
    price_segments: bool = True,
) -> CostTable:
    """The profile of ``model`` on ``batch`` from this machine's cache, else measured (``price_segments`` as
    :func:`~remat.profiling.profiler.profile` takes it) and kept there."""
    from .profiler import profile

    directory = cache_directory()
    if directory is None:
        return profile(model, batch, step=step, policies=policies, price_segments=price_segments)
    path = directory / f"{profile_key(model, batch, step, policies)}.json"
    if path.exists():
        try:
            costs = CostTable.from_json(path.read_text())
        except (ValueError, KeyError, TypeError):
            costs = None
        if costs is not None:
            costs.info["cached_from"] = str(path)
            return costs
    costs = profile(model, batch, step=step, policies=policies, price_segments=price_segments)
    keep_profile(model, batch, costs, step=step, policies=policies)
    return costs


def keep_profile(
    model: nn.Module, batch: Batch, costs: CostTable, *, step: StepSpec, policies: str | Iterable[str]
) -> None:
    """Write ``costs`` to this machine's cache as ``model``'s profile on ``batch`` (replacing what was there:
    a table that gained a measurement since), where the cache is on and writable."""
    directory = cache_directory()
    if directory is None:
        return
    path = directory / f"{profile_key(model, batch, step, policies)}.json"
    kept = {k: v for k, v in costs.info.items() if k != "cached_from"}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(dataclasses.replace(costs, info=kept).to_json())
        temporary.replace(path)
    except OSError:
        pass  # a read-only home: profiles are not kept, planning works all the same
