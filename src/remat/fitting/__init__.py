"""Choosing by measurement: candidates run on the caller's step, measured, the fastest that fits kept. One
:class:`Trial`/:class:`Fit` type (:mod:`.trial`, rules 1-3 there) serves every fit.

* :mod:`.measured_fit`: :func:`fit`, ``optimal`` with and without per-operator policies, the faster that fits on
  the step kept applied (:class:`PlanFit`);
* :mod:`.compile_budget`: torch.compile's whole-model ``activation_memory_budget`` fitted to bytes
  (:class:`CompileBudgetFit`); :mod:`.compiled_blocks`: compiling a chain's blocks in place;
* :mod:`.compiled_choice`: :func:`fit_compiled`, the faster compiled route that fits (:class:`CompiledFit`);
* :mod:`.whole_step`: the device's memory for a whole training step, what is fixed in it (parameters, gradients,
  optimizer state, buffers) and a step's measured peak; :mod:`.device_fit`: :func:`fit_memory`, the plan whose
  whole step fits that memory (``remat.fit``'s work), and :func:`fit_memory_compiled`, the fastest route that
  fits it, eager or compiled (``remat.fit(..., compile=True)``);
* :mod:`.advice`: :func:`advise` (``remat.advise``, measured on the model) and :func:`advise_costs` (from a cost
  table): whether the model fits, which plan fits, and whether the memory freed buys a
  larger batch.
"""

from __future__ import annotations

from .advice import ModelAdvice, advise, advise_costs, model_state_bytes
from .compile_budget import DEFAULT_BUDGETS, CompileBudgetFit, fit_compile_budget
from .compiled_blocks import compile_blocks, uncompile_blocks
from .compiled_choice import CompiledFit, fit_compiled
from .device_fit import (
    CompiledMemoryFit,
    MemoryFit,
    MemoryFitError,
    StepWrapper,
    activation_budget,
    activations_within,
    fit_memory,
    fit_memory_compiled,
)
from .measured_fit import PlanFit, fit
from .trial import Fit, Trial
from .whole_step import (
    FixedMemory,
    StepPeak,
    device_memory,
    fixed_memory,
    stepping_optimizer,
    warn_if_on_host,
    whole_step_peak,
)

__all__ = [
    "DEFAULT_BUDGETS",
    "CompileBudgetFit",
    "CompiledFit",
    "CompiledMemoryFit",
    "Fit",
    "FixedMemory",
    "MemoryFit",
    "MemoryFitError",
    "ModelAdvice",
    "PlanFit",
    "StepPeak",
    "StepWrapper",
    "Trial",
    "activation_budget",
    "activations_within",
    "advise",
    "advise_costs",
    "compile_blocks",
    "device_memory",
    "warn_if_on_host",
    "fit_compile_budget",
    "fit",
    "fit_compiled",
    "fit_memory",
    "fit_memory_compiled",
    "fixed_memory",
    "model_state_bytes",
    "stepping_optimizer",
    "uncompile_blocks",
    "whole_step_peak",
]
