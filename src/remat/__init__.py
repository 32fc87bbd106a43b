"""remat: activation checkpointing for PyTorch that fits a memory budget at the smallest time cost.

The data flow: ``find_blocks`` -> ``profile`` (a CostTable) -> ``plan`` (a Plan) -> ``apply`` (hooks on the
live model), with the dynamic controllers ``PGAC`` and ``DTR`` closing the loop during training.
The dynamic controllers, the experiment harness and the integrations are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import policies
from .chain import find_blocks, find_chains
from .checkpointing import Checkpoint, checkpoint, checkpoint_fn, checkpointed
from .costs import BlockCost, CostTable
from .memory import MemoryReport, measure
from .planners import STRATEGIES, BudgetError, plan
from .profiler import profile
from .runtime import RematHandle, apply
from .simulator import Plan, Simulation, simulate
from .sizes import format_bytes, parse_budget, parse_bytes

__version__ = "0.1.0"

_LAZY = {"PGAC": "remat.dynamic.pgac", "PGACQ": "remat.dynamic.pgac_q", "DTR": "remat.dynamic.dtr"}
_LAZY_MODULES = {"estimate", "integrations", "bench", "dynamic", "knapsack"}

__all__ = [
    "BlockCost",
    "BudgetError",
    "Checkpoint",
    "CostTable",
    "DTR",
    "MemoryReport",
    "PGAC",
    "PGACQ",
    "Plan",
    "RematHandle",
    "STRATEGIES",
    "Simulation",
    "apply",
    "checkpoint",
    "checkpoint_fn",
    "checkpointed",
    "find_blocks",
    "find_chains",
    "format_bytes",
    "measure",
    "parse_budget",
    "parse_bytes",
    "plan",
    "policies",
    "profile",
    "simulate",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _LAZY_MODULES:
        return importlib.import_module(f"remat.{name}")
    raise AttributeError(f"module 'remat' has no attribute {name!r}")
