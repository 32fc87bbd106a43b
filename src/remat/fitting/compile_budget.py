"""torch.compile's whole-model activation memory budget, fitted to a byte budget by measurement.

``torch._functorch.config.activation_memory_budget`` is a fraction of what torch's partitioner saves without a
budget, for one graph: not a byte count. What a fraction saves depends on the graph (on the peers benchmark's
Llama, ``docs/results/compiled-partitions.md``, 0.05 kept 0.37 of the unbudgeted peak, 0.5 kept 0.66), and 0
can cost more than no budget: the compiled backward is one graph, and what it recomputes is alive in it at once.
:func:`fit_compile_budget` compiles the whole model under each budget of a grid, measures each step's peak
activation memory (the allocator's events, ``remat.measure(..., allocations=True)``) and its time, and returns
the fastest budget whose measured peak fits (:class:`CompileBudgetFit`), or raises :class:`remat.BudgetError`
naming the least peak it measured.

One graph takes one budget (torch's ``torch.autograd.graph.region_activation_memory_budget`` must cover a whole graph
too), so a byte budget below what the whole-model grid reaches needs a graph per block: ``compile_blocks(model,
partition_budgets=...)`` and ``remat.plan(costs, "optimal", ...)`` (:mod:`remat.checkpointing.compiled_partitions`)
reach lower peaks, at the price of compiling blocks instead of the model.

Invariants, enforced here:

1. Exact steps: every budget tried keeps what the forward draws. Under inductor with a budget in (0, 1) the compiled
   step saves the forward's random seeds (:func:`remat.checkpointing.compiled_partitions.save_draws_pass`), so the
   backward regenerates the forward's dropout masks; on a model whose step draws random numbers, a budget whose
   compilation cannot save them (0, or a backend other than inductor) is not tried, and the fit says why.
2. The model is left as it was: parameter gradients, the RNG state and the module itself (the trials compile
   wrappers, ``torch.compile(model, ...)``; the model is not compiled in place).
3. A budget whose step runs out of the device's memory is a measurement: its trial is refused with
   :data:`OUT_OF_MEMORY` and the others are measured. Where the step without a budget is one of them, a fraction
   has nothing to be a fraction of, but 1 (every budget that ran fits the device, so it stays below the
   unbudgeted step's peak): the fit chooses among those that ran, and another fraction is refused for bytes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import nn

from ..chains import interleaved_rounds, timed_step
from ..checkpointing import RandomDraws, budgeted_backend, saves_draws_under
from ..core import (
    AutocastArg,
    Batch,
    BudgetError,
    StepSpec,
    autocast_spec,
    format_bytes,
    normalize_budget,
    parse_budget,
)
from ..meters import measure, model_device, within_memory
from ..profiling import step_aside
from .trial import Fit, Trial, fastest, over

DEFAULT_BUDGETS: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7)
NO_BUDGET = 1.0
OUT_OF_MEMORY = "ran out of the device's memory"  # invariant 3: a trial refused so


NAME = "torch.compile"


@dataclass(frozen=True)
class CompileBudgetFit(Fit):
    """The fastest budget whose measured peak fits ``max_bytes``, every trial (one per budget, ``trial.budget``;
    1.0 is torch.compile's default, no budget), and the backend that compiles each."""

    backends: Mapping[float, Callable[..., Any]] = field(repr=False)
    dynamic: bool | None = None

    heading: ClassVar[str] = "activation_memory_budget fitted to {max_bytes}"
    reference: ClassVar[str | None] = f"{NAME} at {NO_BUDGET:g}"

    @property
    def budget(self) -> float:
        assert self.chosen.budget is not None
        return self.chosen.budget

    @property
    def backend(self) -> Callable[..., Any]:
        """The ``torch.compile`` backend of the chosen budget."""
        return self.backends[self.budget]

    def refit(self, max_bytes: int | float | str) -> CompileBudgetFit:
        """The fit for another byte budget, chosen from the same measurements (nothing compiles or runs)."""
        return choose_budget(self.trials, max_bytes, self.backends, self.dynamic)

    def compile(self, model: nn.Module, budget: float | None = None) -> nn.Module:
        """``torch.compile(model)`` under the chosen budget, or under ``budget``, one the trials ran (the backend
        the fit measured, already compiled)."""
        if budget is not None and budget not in self.backends:
            raise ValueError(f"budget {budget:g} was not run: the trials ran {sorted(self.backends)}")
        backend = self.backend if budget is None else self.backends[budget]
        return torch.compile(model, backend=backend, dynamic=self.dynamic)


def fit_compile_budget(
    model: nn.Module,
    batch: Batch,
    max_bytes: int | float | str,
    *,
    step: StepSpec | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    budgets: Sequence[float] = DEFAULT_BUDGETS,
    backend: str | Callable[..., Any] = "inductor",
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    dynamic: bool | None = None,
    autocast: AutocastArg = None,
    rounds: int = 3,
    clock: Callable[[], float] = time.perf_counter,
    holds_output: bool | None = None,
    set_to_none: bool = True,
) -> CompileBudgetFit:
    """Compile the whole ``model`` under no budget and under each of ``budgets``, measure one training step of
    each on ``batch`` (peak activation bytes by the allocator's events; then ``rounds`` rounds of one timed step
    per budget, interleaved, read from ``clock``: the median) and return the fastest whose peak fits
    ``max_bytes``: bytes, a string like ``"2GiB"``, or a float in (0, 1], a fraction of the unbudgeted
    compiled step's measured peak.

    ``step`` (or its fields ``loss_fn``, ``autocast``, ``holds_output`` as keywords) and ``batch`` are those of
    :func:`remat.profile` (the whole model is compiled, so the step's ``blocks`` play no part); ``backend``,
    ``mode``, ``options`` and ``dynamic`` those of ``torch.compile``. ``set_to_none``: how the training loop
    clears gradients (``optimizer.zero_grad()``'s default, True, or in place): a compiled backward returns every
    parameter's gradient at its end, and gradients kept from the last step add them at the peak of graphs that
    recompute much. Each budget compiles once (seconds to a
    minute on a CPU), and dynamo keeps every compiled entry: its recompile limit is raised to hold them, so that
    :meth:`CompileBudgetFit.compile` reuses the chosen one; :meth:`CompileBudgetFit.refit` chooses for another
    byte budget from the same measurements. Raises :class:`remat.BudgetError` (``floor``: the least peak
    measured) when no budget fits."""
    spec = StepSpec.of(step, loss_fn=loss_fn, autocast=autocast, holds_output=holds_output)
    if normalize_budget(max_bytes) is None:  # checked before anything compiles
        raise ValueError("max_bytes is None: give bytes, a string like '2GiB' or a fraction in (0, 1]")
    trials, backends = measured_grid(model, batch, spec, budgets, backend, mode, options, dynamic, rounds, clock,
                                     set_to_none)  # fmt: skip
    return choose_budget(trials, max_bytes, backends, dynamic)


def measured_grid(
    model: nn.Module,
    batch: Batch,
    spec: StepSpec,
    budgets: Sequence[float],
    backend: str | Callable[..., Any],
    mode: str | None,
    options: dict[str, Any] | None,
    dynamic: bool | None,
    rounds: int,
    clock: Callable[[], float],
    set_to_none: bool,
) -> tuple[tuple[Trial, ...], dict[float, Callable[..., Any]]]:
    """:func:`fit_compile_budget`'s measurements, before any choice: a trial per budget, no budget first (each
    refused where it did not run, invariants 1 and 3), and the backend that compiled each that ran."""
    loss_fn, holds_output = spec.loss_fn, spec.holds_output
    candidates = _check_budgets(budgets)
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: at least one timed step per budget is needed")
    device = model_device(model)
    autocast_setting = autocast_spec(spec.autocast, device.type)
    dynamo = torch._dynamo.config
    dynamo.cache_size_limit = max(dynamo.cache_size_limit, 8 * (1 + len(candidates)))
    skipped: dict[float, str] = {}
    peaks: dict[float, int] = {}
    steps: dict[float, Callable[[], float]] = {}
    backends: dict[float, Callable[..., Any]] = {}
    with step_aside(model):
        draws = False
        for budget in (NO_BUDGET, *candidates):
            if draws and not saves_draws_under(backend, options, budget):
                skipped[budget] = _WHY_NOT_EXACT.format(backend=backend)
                continue
            backends[budget] = budgeted_backend(backend, mode, options, dynamic, budget)
            compiled = torch.compile(model, backend=backends[budget], dynamic=dynamic)

            def step(compiled: nn.Module = compiled) -> float:
                return timed_step(compiled, batch, loss_fn, autocast_setting, clock, holds_output, set_to_none)

            def first_steps(step: Callable[[], float] = step) -> tuple[int, bool]:
                torch.manual_seed(0)  # every step draws what the others draw (seeded outside RandomDraws' watch)
                with RandomDraws(device) as drawn:
                    step()  # compiles
                torch.manual_seed(0)
                with measure(device, allocations=True) as meter:
                    step()
                return meter.activation_bytes, drawn.seen

            measured, out_of_memory = within_memory(first_steps, device)
            if measured is None:  # invariant 3
                skipped[budget] = OUT_OF_MEMORY
                continue
            draws = draws or measured[1]
            if draws and budget != NO_BUDGET and not saves_draws_under(backend, options, budget):
                skipped[budget] = _WHY_NOT_EXACT.format(backend=backend)  # the first to run drew (invariant 1)
                continue
            peaks[budget], steps[budget] = measured[0], step

        def seeded(budget: float) -> float:
            torch.manual_seed(0)
            return steps[budget]()

        seconds = interleaved_rounds(list(steps), seeded, rounds)
    trials = [
        Trial(NAME, budget=b, refused=skipped[b] if skipped[b] == OUT_OF_MEMORY else f"not tried: {skipped[b]}")
        if b in skipped
        else Trial(NAME, "no activation_memory_budget" if b == NO_BUDGET else "", budget=b, peak_bytes=peaks[b],
                   step_s=statistics.median(seconds[b]))  # fmt: skip
        for b in (NO_BUDGET, *candidates)
    ]
    return tuple(trials), {b: backends[b] for b in peaks}


def choose_budget(
    trials: tuple[Trial, ...],
    max_bytes: int | float | str,
    backends: Mapping[float, Callable[..., Any]],
    dynamic: bool | None,
) -> CompileBudgetFit:
    """The fastest trial whose peak fits ``max_bytes`` (a fraction: of the unbudgeted trial's peak)."""
    assert trials[0].budget == NO_BUDGET
    limit = budget_bytes(max_bytes, trials)
    trials = tuple(t if t.peak_bytes is None else replace(t, refused=over(t.peak_bytes, limit)) for t in trials)
    chosen = fastest(trials, by=lambda t: t.step_s or 0.0)
    if chosen is None and all(t.peak_bytes is None for t in trials):
        raise BudgetError(
            "no activation_memory_budget of the whole compiled model ran ("
            + "; ".join(f"{t.budget:g}: {t.refused}" for t in trials)
            + "). Lower peaks need a graph per block (compile_blocks and remat's plan, which fit_compiled measures "
            "too), a smaller batch, or remat's eager plans (remat.fit without compile=)"
        )
    if chosen is None:
        least = least_peak_trial(trials)
        skipped = [t for t in trials if t.peak_bytes is None]
        reference = trials[0].peak_bytes
        raise BudgetError(
            f"no activation_memory_budget of the whole compiled model fits {format_bytes(limit)}: the least peak "
            f"measured is {format_bytes(least.peak_bytes or 0)} (budget {least.budget:g}; without one "
            f"{format_bytes(reference) if reference is not None else OUT_OF_MEMORY})"
            + (f"; budgets {[t.budget for t in skipped]} were not run ({skipped[0].refused})" if skipped else "")
            + ". One graph takes one budget; lower peaks need a graph per block: "
            "remat.integrations.compile.compile_blocks(model, partition_budgets=[...]) and "
            "remat.plan(remat.profile(model, batch), 'optimal', budget); fit_compiled(model, batch, budget) measures "
            "both routes and takes the faster that fits",
            floor=least.peak_bytes,
        )
    return CompileBudgetFit(limit, chosen, trials, dict(backends), dynamic)


def budget_bytes(max_bytes: int | float | str, trials: Sequence[Trial]) -> int:
    """``max_bytes`` in bytes, a fraction read against the first trial's peak (the step without a budget). Where
    that step did not run, 1 reads as the largest peak of those that ran (invariant 3), and another fraction is
    refused."""
    ran = [t.peak_bytes for t in trials if t.peak_bytes is not None]
    reference = trials[0].peak_bytes
    fraction = normalize_budget(max_bytes)
    if reference is None and isinstance(fraction, float):
        if fraction == NO_BUDGET and ran:
            return max(ran)
        raise ValueError(
            f"max_bytes={max_bytes!r} is a fraction of the compiled step's peak without a budget, and that step "
            f"{OUT_OF_MEMORY}: give bytes, an int or a string like '2GiB'"
        )
    limit = parse_budget(max_bytes, reference)
    assert limit is not None
    return limit


def fitting_trials(trials: Sequence[Trial], limit: int) -> list[Trial]:
    """The trials that ran and whose measured peak is at most ``limit`` bytes, in their order."""
    return [t for t in trials if t.peak_bytes is not None and t.peak_bytes <= limit]


def least_peak_trial(trials: Sequence[Trial]) -> Trial:
    """The trial that ran with the least measured peak."""
    return min((t for t in trials if t.peak_bytes is not None), key=lambda t: t.peak_bytes or 0)


_WHY_NOT_EXACT = (
    "the model draws random numbers and {backend!r} under this budget may draw them again in the backward; "
    "inductor with a budget in (0, 1) keeps them"
)


def _check_budgets(budgets: Sequence[float]) -> list[float]:
    candidates = []
    for budget in budgets:
        if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0.0 <= budget < 1.0:
            raise ValueError(
                f"budget {budget!r}: activation memory budgets are fractions in [0, 1) (1, no budget, is always "
                "tried), like (0.05, 0.1, 0.3)"
            )
        if float(budget) not in candidates:
            candidates.append(float(budget))
    if not candidates:
        raise ValueError("budgets is empty: give the activation memory budgets to try, like (0.05, 0.1, 0.3)")
    return candidates
