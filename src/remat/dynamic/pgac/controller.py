"""PGAC: gradient-aware checkpoint masks, re-planned between optimizer steps under a byte budget.

Per optimizer step ``t`` (sections 2.2-2.5 of the PGAC proposal):

1. during backward every block ``l`` gets a score ``s_l = ||dL/da_l * a_l||_2`` (:mod:`.scores`; under
   gradient accumulation the micro-batches combine by root-sum-square), every ``every`` steps;
2. ``bar_s_l <- alpha * bar_s_l + (1 - alpha) * s_l``, from ``bar_s = 0``;
3. ``tau_t = gamma(t / total_steps) * Quantile_q(bar_s)`` (:mod:`.schedules`);
4. block ``l`` is stored (``keep``) when ``bar_s_l >= tau_t`` and recomputed (``checkpoint``) otherwise;
5. the mask is fitted to the budget with the shared simulator (:mod:`.mask`): lowest-score stored
   blocks are recomputed first, then recomputed blocks are merged into segments;
6. the new plan is switched in on the live model (``handle.set_plan``) and takes effect at the next step.

Costs come from ``costs=`` or are measured (``costs=None``) by :class:`remat.profiling.profiler.BlockProfiler` in the
first training step, run with every block checkpointed; plans start from the second step. DDP: ``sync="global"``
averages the EMA scores across ranks with one all-reduce per update (with the learned schedule's reward), and
with ``costs=None`` rank 0's cost table is broadcast once: every rank gets the same tau and mask.
``sync="local"`` keeps a mask per rank. Pipelines: :mod:`remat.integrations.pipeline` runs a PGAC per stage
(``threshold_scores``: the whole chain's scores); :mod:`.pipeline` simulates a protocol without collectives.
PGAC-Q (:mod:`.q`) adds compressed storage as a third state. The constructor's options are checked before
anything is installed (:func:`check_options`); the data-parallel collectives (one all-reduce of the EMA scores
per update, one broadcast of the profiled table) are at the end of the module.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ...chains import profiled_blocks, resolve_blocks
from ...core import CHECKPOINT, KEEP, BudgetError, CostTable, ShapeCosts, StepSpec, format_bytes, normalize_budget
from ...meters import MemoryReport, measure, model_device
from ...planning import Buckets, Plan, ShapeBudgetError, ShapePlans, resolve_budget
from ...runtime import HandleHook, RematHandle, apply
from .mask import FittedMask, MaskFitter, quantile, score_mask
from .record import StepRecord, own_seconds, step_reward
from .schedules import NEEDS_LENGTH, Schedule, make_schedule
from .scores import GradientScorer, ema_update
from .state import STATE_VERSION, check_state, plain


class PGAC:
    """Gradient-aware activation checkpointing under a memory budget.

    >>> pgac = remat.PGAC(model, "4GiB").attach(optimizer)   # that is all a training loop needs

    Arguments: ``budget`` (bytes, a string like "4GiB", a float fraction of the no-checkpoint activation peak,
    or None for no limit); ``alpha`` EMA decay in [0, 1); ``q`` quantile in [0, 1]; ``gamma`` a number, "constant"
    (1.0), "linear", "cosine", "learned", a :class:`~remat.dynamic.pgac.schedules.Schedule` or a callable of the
    training fraction; ``sync`` None, "local" or "global"; ``costs`` a CostTable or None to measure it in the
    first step; ``every`` score every that many steps; ``blocks`` the chain (default ``find_blocks``);
    ``total_steps`` the training length for the schedules; ``measure`` measure the step's activation peak every
    that many steps (None: every step on CUDA from allocator statistics, never on CPU, where the live-tensor
    tracker slows the step; 0: never); ``overshoot_penalty`` the learned schedule's weight on exceeding the
    budget; ``process_group`` for ``sync``; ``history_limit`` records kept; ``main_input``/``main_output`` the
    hidden state a block takes and returns, where remat's guess is wrong (see :mod:`remat.chains.blocks`), or
    ``step`` (a :class:`remat.StepSpec`) with them;
    ``threshold_scores`` a callable given this PGAC's EMA scores that returns the scores ``Quantile_q`` is taken
    over (default: those scores; a pipeline stage passes the whole chain's, see
    :mod:`remat.integrations.pipeline`).
    """

    profiled_actions: tuple[str, ...] = (KEEP, CHECKPOINT)  # what the first step profiles (with segments)

    def __init__(
        self,
        model: nn.Module,
        budget: int | float | str | None,
        *,
        alpha: float = 0.9,
        q: float = 0.5,
        gamma: str | float | Schedule | Callable[[float], float] = "constant",
        sync: str | None = None,
        costs: CostTable | None = None,
        every: int = 1,
        blocks: Sequence[str] | Sequence[tuple[str, nn.Module]] | None = None,
        total_steps: int | None = None,
        measure: int | None = None,
        overshoot_penalty: float = 10.0,
        process_group: Any = None,
        history_limit: int = 100_000,
        main_input: Any = None,
        main_output: Any = None,
        threshold_scores: Callable[[list[float]], Sequence[float]] | None = None,
        step: StepSpec | None = None,
    ) -> None:
        spec = StepSpec.of(step, blocks=blocks, main_input=main_input, main_output=main_output)
        blocks, main_input, main_output = spec.blocks, spec.main_input, spec.main_output
        check_options(alpha, q, every, sync, total_steps, measure, history_limit)
        self.model = model
        self.alpha, self.q, self.every, self.sync = float(alpha), float(q), int(every), sync
        self.schedule = make_schedule(gamma)
        check_length(self.schedule, total_steps)
        self.total_steps = total_steps
        self.overshoot_penalty = float(overshoot_penalty)
        self.process_group = process_group
        self.threshold_scores = threshold_scores
        if sync == "global":
            require_distributed()
        self._budget_spec = normalize_budget(budget)  # a malformed budget fails here, not after the first step
        self.budget_bytes: int | None = None
        self.costs: CostTable | None = None
        self._fitter: Any = None  # a MaskFitter (PGAC-Q: a QuantizedMaskFitter)

        chain = resolve_blocks(model, blocks)
        self._profiled: Any = profiled_blocks(model, blocks)  # several chains: profiled together
        initial = Plan({fqn: CHECKPOINT for fqn, _ in chain}, strategy="pgac")
        self.handle: RematHandle = apply(model, initial, chain, main_input=main_input, main_output=main_output)
        self.fqns: list[str] = list(self.handle.fqns)
        self._ema = [0.0] * len(self.fqns)
        self.stored_mask: list[bool] = [True] * len(self.fqns)  # the last update's score mask (plans per shape)
        self.shape_plans: PerShape | None = None
        self.scorer = GradientScorer(self.handle)
        self.history: deque[StepRecord] = deque(maxlen=history_limit)
        self.step_count = 0
        self._tau = 0.0
        self._gamma = math.nan  # set by the first update
        self._measure_every = measure
        self._device = model_device(model)
        self.clock: Callable[[], float] = time.perf_counter  # seconds; replaceable for simulations
        self._last_update: float | None = None
        self._step_start: float | None = None  # the clock at the step's first forward
        self._profiler: Any = None  # the BlockProfiler of the first step when costs=None
        self._profiler_open = False
        self._profiling = costs is None
        self._region_open = False
        self._meter: Any = None
        self._report: MemoryReport | None = None
        self._optimizer_hooks: list[Any] = []
        self._optimizer: Any = None
        self._forward_hook = model.register_forward_pre_hook(HandleHook(self._on_forward))
        self._removed = False
        if costs is not None:
            try:
                self._set_costs(costs)
                self._apply(self._fit([True] * len(self.fqns)))
            except Exception:
                self.remove()
                raise

    # ----- public API -----
    @property
    def scores(self) -> dict[str, float]:
        """EMA score per block FQN."""
        return dict(zip(self.fqns, self._ema, strict=True))

    @property
    def mask(self) -> dict[str, bool]:
        """Block FQN -> True where the block's activations are stored in the next step."""
        return {f: a == KEEP for f, a in self.handle.plan.actions.items()}

    @property
    def plan(self) -> Plan:
        """The plan the next step runs with."""
        return self.handle.plan

    @property
    def own_seconds(self) -> tuple[float, float]:
        """PGAC's own seconds per step, in its gradient hooks and in its update (:func:`.record.own_seconds`)."""
        return own_seconds(self.history)

    @property
    def tau(self) -> float:
        return self._tau

    @property
    def gamma(self) -> float:
        return self._gamma

    def attach(self, optimizer: torch.optim.Optimizer) -> PGAC:
        """Update the mask after every ``optimizer.step()``; returns ``self``."""
        self._check_live()
        if self._optimizer is not None:
            raise RuntimeError("this PGAC is already attached to an optimizer; call remove() and make a new one")
        model_params = {id(p) for p in self.model.parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not any(id(p) in model_params for p in params):
            raise ValueError(
                f"the optimizer holds none of the parameters of the model PGAC manages ({type(self.model).__name__}); "
                "attach the optimizer built from this model's parameters, e.g. torch.optim.AdamW(model.parameters())"
            )
        self._optimizer = optimizer
        self._optimizer_hooks = [
            optimizer.register_step_pre_hook(lambda *_: self._close_region()),
            optimizer.register_step_post_hook(lambda *_: self._update()),
        ]
        return self

    def step(self, *, measured_peak_bytes: int | None = None) -> None:
        """Update scores, threshold and mask by hand, after ``optimizer.step()`` (not needed with ``attach``);
        ``measured_peak_bytes``: the step's activation peak from your own meter, used in place of PGAC's."""
        self._check_live()
        self._update(measured_peak_bytes)

    def plan_per_shape(self, shapes: ShapeCosts, *, buckets: Buckets | None = None,
                       on_overflow: str = "raise") -> PerShape:  # fmt: skip
        """Fit the mask, each forward, to the costs at that forward's input shape (``shapes``, from
        :func:`remat.profile_shapes`), within the budget in bytes: the scores stay per block, the mask of the last
        update is fitted per shape bucket (docs/shapes.md). A budget given as a fraction is read at the profiled
        shape. A shape no mask fits is refused before its first block (``on_overflow``: :class:`remat.ShapePlans`)."""
        self._check_live()
        if self.costs is None or self._profiling:
            self._profiling = False
            self._set_costs(shapes.reference)
        assert self.budget_bytes is not None
        self.shape_plans = PerShape(self, shapes, self.budget_bytes, buckets=buckets or Buckets(),
                                    on_overflow=on_overflow)  # fmt: skip
        self.handle.plan_per_shape(self.shape_plans)
        return self.shape_plans

    def set_budget(self, budget: int | float | str | None) -> None:
        """Change the budget; the next update plans for it. Raises BudgetError below the feasible minimum."""
        self._budget_spec = normalize_budget(budget)
        if self.costs is not None:
            self._set_costs(self.costs)

    def remove(self) -> None:
        """Remove every hook; the model behaves exactly as before PGAC."""
        if self._removed:
            return
        self._close_region()
        for hook in self._optimizer_hooks:
            hook.remove()
        self._optimizer_hooks, self._optimizer = [], None
        self._forward_hook.remove()
        self.scorer.remove()
        self.handle.remove()
        self._removed = True

    def state_dict(self) -> dict[str, Any]:
        """Scores, step, schedule, costs, budget and plan, for training checkpoints (history excluded): plain
        values (:mod:`.state`), loadable with ``torch.load(..., weights_only=True)``; loading it into a PGAC of the
        same model and options resumes the same decisions."""
        return plain(
            {
                "version": STATE_VERSION,
                "fqns": list(self.fqns),
                "step": self.step_count,
                "ema": list(self._ema),
                "tau": self._tau,
                "gamma": self._gamma,
                "schedule": self.schedule.state_dict(),
                "costs": self.costs.to_dict() if self.costs is not None else None,
                "budget": self._budget_spec,
                "actions": dict(self.handle.plan.actions),
                # Where the next step's time starts: meaningful only to this clock in this process (an in-place
                # restore resumes exactly); elsewhere the first step after loading is timed from its forward.
                "clock": {"owner": self._clock_owner(), "last_update": self._last_update},
            },
            "PGAC.state_dict()",
        )

    def _clock_owner(self) -> str:
        return f"{_PROCESS}:{id(self.clock)}"

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`. Loaded into the PGAC that saved it (same clock, same process), the next
        step is timed from the last update, as without the round trip; elsewhere from its first forward."""
        self._check_live()
        check_state(state, self.fqns)
        self.step_count = int(state["step"])
        self._ema = [float(v) for v in state["ema"]]
        self._tau, self._gamma = float(state["tau"]), float(state["gamma"])
        self.schedule.load_state_dict(state["schedule"])
        self._budget_spec = normalize_budget(state["budget"])
        if state["costs"] is not None:
            self._close_region()
            self._profiling = False
            self._set_costs(CostTable.from_dict(state["costs"]))
        self.handle.set_plan(Plan.from_named_actions(self.costs, dict(state["actions"]), "pgac", self.budget_bytes))
        clock = state.get("clock") or {}
        same_clock = clock.get("owner") == self._clock_owner() and clock.get("last_update") is not None
        self._last_update = float(clock["last_update"]) if same_clock else None

    # ----- step boundaries -----
    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if self._region_open or not torch.is_grad_enabled():
            return
        self._region_open = True
        self._step_start = self.clock()
        if self._profiling and self._profiler is None:
            from ...profiling import BlockProfiler

            # Profile the single actions the plans use (PGAC: keep and checkpoint, with segments).
            self._profiler = BlockProfiler(
                self.model, self._profiled, actions=list(self.profiled_actions), io=self.handle.io,
                step_actions=list(self.handle.plan.actions.values()),
            )  # fmt: skip
            self._profiler.__enter__()
            self._profiler_open = True
        elif self._measured_step():
            self._meter = measure(self._device, tracker=self._device.type != "cuda")
            self._report = self._meter.__enter__()

    def _measured_step(self) -> bool:
        every = self._measure_every
        if every is None:
            return self._device.type == "cuda"
        return every > 0 and self.step_count % every == 0

    def _close_region(self) -> None:
        """End the step's measurement (before the optimizer runs, so its memory is not counted)."""
        if self._meter is not None:
            meter, self._meter = self._meter, None
            meter.__exit__(None, None, None)
        if self._profiler_open:
            self._profiler_open = False
            self._profiler.__exit__(None, None, None)

    # ----- the update -----
    def _update(self, measured_peak_bytes: int | None = None) -> None:
        self._close_region()  # on CUDA the meter's end and the scores' read-back wait for the step's device work,
        self.scorer.wait_for_device()  # the step's time, not PGAC's own: the clock starts after both
        start = self.clock()
        # From the previous update; in the first step after load_state_dict, from the step's first forward.
        since = self._last_update if self._last_update is not None or self.step_count == 0 else self._step_start
        step_time = start - since if since is not None else None
        self._step_start = None
        ran = self.handle.plan
        if self._profiling:
            step_time = None  # the profiling step is no measure of the plan's speed
            if self._profiler is not None:
                self._set_costs(self._costs_from_profiler())
                self._profiling = False
                self._profiler = None
        measured = self._report.activation_bytes if self._report is not None else None
        self._report = None
        if measured_peak_bytes is not None:
            measured = int(measured_peak_bytes)

        collected = self.scorer.collect()
        step_scores = None
        if collected is not None:
            step_scores, counts = collected
            self._ema = ema_update(self._ema, step_scores, counts, self.alpha)
        # log throughput, minus a hinge penalty when the step's activation peak exceeded the budget
        peak = measured if measured is not None else ran.predicted_peak_bytes
        learns = self.schedule.learns and step_time is not None and step_time > 0
        reward = step_reward(step_time, peak, self.budget_bytes, self.overshoot_penalty) if learns else None
        if self.sync == "global":
            reward = self._all_reduce(reward)
        if reward is not None:
            self.schedule.observe(reward, outcome=tuple(ran.actions.values()))

        fraction = min(1.0, self.step_count / self.total_steps) if self.total_steps else 0.0
        self._gamma = self.schedule(fraction)
        ranking = self._ranking()
        pool = list(self.threshold_scores(list(ranking))) if self.threshold_scores is not None else ranking
        self._tau = self._gamma * quantile(pool, self.q)
        stored = score_mask(ranking, self._tau)
        self.stored_mask = list(stored)
        fitted = self._fit(stored) if self._fitter is not None else None
        if fitted is not None:
            self._apply(fitted)
        self.history.append(
            StepRecord(
                step=self.step_count,
                scored=collected is not None,
                step_scores=tuple(step_scores) if step_scores is not None else None,
                scores=tuple(self._ema),
                gamma=self._gamma,
                tau=self._tau,
                mask=tuple(stored),
                actions=tuple(ran.actions.values()),
                next_actions=tuple(self.handle.plan.actions.values()),
                predicted_peak_bytes=ran.predicted_peak_bytes,
                next_predicted_peak_bytes=self.handle.plan.predicted_peak_bytes,
                measured_peak_bytes=measured,
                step_time_s=step_time,
                reward=reward,
                update_s=self.clock() - start,
                scoring_s=self.scorer.take_seconds(),
            )
        )
        self.step_count += 1
        self.scorer.enabled = self.step_count % self.every == 0
        self._region_open = False
        self._last_update = start

    def _fit(self, stored: list[bool]) -> FittedMask:
        assert self._fitter is not None
        return self._fitter.fit(stored, self._ranking())

    # Overridden by PGAC-Q (:mod:`.q`), with ``profiled_actions``: the ranking and the mask fitter.
    def _ranking(self) -> list[float]:
        return self._ema

    def _make_fitter(self, costs: CostTable) -> Any:
        return MaskFitter(costs, self.budget_bytes, fqns=self.fqns)  # raises BudgetError below the minimum

    def _apply(self, fitted: FittedMask) -> None:
        assert self.costs is not None  # a fitted mask comes from the cost table's fitter
        # from the simulator, as every plan: peak, recompute and step time predicted on the same table
        dropped = [self.fqns[i] for i in fitted.dropped]
        plan = Plan.from_actions(
            self.costs, _by_name(self.costs, self.fqns, fitted.actions), "pgac", self.budget_bytes, how=fitted.how,
            dropped=dropped,
        )  # fmt: skip
        self.handle.set_plan(plan)

    def _set_costs(self, costs: CostTable) -> None:
        MaskFitter.check_blocks(costs, self.fqns)
        self.costs, self._fitter = costs, None  # kept when the budget is below the minimum: set_budget can fix it
        self.budget_bytes = resolve_budget(self._budget_spec, costs)
        self._fitter = self._make_fitter(costs)

    def _costs_from_profiler(self) -> CostTable:
        costs = self._profiler.cost_table()
        return broadcast_costs(costs, self.process_group) if self.sync == "global" else costs

    def _all_reduce(self, reward: float | None) -> float | None:
        """Average the EMA scores (and the learned schedule's reward) over the ranks: one all-reduce."""
        values = [*self._ema, reward if reward is not None else 0.0, 1.0 if reward is not None else 0.0]
        out = all_reduce_mean(values, self.process_group)
        self._ema = out[: len(self._ema)]
        return out[-2] / out[-1] if out[-1] > 0 else None

    def _check_live(self) -> None:
        if self._removed:
            raise RuntimeError("this PGAC was removed; create a new one")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({len(self.fqns)} blocks, {sum(self.mask.values())} stored, step {self.step_count}, "
            f"alpha={self.alpha}, q={self.q}, gamma={self.schedule!r}, sync={self.sync!r})"
        )


# ----------------------------------------------------------------------------------------------------
# Checks of :class:`remat.PGAC`'s constructor options, run before anything is installed on the model.


SYNC_MODES = (None, "local", "global")


class PerShape(ShapePlans):
    """PGAC's plans per input shape: the last update's score mask fitted, each forward, to the costs at the
    forward's shape bucket (one mask fitter per bucket, made the first time the bucket is seen)."""

    def __init__(self, pgac: PGAC, shapes: ShapeCosts, budget: int, **options: Any) -> None:
        super().__init__(shapes, budget, strategy="pgac", **options)
        self.pgac = pgac
        self.fitters: dict[tuple[int, int], tuple[CostTable, Any]] = {}
        self.last_masks: dict[tuple[int, int], Sequence[str]] = {}  # each bucket's actions, as last fitted

    def describe(self) -> str:
        """The buckets seen, their shapes and the actions each was last fitted to."""
        lines = [f"PGAC's masks per shape within {format_bytes(self.budget_bytes)} ({self.planned} buckets):"]
        for key in sorted(self.last_masks):
            shapes = sorted(s for s, b in self.seen.items() if b == key)
            counts: dict[str, int] = {}
            for action in self.last_masks[key]:
                counts[action] = counts.get(action, 0) + 1
            actions = ", ".join(f"{n} {a}" for a, n in sorted(counts.items()))
            lines.append(f"  {list(key)} for {[list(s) for s in shapes]}: last {actions}")
        return "\n".join(lines)

    def plan_for(self, batch: int, seq: int, past_second: tuple[int, ...] = ()) -> Plan:
        shape, bucket = self.shape_and_bucket(batch, seq, past_second)
        key = self.seen.setdefault(shape, bucket)
        if shape in self.refused:
            raise self.refused[shape]
        if key in self.plans:  # a bucket over the budget, run under on_overflow's plan
            return self.plans[key]
        started = time.perf_counter()
        try:
            if key not in self.fitters:
                self.planned += 1
                table = self.costs.at(*key)
                try:
                    self.fitters[key] = (table, self.pgac._make_fitter(table))  # BudgetError below its minimum
                except BudgetError as err:
                    self.plans[key] = self.last = self._overflow(key, shape, err)
                    return self.last
        except ShapeBudgetError as err:
            self.refused[shape] = err
            raise
        finally:
            self.planning_s += time.perf_counter() - started
        table, fitter = self.fitters[key]
        fitted = fitter.fit(self.pgac.stored_mask, self.pgac._ranking())
        self.last_masks[key] = fitted.actions
        plan = Plan.from_actions(table, _by_name(table, self.pgac.fqns, fitted.actions), "pgac", self.budget_bytes,
                                 how=fitted.how)  # fmt: skip
        plan.options["shape"] = list(key)
        self.last = plan
        return plan


_PROCESS = f"{os.getpid()}-{uuid.uuid4().hex}"  # this process, for state that only it can read back


def _by_name(costs: CostTable, fqns: Sequence[str], actions: Sequence[str]) -> dict[str, str]:
    """``actions``, given in PGAC's block order ``fqns`` (a model's chains in module order), keyed by block and
    listed in the table's order (the order the step runs the chains): each action stays with its block."""
    named = dict(zip(fqns, actions, strict=True))
    return {fqn: named[fqn] for fqn in costs.fqns}


def check_options(
    alpha: float,
    q: float,
    every: int,
    sync: str | None,
    total_steps: int | None,
    measure_every: int | None,
    history_limit: int,
) -> None:
    """Raise ValueError naming the first option out of its range and the range it must be in."""
    if not (isinstance(alpha, int | float) and 0.0 <= alpha < 1.0):
        raise ValueError(f"alpha is the EMA decay and must be in [0, 1), got {alpha!r}")
    if not (isinstance(q, int | float) and 0.0 <= q <= 1.0):
        raise ValueError(f"q is the quantile of the scores that sets the threshold and must be in [0, 1], got {q!r}")
    if not _is_int(every) or every < 1:
        raise ValueError(f"every (score every that many steps) must be an int >= 1, got {every!r}")
    if sync not in SYNC_MODES:
        raise ValueError(f"sync must be None (one process), 'local' (a mask per rank) or 'global', got {sync!r}")
    if total_steps is not None and (not _is_int(total_steps) or total_steps < 1):
        raise ValueError(f"total_steps must be a positive int (optimizer steps), got {total_steps!r}")
    if measure_every is not None and (not _is_int(measure_every) or measure_every < 0):
        raise ValueError(f"measure must be None or an int >= 0 (measure every that many steps), got {measure_every!r}")
    if not _is_int(history_limit) or history_limit < 0:
        raise ValueError(
            f"history_limit is the number of step records kept and must be an int >= 0 (0: none), got {history_limit!r}"
        )


def check_length(schedule: Any, total_steps: int | None) -> None:
    """Raise ValueError when ``schedule`` runs over the training length and ``total_steps`` is not given."""
    if isinstance(schedule, NEEDS_LENGTH) and total_steps is None:
        raise ValueError(f"gamma={schedule!r} runs over the training length: pass total_steps= (optimizer steps)")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ----------------------------------------------------------------------------------------------------
# PGAC's collectives for data parallel training (``sync="global"``): one all-reduce of the EMA scores per
# update, and one broadcast of the measured CostTable after the profiling step, so every rank computes the same
# threshold, mask and budget fit.


def require_distributed() -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "sync='global' averages scores across ranks and needs torch.distributed initialised "
            "(dist.init_process_group) before PGAC is created; use sync=None in a single process"
        )


def all_reduce_mean(values: list[float], group: Any = None) -> list[float]:
    """The mean over the ranks of ``values``, in float64, with one all-reduce (CPU for gloo, the current CUDA
    device for NCCL). Every rank receives the same numbers."""
    import torch.distributed as dist

    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    t /= dist.get_world_size(group)
    return t.tolist()


def broadcast_costs(costs: CostTable, group: Any = None) -> CostTable:
    """The first rank's cost table, on every rank."""
    import torch.distributed as dist

    box = [costs.to_dict() if dist.get_rank(group) == 0 else None]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return CostTable.from_dict(box[0])
