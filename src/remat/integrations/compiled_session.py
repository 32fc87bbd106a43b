"""The handle ``remat.fit(model, memory, batch=..., compile=True)`` returns: the fastest route whose whole step
fits the memory, eager or compiled, set up on the model in place.

The routes are :func:`remat.fitting.fit_memory_compiled`'s: remat's eager plan, ``torch.compile`` of the whole
model under the ``activation_memory_budget`` fitted to the bytes, and remat's plan on compiled blocks with
per-block partitions. The chosen route is set up so that the training loop keeps calling ``model``:

* ``"eager"``: the plan applied to the plain blocks;
* ``"blocks"``: the blocks compiled in place (``module.compile()``) with the plan applied;
* ``"whole model"``: the model compiled in place (``model.compile()``) with the backend of the chosen budget.

``remove()`` gives back the plain model (no plan, nothing compiled), Hugging Face's flag and ``use_cache`` or
Megatron-Core's recompute where they were on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..chains import in_train_mode, resolve_blocks, run_step
from ..core import CostTable, StepSpec, autocast_spec
from ..fitting import CompiledMemoryFit, fit_memory_compiled, uncompile_blocks, warn_if_on_host
from ..meters import model_device
from ..planning import Plan
from ..profiling import step_aside
from ..runtime import RecomputeStats
from .session import OwnRecomputeOff

COMPILE_OPTIONS = frozenset({"backend", "mode", "options", "dynamic", "budgets", "partition_budgets", "rounds"})


class CompiledSession:
    """What ``remat.fit(..., compile=True)`` set up: ``route``, ``plan`` (None on the whole model's route),
    ``costs``, ``stats``, ``fitted`` (every route as measured), ``describe()`` and ``remove()``."""

    def __init__(
        self,
        model: nn.Module,
        memory: int | str,
        *,
        batch: Any,
        optimizer: torch.optim.Optimizer | None,
        step: StepSpec,
        compile_options: dict[str, Any],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        unknown = set(compile_options) - COMPILE_OPTIONS
        if unknown:
            raise TypeError(f"compile= takes {sorted(COMPILE_OPTIONS)}, not {sorted(unknown)}")
        self.model = model
        self.memory = memory
        self._chain = resolve_blocks(model, step.blocks)
        self._own_recompute = OwnRecomputeOff(model)
        # Hugging Face's KV cache in a training step is memory no plan recomputes: off, as the HF door does.
        self._config = getattr(model, "config", None)
        self._use_cache = getattr(self._config, "use_cache", None)
        if self._use_cache:
            self._config.use_cache = False
        with in_train_mode(model, "remat.fit"):
            try:
                self.fitted: CompiledMemoryFit = fit_memory_compiled(
                    model, batch, memory, optimizer=optimizer, step=step, clock=clock, **compile_options
                )
            except BaseException:
                self._flags_on()
                raise
            compiled = self.fitted.compiled
            self._handle = compiled.handle
            if self.route == "whole model":
                # In place, so that the loop keeps calling the model: the backend the fit measured for the budget,
                # compiled now by one step (gradients and RNG put back), so that the time to plan counts it.
                begun = time.perf_counter()
                model.compile(backend=compiled.budgets.backends[compiled.budget], dynamic=compiled.budgets.dynamic)
                device = model_device(model)
                with step_aside(model):
                    run_step(model, batch, step.loss_fn, autocast=autocast_spec(step.autocast, device.type),
                             holds_output=step.holds_output)  # fmt: skip
                self.fitted.seconds["compiling the model in place"] = time.perf_counter() - begun
        self._removed = False

    @property
    def route(self) -> str:
        """``"eager"``, ``"whole model"`` or ``"blocks"``."""
        return self.fitted.route

    @property
    def plan(self) -> Plan | None:
        """The plan on the blocks (eager or compiled); None where the whole model is compiled."""
        return self.fitted.compiled.plan

    @property
    def costs(self) -> CostTable | None:
        """The eager plan's profile, where an eager plan was made."""
        eager = self.fitted.eager
        return eager.costs if eager is not None else None

    @property
    def stats(self) -> RecomputeStats:
        """Block re-executions in backward (none are counted where the whole model is compiled)."""
        if self._handle is not None:
            return self._handle.stats
        return RecomputeStats([fqn for fqn, _ in self._chain])

    @property
    def removed(self) -> bool:
        return self._removed

    def describe(self) -> str:
        """The route, the memory, what is fixed and every route as measured."""
        return self.fitted.describe()

    def remove(self) -> None:
        """The plain model back: no plan, nothing compiled, Hugging Face's flag as it was."""
        if self._removed:
            return
        if self._handle is not None:
            self._handle.remove()
        uncompile_blocks(self._chain)
        self.model._compiled_call_impl = None
        self._flags_on()
        self._removed = True

    def _flags_on(self) -> None:
        self._own_recompute.restore()
        if self._use_cache:
            self._config.use_cache = self._use_cache

    def __repr__(self) -> str:
        return f"CompiledSession(route={self.route!r}, memory={self.memory!r})"


def check_compile_arguments(memory: Any, batch: Any, strategy: str, given: dict[str, Any],
                            call: str = "remat.fit(model, '22GiB', batch=..., compile=True)") -> None:  # fmt: skip
    """``compile=`` fits the whole step's memory with a sample batch: both given, and nothing of the eager doors'
    own (``given``: an activation budget, a plan, costs, plan options; a value of None or False is not given)."""
    named = [name for name, value in given.items() if value is not None and value is not False]
    if memory is None or batch is None or named or strategy != "optimal":
        raise ValueError(
            f"compile=True fits the whole step's memory with a sample batch: {call}, with no activations=, "
            f"budget=, plan=, costs=, strategy or plan options (given: {named})"
        )


def compiled_route(
    model: nn.Module,
    memory: int | str | None,
    *,
    batch: Any,
    optimizer: torch.optim.Optimizer | None,
    step: StepSpec,
    compile: bool | dict[str, Any],  # noqa: A002 (torch's word for it)
    strategy: str = "optimal",
    **given: Any,
) -> CompiledSession:
    """``remat.fit(..., compile=...)`` and ``hf.enable(..., compile=...)``: the arguments checked (memory and a
    sample batch; nothing of the eager doors' own, ``given``), a model compiled in place or with compiled blocks
    made plain (the fit compiles the route it chooses), then the :class:`CompiledSession`."""
    clock = given.pop("clock", time.perf_counter)
    check_compile_arguments(memory, batch, strategy, given)
    warn_if_on_host(model_device(model), "remat.fit")
    compile_options = compile if isinstance(compile, dict) else {}
    model._compiled_call_impl = None
    uncompile_blocks(resolve_blocks(model, step.blocks))
    return CompiledSession(model, memory, batch=batch, optimizer=optimizer, step=step,
                           compile_options=compile_options, clock=clock)  # fmt: skip
