"""RematSession: a plan on a live model, chosen now or after the first training step, or PGAC.

The integrations (Hugging Face, Lightning, DDP/FSDP) all return a :class:`RematSession`. It owns one
:func:`remat.apply` handle (or one :class:`remat.PGAC`) and decides when the plan is made:

* ``plan=`` given: applied as it is;
* ``costs=`` given, or ``batch=`` (a sample batch, profiled with :func:`remat.profile` at once): the plan is made
  now with :func:`remat.plan`;
* neither: no example batch is needed. The first training step runs with every block checkpointed and is profiled by
  :class:`remat.profiling.profiler.BlockProfiler`; at the end of that step the cost table is complete, the plan is made
  and switched in, so it applies from the second step on. The end of the step is the first ``optimizer.step()`` of an
  optimizer that holds the model's parameters (seen through PyTorch's global optimizer hooks, so Hugging Face's
  ``Trainer`` needs no extra call), or :meth:`RematSession.step`, or at the latest the next training forward. Blocks
  compiled with ``torch.compile`` cannot be profiled this way (the profiler's tracker makes dynamo run them eagerly):
  give ``batch=`` or ``costs=`` made before compiling;
* ``strategy="pgac"``: :class:`remat.PGAC` does the same profiling itself and then re-plans after every
  optimizer step; the session attaches it to the first optimizer that steps the model's parameters.

The profiled step's live-tensor tracker (a ``TorchDispatchMode``) is open from the first forward to the end
of the step. To wrap that step in ``remat.measure()`` as well, put the optimizer step inside the measured block
(or call :meth:`RematSession.step` in it), so the modes close in the order they opened.

Under ``torch.distributed`` (``sync="global"``, the default when more than one rank runs) rank 0's measured
cost table is broadcast, so every rank runs the same plan: FSDP2 needs that, as a rank that recomputes a block
the others keep would all-gather alone. The session also says whether a model was already wrapped or sharded
(:func:`is_wrapped`, :func:`is_sharded`), so that every door refuses the wrong order, and how many ranks a
process group has (:func:`distributed_world`).
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..chains import in_train_mode, megatron_recomputes, profiled_blocks, resolve_blocks
from ..core import (
    CHECKPOINT,
    AutocastArg,
    AutocastSpec,
    CostTable,
    StepSpec,
    format_bytes,
    normalize_budget,
    precision_mismatch,
)
from ..dynamic import PGAC
from ..fitting import (
    MemoryFit,
    activation_budget,
    activations_within,
    device_memory,
    fit_memory,
    fixed_memory,
    stepping_optimizer,
    warn_if_on_host,
)
from ..meters import is_compiled, model_device
from ..planning import STRATEGIES, Buckets, Plan, ShapePlans, check_plan_options, make_plan
from ..profiling import BlockProfiler, batch_of_call, profile, profile_shapes, step_aside
from ..runtime import HandleHook, OwnsHooks, RecomputeStats, RematHandle, apply
from .deepspeed import EngineSteps

log = logging.getLogger("remat.integrations")

HF_FLAG_OFF = (
    "remat: Hugging Face gradient checkpointing was on; remat switched it off (its plan decides what is "
    "recomputed). remove() switches it back on."
)
PGAC_OPTIONS = frozenset(
    {"alpha", "q", "gamma", "every", "total_steps", "measure", "overshoot_penalty", "history_limit"}
)
SYNC_MODES = (None, "local", "global")

Blocks = Sequence[str] | Sequence[tuple[str, nn.Module]] | None


MEGATRON_RECOMPUTE_OFF = (
    "remat: Megatron-Core's recompute was on (config.recompute_granularity={!r}); remat switched it off (its plan "
    "decides what is recomputed). remove() switches it back on."
)


class OwnRecomputeOff:
    """Another library's own recomputation switched off on ``model``, with one warning each, and back on with
    :meth:`restore`: Hugging Face's ``gradient_checkpointing`` flag on every module that has it on, and Megatron-Core's
    ``config.recompute_granularity`` on every config its modules share (a plan on top of either would recompute the
    blocks twice)."""

    def __init__(self, model: nn.Module) -> None:
        self.hf_modules = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
        if self.hf_modules:
            log.warning(HF_FLAG_OFF)
        for module in self.hf_modules:
            module.gradient_checkpointing = False
        configs = {id(c): c for m in model.modules() if megatron_recomputes(c := getattr(m, "config", None))}
        self.megatron: list[tuple[Any, str]] = [(c, c.recompute_granularity) for c in configs.values()]
        for config, granularity in self.megatron:
            log.warning(MEGATRON_RECOMPUTE_OFF.format(granularity))
            config.recompute_granularity = None

    def restore(self) -> None:
        for module in self.hf_modules:
            module.gradient_checkpointing = True
        for config, granularity in self.megatron:
            config.recompute_granularity = granularity
        self.hf_modules, self.megatron = [], []


def _refuse_compiled(chain: Sequence[tuple[str, nn.Module]]) -> None:
    compiled = [fqn for fqn, m in chain if is_compiled(m)]
    if compiled:
        raise RuntimeError(
            f"blocks {compiled} are compiled (module.compile()): remat's profiler would make dynamo run them "
            "eagerly from then on. remat.fit(model, memory, batch=..., compile=True) fits the compiled routes and "
            "the eager plan and compiles the faster in place; or profile before compiling and pass costs=, or give "
            "batch= before compiling"
        )


def check_strategy(strategy: str, budget: int | float | str | None) -> None:
    """Fail early, before any training step, on an unknown strategy or a malformed budget."""
    if strategy != "pgac" and strategy not in STRATEGIES:
        known = ", ".join(sorted([*STRATEGIES, "pgac"]))
        raise ValueError(f"unknown strategy {strategy!r}; known strategies: {known}")
    if strategy == "optimal" and budget is None:
        raise ValueError(
            "strategy 'optimal' needs a budget: bytes, a string like '2GiB', or a float in (0, 1] for a fraction "
            "of the activation memory without checkpointing"
        )
    normalize_budget(budget)


ACCUMULATION_UNMEASURED = (
    "remat.fit: a second forward came before an optimizer step (gradient accumulation): after the first, each "
    "micro-batch's step runs with the gradients there and adds its own into them, a transient of up to a few "
    "parameters' gradients that a fit without a batch does not measure. Pass batch=<a micro-batch> and "
    "step=remat.StepSpec(accumulates=True) to measure it"
)
ACCUMULATION_UNMEASURED_BATCH = (
    "remat.fit: a second training forward came before the first optimizer step (gradient accumulation), and the "
    "fit measured steps of one forward and backward: from the second micro-batch on each runs with the gradients "
    "there and adds its own into them, a transient the fit did not measure, which can take the step over "
    "memory=. Fit with step=remat.StepSpec(accumulates=True) (under Hugging Face's Trainer: "
    "step=remat.integrations.hf.trainer_step(args))"
)


class RematSession(OwnsHooks):
    """A remat plan (or PGAC) on ``model``, made now or from the first training step. See the module docs.

    ``strategy``: a :data:`remat.STRATEGIES` name or ``"pgac"``; ``budget``: bytes, "2GiB" or a fraction;
    ``options`` go to :func:`remat.plan` (``k=``, ``fraction=``, ``strict=``...) or to :class:`remat.PGAC`
    (``alpha``, ``q``, ``gamma``, ``every``, ``total_steps``...). ``auto_step=False`` turns off the global
    optimizer hooks; then call :meth:`step` (or :meth:`attach`) yourself. ``step=`` (a :class:`remat.StepSpec`)
    describes the training step, or its fields are given as keywords: ``main_input``/``main_output`` name
    the hidden state a block takes and returns where remat's guess is wrong (see :mod:`remat.chains.blocks`).
    ``autocast=`` is the training precision a ``batch=`` is profiled under (as :func:`remat.profile` takes
    it). The first training forward's autocast setting is recorded (:attr:`step_autocast`); costs measured under
    another setting are warned about.
    """

    def __init__(
        self,
        model: nn.Module,
        strategy: str = "optimal",
        budget: int | float | str | None = None,
        *,
        costs: CostTable | None = None,
        batch: Any = None,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        plan: Plan | None = None,
        blocks: Blocks = None,
        sync: str | None = None,
        process_group: Any = None,
        auto_step: bool = True,
        main_input: Any = None,
        main_output: Any = None,
        autocast: AutocastArg = None,
        step: StepSpec | None = None,
        memory: int | str | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        holds_output: bool | None = None,
        **options: Any,
    ) -> None:
        spec = StepSpec.of(step, loss_fn=loss_fn, blocks=blocks, main_input=main_input, main_output=main_output,
                           autocast=autocast, holds_output=holds_output)  # fmt: skip
        blocks = spec.blocks
        if batch is not None and costs is None and plan is None and is_sharded(model):
            raise ValueError(ALREADY_SHARDED)
        if memory is not None:
            if strategy != "optimal":
                raise ValueError(
                    f"memory= (the whole step's device memory) plans with strategy 'optimal', not {strategy!r}; "
                    "other strategies take budget= (activation bytes or a fraction)"
                )
            if budget is not None:
                raise ValueError("give memory= (the whole step's device memory) or an activation budget, not both")
            device = model_device(model)
            device_memory(memory, device)  # a malformed memory fails here, not after the first step
            warn_if_on_host(device, "remat.fit")
        else:
            check_strategy(strategy, budget)
        # A DeepSpeed engine: plans go on the model it holds, whole steps are measured through it (its buckets).
        self._engine_steps = EngineSteps(model) if is_deepspeed(model) else None
        if self._engine_steps is not None:
            if memory is not None and batch is None and plan is None and costs is None:
                raise ValueError(DEEPSPEED_NEEDS_BATCH)
            if memory is not None and spec.accumulates:
                raise ValueError(
                    "step=StepSpec(accumulates=True) is not measured through a DeepSpeed engine: ZeRO accumulates the "
                    "gradients of its gradient_accumulation_steps in buffers of its own, which a measured micro-step "
                    "would change. Fit with accumulates=False and give memory= less the bytes of one set of gradients, "
                    "which its measured step does not hold through the micro-steps after the first"
                )
            if memory is not None and not self._engine_steps.zero:
                raise ValueError(DEEPSPEED_STAGE_0)
            optimizer = optimizer if optimizer is not None else model.optimizer
            model = model.module
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be None (automatic), 'local' (a plan per rank) or 'global', got {sync!r}")
        if sync is None:
            sync = "global" if distributed_world(process_group) > 1 else None
        self.model = model
        # Hugging Face's own checkpointing flag, on any door: switched off with one warning, back on at remove().
        self._own_recompute = OwnRecomputeOff(model)
        try:
            self.strategy = strategy
            self.budget = budget
            self.memory = memory
            self.optimizer = optimizer
            self._refit: Callable[[Any], Plan] | None = None  # the fit with a batch, to run again with an optimizer
            self.fitted: MemoryFit | None = None  # how the plan was fitted to memory= (None without memory=)
            self.options = dict(options)
            shapes = self.options.pop("shapes", False)
            on_overflow = self.options.pop("on_overflow", "raise")
            if strategy != "pgac":  # checked before any profile runs (PGAC checks its own below)
                plan_strategy = "optimal" if memory is not None else strategy
                fit_own = ("policies", "rounds", "clock") if memory is not None else ()
                check_plan_options(plan_strategy, self.options, also=fit_own, where="remat.fit")
            self.shape_plans: ShapePlans | None = None  # plans per input shape (shapes=True), docs/shapes.md
            if shapes and (memory is None or plan is not None or costs is not None):
                raise ValueError(
                    "shapes=True plans each input shape within memory=: it needs memory= (with batch=, the largest "
                    "batch the run will see, which is profiled and cut to smaller shapes; without, the first "
                    "training batch is), and no plan= or costs=. PGAC takes its shapes from "
                    "pgac.plan_per_shape(remat.profile_shapes(model, batch))"
                )
            # Without a batch, the first training batch is kept through its profiled step and cut to shapes then.
            self._shapes_later = (shapes, on_overflow) if shapes and batch is None else None
            self._first_batch: Any = None
            self.sync = sync
            self.process_group = process_group
            self.costs: CostTable | None = costs
            self.step_autocast: AutocastSpec | None = None  # seen in the first training forward
            self.pgac: Any = None
            self._profiler: BlockProfiler | None = None
            self._hooks: list[Any] = []
            self._global_hooks: list[Any] = []
            self._owners: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
            self._removed = False
            chain = resolve_blocks(model, blocks)
            # What profiles see: several chains stay several (planned together), else the chain; hooks go on the chain.
            self._profiled: Any = profiled_blocks(model, blocks)
            self._warned_eval = False
            self._forwards_before_optimizer = 0  # training forwards seen while a fit awaits its optimizer
            profiled_step, hooked_step = replace(spec, blocks=self._profiled), replace(spec, blocks=chain)
            self._profiled_step = profiled_step
            self._hooked_step = hooked_step  # what the handle runs; a refit applies its plan with it again

            if strategy == "pgac":
                unknown = set(options) - PGAC_OPTIONS
                if unknown:
                    raise TypeError(f"unknown PGAC options {sorted(unknown)}; PGAC takes {sorted(PGAC_OPTIONS)}")
                if plan is not None:
                    raise ValueError("strategy='pgac' makes its own plans; pass costs= or nothing, not plan=")
                if costs is None:
                    _refuse_compiled(chain)  # PGAC would profile the first step
                    if batch is not None:
                        with in_train_mode(model, "remat"):
                            self.costs = profile(model, batch, step=profiled_step)
                self.pgac = PGAC(
                    model,
                    budget,
                    costs=self.costs,
                    sync=sync,
                    process_group=process_group,
                    step=hooked_step,
                    **options,
                )
                self.handle: RematHandle = self.pgac.handle
                self._waiting = False
            else:
                if plan is None and memory is not None and self.costs is None and batch is not None:
                    _refuse_compiled(chain)
                    self._warn_without_optimizer()

                    def fitted_with(optimizer: torch.optim.Optimizer | None) -> Plan:
                        with in_train_mode(model, "remat.fit"):
                            self.fitted = fit_memory(model, batch, memory, optimizer=optimizer, step=profiled_step,
                                                     through=self._engine_steps, **self.options)  # fmt: skip
                            self.costs = self.fitted.costs
                            if shapes:
                                self.shape_plans = self._plans_per_shape(batch, profiled_step, shapes, on_overflow)
                        return self._shared_plan(self.fitted.plan)

                    plan = fitted_with(optimizer)
                    if optimizer is None:
                        self._refit = fitted_with
                        if self.costs is None:  # the plain step fitted: costs to plan with once the state counts
                            with in_train_mode(model, "remat.fit"):
                                self.costs = profile(model, batch, step=profiled_step)
                if plan is None:
                    if self.costs is None and batch is not None:
                        _refuse_compiled(chain)
                        with in_train_mode(model, "remat"):
                            self.costs = profile(model, batch, step=profiled_step)
                    if self.costs is not None:
                        self.costs = self._shared(self.costs)
                        plan = self._plan_for(self.costs)
                self._waiting = plan is None
                initial = plan if plan is not None else Plan({f: CHECKPOINT for f, _ in chain}, strategy="profiling")
                self.handle = apply(model, initial, step=hooked_step)
                self.handle.plan_per_shape(self.shape_plans)
            model._remat_session = self  # type: ignore[assignment]
            watching = self._waiting or self.pgac is not None or self._awaiting_optimizer()
            self._global_done = not (auto_step and watching)
            # removed once it has no more to do
            self._hooks.append(model.register_forward_pre_hook(HandleHook(self._on_forward), with_kwargs=True))
            if not self._global_done:
                from torch.optim.optimizer import register_optimizer_step_pre_hook

                # A weak reference: a session that is dropped without remove() leaves a hook that does nothing.
                ref = weakref.ref(self)

                def on_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                    session = ref()
                    if session is not None:
                        session._on_optimizer_step(optimizer)

                self._global_hooks.append(register_optimizer_step_pre_hook(on_step))
        except BaseException:
            self._own_recompute.restore()
            raise

    # ----- state -----
    @property
    def plan(self) -> Plan:
        """The plan the next step runs with (every block checkpointed until the first step was profiled)."""
        return self.handle.plan

    @property
    def profiling(self) -> bool:
        """True until the plan is made: the first training step is (or will be) profiled."""
        return self._waiting

    @property
    def stats(self) -> RecomputeStats:
        """Block re-executions in backward and their seconds, per block (see ``remat.apply``)."""
        return self.handle.stats

    @property
    def removed(self) -> bool:
        """True after :meth:`remove`."""
        return self._removed

    @property
    def attached(self) -> bool:
        """With PGAC: whether it is attached to an optimizer (its updates then follow ``optimizer.step()``)."""
        return self.pgac is not None and getattr(self.pgac, "_optimizer", None) is not None

    @property
    def mask(self) -> dict[str, bool]:
        """Block FQN -> True where the block's activations are stored."""
        return self.handle.mask

    # ----- step boundaries -----
    def step(self) -> None:
        """Mark the end of a training step: finish the profiling step and switch the plan in; with PGAC, update
        the scores and the mask (not needed when an optimizer step is seen or :meth:`attach` was called)."""
        self._check_live()
        if self.pgac is not None:
            self._global_done = True  # stepped by hand: PGAC is not attached to an optimizer as well
            self.pgac.step()
        elif self._profiler is not None:
            self._finish_profiling()

    def attach(self, optimizer: torch.optim.Optimizer) -> RematSession:
        """Take the end of each step from ``optimizer.step()`` only (the global hook is removed)."""
        self._check_live()
        self._remove_global_hooks()
        if self.pgac is not None:
            self.pgac.attach(optimizer)
        elif self._waiting:
            self._hooks.append(optimizer.register_step_pre_hook(lambda *_: self._end_of_step()))
        self._global_done = True
        return self

    def load_pgac_state(self, state: dict[str, Any]) -> None:
        """Resume PGAC from :meth:`remat.PGAC.state_dict` (a training checkpoint's); the session's costs are the
        loaded ones."""
        self._check_live()
        assert self.pgac is not None
        self.pgac.load_state_dict(state)
        self.costs = self.pgac.costs

    def _end_of_step(self) -> None:
        if self._profiler is not None:
            self._finish_profiling()

    def _on_forward(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if self._global_done and self._global_hooks and not self._awaiting_optimizer():
            # Removed here, outside the optimizer's loop over its hooks, which must not change while it runs.
            self._remove_global_hooks()
        training = torch.is_grad_enabled() and self.model.training
        if self._waiting and torch.is_grad_enabled() and not self.model.training:
            # A model in eval mode (what from_pretrained returns) would otherwise never end its profiling.
            if not self._warned_eval:
                self._warned_eval = True
                warnings.warn(
                    f"remat: {type(self.model).__name__} is in eval mode but its forward records gradients: remat "
                    "profiles this step as the training step. Call model.train() before training, so that dropout "
                    "and normalisation run as they will train",
                    stacklevel=3,
                )
            training = True
        if training and self.step_autocast is None:
            self._check_precision()
        if training and self._refit is not None and not self.accumulates:
            self._forwards_before_optimizer += 1
            if self._forwards_before_optimizer == 2:
                warnings.warn(ACCUMULATION_UNMEASURED_BATCH, stacklevel=3)
        if not self._waiting:
            if self._global_done and self.step_autocast is not None and not self._awaiting_optimizer():
                self._remove_hooks()
            return
        if not training:
            return
        if self._profiler is None:
            _refuse_compiled(self.handle.blocks)
            if is_sharded(self.model):
                raise RuntimeError(
                    "remat cannot profile the first step of a model sharded with fully_shard (FSDP2 frees each "
                    "block's parameters after its forward). Make the plan before sharding: pass batch=<a sample "
                    "batch> or costs= (see remat.integrations.distributed.prepare)"
                )
            # The step runs with every block checkpointed: the profile reads its figures as such.
            actions = list(self.handle.plan.actions.values())
            self._profiler = BlockProfiler(self.model, self._profiled, io=self.handle.io, step_actions=actions)
            if self._engine_steps is not None:
                self._engine_steps.allocate_bucket()  # DeepSpeed's buffer, not the step's activations
            if self._shapes_later is not None:
                self._first_batch = batch_of_call(self.model, args, kwargs)
                if self._first_batch is None:
                    self._shapes_later = None
                    warnings.warn(
                        f"remat: shapes=True needs the first training batch in a form it can run again, and "
                        f"{type(self.model).__name__}'s forward takes its positional arguments as *args, beside "
                        "keyword ones: the plan is made for this batch's shape alone. Give remat.fit a sample of the "
                        "largest batch (batch=...), or call the model with keyword arguments only",
                        stacklevel=3,
                    )
            self._profiler.__enter__()
        else:  # a second training forward before any optimizer step: the profiled step has ended
            if self.memory is not None and not self.accumulates:
                warnings.warn(ACCUMULATION_UNMEASURED, stacklevel=3)
            self._finish_profiling()

    def _check_precision(self) -> None:
        """Record the autocast setting of the first training forward; warn when the costs were measured under
        another (a first step profiled here is measured under it)."""
        self.step_autocast = AutocastSpec.current(model_device(self.model).type)
        costs = self.pgac.costs if self.pgac is not None else self.costs
        problem = precision_mismatch(costs.autocast, self.step_autocast) if costs is not None else None
        if problem:
            warnings.warn(problem, stacklevel=3)

    @property
    def accumulates(self) -> bool:
        """Whether the training loop accumulates gradients (``StepSpec.accumulates``)."""
        return self._hooked_step.accumulates

    def _awaiting_optimizer(self) -> bool:
        """Whether a plan for ``memory=`` was made before any optimizer was given or seen (a first step of several
        backwards, as gradient accumulation runs): the global hook stays until one steps the model."""
        return self.memory is not None and self.optimizer is None and self.pgac is None

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._removed or not self._owns(optimizer):
            return
        if self._awaiting_optimizer() and not self._waiting:  # a plan for memory= was made without it
            self.count_optimizer(optimizer)
            self._global_done = True
            return
        if self._global_done:
            return
        if self.optimizer is None:
            self.optimizer = optimizer  # its state counts in memory=
        if self.pgac is not None:
            # Attached from inside the step's pre-hooks: PGAC's own pre- and post-hooks run in this same step.
            if not self.attached:
                self.pgac.attach(optimizer)
            self._global_done = True
        elif self._profiler is not None:
            self._finish_profiling()

    def _owns(self, optimizer: torch.optim.Optimizer) -> bool:
        owns = self._owners.get(optimizer)
        if owns is None:
            params = {id(p) for p in self.model.parameters()}
            owns = any(id(p) in params for group in optimizer.param_groups for p in group["params"])
            # A wrapper given (DeepSpeed's ZeRO optimizer) steps its own copies through the optimizer it holds.
            owns = owns or (self.optimizer is not None and stepping_optimizer(self.optimizer) is optimizer)
            self._owners[optimizer] = owns
        return owns

    def _finish_profiling(self) -> None:
        profiler, self._profiler = self._profiler, None
        assert profiler is not None
        profiler.__exit__(None, None, None)
        costs = self._shared(profiler.cost_table())
        self.costs = costs
        plan = self._plan_for(costs)
        self.handle.set_plan(plan)
        self._waiting = False
        if self._shapes_later is not None and self._first_batch is not None:
            (shapes, on_overflow), batch, self._first_batch = self._shapes_later, self._first_batch, None
            with step_aside(self.model):  # the step's gradients and generators, as they were
                self.shape_plans = self._plans_per_shape(batch, self._profiled_step, shapes, on_overflow, fresh=True)
            self.handle.plan_per_shape(self.shape_plans)
        self._global_done = True
        log.info("remat: profiled the first step; from now on\n%s", plan.table(costs))

    def count_optimizer(self, optimizer: torch.optim.Optimizer, measure: bool = False) -> None:
        """``optimizer`` steps the model from now on: where the plan was fitted to ``memory=`` before it was known
        (none given; the Lightning callback fits at setup, before the trainer makes it), the plan is made again
        with its state and its step's temporaries counted, from the next step on. ``measure`` (outside a training
        step): a fit with a batch measures its whole steps again; else the state is added to what it measured."""
        self.optimizer = optimizer
        refit, self._refit = self._refit, None
        if measure and refit is not None:  # fitted with a batch: its whole steps are measured again, the state made
            step = self._hooked_step
            self.handle.remove()  # the fit measures plans of its own on the model
            self.handle = apply(self.model, refit(optimizer), step=step)
            self.handle.plan_per_shape(self.shape_plans)
            log.info("remat: %s counted in memory=; from now on\n%s", type(optimizer).__name__, self.describe())
            return
        if self.fitted is None or self.costs is None or self.memory is None:
            return
        before = self.fitted.fixed
        now = fixed_memory(self.model, self.optimizer)
        added = max(0, now.total + now.optimizer_step_bytes - before.total - before.optimizer_step_bytes)
        limit = device_memory(self.memory, model_device(self.model))
        non_activation = limit - activations_within(self.fitted, self.costs) + added
        plan = self._plan_for_memory(self.costs, self.memory, non_activation)
        if self.shape_plans is not None:
            assert self.fitted.activation_budget is not None
            self.shape_plans.use_budget(self.fitted.activation_budget)
        else:
            self.handle.set_plan(plan)
        log.info(
            "remat: %s steps the model: its state (%s) now counts in memory=; from the next step on\n%s",
            type(self.optimizer).__name__,
            format_bytes(added),
            plan.table(self.costs),
        )

    def _plan_for(self, costs: CostTable) -> Plan:
        if self.memory is None:
            return make_plan(costs, self.strategy, self.budget, **self.options)
        # No step to measure: the activations get what the fixed memory leaves, every gradient counted.
        self._warn_without_optimizer()
        return self._plan_for_memory(costs, self.memory)

    def _plan_for_memory(self, costs: CostTable, memory: int | str, non_activation: int | None = None) -> Plan:
        """The optimal plan for ``memory`` from ``costs``, with the step's bytes beyond activations as measured
        (``non_activation``) or, by default, the fixed memory with every gradient counted; kept in ``fitted``."""
        device = model_device(self.model)
        limit = device_memory(memory, device)
        fixed = fixed_memory(self.model, self.optimizer)
        non_activation = fixed.total if non_activation is None else non_activation
        budget = activation_budget(limit, fixed, costs, non_activation=non_activation, device=device)
        plan = make_plan(costs, "optimal", budget, **self.options)
        self.fitted = MemoryFit(limit, fixed, plan, costs, None, None, budget, non_activation)
        return plan

    def _plans_per_shape(self, batch: Any, step: StepSpec, shapes: bool | Buckets, on_overflow: str,
                         fresh: bool = False) -> ShapePlans:  # fmt: skip
        """Plans per input shape within the activation bytes the memory fit leaves (docs/shapes.md); ``fresh``:
        ``batch`` profiled again (the first training step's profile, run with every block checkpointed, is not
        one of the shape profiles' kind)."""
        assert self.fitted is not None
        reference = None if fresh else self.costs
        shape_costs = profile_shapes(self.model, batch, step=step, reference=reference, price_segments=False)
        budget = activations_within(self.fitted, shape_costs.reference)
        buckets = shapes if isinstance(shapes, Buckets) else Buckets()
        return ShapePlans(shape_costs, budget, buckets=buckets, on_overflow=on_overflow)

    def _warn_without_optimizer(self) -> None:
        if self.optimizer is None:
            warnings.warn(
                "remat.fit: no optimizer given or seen yet, so its state is not counted in memory= until one steps "
                "the model (the plan is then made again with it; AdamW's is twice the parameters): pass optimizer=",
                stacklevel=4,
            )

    def _shared_plan(self, plan: Plan) -> Plan:
        """Rank 0's plan on every rank under ``sync="global"`` (each rank's measured fit could differ)."""
        if self.sync != "global":
            return plan
        actions, strategy = self._from_rank0((dict(plan.actions), plan.strategy))
        return Plan(actions, strategy=strategy)

    # ----- the front door's handle -----
    def set_memory(self, memory: int | str) -> Plan:
        """Plan again for ``memory`` (the whole step's device memory) from the costs and the step's measured
        bytes beyond activations; the new plan applies from the next step. Raises ``remat.BudgetError`` (naming
        the least memory) where no plan fits."""
        self._check_live()
        if self.pgac is not None or self._waiting:
            raise RuntimeError("set_memory needs a plan made from costs: after the first profiled step, not with PGAC")
        if self.costs is None:
            raise RuntimeError(
                "the plan was made without a profile (the plain step fitted the memory): call remat.fit again with "
                "the new memory"
            )
        non_activation = self.fitted.non_activation if self.fitted is not None else None
        plan = self._shared_plan(self._plan_for_memory(self.costs, memory, non_activation))
        self.handle.set_plan(plan)
        self.memory, self.strategy, self.budget = memory, "optimal", None
        return plan

    def describe(self) -> str:
        """What the session runs: the plan per block (with the costs' predictions) and, with ``memory=``, the
        memory, what is fixed and what was measured."""
        if self._waiting:
            return f"{self!r}: the plan is made at the end of the first training step"
        parts = [self.plan.table(self.costs)] if self.costs is not None else []
        if self.fitted is None and self.costs is None:
            parts.append(f"plan: {self.plan.action_counts()}")
        if self.fitted is not None:
            parts.append(self.fitted.describe())
        if self.shape_plans is not None:
            parts.append(self.shape_plans.describe())
        return "\n".join(parts)

    def _shared(self, costs: CostTable) -> CostTable:
        """Rank 0's cost table on every rank under ``sync="global"``, so every rank makes the same plan."""
        if self.sync != "global":
            return costs
        return CostTable.from_dict(self._from_rank0(costs.to_dict()))

    def _from_rank0(self, value: Any) -> Any:
        """Rank 0's ``value`` (picklable) on every rank of the session's process group."""
        import torch.distributed as dist

        group = self.process_group
        src = dist.get_global_rank(group, 0) if group is not None else 0
        box = [value if dist.get_rank(group) == 0 else None]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    # ----- lifecycle -----
    def _remove_global_hooks(self) -> None:
        for hook in self._global_hooks:
            hook.remove()
        self._global_hooks.clear()

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def remove(self) -> None:
        """Remove every hook: the model runs and serialises exactly as before."""
        if self._removed:
            return
        self._remove_global_hooks()
        self._remove_hooks()
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler = None
        if self.pgac is not None:
            self.pgac.remove()
        else:
            self.handle.remove()
        if getattr(self.model, "_remat_session", None) is self:
            del self.model._remat_session
        self._own_recompute.restore()
        self._removed = True

    def _check_live(self) -> None:
        if self._removed:
            raise RuntimeError("this remat session was removed; start a new one")

    def __repr__(self) -> str:
        state = "profiling the first step" if self._waiting else f"{sum(self.mask.values())} of {len(self.mask)} kept"
        limit = f"memory={self.memory!r}" if self.memory is not None else f"budget={self.budget!r}"
        return f"{type(self).__name__}(strategy={self.strategy!r}, {limit}, {state})"


# ----------------------------------------------------------------------------------------------------
# How many ranks a process group has: the session picks PGAC's global threshold when there is more than one.


def distributed_world(process_group: Any = None) -> int:
    """Number of ranks in ``process_group`` (1 when torch.distributed is not initialised)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)


# ----------------------------------------------------------------------------------------------------
# Whether a model was already wrapped for data parallelism (DDP, FSDP, DeepSpeed) or sharded with FSDP2.


ALREADY_SHARDED = (
    "the model is already sharded with fully_shard; activation checkpointing goes on before sharding: "
    "session = prepare(model, ..., batch=sample) (or remat.fit / hf.enable), then fully_shard_blocks(model, session, "
    "mesh=...)"
)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` or one of its modules was sharded with FSDP2's ``fully_shard``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


DEEPSPEED_NEEDS_BATCH = (
    "remat.fit(engine, memory) measures whole steps through the DeepSpeed engine (its buckets and float32 copies "
    "count) before training: pass batch=<a sample batch>, or give activations= to profile the first step instead"
)


DEEPSPEED_STAGE_0 = (
    "remat.fit(engine, memory) measures steps through a ZeRO engine (stages 1 and 2); at stage 0 DeepSpeed takes "
    "only engine.backward(loss). Plan the model before deepspeed.initialize instead: remat.fit(model, memory, "
    "batch=..., optimizer=...), as for DDP"
)


def is_deepspeed(model: nn.Module) -> bool:
    """Whether ``model`` is a DeepSpeed engine (``deepspeed.initialize``'s), which remat plans through."""
    return type(model).__name__ == "DeepSpeedEngine"


def is_wrapped(model: nn.Module) -> bool:
    """Whether ``model`` itself is a DDP, FSDP (version 1) or DeepSpeed wrapper around the model."""
    return isinstance(model, nn.parallel.DistributedDataParallel) or type(model).__name__ in (
        "FullyShardedDataParallel",
        "DeepSpeedEngine",
    )
