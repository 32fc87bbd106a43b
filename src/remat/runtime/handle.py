"""Applying a Plan to a live model: hooks installed once, actions switched between steps cheaply.

``apply(model, plan)`` registers a forward pre-hook and a forward hook on every block of the chain. At each
forward the hooks read the current plan's units and open/close the matching region around the blocks:

* ``checkpoint`` and ``selective:<policy>``: a non-reentrant checkpoint frame around the block (as
  ``torch.distributed``'s composable checkpoint opens it by hooks), with a per-op policy for selective;
* ``segment`` groups: one frame from the first block to the last (re-run in order in backward); ``memory_poor``
  groups: one frame per block, re-deriving its input from the group's input, storing nothing;
* ``offload``, ``compress:`` and ``recompute+compress:``: saved tensors on the host (copied on side streams,
  Note [10]), compressed, or re-run and compressed in backward (:mod:`remat.checkpointing.recompute_compression`);
  ``checkpoint+compress:``: its own frame;
* ``partition:<budget>``: a compiled block's variant of that budget. Notes [1] to [11]; ``stats`` counts re-runs.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import noop_context_fn

from ..chains import (
    BlockIO,
    CallCounter,
    CallPositions,
    block_ios,
    extra_run,
    layer_drop_settings,
    names_calls,
    refuse_groups_under_layer_drop,
    refuse_hf_checkpointing,
    refuse_recomputed_blocks,
    resolve_blocks,
    training_forward_guards,
)
from ..checkpointing import (
    CallRecord,
    Forked,
    OffloadQueue,
    OpenRegion,
    QueueStats,
    compiled_caller_check,
    compiled_partitions,
    eager,
    exception_propagating,
    handoff_error,
    in_place_error,
    missing_start_error,
    open_block_frame,
    open_checkpoint_frame,
    output_refs,
    policies,
    same_tensor,
    storing_context,
)
from ..core import (
    CHECKPOINT,
    COMPRESS,
    INPUT_COMPRESS,
    KEEP,
    MEMORY_POOR,
    OFFLOAD,
    RECOMPUTE_COMPRESS,
    SEGMENT,
    SELECTIVE,
    SINGLE,
    Action,
    BlocksArg,
    InputName,
    OutputName,
    StepSpec,
    Unit,
    format_bytes,
    shape_of,
)
from ..planning import Plan, ShapePlans
from . import applied
from .applied import Counting, all_suspended
from .recompute_stats import RecomputeStats

# Note [1] Segments.
# A segment (blocks start..end of one unit) is one checkpoint frame: opened by the pre-hook of its first block
# with the segment's input as the frame's only input, closed by the forward hook of its last block. The open
# region is kept in self._open under the unit's start index and gathers one CallRecord per block; backward
# recomputes the segment by re-running the records in order, each on the previous one's output. That replays
# the forward only if the blocks run in chain order within one forward, each on the previous block's output
# unchanged (regions.same_tensor also accepts an identity autograd function, as FSDP2 inserts); otherwise the
# hooks raise and name the way out: 'checkpoint' per block.
#
# Note [2] Memory-poor groups.
# A memory-poor group stores only its input. Each block has a frame of its own whose only input is the group's
# input; recomputing block m re-runs blocks start..m-1 under no_grad from it (storing nothing), then block m with
# grad on its rebuilt input, detached. "Storing nothing" holds even for code that turns grad back on inside a block
# (Megatron-Core runs bias-dropout-add under torch.enable_grad()): the re-runs pack what they save into nothing,
# under saved-tensor hooks of their own, so that block m's frame sees only block m's saved tensors. While the
# group's forward runs, self._memory_poor holds the group's input, the records so far and the last output; it is
# dropped when the group's last block closes. As in Note [1], each block must receive the previous block's output.
#
# Note [3] RNG replay.
# A recomputation must draw the random numbers the forward drew (dropout), or gradients differ from a step
# without checkpointing. Each CallRecord takes an RngSnapshot of its main input's devices before the block runs
# in forward; a recomputation runs inside rng.Forked (the step's own RNG stream does not advance) and restores a
# block's snapshot right before re-running it. So torch's frame is opened with preserve_rng_state=False
# (regions.open_checkpoint_frame): the snapshots are per block, which segments and groups (one frame, several
# blocks) need.
#
# Note [4] Hooks installed once.
# apply() puts on each block one forward pre-hook (opens regions) and one forward hook with always_call=True (closes
# them, also when the block raises), and marks the model (a second apply() is refused). Nothing is wrapped: parameter
# names and state_dict keys stay. The hooks are kept out of torch.compile (regions.eager); a forward that itself runs
# compiled while the plan opens regions is refused (regions.compiled_caller_check: a recomputation would run eagerly
# what the forward ran compiled). The hooks do nothing while inactive: grad disabled, during a recomputation (a re-run
# block must not open a region of its own), under handle.suspended() or suspend_all() (the profiler runs blocks alone).
# Recomputation runs a block's forward past them if no other hook or compiled call is on it (forward_past_own_hooks).
#
# Note [5] What set_plan may change.
# Between steps, set_plan may change every block's action and the grouping into segments and memory-poor
# groups; no hook is added or removed. The plan must name every block of the chain in chain order, and
# selective policies are looked up there, so a bad plan fails in set_plan, not in the middle of a forward. It is
# not called during a forward (the hooks would look up units the open regions were not opened under). A backward
# still to come for a finished forward recomputes under the plan that forward ran with: its frames hold their
# own records. 'partition:<budget>' blocks run as keep does, their compiled variant chosen here (compiled_partitions).
#
# Note [6] Teardown.
# remove() removes every hook, forgets open regions and deletes the mark on the model, which then behaves and
# serialises as before apply(). Regions close in the forward hook that ends them (Note [4]); per-thread counters
# (recomputing, suspended) are restored in finally blocks. A forward that raises closes every open region, so no
# checkpoint frame outlives it: a raising block is seen by its always_call forward hook (called with no output),
# an exception in the model's code between two blocks of a segment by an always_call forward hook on the model.
#
# Note [7] Autocast.
# Every region that does not keep its activations runs with autocast's weight-cast cache off, entered before its
# frame opens (so recomputation replays it) and left after it closes; why, and the helpers: remat.core.precision.
#
# Note [8] Blocks called more than once in a forward.
# Plan entries are calls (remat.chains.block_calls: '<fqn>@<k>' for a block's k-th call). A model pre-hook resets
# the call counts where a forward starts; block hooks index units, open regions and names by the plan position of
# the call now running, the block index only choosing the module. So segments and groups may span calls (Notes [1],
# [2]).
#
# Note [9] Inputs larger than planned for.
# A plan's predictions hold for the input its table was profiled on (Plan.options["planned_input"]: the first
# block's main-input shape). Activations grow with the input, so a larger batch or a longer sequence breaks a byte
# budget silently; where the plan has a budget, the first block's pre-hook compares each forward's main input with
# that shape and warns, once per shape, where it holds more elements, naming both shapes, the growth and the
# budget. Smaller inputs fit.
#
# Note [10] Offloaded blocks.
# An 'offload' block's saved tensors go to host memory through the handle's OffloadQueue
# (remat.checkpointing.offload_streams, invariants 1 and 2 there): copied on a side stream as they are saved, copied
# back one block ahead of their backward. The hooks tell the queue where a forward starts (the model pre-hook), where
# each block call starts (it releases the copies of the calls before the previous one), each block's output (its
# gradient starts the copy back of the call before it, where that one was offloaded) and where the forward ends (it
# releases every call). A plan without offload leaves the queue alone.
#
# Note [11] Plans per input shape.
# With plan_per_shape(plans) (a remat.planning.ShapePlans), the pre-hook of block 0, on its first call in a forward
# and before any block runs, reads the (batch, sequence) of block 0's main input and asks plans.plan_for for that
# shape's plan: its bucket's, planned the first time the bucket is seen. A plan other than the current one is set
# there (set_plan: no region is open yet, Note [5]); a shape no plan fits raises ShapeBudgetError from that hook, so
# the forward stops before its first block (on_overflow chooses otherwise). Each such plan is made for its bucket's
# shape, so Note [9] does not warn for it.

OutputObserver = Callable[[int, torch.Tensor, bool], None]


class RematHandle(applied.OwnsHooks):
    """The live application of a plan to a model. Create it with :func:`apply`."""

    def __init__(
        self,
        model: nn.Module,
        blocks: list[tuple[str, nn.Module]],
        plan: Plan,
        *,
        time_recompute: bool = True,
        io: Sequence[BlockIO] | None = None,
    ) -> None:
        self.model = model
        self.blocks = blocks
        self.fqns = [fqn for fqn, _ in blocks]
        self.io = list(io) if io is not None else block_ios(blocks)  # how each block is called
        self.stats = RecomputeStats(self.fqns)
        self.time_recompute = time_recompute
        self._observers: list[OutputObserver] = []
        self._local = threading.local()
        self._open: dict[int, OpenRegion] = {}
        self._hooks: list[Any] = []
        self._removed = False
        self._memory_poor: dict[str, Any] | None = None
        self._calls = CallCounter(len(blocks))  # Note [8]
        self._warned_inputs: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()  # Note [9]: (planned, seen)
        self._offload = OffloadQueue()  # Note [10]
        self._shape_plans: ShapePlans | None = None  # Note [11]
        self._shape_read = False
        self._layer_drop = layer_drop_settings(model)  # read once, not on every set_plan (PGAC sets one a step)
        self.set_plan(plan)
        self._own_hook_ids: list[frozenset[int]] = []
        for i, (_, module) in enumerate(blocks):  # Note [4]
            pre_hook = applied.HandleHook(self._make_pre_hook(i))
            post_hook = applied.HandleHook(self._make_post_hook(i))
            pre = module.register_forward_pre_hook(pre_hook, with_kwargs=True)
            post = module.register_forward_hook(post_hook, with_kwargs=True, always_call=True)
            self._hooks += [pre, post]
            self._own_hook_ids.append(frozenset((pre.id, post.id)))
        for entry in (eager(lambda *_: self._forward_starts()), compiled_caller_check(self)):  # Notes [8], [4]
            self._hooks.append(model.register_forward_pre_hook(applied.HandleHook(entry)))
        model_exit = applied.HandleHook(eager(self._after_model_forward))
        self._hooks.append(model.register_forward_hook(model_exit, always_call=True))  # Note [6]

    # ----- plan -----
    def set_plan(self, plan: Plan) -> None:
        """Switch to ``plan`` from the next forward on; no hooks are added or removed (Note [5])."""
        plan, positions, units = planned_calls(plan, self.fqns)  # Note [8]
        if self._layer_drop and any(unit.kind != SINGLE for unit in units):
            refuse_groups_under_layer_drop(self.model, list(plan.actions.values()), self._layer_drop)
        for unit in units:
            if unit.kind == SINGLE and Action.parse(unit.action).kind == SELECTIVE:
                policies.get(Action.parse(unit.action).policy)
        compiled_partitions.select_for(self.blocks, positions.planned(list(plan.actions.values())))  # Note [5]
        self.plan, self._positions, self._names = plan, positions, list(plan.actions)
        self._single_positions = positions.single_call_positions()  # None: some block's calls are planned apart
        self._unit_of = [unit for unit in units for _ in range(unit.size)]
        self._offloads = any(u.kind == SINGLE and Action.parse(u.action).kind == OFFLOAD for u in units)
        self.opens_regions = any(u.kind != SINGLE or not compiled_partitions.runs_plainly(u.action) for u in units)
        planned = plan.options.get("planned_input")
        self._planned_input = (  # a plan without a budget promises no peak
            tuple(planned["shape"])
            if isinstance(planned, dict) and planned.get("block") == self.fqns[0] and plan.budget_bytes
            else None
        )

    def _check_input(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Note [9]: warn, once per shape, where the first block's main input holds more elements than the input
        the plan was made for."""
        try:
            shape = tuple(self.io[0].input_tensor(args, kwargs).shape)
        except ValueError:
            return
        planned = self._planned_input
        if planned is None or shape == planned or (planned, shape) in self._warned_inputs:
            return
        growth = math.prod(shape) / max(1, math.prod(planned))
        if growth <= 1:
            return
        self._warned_inputs.add((planned, shape))  # kept across set_plan: PGAC and DTR set a plan every step
        budget = f" of {format_bytes(self.plan.budget_bytes)}"
        warnings.warn(
            f"remat: block {self.fqns[0]!r} gets an input of shape {list(shape)}, {growth:.2f}x the elements of "
            f"the {list(planned)} its plan was made for: the activations grow with it (more than that where "
            f"attention scores grow with the square of the sequence), so the plan's predicted peak and budget"
            f"{budget} do not hold for this batch. Profile and plan with the largest batch the run will see, or give "
            "each shape its plan: remat.fit(..., shapes=True) (docs/shapes.md).",
            stacklevel=2,
        )

    def _forward_starts(self) -> None:
        self._calls.reset()  # Note [8]
        self._offload.forward_started()  # Note [10]
        self._shape_read = False  # Note [11]

    @contextlib.contextmanager
    def running(self, plan: Plan) -> Iterator[None]:
        """Within this context every forward runs under ``plan``, no plan per shape switched in (Note [11]): a
        measurement's steps on a model in training (a profile taken with every block checkpointed). The plan and
        the plans per shape are put back afterwards."""
        before, shape_plans = self.plan, self._shape_plans
        self._shape_plans = None
        self.set_plan(plan)
        try:
            yield
        finally:
            self.set_plan(before)
            self._shape_plans = shape_plans

    def plan_per_shape(self, plans: ShapePlans | None) -> None:
        """Run each forward under ``plans.plan_for(batch, sequence)`` of its input's shape, switched before the
        first block runs (Note [11]); ``None`` goes back to the plan set last."""
        self._shape_plans = plans

    def _plan_for_input(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Note [11]: switch to the plan of this forward's input shape (or refuse the batch) before block 0 runs."""
        self._shape_read = True
        started = time.perf_counter()
        try:
            main = self.io[0].input_tensor(args, kwargs)
        except ValueError:
            return
        plans = self._shape_plans
        assert plans is not None
        try:
            plan = plans.plan_for(*shape_of(main.shape), tuple(main.shape[2:]))
            if plan is not self.plan:
                self.set_plan(plan)
        finally:
            plans.switch_s += time.perf_counter() - started

    @property
    def offload_stats(self) -> QueueStats:
        """What the offloaded blocks' copies did (Note [10]): the most block calls holding device memory for their
        copies at once, where the compute stream waited for a copy, how many copies back came ahead of need."""
        return self._offload.stats

    @property
    def mask(self) -> dict[str, bool]:
        """Block FQN -> True where the block runs with its activations stored."""
        return {f: a == KEEP for f, a in self.plan.actions.items()}

    def add_output_observer(self, observer: OutputObserver) -> Callable[[], None]:
        """Call ``observer(block_index, output, recomputed)`` with each block's output, in forward and in
        recomputation. Returns a function that removes the observer."""
        self._observers.append(observer)
        return lambda: self._observers.remove(observer)

    # ----- lifecycle -----
    def remove(self) -> None:
        """Remove every hook; the model behaves and serialises exactly as before ``apply`` (Note [6])."""
        compiled_partitions.select_for(self.blocks, None)  # Note [5]
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._open.clear()
        self._removed = True
        applied.unregister(self.model, self)
        if getattr(self.model, "_remat_handle", None) is self:
            del self.model._remat_handle

    def suspended(self) -> contextlib.AbstractContextManager[None]:
        """Run the model with every block kept, e.g. for measurement."""
        return Counting(self._local, "suspended")

    # ----- hooks -----
    def _inactive(self) -> bool:
        # Note [4]
        return (
            getattr(self._local, "recomputing", 0) > 0
            or getattr(self._local, "suspended", 0) > 0
            or all_suspended()
            or not torch.is_grad_enabled()
        )

    def _recomputing(self) -> contextlib.AbstractContextManager[None]:
        return Counting(self._local, "recomputing")

    def _make_pre_hook(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._inactive():
                return
            if i == 0 and self._shape_plans is not None and not self._shape_read:
                self._plan_for_input(args, kwargs)  # Note [11]
            if i == 0 and self._planned_input is not None:
                self._check_input(args, kwargs)  # Note [9]
            if self._offloads:
                self._offload.block_started()  # Note [10]
            single = self._single_positions
            p = single[i] if single is not None else self._positions.position(i, self._calls.enter(i))
            unit = self._unit_of[p]
            if unit.kind == SINGLE:
                self._open_single(i, p, unit, module, args, kwargs)
            elif unit.kind == SEGMENT:
                self._enter_segment_block(i, p, unit, args, kwargs)
            else:
                self._enter_memory_poor_block(i, p, unit, args, kwargs)

        return eager(hook)

    def _make_post_hook(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if self._inactive():
                return
            if output is None and exception_propagating():  # Note [6]
                self._abandon_open_regions()
                return
            if self._offloads:
                self._offload.copy_back_after(output)  # Note [10]
            single = self._single_positions
            p = single[i] if single is not None else self._positions.position(i, self._calls.current(i))
            unit = self._unit_of[p]
            key = unit.start if unit.kind == SEGMENT else p
            region = self._open.get(key)
            record = region.records[-1] if region is not None and region.records else None
            if record is not None and record.modified_in_place(args, kwargs):
                self._abandon_open_regions()
                raise in_place_error(self._names[p], f"under action {self.plan.actions[self._names[p]]!r}")
            if region is None and not self._observers:  # a kept block, nobody watching
                return
            io = self.io[i]
            if unit.kind == SINGLE and not self._observers and io.main_output is None:  # no output to read
                self._close(key)
                return
            out = io.output(output, record.shape if record is not None else io.input_shape(args, kwargs))
            if region is not None:
                if unit.kind != SINGLE:  # the next block's hand-off check needs these
                    region.last_output, region.last_outputs = out, output_refs(self.io[i], output)
                if unit.kind == MEMORY_POOR and self._memory_poor is not None:
                    self._memory_poor["last"] = out
                    self._memory_poor["outputs"] = region.last_outputs
                if unit.kind != SEGMENT or p == unit.end:
                    self._close(key)
            if out is not None and torch.is_grad_enabled():
                for observer in self._observers:
                    observer(i, out, False)

        return eager(hook)

    def _after_model_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._offloads:
            self._offload.forward_ended()  # Note [10]
        if self._open and output is None and exception_propagating():  # Note [6]: raised between blocks
            self._abandon_open_regions()

    def _abandon_open_regions(self) -> None:
        """Close every open region (last opened first) of a forward that raised; its graph is never used."""
        for key in sorted(self._open, reverse=True):
            with contextlib.suppress(Exception):  # the forward's own exception is the one to see
                self._close(key)
        self._open.clear()
        self._memory_poor = None

    def _close(self, key: int) -> None:
        region = self._open.pop(key)
        region.close()
        if region.unit.kind == MEMORY_POOR and key == region.unit.end:
            self._memory_poor = None

    def _run_block(self, record: CallRecord, main: torch.Tensor) -> torch.Tensor | None:
        """Re-run one block in recomputation, from ``main`` and the recorded other arguments."""
        _, module = self.blocks[record.index]
        args, kwargs = record.arguments(main)
        fqn = self.fqns[record.index]
        started = self.stats.started(fqn, main if self.time_recompute else None)
        try:
            record.rng.restore()  # Note [3]
            with extra_run(module):
                run = applied.forward_past_own_hooks(module, self._own_hook_ids[record.index])  # Note [4]
                out = self.io[record.index].output(run(*args, **kwargs), record.shape)
        finally:
            self.stats.stopped(fqn, started)
        if out is not None:
            for observer in self._observers:
                observer(record.index, out, True)
        return out

    def _open_single(
        self, i: int, p: int, unit: Unit, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        action = unit.action
        if compiled_partitions.runs_plainly(action):  # Note [5]: a partition's compiled variant runs it
            return
        region = OpenRegion(unit)
        kind = Action.parse(action).kind
        if kind in (OFFLOAD, COMPRESS, RECOMPUTE_COMPRESS):
            region.uncache_casts()  # Note [7]
            if kind == OFFLOAD:  # Note [10]
                region.context = self._offload.saving(self._names[p], module, args, kwargs)
            else:
                region.context = storing_context(action, module, args, kwargs, self._recompute_block, i, self.io[i])
            region.context.__enter__()
            self._open[p] = region
            return
        record, main = CallRecord.take(i, args, kwargs, self.io[i])
        context_fn = noop_context_fn
        if kind == SELECTIVE:
            context_fn = policies.get(Action.parse(action).policy).context_fn
        elif kind not in (CHECKPOINT, INPUT_COMPRESS):
            raise ValueError(f"unknown action {action!r} for block {self._names[p]!r}")

        region.records.append(record)
        self._open[p] = region
        region.uncache_casts()  # Note [7]
        recompute = lambda m: self._recompute_block(record, m)  # noqa: E731
        region.generator = open_block_frame(action, recompute, context_fn, main, record.requires_grad)

    def _recompute_block(self, record: CallRecord, main: torch.Tensor) -> None:
        with self._recomputing(), Forked(record.rng.devices, record.rng.device_type), policies.naming_second_backward():
            self._run_block(record, main)

    def _enter_segment_block(self, i: int, p: int, unit: Unit, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # Note [1]
        record, main = CallRecord.take(i, args, kwargs, self.io[i])
        if p == unit.start:
            region = OpenRegion(unit)
            records = region.records

            def recompute(saved_main: torch.Tensor) -> None:
                with self._recomputing(), Forked(records[0].rng.devices, records[0].rng.device_type):
                    current = saved_main
                    for rec in records:
                        current = self._run_block(rec, current)

            records.append(record)
            self._open[p] = region
            region.uncache_casts()  # Note [7]
            region.generator = open_checkpoint_frame(recompute, noop_context_fn, main)
            return
        region = self._open.get(unit.start)
        if region is None:
            raise missing_start_error(self._names[p], self._names[unit.start], SEGMENT)
        if not same_tensor(main, region.last_output):
            raise handoff_error(self._names[p - 1], self._names[p], main, region.last_outputs, SEGMENT)
        region.records.append(record)

    def _enter_memory_poor_block(
        self, i: int, p: int, unit: Unit, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        # Note [2]
        record, main = CallRecord.take(i, args, kwargs, self.io[i])
        if p == unit.start:
            self._memory_poor = {"input": main, "records": [], "last": None}
        group = self._memory_poor
        if group is None:
            raise missing_start_error(self._names[p], self._names[unit.start], "memory-poor group")
        if p > unit.start and not same_tensor(main, group["last"]):
            raise handoff_error(self._names[p - 1], self._names[p], main, group.get("outputs", []), MEMORY_POOR)
        previous = list(group["records"])
        group["records"].append(record)
        region = OpenRegion(unit, records=[record])

        def recompute(group_input: torch.Tensor) -> None:
            with self._recomputing(), Forked(record.rng.devices, record.rng.device_type):
                current = group_input
                with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(_store_nothing, _stored_nothing):
                    for rec in previous:
                        current = self._run_block(rec, current)
                current = current.detach().requires_grad_(record.requires_grad)
                self._run_block(record, current)

        self._open[p] = region
        region.uncache_casts()  # Note [7]
        region.generator = open_checkpoint_frame(recompute, noop_context_fn, group["input"])


def _store_nothing(_: torch.Tensor) -> None:
    """Note [2]: what a re-run that only rebuilds the next block's input saves is dropped."""
    return None


def _stored_nothing(_: None) -> torch.Tensor:
    raise RuntimeError("remat: a memory-poor group's rebuilt input was used in the backward (Note [2])")


def apply(
    model: nn.Module,
    plan: Plan,
    blocks: BlocksArg = None,
    *,
    main_input: InputName | Mapping[str, InputName] = None,
    main_output: OutputName | Mapping[str, OutputName] = None,
    time_recompute: bool = True,
    step: StepSpec | None = None,
) -> RematHandle:
    """Install ``plan`` on ``model``; return the handle (``set_plan``, ``remove``, ``stats``); Note [4].
    ``main_input``/``main_output`` name a block's hidden state where remat's guess is wrong
    (:mod:`remat.chains.blocks`); ``step`` (a :class:`remat.StepSpec`) gives them and ``blocks`` instead."""
    spec = StepSpec.of(step, blocks=blocks, main_input=main_input, main_output=main_output)
    applied.refuse_overlap(model)
    applied.strip_inert_hooks(model)
    refuse_hf_checkpointing(model)
    chain = resolve_blocks(model, spec.blocks)
    refuse_recomputed_blocks(chain)
    io = block_ios(chain, spec.main_input, spec.main_output)
    handle = RematHandle(model, chain, plan, time_recompute=time_recompute, io=io)
    handle._hooks += training_forward_guards(model, wrap=applied.HandleHook)
    applied.register(model, handle)
    model._remat_handle = handle  # type: ignore[assignment]
    return handle


def planned_calls(plan: Plan, fqns: Sequence[str]) -> tuple[Plan, CallPositions, list[Unit]]:
    """``plan`` as the runtime runs it on blocks ``fqns``: the plan (chains in ``fqns``' order when it names each
    block once), where each call sits in it, and its units over those positions. Raises when it does not fit."""
    if names_calls(list(plan.actions)):
        return plan, CallPositions(fqns, list(plan.actions)), plan.units()
    plan = plan.in_order(fqns)  # a plan of several chains lists them as the step runs them
    return plan, CallPositions(fqns, fqns), plan.units_for(fqns)
