"""Choosing by measurement: candidates run on the caller's step, measured, the fastest that fits kept. One
:class:`Trial`/:class:`Fit` type (:mod:`.trial`, rules 1-3 there) serves every fit.

* :mod:`.measured_fit`: :func:`fit`, ``optimal`` with and without per-operator policies, the faster that fits on
  the step kept applied (:class:`PlanFit`);
* :mod:`.compile_budget`: torch.compile's whole-model ``activation_memory_budget`` fitted to bytes
  (:class:`CompileBudgetFit`); :mod:`.compiled_blocks`: compiling a chain's blocks in place;
* :mod:`.compiled_choice`: :func:`fit_compiled`, the faster compiled route that fits (:class:`CompiledFit`);
* :mod:`.advice`: :func:`advise`, whether the model fits, which plan fits, and whether the memory freed buys a
  larger batch.
"""

from __future__ import annotations

from .advice import advise, model_state_bytes
from .compile_budget import DEFAULT_BUDGETS, CompileBudgetFit, fit_compile_budget
from .compiled_blocks import compile_blocks, uncompile_blocks
from .compiled_choice import CompiledFit, fit_compiled
from .measured_fit import PlanFit, fit
from .trial import Fit, Trial

__all__ = [
    "DEFAULT_BUDGETS",
    "CompileBudgetFit",
    "CompiledFit",
    "Fit",
    "PlanFit",
    "Trial",
    "advise",
    "compile_blocks",
    "fit_compile_budget",
    "fit",
    "fit_compiled",
    "model_state_bytes",
    "uncompile_blocks",
]
