"""remat: activation checkpointing for PyTorch that fits a memory budget at the smallest time cost.

The data flow: ``find_blocks`` -> ``profile`` (a CostTable) -> ``plan`` (a Plan) -> ``apply`` (hooks on the
live model), with the dynamic controllers ``PGAC`` and ``DTR`` closing the loop during training. The package's
folders are those stages (``docs/architecture.md``); this face gathers what a user needs from them. The dynamic
controllers, the experiment harness and the integrations are imported on first use.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

from .chains import find_blocks, find_chains
from .checkpointing import Checkpoint, checkpoint, checkpoint_fn, checkpointed, policies
from .core import BlockCost, BudgetError, CostTable, ShapeCosts, StepSpec, format_bytes, parse_budget, parse_bytes
from .meters import MemoryReport, measure
from .planning import STRATEGIES, Buckets, Plan, ShapeBudgetError, ShapePlans, Simulation, simulate
from .planning import make_plan as plan
from .profiling import profile, profile_shapes
from .runtime import RematHandle, apply

__version__ = "0.1.0"

# `remat.policies` is the public namespace of the per-operator policies: importable by its own path too.
sys.modules[__name__ + ".policies"] = policies

_LAZY = {
    "PGAC": "remat.dynamic",
    "PGACQ": "remat.dynamic",
    "DTR": "remat.dynamic",
    "fit": "remat.integrations",
    "advise": "remat.fitting",
}
_LAZY_MODULES = {"integrations": "remat.integrations", "bench": "remat.bench", "dynamic": "remat.dynamic"}

# Where the modules of remat's first layout live now (one folder per stage of the data flow). Importing an old
# path gives the module that holds its code, with a DeprecationWarning naming the path to write.
MOVED_MODULES = {
    "action_steps": "profiling.action_steps",
    "action_times": "profiling.action_times",
    "actions": "core.actions",
    "advise": "fitting.advice",
    "alloc_tracker": "meters.alloc_tracker",
    "applied": "runtime.applied",
    "block_bytes": "profiling.block_bytes",
    "block_calls": "chains.block_calls",
    "block_measure": "profiling.block_measure",
    "block_run": "profiling.block_run",
    "block_signature": "profiling.block_signature",
    "block_timing": "profiling.block_timing",
    "blocks": "chains.blocks",
    "chain": "chains.chain",
    "chain_bounds": "profiling.chain_bounds",
    "cli_args": "cli.args",
    "cli_parallel": "cli.parallel",
    "compiled_partitions": "checkpointing.compiled_partitions",
    "compression": "checkpointing.compression",
    "costs": "core.costs",
    "double_backward": "planning.strategies",
    "dynamic.dtr": "dynamic.dtr.controller",
    "dynamic.dtr_evict": "dynamic.dtr.evict",
    "dynamic.dtr_graph": "dynamic.dtr.graph",
    "dynamic.dtr_ops": "dynamic.dtr.runtime",
    "dynamic.dtr_predict": "dynamic.dtr.predict",
    "dynamic.dtr_remat": "dynamic.dtr.remat",
    "dynamic.dtr_runtime": "dynamic.dtr.runtime",
    "dynamic.pgac": "dynamic.pgac.controller",
    "dynamic.pgac_mask": "dynamic.pgac.mask",
    "dynamic.pgac_options": "dynamic.pgac.controller",
    "dynamic.pgac_pipeline": "dynamic.pgac.pipeline",
    "dynamic.pgac_q": "dynamic.pgac.q",
    "dynamic.pgac_q_mask": "dynamic.pgac.q_mask",
    "dynamic.pgac_record": "dynamic.pgac.record",
    "dynamic.pgac_scores": "dynamic.pgac.scores",
    "dynamic.pgac_state": "dynamic.pgac.state",
    "dynamic.pgac_sync": "dynamic.pgac.controller",
    "dynamic.schedules": "dynamic.pgac.schedules",
    "estimate": "profiling.estimate",
    "estimate.activation_formula": "profiling.estimate.activation_formula",
    "estimate.meta": "profiling.estimate.meta",
    "estimate.parallel": "profiling.estimate.parallel",
    "estimate.time_model": "profiling.estimate.time_model",
    "grad_error": "profiling.grad_error",
    "hf_guards": "chains.hf_guards",
    "host_copies": "checkpointing.host_copies",
    "input_compression": "checkpointing.input_compression",
    "integrations.compile_budget": "fitting.compile_budget",
    "integrations.compiled_blocks": "fitting.compiled_blocks",
    "integrations.compiled_choice": "fitting.compiled_choice",
    "integrations.process_group": "integrations.session",
    "integrations.wrappers": "integrations.session",
    "knapsack": "checkpointing.knapsack",
    "live_series": "meters.live_series",
    "lossy_actions": "core.actions",
    "measured_fit": "fitting.measured_fit",
    "memory": "meters.memory",
    "model_state": "chains.model_state",
    "op_kinds": "checkpointing.op_kinds",
    "outside_time": "profiling.outside_time",
    "plan_files": "planning.plan_files",
    "planners": "planning",
    "planners.chain_units": "planning.chain_units",
    "planners.errors": "core.sizes",
    "planners.lossy": "planning.lossy",
    "planners.optimal": "planning.optimal_plan",
    "planners.pareto": "planning.pareto",
    "planners.search": "planning.search",
    "planners.static": "planning.static",
    "precision": "core.precision",
    "profiled_actions": "profiling.profiler",
    "profiler": "profiling.profiler",
    "recompute_compression": "checkpointing.recompute_compression",
    "recompute_stats": "runtime.recompute_stats",
    "regions": "checkpointing.regions",
    "replayed_draws": "checkpointing.replayed_draws",
    "rng": "checkpointing.rng",
    "simulator": "planning",
    "sizes": "core.sizes",
    "step_anchor": "profiling.profiler",
    "suspension": "runtime.applied",
    "training_step": "chains.training_step",
    "unit_terms": "planning.unit_terms",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of an old module path (``remat.sizes``) give the module now holding its code (``remat.core.sizes``),
    with a DeprecationWarning: the old paths keep working while code moves to the new ones."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        old = fullname.removeprefix(__name__ + ".")
        if not fullname.startswith(__name__ + ".") or old not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a placeholder, replaced in sys.modules by the module itself (the import returns that)

    def exec_module(self, module: ModuleType) -> None:
        new = f"{__name__}.{MOVED_MODULES[module.__name__.removeprefix(__name__ + '.')]}"
        warnings.warn(f"{module.__name__} moved: import {new} instead", DeprecationWarning, stacklevel=2)
        sys.modules[module.__name__] = importlib.import_module(new)


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())

__all__ = [
    "BlockCost",
    "Buckets",
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
    "ShapeBudgetError",
    "ShapeCosts",
    "ShapePlans",
    "Simulation",
    "StepSpec",
    "advise",
    "apply",
    "checkpoint",
    "checkpoint_fn",
    "checkpointed",
    "find_blocks",
    "find_chains",
    "fit",
    "format_bytes",
    "measure",
    "parse_budget",
    "parse_bytes",
    "plan",
    "policies",
    "profile",
    "profile_shapes",
    "simulate",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _LAZY_MODULES:
        return importlib.import_module(_LAZY_MODULES[name])
    if name in MOVED_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'remat' has no attribute {name!r}")
