"""A plan whose whole training step fits the device's memory, found by measuring: ``remat.fit``'s work.

:func:`fit_memory` (a sample batch at hand) measures the plain step whole first (:mod:`.whole_step`, rule 3
there): where it fits, every block is kept and nothing is profiled. Otherwise it profiles (a segment's price
only once a plan for the budget holds a segment: :func:`remat.profiling.price_segments`), takes the measured
bytes beyond the predicted activations (parameters, gradients in flight, optimizer state, buffers, the loss's
temporaries) from the plain step, plans the activations within what is left by :func:`~.measured_fit.fit`
(the measured-step choice between near-ties), and measures the chosen plan's whole step; a plan that
measures over the memory lowers the activation budget by its overshoot and is planned again.
:func:`activation_budget` is the same arithmetic from a first training step already profiled, where no step
can be re-run (``remat.fit`` without a batch): gradients are then counted in full. :func:`fit_memory_compiled`
(``remat.fit(..., compile=True)``) turns the same memory into the bytes a step may add to what is resident and
lets the eager plan compete with the compiled routes (:func:`remat.fitting.fit_compiled`) for them.

Invariants, enforced here:

1. The plan returned measured a whole step within ``memory`` (with a batch), or was predicted to with every
   gradient counted (without one); nothing over ``memory`` is returned silently.
2. Where no plan fits, :class:`MemoryFitError` is raised before any training step: it names the least device
   memory any plan reaches at this batch (the plan of least predicted activations, its whole step measured: a
   memory of at least that fits), the fixed parts by name and size, what the plans can change, and the
   levers (a smaller batch, computed; ``allow_lossy=True``; offload where the device has a host).
3. The model ends with no hooks of the fit's (the caller applies the plan) and its gradients and RNG state as
   they were; :func:`fit_memory_compiled` leaves it set up for the route it chose, and only for that one.
4. A device the plain step does not fit at all is the case the fit is for: a step that runs out of memory
   (``torch.OutOfMemoryError``) is measured as over the memory (:mod:`.whole_step`, rule 4), the profile is then
   taken with every block checkpointed (:mod:`remat.profiling.profiler`, invariant 1), the step's bytes beyond
   the activations start as the fixed memory with every gradient counted, and a plan whose step runs out of
   memory lowers the budget as one measured over it does. Where even that profile's step runs out of memory,
   :class:`MemoryFitError` says so, with the levers, before any training step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import nn

from ..chains import resolve_blocks, run_step
from ..checkpointing import PROFILED_BY_DEFAULT
from ..core import KEEP, Batch, BudgetError, CostTable, StepSpec, autocast_spec, format_bytes
from ..meters import model_device, within_memory
from ..planning import Plan, make_plan, minimum_peak_bytes, no_checkpoint_peak, simulate
from ..profiling import cached_profile, keep_profile, price_segments
from ..runtime import RematHandle, apply
from .compiled_choice import CompiledFit, fit_compiled
from .measured_fit import candidate_trials
from .measured_fit import fit as fit_activations
from .whole_step import FixedMemory, MemoryArg, StepPeak, device_memory, fixed_memory, whole_step_peak

ATTEMPTS = 4  # plans measured over the memory before giving up (each lowers the budget by its overshoot)


class StepWrapper(Protocol):
    """A wrapper whose forward the training step calls (a DeepSpeed engine), around the model a fit plans."""

    module: nn.Module  # the wrapper itself: whole steps are measured through it

    def held_off(self) -> AbstractContextManager[Any]:
        """The wrapper's hooks on the model held off while the fit runs the model on its own."""
        ...

    def step(self) -> AbstractContextManager[Any]:
        """One forward and backward through the wrapper, run as one of its steps."""
        ...


class MemoryFitError(BudgetError):
    """Rule 2: no plan makes the whole step fit the memory; the message says what is fixed and what to do.
    ``costs``: the profile the plans were made from (None where the fixed memory alone is too large)."""

    costs: CostTable | None = None


@dataclass(frozen=True)
class MemoryFit:
    """The plan for ``memory`` and the figures it was chosen by (bytes; seconds in ``seconds``)."""

    memory: int
    fixed: FixedMemory
    plan: Plan
    costs: CostTable | None
    plain: StepPeak | None  # the plain step measured whole (None without a batch)
    measured: StepPeak | None  # the plan's step measured whole (None without a batch)
    activation_budget: int | None  # what the activations were planned within (None: the plain step fits)
    non_activation: int  # the step's bytes beyond the predicted activations
    seconds: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        """A few lines: the memory, what is fixed, the plan and what its step measured."""
        lines = [f"memory {format_bytes(self.memory)} for the whole step; fixed: {self.fixed.describe()}"]
        if self.activation_budget is None:
            lines.append("the plain step fits: every block kept, nothing profiled")
        else:
            lines.append(
                f"activations planned within {format_bytes(self.activation_budget)} "
                f"(the step's other bytes: {format_bytes(self.non_activation)})"
            )
        if self.plain is not None and self.plain.out_of_memory:
            past = format_bytes(self.plain.whole)
            lines.append(f"plain step did not fit the device (it ran out of memory past {past})")
        elif self.plain is not None:
            lines.append(f"plain step measured {format_bytes(self.plain.whole)}")
        if self.measured is not None and self.activation_budget is not None:
            lines.append(f"planned step measured {format_bytes(self.measured.whole)}")
        lines.append(f"plan: {self.plan.action_counts()}")
        if self.seconds:
            lines.append("time to plan: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items()))
        return "\n".join(lines)


def batch_size(batch: Batch) -> int | None:
    """The leading dimension of the batch's first tensor (None where it has none)."""
    if torch.is_tensor(batch):
        return int(batch.shape[0]) if batch.dim() else None
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, list | tuple) else ()
    for value in values:
        size = batch_size(value)
        if size is not None:
            return size
    return None


def keep_all(model: nn.Module, blocks: Any) -> Plan:
    """Every block of the chain kept."""
    return Plan({fqn: KEEP for fqn, _ in resolve_blocks(model, blocks)}, strategy="keep")


def fit_memory(
    model: nn.Module,
    batch: Batch,
    memory: MemoryArg,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    step: StepSpec | None = None,
    costs: CostTable | None = None,
    policies: str | tuple[str, ...] = PROFILED_BY_DEFAULT,
    rounds: int = 5,
    clock: Callable[[], float] = time.perf_counter,
    through: StepWrapper | None = None,
    **options: Any,
) -> MemoryFit:
    """The fastest plan whose whole step on ``batch`` measures within ``memory`` (module docstring).

    ``options`` go to :func:`remat.plan` (``allow_lossy=True``...); with options the measured choice between
    the two ``optimal`` plans is skipped. ``through``: the wrapper whose forward the training step calls (a
    DeepSpeed engine, :class:`StepWrapper`): whole steps run through it, so that its buckets are measured, and
    its hooks are held off while the fit runs ``model`` on its own (profiles, trials); plans are ``model``'s.
    Raises :class:`MemoryFitError` where nothing fits."""
    with through.held_off() if through is not None else nullcontext():
        return _fit_memory(model, batch, memory, optimizer, step, costs, policies, rounds, clock, through, options)


def _fit_memory(
    model: nn.Module,
    batch: Batch,
    memory: MemoryArg,
    optimizer: torch.optim.Optimizer | None,
    step: StepSpec | None,
    costs: CostTable | None,
    policies: str | tuple[str, ...],
    rounds: int,
    clock: Callable[[], float],
    through: StepWrapper | None,
    options: dict[str, Any],
) -> MemoryFit:
    spec = step or StepSpec()
    device = model_device(model)
    limit = device_memory(memory, device)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    fixed = fixed_memory(model, optimizer)
    _refuse_fixed_over(limit, fixed)
    setting = autocast_spec(spec.autocast, device.type)

    def run() -> None:
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else None, device_type=device.type):
            if through is None:
                run_step(model, batch, spec.loss_fn, autocast=setting, holds_output=spec.holds_output)
                return
            with through.step():
                run_step(through.module, batch, spec.loss_fn, autocast=setting, holds_output=spec.holds_output)

    plain = whole_step_peak(model, run, fixed, spec.accumulates)
    seconds["plain step"] = time.perf_counter() - start
    if plain.within(limit):  # every block kept; a profile given is kept with the plan, none is taken
        beyond = plain.whole if costs is None else _beyond_activations(plain, fixed, costs)
        return MemoryFit(limit, fixed, keep_all(model, spec.blocks), costs, plain, plain, None, beyond, seconds)
    if costs is None:  # on a device the plain step does not fit, profiled with every block checkpointed
        begun = time.perf_counter()
        costs, _ = within_memory(
            lambda: cached_profile(model, batch, step=spec, policies=policies, price_segments=False), device
        )
        if costs is None:
            raise _checkpointed_out_of_memory(limit, fixed, batch_size(batch), device, plain)
        seconds["profile"] = time.perf_counter() - begun
    # Invariant 4: a plain step that ran out of memory measured nothing beyond the activations: every gradient
    # counted, as without a batch, until a plan's whole step is measured.
    non_activation = fixed.total if plain.out_of_memory else _beyond_activations(plain, fixed, costs)
    floor = minimum_peak_bytes(costs)
    begun = time.perf_counter()
    for _ in range(ATTEMPTS):
        budget = limit - non_activation
        if budget < floor:
            break
        plan = _plan_within(model, batch, budget, costs, spec, rounds, clock, options, policies)
        if plan is None:  # every candidate measured over the activation budget
            non_activation += max(1, budget // 32)
            continue
        handle = applied(model, plan, spec)
        try:
            measured = whole_step_peak(model, run, fixed, spec.accumulates)
        finally:
            handle.remove()
        if measured.within(limit):
            seconds["fit"] = time.perf_counter() - begun
            return MemoryFit(limit, fixed, plan, costs, plain, measured, budget, non_activation, seconds)
        # The plan's peak came where more of the step's other bytes were live (gradients later in the backward):
        # what it measured beyond its predicted activations is the figure to plan with. A step that ran out of
        # memory measured a floor only: the budget goes down by its overshoot over the floor, at least a step.
        beyond = measured.forward_backward - simulate(costs, plan.actions).peak_bytes
        overshoot = measured.whole - limit if not measured.out_of_memory else max(measured.whole - limit, budget // 16)
        non_activation = max(beyond, non_activation + max(1, overshoot))
    # Invariant 2: the least named is a measured one. The plan of least predicted activations is measured whole
    # (its bytes beyond the activations can exceed the plain step's, where its peak falls later in the backward).
    least = make_plan(costs, "optimal", floor)
    handle = applied(model, least, spec)
    try:
        measured = whole_step_peak(model, run, fixed, spec.accumulates)
    finally:
        handle.remove()
    non_activation = max(non_activation, measured.forward_backward - simulate(costs, least.actions).peak_bytes)
    raise _infeasible(limit, fixed, costs, non_activation, batch_size(batch), device, measured.whole)


def activations_within(fitted: MemoryFit, costs: CostTable) -> int:
    """The activation bytes ``fitted``'s memory leaves at every shape: the memory less the step's bytes beyond its
    activations (what the fit measured beyond them, or, where the plain step fitted, what the plain step measured
    beyond ``costs``' prediction)."""
    if fitted.activation_budget is not None:
        return fitted.activation_budget
    if fitted.plain is None:
        raise ValueError("the memory fit measured no step: no activation budget can be read from it")
    return fitted.memory - _beyond_activations(fitted.plain, fitted.fixed, costs)


def _beyond_activations(plain: StepPeak, fixed: FixedMemory, costs: CostTable) -> int:
    """The plain step's measured bytes beyond its predicted activations (never less than what stays resident
    through the forward and backward)."""
    return max(plain.forward_backward - no_checkpoint_peak(costs), fixed.resident)


def _plan_within(
    model: nn.Module,
    batch: Batch,
    budget: int,
    costs: CostTable,
    spec: StepSpec,
    rounds: int,
    clock: Callable[[], float],
    options: dict[str, Any],
    policies: str | tuple[str, ...],
) -> Plan | None:
    """The plan for an activation ``budget``: ``optimal`` with ``options``, else the measured choice between
    near-ties (None where every candidate measured over the budget). Where ``costs`` left a segment's price
    unmeasured and the plan holds a segment, the price is measured (:func:`remat.profiling.price_segments`), kept
    in the machine's cache, and the plan made again."""

    def candidates() -> list[Plan]:
        if options:
            return [make_plan(costs, "optimal", budget, **options)]
        return [trial.plan for trial in candidate_trials(costs, budget) if trial.plan is not None]

    try:
        plans = candidates()
        if price_segments(model, batch, costs, plan=plans[0], step=spec, clock=clock):
            keep_profile(model, batch, costs, step=spec, policies=policies)
            plans = candidates()
    except BudgetError:
        if options:  # the planner's own error, as with options it always was
            raise
        return None
    if len(plans) == 1:  # the profile tells the plans apart: nothing to run head to head; its whole step is next
        return plans[0]
    try:
        chosen, _ = within_memory(
            lambda: fit_activations(model, batch, budget, costs=costs, step=spec, rounds=rounds, clock=clock),
            model_device(model),
        )
    except BudgetError:
        return None
    if chosen is None:  # a near-tie's step the device does not hold: the budget goes down
        return None
    chosen.handle.remove()
    return chosen.plan


def applied(model: nn.Module, plan: Plan, spec: StepSpec) -> RematHandle:
    """``plan`` applied to the chain ``spec`` names (several chains joined, as the runtime takes them)."""
    return apply(model, plan, step=replace(spec, blocks=resolve_blocks(model, spec.blocks)))


def activation_budget(
    memory: int,
    fixed: FixedMemory,
    costs: CostTable,
    *,
    non_activation: int | None = None,
    batch: int | None = None,
    device: torch.device | None = None,
) -> int:
    """Rule 1 without a batch to measure: the activations' share of ``memory`` beyond ``non_activation`` (a
    measured figure, or by default the fixed memory with every gradient counted), or :class:`MemoryFitError`
    where no plan reaches it."""
    if non_activation is None:
        non_activation = fixed.total
    _refuse_fixed_over(memory, fixed)
    budget = memory - non_activation
    if budget < minimum_peak_bytes(costs):
        raise _infeasible(memory, fixed, costs, non_activation, batch, device or torch.device(costs.device))
    return budget


def _refuse_fixed_over(limit: int, fixed: FixedMemory) -> None:
    """Rule 2: the fixed memory alone (and its optimizer step's temporaries) over ``limit`` is refused."""
    least = fixed.total + fixed.optimizer_step_bytes
    if least <= limit:
        return
    raise MemoryFitError(
        f"remat.fit: the fixed memory of the step alone is {format_bytes(least)} ({fixed.describe()}), above the "
        f"memory of {format_bytes(limit)}; no checkpointing plan changes it. Shard the parameters and optimizer "
        "state (FSDP2's fully_shard, DeepSpeed ZeRO), train in lower precision, or use an optimizer with less "
        "state",
        floor=least,
    )


def _checkpointed_out_of_memory(limit: int, fixed: FixedMemory, size: int | None, device: torch.device,
                                plain: StepPeak) -> MemoryFitError:  # fmt: skip
    """Invariant 4: the step with every block checkpointed ran out of the device's memory too (the profile's),
    so no plan of remat's reaches the memory at this batch; what is known is said, and the levers."""
    batch = f" of {size}" if size else ""
    smaller = f"a batch of {size // 2} or fewer; " if size and size > 1 else ""
    offload = "; the 'offload' action (saved tensors in host memory)" if device.type == "cuda" else ""
    return MemoryFitError(
        f"remat.fit: at this batch{batch} even the step with every block checkpointed ran out of the device's "
        f"memory (the plain step ran out past {format_bytes(plain.whole)}); no checkpointing plan fits "
        f"{format_bytes(limit)}. Fixed: {fixed.describe()}. Next: {smaller}allow_lossy=True (compressed "
        f"activations; gradients no longer exact){offload}; shard the parameters and optimizer state",
        floor=None,
    )


def _infeasible(
    limit: int,
    fixed: FixedMemory,
    costs: CostTable,
    non_activation: int,
    size: int | None,
    device: torch.device,
    measured_least: int = 0,
) -> MemoryFitError:
    least_activations = minimum_peak_bytes(costs)
    least = max(non_activation + least_activations, measured_least, fixed.total + fixed.optimizer_step_bytes)
    levers = []
    room = limit - non_activation
    if size and room > 0:
        fitting = math.floor(size * room / least_activations)
        if 0 < fitting < size:
            levers.append(f"a batch of {fitting} (activations scale with the batch: about {format_bytes(room)} left)")
        elif fitting < 1:
            levers.append("not even a batch of 1 fits by these figures")
    levers.append("allow_lossy=True (compressed activations; gradients no longer exact)")
    if device.type == "cuda":
        levers.append("the 'offload' action (saved tensors kept in host memory, at the cost of the copies)")
    error = MemoryFitError(
        f"remat.fit: no plan fits {format_bytes(limit)} at this batch"
        + (f" of {size}" if size else "")
        + f"; the least any plan reaches is {format_bytes(least)}. Fixed: {fixed.describe()}; the step's other "
        f"bytes beyond activations: {format_bytes(non_activation)}. The plans change the activations only: "
        f"{format_bytes(no_checkpoint_peak(costs))} with every block kept, {format_bytes(least_activations)} at the "
        f"least. Next: {'; '.join(levers)}",
        floor=least,
    )
    error.costs = costs
    return error


@dataclass(frozen=True)
class CompiledMemoryFit:
    """The route chosen for ``memory`` among the eager plan and the compiled ones, and the figures it was chosen
    by: ``step_bytes``, what the memory leaves for the bytes a step adds to what is resident (every route's
    measured peak is held to it); ``eager``, remat's eager whole-step fit (None where no eager plan fits)."""

    memory: int
    fixed: FixedMemory
    compiled: CompiledFit
    step_bytes: int
    eager: MemoryFit | None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def route(self) -> str:
        """``"eager"``, ``"whole model"`` or ``"blocks"``."""
        return self.compiled.route

    def describe(self) -> str:
        lines = [
            f"memory {format_bytes(self.memory)} for the whole step; fixed: {self.fixed.describe()}",
            f"the step's own bytes within {format_bytes(self.step_bytes)}; route: {self.route}",
            self.compiled.describe(),
        ]
        if self.seconds:
            lines.append("time to plan: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items()))
        return "\n".join(lines)


def fit_memory_compiled(
    model: nn.Module,
    batch: Batch,
    memory: MemoryArg,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    step: StepSpec | None = None,
    clock: Callable[[], float] = time.perf_counter,
    **compile_options: Any,
) -> CompiledMemoryFit:
    """The fastest route whose whole step on ``batch`` fits ``memory``: remat's eager plan (:func:`fit_memory`),
    ``torch.compile`` of the whole model under a fitted budget, or remat's plan on compiled blocks
    (:func:`remat.fitting.fit_compiled`, which takes ``compile_options``: ``backend``, ``mode``, ``options``,
    ``dynamic``, ``budgets``, ``partition_budgets``, ``rounds``), chosen by their steps measured head to head. The
    model is left set up for the chosen route (the whole model's compiled wrapper is ``compiled.module``). Raises
    :class:`MemoryFitError` where no route fits, naming the least memory any reaches."""
    spec = step or StepSpec()
    device = model_device(model)
    limit = device_memory(memory, device)
    seconds: dict[str, float] = {}
    fixed = fixed_memory(model, optimizer)
    _refuse_fixed_over(limit, fixed)
    begun = time.perf_counter()
    eager: MemoryFit | None = None
    eager_error: MemoryFitError | None = None
    try:
        eager = fit_memory(model, batch, memory, optimizer=optimizer, step=spec, clock=clock)
    except MemoryFitError as error:
        eager_error = error
    seconds["eager fit"] = time.perf_counter() - begun
    begun = time.perf_counter()
    try:
        compiled = fit_compiled(model, batch, limit - fixed.resident, step=spec, clock=clock,
                                eager=eager.plan if eager is not None else None, **compile_options)  # fmt: skip
    except BudgetError as error:
        floors = [error.floor + fixed.resident] if error.floor is not None else []
        if eager_error is not None and eager_error.floor is not None:
            floors.append(eager_error.floor)
        raise MemoryFitError(
            f"remat.fit(compile=True): no route fits {format_bytes(limit)}. Eager: "
            f"{eager_error if eager_error is not None else 'fits'}. Compiled: {error}",
            floor=min(floors) if floors else None,
        ) from error
    seconds["compiled routes (compiling included)"] = time.perf_counter() - begun
    return CompiledMemoryFit(limit, fixed, compiled, limit - fixed.resident, eager, seconds)
