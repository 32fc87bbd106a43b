"""Compiled training within a byte budget, by whichever of the two compiled routes measures faster.

Below the peak of ``torch.compile(model)`` a compiled step fits a byte budget in one of two ways:

* **whole model**: ``torch.compile(model)`` under the ``activation_memory_budget`` fraction fitted to the bytes by
  measurement (:func:`remat.fitting.compile_budget.fit_compile_budget`). One graph, so nothing is lost at
  block edges, but the least peak its fractions reach is a floor (0.37 to 0.62 of the unbudgeted peak on the
  peers benchmark's models, ``docs/results/compiled-partitions.md``).
* **blocks**: remat's ``optimal`` plan on compiled blocks with partition variants
  (:func:`remat.fitting.compiled_blocks.compile_blocks`): a graph and a budget per block, which reaches
  lower peaks.

Which is faster where both fit depends on the model (within a few percent either way round in that document). A
third contender may join: remat's **eager** plan for the same bytes, made and measured by the caller
(``remat.fit(..., compile=True)`` passes the plan of its whole-step fit), so that compiling is chosen only where it
measures faster. :func:`fit_compiled` measures the compiled routes on the caller's step: each route's peak by the
allocator's events, then their steps head to head with ``torch.compile``'s unbudgeted step in interleaved rounds; it
leaves the model set up for the faster route that fits and returns a :class:`CompiledFit`. Every whole-model
fraction whose peak fits runs in those rounds, not only the one the grid's own few trial steps ranked first: where a
step is long and noisy (bf16 matmuls emulated on a CPU) those few steps misrank fractions whose steps differ by a
third.

Invariants, enforced here:

1. One meter, one step: every route's peak (the eager plan's too) is ``remat.measure(..., allocations=True)`` of the
   same training step (:func:`remat.chains.training_step.timed_step`), and a route fits when its *measured* peak
   does. A blocks plan predicted to fit but measured over is planned again (up to ``REPLANS`` times), each time for
   the byte budget less the most a prediction has missed by so far.
2. The model ends set up for the chosen route only. ``"whole model"``: no plan applied and no block compiled;
   ``CompiledFit.module`` is the compiled wrapper. ``"blocks"``: the plan applied to the compiled blocks; ``module``
   is the model and ``handle`` the plan's. ``"eager"``: the eager plan applied to the plain blocks. Parameter
   gradients and the RNG state are as they were; after an error the model is as it came.
3. The model comes plain (no plan applied, no block compiled; else ValueError): both routes start from it.
4. A route whose step runs out of the device's memory is measured, not fatal: a whole-model budget so is refused
   (invariant 3 of :mod:`remat.fitting.compile_budget`; the unbudgeted step too, which then leaves the head to head,
   the contenders' ratios read against the first that fits); the blocks are compiled under every block
   checkpointed where the step keeping them does not fit, and a blocks plan that runs out of memory is planned
   again for less, as one measured over.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import nn

from ..chains import resolve_blocks, timed_step
from ..checkpointing import remove_partitions, restore_partitions
from ..core import (
    CHECKPOINT,
    KEEP,
    Action,
    AutocastArg,
    Batch,
    BlocksArg,
    BudgetError,
    StepSpec,
    autocast_spec,
    format_bytes,
    normalize_budget,
)
from ..meters import model_device, within_memory
from ..planning import Plan, make_plan
from ..profiling import profile, step_aside
from ..runtime import RematHandle, apply, owner_of
from .compile_budget import (
    DEFAULT_BUDGETS,
    NO_BUDGET,
    OUT_OF_MEMORY,
    CompileBudgetFit,
    budget_bytes,
    choose_budget,
    fitting_trials,
    least_peak_trial,
    measured_grid,
)
from .compiled_blocks import compile_blocks, uncompile_blocks
from .trial import Fit, Trial, fastest, head_to_head, over, peak_of, with_ratios

WHOLE_MODEL, BLOCKS, EAGER = "whole model", "blocks", "eager"
DEFAULT_PARTITIONS: tuple[float, ...] = (0.1, 0.25, 0.5)
REPLANS = 2  # plans of the blocks made again after one measured over its budget
_REFERENCE = "torch.compile, no budget"


@dataclass(frozen=True)
class CompiledFit(Fit):
    """The trial chosen for ``max_bytes``, what to train (``module``), and every route as measured: the
    unbudgeted reference, each whole-model budget that fits (or one refused trial), the blocks. ``budgets`` holds
    the whole-model grid's trials (every fraction's peak and step; ``budgets.refit(other_bytes)`` chooses among
    them for another byte budget); ``plan`` and ``handle`` are the blocks route's, None for the whole model."""

    module: nn.Module = field(repr=False)
    budgets: CompileBudgetFit | None = field(repr=False)  # None where no whole-model budget ran
    plan: Plan | None = None
    handle: RematHandle | None = field(default=None, repr=False)

    heading: ClassVar[str] = "compiled within {max_bytes}"
    reference: ClassVar[str | None] = _REFERENCE

    @property
    def route(self) -> str:
        """``"whole model"`` or ``"blocks"``."""
        return self.chosen.name

    @property
    def budget(self) -> float | None:
        """The whole model's ``activation_memory_budget`` where that route was chosen, else None."""
        return self.chosen.budget


def fit_compiled(
    model: nn.Module,
    batch: Batch,
    max_bytes: int | float | str,
    *,
    step: StepSpec | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    blocks: BlocksArg = None,
    budgets: Sequence[float] | None = None,
    whole: CompileBudgetFit | None = None,
    partition_budgets: Sequence[float] = DEFAULT_PARTITIONS,
    backend: str | Callable[..., Any] = "inductor",
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    dynamic: bool | None = None,
    autocast: AutocastArg = None,
    rounds: int = 5,
    clock: Callable[[], float] = time.perf_counter,
    holds_output: bool | None = None,
    set_to_none: bool = True,
    eager: Plan | None = None,
) -> CompiledFit:
    """Measure both compiled routes of ``model`` on ``batch`` under ``max_bytes`` and set the model up for the
    faster that fits (module docstring): ``torch.compile``'s whole-model budget (fractions ``budgets``, default
    ``DEFAULT_BUDGETS``, as :func:`fit_compile_budget`) and remat's ``optimal`` plan on compiled blocks (the chain
    ``blocks`` or :func:`remat.find_blocks`'s, each also compiled under ``partition_budgets``). ``max_bytes``:
    bytes, a string like ``"2GiB"``, or a float in (0, 1], a fraction of the unbudgeted compiled step's measured
    peak.

    ``rounds``: at most this many timed steps per contender, head to head (trial rule 2), and per budget in the
    whole-model trials; ``step`` (or its fields ``loss_fn``, ``blocks``, ``autocast``, ``holds_output`` as
    keywords) and ``clock`` are :func:`remat.profile`'s, ``backend``, ``mode``, ``options``, ``dynamic``
    ``torch.compile``'s, ``set_to_none`` how the loop clears gradients (:func:`fit_compile_budget`).
    ``whole``: the whole-model trials already measured for this model (or a copy with its weights) on this batch and
    settings, by :func:`fit_compile_budget` or an earlier call's ``CompiledFit.budgets``: reused instead of
    compiling and measuring the grid again, so fitting several byte budgets measures it once (give ``budgets`` or
    ``whole``, not both). ``eager``: remat's eager plan for the same bytes (the caller's): a third contender, its
    peak measured as the others', chosen where it measures fastest or where no compiled route fits. Raises
    :class:`remat.BudgetError` (``floor``: the least peak either route reached) when no route fits."""
    spec = StepSpec.of(step, loss_fn=loss_fn, blocks=blocks, autocast=autocast, holds_output=holds_output)
    loss_fn, blocks, autocast, holds_output = spec.loss_fn, spec.blocks, spec.autocast, spec.holds_output
    if normalize_budget(max_bytes) is None:  # fit_compile_budget below is given the unbudgeted peak instead
        raise ValueError("max_bytes is None: give bytes, a string like '2GiB' or a fraction in (0, 1]")
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: at least one timed step per route is needed")
    if whole is not None and budgets is not None:
        raise ValueError(
            "give budgets (the whole-model grid to measure) or whole (trials already measured), not both: "
            f"whole holds budgets {[t.budget for t in whole.trials[1:]]}"
        )
    partitions = sorted({Action.partition(b).budget for b in partition_budgets})
    chain = resolve_blocks(model, blocks)
    _refuse_prepared(model, chain)
    compile_options: dict[str, Any] = {"backend": backend, "mode": mode, "options": options, "dynamic": dynamic}
    if whole is not None:
        grid, backends = whole.trials, dict(whole.backends)
    else:
        grid, backends = measured_grid(
            model, batch, replace(spec, blocks=None), DEFAULT_BUDGETS if budgets is None else budgets, backend, mode,
            options, dynamic, rounds, clock, set_to_none,
        )  # fmt: skip
    measured = whole
    if measured is None and any(t.peak_bytes is not None for t in grid):  # the grid kept for refit, with its choice
        measured = choose_budget(grid, NO_BUDGET, backends, dynamic)
    reference_peak = grid[0].peak_bytes
    limit = budget_bytes(max_bytes, grid)
    autocast_setting = autocast_spec(autocast, model_device(model).type)

    def timed(module: nn.Module) -> float:
        torch.manual_seed(0)  # every contender draws what the others draw
        return timed_step(module, batch, loss_fn, autocast_setting, clock, holds_output, set_to_none)

    routes = _Routes(model, chain, timed, eager)
    device = model_device(model)
    try:
        with step_aside(model):
            whole_trials = _whole_routes(grid, limit)
            eager_trial = None
            if eager is not None:  # measured on the plain blocks, before any is compiled
                routes.eager()
                peak = peak_of(lambda: timed(model), device, allocations=True)  # Invariant 1: the same meter
                eager_trial = Trial(EAGER, f"plan {eager.action_counts()}", plan=eager, peak_bytes=peak,
                                    predicted_bytes=eager.predicted_peak_bytes, refused=over(peak, limit))  # fmt: skip
                routes.undo()
            if routes.prepare_blocks(partitions, compile_options):
                costs = profile(model, batch, step=replace(spec, blocks=chain), clock=clock)
                blocks_trial = routes.plan_blocks(costs, limit)
            else:
                blocks_trial = Trial(BLOCKS, "remat optimal", refused=f"with every block checkpointed {OUT_OF_MEMORY}")
            reference = Trial(_REFERENCE, "no activation_memory_budget", peak_bytes=reference_peak,
                              refused="" if reference_peak is not None else OUT_OF_MEMORY)  # fmt: skip
            trials = [reference, *whole_trials, blocks_trial]
            if eager_trial is not None:
                trials.append(eager_trial)
            if all(t.refused for t in trials[1:]):
                raise _neither_fits(limit, reference_peak, trials[1:])
            wrappers = {  # the reference first where it ran (invariant 4): the ratios' denominator
                t.label: torch.compile(model, backend=backends[NO_BUDGET if t.budget is None else t.budget],
                                       dynamic=dynamic)
                for t in trials if t.name in (_REFERENCE, WHOLE_MODEL) and not t.refused
            }  # fmt: skip
            ratios = routes.head_to_head(
                wrappers, blocks=not blocks_trial.refused,
                eager=eager_trial is not None and not eager_trial.refused, rounds=rounds,
            )  # fmt: skip
            trials = with_ratios(trials, ratios)
            chosen = fastest(trials[1:], by=lambda t: t.step_ratio or 0.0)
            assert chosen is not None
            module = routes.finish(chosen.name, wrappers.get(chosen.label))
    except BaseException:
        routes.undo()
        raise
    planned = chosen.name in (BLOCKS, EAGER)
    return CompiledFit(
        limit, chosen, tuple(trials), module, measured, chosen.plan if planned else None,
        routes.handle if planned else None,
    )  # fmt: skip


class _Routes:
    """The model in one route's state at a time: blocks compiled with a plan applied, plain for the whole-model
    wrappers, or plain with the eager plan applied (the blocks' compiled calls set aside, so switching back
    recompiles nothing)."""

    def __init__(
        self,
        model: nn.Module,
        chain: list[tuple[str, nn.Module]],
        step: Callable[[nn.Module], float],
        eager: Plan | None = None,
    ) -> None:
        self.model, self.chain, self.step = model, chain, step
        self.handle: RematHandle | None = None
        self.plan: Plan | None = None
        self.set_aside: list[Any] | None = None
        self.eager_plan = eager
        self.eager_handle: RematHandle | None = None

    def prepare_blocks(self, partitions: Sequence[float], compile_options: dict[str, Any]) -> bool:
        """Compile the blocks and run a step that compiles their calls: keeping every block, or where that runs
        out of memory, checkpointing every one (invariant 4). False where neither step fits the device."""
        self.plan = Plan({fqn: KEEP for fqn, _ in self.chain})
        self.handle = apply(self.model, self.plan, blocks=self.chain)
        compile_blocks(self.model, self.chain, partition_budgets=partitions, **compile_options)
        device = model_device(self.model)
        if not within_memory(lambda: self.step(self.model), device)[1]:  # compiles the blocks' own calls
            return True
        self.plan = Plan({fqn: CHECKPOINT for fqn, _ in self.chain})
        self.handle.set_plan(self.plan)
        return not within_memory(lambda: self.step(self.model), device)[1]

    def plan_blocks(self, costs: Any, limit: int) -> Trial:
        """remat's optimal plan for ``limit``, applied and measured (Invariant 1: replanned while over)."""
        assert self.handle is not None
        budget, plan, peak, missed = limit, None, None, 0
        device = model_device(self.model)

        def measured() -> int:  # a variant the profile did not run compiles in the untimed step
            return peak_of(lambda: self.step(self.model), device, allocations=True)

        for _ in range(1 + REPLANS):
            try:
                plan = make_plan(costs, "optimal", budget)
            except BudgetError as err:
                least = f"least predicted peak {format_bytes(err.floor)}" if err.floor else str(err)
                refused = f"no plan fits ({least})"
                return Trial(BLOCKS, "remat optimal", predicted_bytes=err.floor, refused=refused)
            self.handle.set_plan(plan)
            self.plan = plan
            peak = within_memory(measured, device)[0]
            if peak is not None and peak <= limit:
                break
            predicted = plan.predicted_peak_bytes or limit
            # out of memory: the budget a sixteenth lower than this try's
            missed = max(missed, peak - predicted if peak is not None else limit - budget + budget // 16)
            budget = limit - missed
        assert plan is not None
        if peak is None:
            return Trial(BLOCKS, f"plan {plan.action_counts()}", plan=plan, predicted_bytes=plan.predicted_peak_bytes,
                         refused=f"{OUT_OF_MEMORY} {1 + REPLANS} times")  # fmt: skip
        refused = "" if peak <= limit else f"measured over {format_bytes(limit)} {1 + REPLANS} times"
        trial = Trial(BLOCKS, f"plan {plan.action_counts()}", plan=plan, peak_bytes=peak,
                      predicted_bytes=plan.predicted_peak_bytes, refused=refused)  # fmt: skip
        return trial

    def eager(self) -> None:
        if self.eager_handle is None and self.eager_plan is not None:
            self.whole_model()
            self.eager_handle = apply(self.model, self.eager_plan, blocks=self.chain)

    def _eager_off(self) -> None:
        if self.eager_handle is not None:
            self.eager_handle.remove()
            self.eager_handle = None

    def whole_model(self) -> None:
        self._eager_off()
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
            # the compiled calls and the partition variants (a plan's actions would swap them back in)
            self.set_aside = [(block._compiled_call_impl, remove_partitions(block)) for _, block in self.chain]
            for _, block in self.chain:
                block._compiled_call_impl = None

    def blocks(self) -> None:
        self._eager_off()
        if self.handle is None and self.set_aside is not None and self.plan is not None:
            for (_, block), (call, variants) in zip(self.chain, self.set_aside, strict=True):
                block._compiled_call_impl = call
                restore_partitions(block, variants)
            self.handle = apply(self.model, self.plan, blocks=self.chain)

    def head_to_head(
        self, wrappers: dict[str, nn.Module], blocks: bool, eager: bool, rounds: int
    ) -> dict[str, tuple[float, ...]]:
        """Per contender, its step over the reference's in each of ``rounds`` interleaved rounds (the order
        reversed every other round, the whole-model wrappers next to each other to switch the model's state
        least), after one step of each untimed (a wrapper's first call on this model may compile)."""

        def run(name: str) -> float:
            if name == BLOCKS:
                self.blocks()
                return self.step(self.model)
            if name == EAGER:
                self.eager()
                return self.step(self.model)
            self.whole_model()
            return self.step(wrappers[name])

        # the reference first: fit_compiled builds it first
        names = [*wrappers, *([BLOCKS] if blocks else []), *([EAGER] if eager else [])]
        return head_to_head(names, run, rounds)

    def finish(self, route: str, whole: nn.Module | None) -> nn.Module:
        """Leave the model in ``route``'s state only (Invariant 2); return what to train."""
        if route == BLOCKS:
            self.blocks()
            return self.model
        if route == EAGER:
            self.undo()
            self.eager()
            self.handle, self.eager_handle = self.eager_handle, None
            return self.model
        assert whole is not None
        self.undo()
        return whole

    def undo(self) -> None:
        """The model as it came: no plan, no compiled block."""
        self._eager_off()
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        uncompile_blocks(self.chain)


def _whole_routes(grid: Sequence[Trial], limit: int) -> list[Trial]:
    """A trial per whole-model budget whose measured peak fits ``limit``, the grid's fastest first, or one refused
    trial naming the least peak (or why none ran)."""
    fitting = fitting_trials(grid, limit)
    if fitting:
        return [
            Trial(WHOLE_MODEL, f"activation_memory_budget {t.budget:g}", budget=t.budget, peak_bytes=t.peak_bytes)
            for t in sorted(fitting, key=lambda t: t.step_s or 0.0)
        ]
    if all(t.peak_bytes is None for t in grid):
        return [Trial(WHOLE_MODEL, "every activation_memory_budget", refused=f"none ran ({grid[-1].refused})")]
    least = least_peak_trial(grid)
    return [
        Trial(
            WHOLE_MODEL, f"least peak at activation_memory_budget {least.budget:g}", budget=least.budget,
            peak_bytes=least.peak_bytes, refused="no activation_memory_budget fits",
        )
    ]  # fmt: skip


def _neither_fits(limit: int, reference: int | None, trials: Sequence[Trial]) -> BudgetError:
    floors = [b for t in trials for b in (t.peak_bytes or t.predicted_bytes,) if b is not None]
    reasons = "; ".join(f"{t.name}: {t.refused}" for t in trials)
    against = (f"{limit / reference:.2f} of torch.compile's peak {format_bytes(reference)}" if reference is not None
               else f"torch.compile's step without a budget {OUT_OF_MEMORY}")  # fmt: skip
    return BudgetError(
        f"no compiled route fits {format_bytes(limit)} ({against}): {reasons}. Give more bytes, partition budgets "
        "nearer 0 (partition_budgets=), or train eagerly with remat.plan(costs, 'optimal', budget)",
        floor=min(floors) if floors else None,
    )


def _refuse_prepared(model: nn.Module, chain: Sequence[tuple[str, nn.Module]]) -> None:
    """Invariant 3."""
    if owner_of(model) is not None:
        raise ValueError(
            "fit_compiled takes a model without a plan applied: call handle.remove() first (it sets up the route "
            "it chooses itself)"
        )
    compiled = [fqn for fqn, block in chain if getattr(block, "_compiled_call_impl", None) is not None]
    if compiled:
        raise ValueError(
            f"fit_compiled takes a model whose blocks are not compiled, and {compiled[:3]} are: call "
            "remat.integrations.compile.uncompile_blocks(chain) first (it compiles the route it chooses itself)"
        )
