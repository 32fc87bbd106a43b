"""The contenders of the peers benchmark: what a user would run at a byte budget, and remat's answers.

A :class:`Contender` is one way of running the same training step on its own copy of the model (same
weights): the forward it calls, what to switch before a step (outside the timed region), the context around
forward and backward, and what follows the backward inside the timed region (PGAC's update). Contenders
that produce the same computation at several budgets (``remat full`` is one plan whatever the budget) are
built once and share one key; a :class:`Row` puts a contender at a budget in the table.

Peers, written as a user writes them:

* no checkpointing, twice (an A/A pair: the noise floor of the timings);
* ``torch.utils.checkpoint`` around the forward of the first ``k`` of ``n`` blocks (:class:`HandCheckpointed`),
  plain or selective with ``create_selective_checkpoint_contexts`` and a policy that saves matmul and
  attention outputs; ``k`` is chosen later, by measurement, as the smallest that fits;
* ``torch.compile`` of the whole model, without and with ``torch._functorch.config.activation_memory_budget``.

remat, through its public API: ``remat.profile`` once, then ``remat.plan`` + ``remat.apply`` for the static
strategies and ``optimal``, ``remat.fitting.measured_fit.fit`` (``optimal`` with and without per-operator policies, the
faster on the step), ``remat.PGAC`` and ``remat.DTR`` at the budget; and ``optimal`` on compiled blocks
(``remat.integrations.compile.compile_blocks`` with :data:`PARTITION_BUDGETS`), planned from ``remat.profile``
of the compiled-block model (what the compiled graphs save and how long they take, under keep, checkpoint and
each partition budget, on blocks without random draws), ``torch.compile`` of the whole model under the
``activation_memory_budget`` that ``remat.integrations.compile.fit_compile_budget`` measures fastest among
those whose peak fits (its trials run once per model and precision), and remat's compiled answer at the budget,
``remat.integrations.compile.fit_compiled`` on a copy of its own: whichever of those two routes (the fitted
whole-model budget, the plan on compiled blocks) measures faster on the step and fits. Compiled contenders are
measured with ``remat.measure(allocations=True)`` (the allocator's events), which sees compiled code and
leaves it compiled, where eager ones use the live-tensor tracker.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import remat
from remat.bench import uniform_plan
from remat.checkpointing import budgeted_backend
from remat.fitting import CompileBudgetFit, CompiledFit, PlanFit, compile_blocks
from remat.planning import no_checkpoint_peak

EAGER = "eager"
COMPILED = "compiled"
# torch.compile's activation memory budgets each compiled block is also compiled under (partition:<budget> actions)
PARTITION_BUDGETS = (0.1, 0.25, 0.5)
FITTED = "torch.compile, budget fitted by remat"
FIT_COMPILED = "remat.fit(compile=True)"
FIT = "remat fit"
WHOLE_BUDGET_NOTE = "the partitioner's recomputation changes the kernels (rounding); dropout masks are kept"

aten = torch.ops.aten
# What a user's "save the matmuls" policy names: matrix products and the attention kernels, the CPU's and
# CUDA's (flash, memory-efficient, cuDNN), those this torch has.
ATTENTION_OPS = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
MATMUL_OPS = frozenset(
    op
    for op in (
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        *(getattr(aten, name, None) for name in ATTENTION_OPS),
    )
    if op is not None
)


def _overloads(ops: frozenset[Any]) -> frozenset[Any]:
    """Packets (``aten._scaled_dot_product_flash_attention_for_cpu``) become their ``.default`` overload."""
    return frozenset(getattr(op, "default", op) for op in ops)


SAVED_OPS = _overloads(MATMUL_OPS)


def save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A selective-checkpointing policy: keep the outputs of matmuls and attention, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def matmul_saving_contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(save_matmuls)


@dataclass
class Contender:
    """One way of running the training step. ``group`` names its reference: eager or compiled no checkpointing."""

    key: str
    name: str
    group: str
    model: nn.Module
    forward: Callable[..., Any]
    grad_reference: str
    exact: bool = True
    tracker: bool = True
    allocations: bool = False  # measured with remat.measure(allocations=True) (compiled code) instead
    detail: str = ""
    note: str = ""
    select: Callable[[], None] = lambda: None
    step_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    after_backward: Callable[[], None] = lambda: None
    info: Callable[[], dict[str, Any]] = field(default=lambda: {})
    plan: Callable[[], remat.Plan | None] = lambda: None  # remat's plan the next step runs, where one exists
    costs: remat.CostTable | None = None  # the profile that plan is predicted from (None: the eager one)
    own_s: Callable[[], float] = lambda: 0.0  # seconds of its own work in a step, added to the plan's prediction


@dataclass(frozen=True)
class Row:
    """A contender at a budget (``budget`` None: a reference row, the same at every budget)."""

    budget: float | None
    key: str
    name: str
    group: str


@dataclass(frozen=True)
class Refused:
    """A contender that could not be set up at a budget, and why."""

    budget: float
    name: str
    group: str
    reason: str


# -------------------------------------------------------------------------------------------- hand-written


class HandCheckpointed:
    """What a user writes: each block's forward wrapped so that the chosen blocks (the first ``k``, or a planner's
    choice) run under ``torch.utils.checkpoint`` (non-reentrant; ``selective`` adds the matmul-saving policy)."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        self.model = model
        self.n = len(blocks)
        self.mode, self.chosen = "plain", frozenset[int]()
        for i, block in enumerate(blocks):
            block.forward = functools.partial(self._forward, i, block.forward)

    def _forward(self, index: int, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if index not in self.chosen or not torch.is_grad_enabled():
            return original(*args, **kwargs)
        if self.mode == "selective":
            return checkpoint(original, *args, use_reentrant=False, context_fn=matmul_saving_contexts, **kwargs)
        return checkpoint(original, *args, use_reentrant=False, **kwargs)

    def use(self, mode: str, k: int) -> None:
        self.use_blocks(mode, [i < k for i in range(self.n)])

    def use_blocks(self, mode: str, checkpointed: Sequence[bool]) -> None:
        if len(checkpointed) != self.n:
            raise ValueError(f"{len(checkpointed)} choices for {self.n} blocks")
        self.mode, self.chosen = mode, frozenset(i for i, c in enumerate(checkpointed) if c)


HAND_NAMES = {"plain": "torch checkpoint, first k blocks", "selective": "torch selective (matmuls saved), first k"}


def hand_contender(hand: HandCheckpointed, mode: str, k: int) -> Contender:
    return Contender(
        key=f"hand-{mode}-k{k}", name=HAND_NAMES[mode], group=EAGER, model=hand.model, forward=hand.model,
        grad_reference="none", detail=f"k={k}/{hand.n}", select=lambda: hand.use(mode, k),
    )


def ckptplan_contender(hand: HandCheckpointed, checkpointed: Sequence[bool]) -> Contender:
    """A plan ckptplan made: the blocks it checkpoints under ``torch.utils.checkpoint`` as its own
    ``CheckpointedSequential`` runs them (non-reentrant, RNG state preserved), inside the model's forward; plans
    alike at several budgets share the contender."""
    detail = "".join("C" if c else "K" for c in checkpointed)
    return Contender(
        key=f"ckptplan-{detail}", name="ckptplan (PyPI) plan", group=EAGER, model=hand.model, forward=hand.model,
        grad_reference="none", detail=detail, select=lambda: hand.use_blocks("plain", checkpointed),
    )


# --------------------------------------------------------------------------------------------- the factory


SELECTIVE_CODES = {"selective:dots_saveable": "S", "selective:dots_every_other_saveable": "E",
                   "selective:all_but_pointwise_saveable": "A", "selective:attention_saveable": "T"}


def short_actions(plan: remat.Plan) -> str:
    """``keep,checkpoint,segment:0,...`` as ``KCG..``: K keep, C checkpoint, S selective saving matmuls, E saving
    every other matmul, A all but pointwise ops, T attention outputs (another policy: s), G segment, M
    memory-poor group, N nested, O offload, P partition of a compiled block."""
    codes = {"keep": "K", "checkpoint": "C", "offload": "O", **SELECTIVE_CODES}
    prefixes = {"selective": "s", "segment": "G", "memory_poor": "M", "nested": "N", "partition": "P"}
    out = []
    for action in plan.actions.values():
        out.append(codes.get(action) or prefixes.get(action.split(":", 1)[0], "?"))
    return "".join(out)


class ContenderSet:
    """Builds every contender of one (model, precision) from one base model and its remat CostTable."""

    def __init__(self, base: nn.Module, blocks_of: Callable[[nn.Module], list[nn.Module]], costs: remat.CostTable,
                 backend: str, compiled_costs: remat.CostTable | None = None) -> None:
        self.base, self.blocks_of, self.costs, self.backend = base, blocks_of, costs, backend
        self.compiled_costs = compiled_costs  # remat.profile of the model with its blocks compiled
        self.contenders: dict[str, Contender] = {}
        self.rows: list[Row] = []
        self.refused: list[Refused] = []
        self._remat_eager: Any = None
        self._remat_compiled: Any = None
        self._dtr_model: nn.Module | None = None
        self._fit: CompileBudgetFit | None = None
        self._whole: nn.Module | None = None

    def copy(self) -> nn.Module:
        return copy.deepcopy(self.base)

    def whole_model(self) -> nn.Module:
        """The one copy every whole-model compiled contender compiles: dynamo keeps a graph per module instance and
        backend (one backend per budget), so the reference, each budget's contender and the fit's trials of the
        same budget share one compilation."""
        if self._whole is None:
            self._whole = self.copy()
        return self._whole

    def add(self, contender: Contender, budget: float | None) -> Contender:
        known = self.contenders.setdefault(contender.key, contender)
        # identical plans share one measurement; each keeps the name it was asked for
        self.rows.append(Row(budget, known.key, contender.name, known.group))
        return known

    # ----- references
    def references(self, compiled: bool = True) -> None:
        """No checkpointing, twice; with ``compiled``, also ``torch.compile`` of the whole model and remat's
        compiled blocks keeping everything (the compiled contenders' references)."""
        keep_all = remat.plan(self.costs, "none")  # remat's prediction of the plain step: every block kept
        for key, name in (("none", "no checkpointing"), ("none-aa", "no checkpointing (A/A)")):
            model = self.copy()
            self.add(Contender(key, name, EAGER, model, model, grad_reference="none", plan=lambda: keep_all), None)
        if compiled:
            self._compiled_references()

    def _compiled_references(self) -> None:
        model = self.whole_model()
        # budget 1 (torch's default) through the backend the fit's trial at 1 uses: one compilation for both
        compiled = torch.compile(model, backend=budget_backend(self.backend, 1.0))
        self.add(Contender("compiled", "torch.compile", COMPILED, model, compiled, grad_reference="compiled",
                           tracker=False, allocations=True), None)
        handle = remat.apply(model := self.copy(), remat.plan(self.costs, "none"))
        compile_blocks(model, backend=self.backend, partition_budgets=PARTITION_BUDGETS)
        self._remat_compiled = handle
        keep = handle.plan
        predicted = remat.plan(self.compiled_costs, "none") if self.compiled_costs is not None else None
        self.add(Contender("compiled-blocks", "remat: compiled blocks, keep all", COMPILED, model, model,
                           grad_reference="compiled-blocks", tracker=False, allocations=True,
                           select=lambda: handle.set_plan(keep), plan=lambda: predicted, costs=self.compiled_costs),
                 None)

    def hand_written(self) -> HandCheckpointed:
        model = self.copy()
        return HandCheckpointed(model, self.blocks_of(model))

    # ----- remat, eager
    def _static(self, name: str, plan: remat.Plan, budget: float) -> None:
        if self._remat_eager is None:
            self._remat_eager = remat.apply(self.copy(), remat.plan(self.costs, "none"))
        handle = self._remat_eager
        self.add(Contender(f"remat-{short_actions(plan)}", name, EAGER, handle.model, handle.model,
                           grad_reference="none", detail=short_actions(plan),
                           select=lambda: handle.set_plan(plan), plan=lambda: plan), budget)

    def remat_static(self, budget: float) -> None:
        budget_bytes = int(budget * no_checkpoint_peak(self.costs))
        for strategy in ("full", "sqrt", "memory_poor"):
            self._static(f"remat {strategy}", remat.plan(self.costs, strategy, budget, strict=False), budget)
        self._static("remat every_k (k fitted)", uniform_plan(self.costs, budget_bytes), budget)
        try:
            plan = remat.plan(self.costs, "optimal", budget)
        except remat.BudgetError as err:
            self.refused.append(Refused(budget, "remat optimal", EAGER, str(err)))
            return
        self._static("remat optimal", plan, budget)

    def remat_fit(self, budget: float, fit_at: Callable[[nn.Module, float], PlanFit]) -> None:
        """``remat.fitting.measured_fit.fit`` at the fraction ``budget`` on a copy of its own, planned from the eager
        profile: ``optimal`` with and without per-operator policies, run head to head where they differ;
        ``fit_at(model, budget)`` runs it."""
        model = self.copy()
        try:
            fit = fit_at(model, budget)
        except remat.BudgetError as err:
            self.refused.append(Refused(budget, FIT, EAGER, str(err)))
            return
        plan = fit.plan
        self.add(Contender(f"fit-{budget:g}", FIT, EAGER, model, model, grad_reference="none",
                           detail=short_actions(plan) + _other_candidate(fit), plan=lambda: plan,
                           info=lambda: {"choice": fit.describe()}), budget)

    def remat_pgac(self, budget: float) -> None:
        model = self.copy()
        try:
            pgac = remat.PGAC(model, budget, costs=self.costs)
        except remat.BudgetError as err:
            self.refused.append(Refused(budget, "remat PGAC", EAGER, str(err)))
            return
        self.add(Contender(f"pgac-{budget:g}", "remat PGAC", EAGER, model, model, grad_reference="none",
                           after_backward=pgac.step, info=lambda: {"plan": short_actions(pgac.plan)},
                           own_s=lambda: sum(pgac.own_seconds),
                           plan=lambda: pgac.plan), budget)

    def remat_dtr(self, budget: float) -> None:
        if self._dtr_model is None:
            self._dtr_model = self.copy()
        model = self._dtr_model
        dtr = remat.DTR(model, budget)
        self.add(Contender(f"dtr-{budget:g}", "remat DTR", EAGER, model, model, grad_reference="none",
                           step_context=lambda: dtr, info=lambda: _dtr_info(dtr)), budget)

    # ----- compiled
    def compile_budget(self, budget: float) -> None:
        model = self.whole_model()
        compiled = torch.compile(model, backend=budget_backend(self.backend, budget))
        self.add(Contender(
            f"compiled-budget-{budget:g}", "torch.compile + activation_memory_budget", COMPILED, model, compiled,
            grad_reference="compiled", tracker=False, allocations=True, exact=False, detail=f"budget={budget:g}",
            note="the partitioner's recomputation changes the kernels (rounding); budget_backend saves the "
                 "forward's seeds, so dropout masks are kept"), budget)

    def compile_fitted(self, budget: float, budget_bytes: int | None,
                       measure_fit: Callable[[nn.Module], CompileBudgetFit]) -> None:
        """``torch.compile`` of the whole model under the budget ``fit_compile_budget`` finds fastest among those
        whose measured peak fits ``budget_bytes`` (or the fraction ``budget`` of the unbudgeted peak);
        ``measure_fit(model)`` runs the trials, once, on the first budget asked for."""
        if self._fit is None:
            self._fit = measure_fit(self.whole_model())
        try:
            fit = self._fit.refit(budget_bytes or budget)
        except remat.BudgetError as err:
            self.refused.append(Refused(budget, FITTED, COMPILED, str(err)))
            return
        model = self.whole_model()
        self.add(Contender(
            f"compiled-fitted-{fit.budget:g}", FITTED, COMPILED, model, fit.compile(model), grad_reference="compiled",
            tracker=False, allocations=True, exact=False, detail=f"budget={fit.budget:g}", note=WHOLE_BUDGET_NOTE),
            budget)

    def remat_compiled(self, budget: float, budget_bytes: int | None) -> None:
        """remat's optimal plan on the compiled blocks at ``budget_bytes`` (the budget's share of the compiled
        model's own peak) or, without it, at the fraction ``budget``; planned from the profile of the compiled
        blocks (and predicted from it), or from the eager one where there is none (then without predictions)."""
        costs = self.compiled_costs or self.costs
        try:
            plan = remat.plan(costs, "optimal", budget_bytes or budget)
        except remat.BudgetError as err:
            source = (f"{budget:g} of torch.compile's measured peak" if budget_bytes
                      else f"{budget:g} of the no-checkpoint peak")
            self.refused.append(Refused(budget, "remat optimal on compiled blocks", COMPILED,
                                        f"budget = {source}: {err}"))
            return
        handle = self._remat_compiled
        predicted = plan if self.compiled_costs is not None else None
        partitioned = _partitioned(plan)
        self.add(Contender(f"compiled-blocks-{short_actions(plan)}", "remat optimal on compiled blocks", COMPILED,
                           handle.model, handle.model, grad_reference="compiled-blocks", tracker=False,
                           allocations=True, exact=not partitioned, note=PARTITION_NOTE if partitioned else "",
                           detail=short_actions(plan),
                           select=lambda: handle.set_plan(plan), plan=lambda: predicted, costs=self.compiled_costs),
                 budget)


    def remat_fit_compiled(self, budget: float, budget_bytes: int | None,
                           fit_at: Callable[[nn.Module, int | float, CompileBudgetFit | None], CompiledFit]) -> None:
        """``remat.fit(compile=True)``'s choice (``fit_compiled`` with remat's eager plan for the same bytes as a
        third route) at ``budget_bytes`` (or the fraction ``budget``) on a copy of its own, set up for the route it
        chose; ``fit_at(model, max_bytes, whole)`` runs it, reusing the whole-model trials of
        :meth:`compile_fitted` where they ran (``whole``). The blocks route's plan is predicted from the compiled
        blocks' profile and compared with keep-all on compiled blocks; the whole model with ``torch.compile``."""
        model = self.copy()
        try:
            fit = fit_at(model, budget_bytes or budget, self._fit)
        except remat.BudgetError as err:
            self.refused.append(Refused(budget, FIT_COMPILED, COMPILED, str(err)))
            return
        costs = self.compiled_costs
        if fit.route == "eager":  # remat's eager plan on the plain blocks measured fastest
            reference, exact, note = "none", True, ""
            detail, costs = f"eager: {short_actions(fit.plan)}", self.costs
        elif fit.plan is not None:  # the blocks route: its plan applied to the copy's compiled blocks
            reference, exact = "compiled-blocks", not _partitioned(fit.plan)
            detail, note = f"blocks: {short_actions(fit.plan)}", "" if exact else PARTITION_NOTE
        else:
            reference, exact = "compiled", False
            detail = f"whole model: {fit.chosen.detail.replace('activation_memory_budget ', 'budget=')}"
            note = WHOLE_BUDGET_NOTE
        predicted = fit.plan if costs is not None else None
        self.add(Contender(f"fit-compiled-{budget:g}", FIT_COMPILED, COMPILED, model, fit.module,
                           grad_reference=reference, tracker=fit.route == "eager", allocations=True, exact=exact,
                           detail=detail, note=note, plan=lambda: predicted, costs=costs,
                           info=lambda: {"choice": fit.describe()}), budget)


def _other_candidate(fit: PlanFit) -> str:
    """Where ``fit`` ran two plans: the one it did not keep, and its measured step over the kept one's."""
    other = fit.passed_over
    return f" (not {short_actions(other.plan)}: {fit.passed_over_text()})" if other is not None else ""


PARTITION_NOTE = ("partition:<budget> variants are compiled apart from keep's graph: their kernels may round "
                  "differently (reductions, casts to bf16)")


def _partitioned(plan: remat.Plan | None) -> bool:
    return plan is not None and any(a.startswith("partition:") for a in plan.actions.values())


def budget_backend(name: str, budget: float) -> Callable[..., Any]:
    """The compiler ``name`` called with ``torch._functorch.config.activation_memory_budget = budget``, as a
    backend of its own (remat's, which its partitions of compiled blocks use): dynamo keeps compiled graphs per
    backend, and two models of one class would otherwise share the graph compiled first, whatever the budget was
    then."""
    return budgeted_backend(name, None, None, None, budget)


def _dtr_info(dtr: Any) -> dict[str, Any]:
    last = dtr.stats.last_step
    return {"evictions": last.evictions, "rematerializations": last.rematerializations,
            "budget_bytes": dtr.budget_bytes}
