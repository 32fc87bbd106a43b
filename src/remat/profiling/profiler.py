"""Measuring a CostTable on the real device: each block run in isolation under each action.

:class:`BlockProfiler` hooks the chain's blocks for one forward/backward step. When a block is first called it takes the
block's real inputs and, aside from the step (RNG forked, gradients restored, other remat hooks suspended), runs the
block alone under every action (:func:`measure_block`): a live-tensor tracker gives the bytes kept after the forward,
the forward and backward transients (:mod:`remat.profiling.block_bytes`); timed repeats of every action, interleaved,
give forward, backward, recompute and overhead seconds (:mod:`remat.profiling.block_timing`,
:mod:`remat.profiling.action_times`). The step itself is tracked too, for the memory before the chain (stem) and after
it (head), what the step keeps beside the blocks (T5's position biases, counted in the stem) and whether the model's
output collects the blocks' outputs (:mod:`remat.profiling.chain_bounds`). After that step :func:`profile` reads the
blocks' times where a plain step and a plan pay them, within whole steps of the model
(:mod:`remat.profiling.outside_time` for keep, :mod:`remat.profiling.action_steps` for every other action).

Under ``torch.autocast`` the isolated runs keep the step's autocast settings but turn autocast's weight-cast
cache off (:func:`remat.core.precision.casts_uncached`), so each block's casts are counted where they are made; the
settings are recorded in the table (``CostTable.autocast``).

Under an offload policy (``selective:offload_dots``...) the host copies are not device memory on CUDA and
the tracker does not count them; on CPU they are, and it does (see :mod:`remat.checkpointing.host_copies`). Such an
action's recompute seconds are the recomputation plus the forward's extra time (the copies it queues).

Blocks that cost the same (equal :func:`~remat.profiling.block_signature.block_signature`: structure, parameter and
input shapes, the same other arguments) are measured once: each block first by one forward under ``keep``
(:func:`~remat.profiling.block_signature.keep_footprint`: saved tensors, output, operators run), and a block whose
footprint matches that of a measured block of its group gets that block's row under its own name; the others
are measured fully. The table's ``info`` records the profile's wall time and how many blocks
were measured and reused.

Lossy actions (``compress:``, ``recompute+compress:``, ``checkpoint+compress:<format>``) are profiled only when
asked (``lossy=("int8",)``), with the gradient error each introduces in the block (:mod:`remat.profiling.grad_error`).
A block the forward calls more than once has a row per call, ``<fqn>@<k>`` (:mod:`remat.chains.block_calls`);
``call_grad_bytes`` counts the gradients of its later calls waiting for the earlier ones'. Several chains
(``blocks=remat.find_chains(model)``) are profiled in one step, rows in the order the step runs them.

Compiled blocks (``module.compile()``, :func:`remat.integrations.compile.compile_blocks`) stay compiled: their
bytes come from the allocator's events (:class:`~remat.meters.alloc_tracker.AllocationTracker`), the step's tracker
ignores compiled code, and they are profiled under keep, checkpoint, offload and the partitions they were
compiled for only (:func:`~remat.profiling.profiler.compiled_block_actions`).
It serves :func:`profile` and in-training profiling (the dynamic controllers wrap a first training step in it).

Invariant 1: a profile fits wherever a step with every block checkpointed does. Where :func:`profile`'s steps
keeping every block run out of the device's memory (``torch.OutOfMemoryError``: a device the plain step does not
fit, the case remat is for), what they held is released and the profile is taken again with every block
checkpointed, as a first training step is profiled without a sample batch (:func:`_profiled_checkpointed`;
``info["profiled_under"]`` says ``"checkpoint"``), through the plan the training runs where one is applied
(``RematHandle.running``, the plan put back afterwards). Its bytes are a kept profile's (each block is measured
alone); its times are the blocks' isolated runs', scaled to the blocks' time within steps where the host reads it.
The module also holds which actions a block is profiled under (:func:`default_actions`,
:func:`compiled_block_actions`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from ..chains import (
    BlockIO,
    ProfiledCalls,
    block_ios,
    chain_name,
    default_loss,
    drops_layers,
    extra_run,
    profiled_step,
    refuse_recomputed_blocks,
    resolve_chains,
    run_step,
    stepped_before,
    waiting_grad_bytes,
    warn_if_evaluating,
)
from ..checkpointing import eager, in_place_error, partition_actions
from ..checkpointing import policies as _policies
from ..core import (
    CHECKPOINT,
    KEEP,
    OFFLOAD,
    SEGMENT,
    Action,
    AutocastArg,
    AutocastSpec,
    Batch,
    BlockCost,
    BlocksArg,
    CostTable,
    InputName,
    OutputName,
    StepSpec,
    autocast_spec,
    casts_uncached,
    lossy_actions,
)
from ..meters import CompiledCodeIgnoringTracker, LiveTensorTracker, is_compiled, model_device, within_memory
from ..planning import Plan, overlap_priced, simulate
from ..runtime import applied, apply
from .action_steps import (
    ISOLATED,
    SEGMENT_PAIRS,
    STEPS,
    StepRun,
    actions_to_time,
    price_segments_in_steps,
    time_actions_in_steps,
)
from .block_measure import measure_block
from .block_run import GradsRestored
from .block_signature import Footprint, block_signature, keep_footprint, renamed
from .block_timing import Clock, copy_bandwidth, device_name
from .chain_bounds import ChainBounds, CollectedOutputs
from .outside_time import anchor_to_plain_steps, aside_from_step, in_backward, plain_steps

# ----------------------------------------------------------------------------------------------------
# The actions a block is profiled under: keep, checkpoint, the selective policies asked for, offload on CUDA and
# the lossy actions asked for (:func:`remat.core.lossy_actions`, checked before any block runs); on a compiled
# block (``module.compile()``) only those that leave its compiled code compiled, and the partition actions it
# was compiled for (:func:`compiled_block_actions`, :mod:`remat.checkpointing.compiled_partitions`).


# Actions whose regions open and close around a compiled forward with saved-tensor hooks only. A selective
# policy's dispatch mode sees only the few operators at the compiled graph's edge, not those inside it, so on
# a compiled block it is a checkpoint saving a few tensors more, not the policy its name says; a lossy action's
# compression is not profiled on compiled code.
COMPILED_BLOCK_ACTIONS = (KEEP, CHECKPOINT, OFFLOAD)


def default_actions(
    device: torch.device, policies: str | Iterable[str] = _policies.PROFILED_BY_DEFAULT, lossy: Iterable[str] = ()
) -> list[str]:
    """The actions a block is profiled under: keep, checkpoint, ``selective:<policy>`` for each of ``policies``
    (``"menu"`` for :data:`remat.policies.MENU`), offload on CUDA, and ``compress:<format>`` for each of
    ``lossy`` (formats or compress actions)."""
    actions = [KEEP, CHECKPOINT] + [Action.selective(name).text for name in _policies.expand(policies)]
    if device.type == "cuda":
        actions.append(OFFLOAD)
    return actions + lossy_actions(lossy)


def compiled_block_actions(
    fqn: str, actions: Sequence[str], asked: Sequence[str] = (), module: nn.Module | None = None
) -> list[str]:
    """Of ``actions``, those a compiled block can run (:data:`COMPILED_BLOCK_ACTIONS`), then the partition
    actions ``module`` was compiled for (:mod:`remat.checkpointing.compiled_partitions`); the per-op policies of the
    default set are left out. ``asked``: actions the caller named (``actions=``, ``lossy=``), refused with an error when
    the compiled block cannot run them."""
    partitions = partition_actions(module) if module is not None else []
    refused = [a for a in asked if a not in COMPILED_BLOCK_ACTIONS and a not in partitions]
    if refused:
        raise ValueError(
            f"block {fqn!r} is compiled (module.compile()) and cannot be profiled under {refused}: a per-op "
            "policy does not reach the operators inside compiled code, and compression is not profiled there. "
            f"Profile compiled blocks under {list(COMPILED_BLOCK_ACTIONS)} only, or profile before compiling"
        )
    chosen = [a for a in actions if a in COMPILED_BLOCK_ACTIONS]
    return chosen + [a for a in partitions if a not in chosen and (not asked or a in actions)]


__all__ = [
    "COMPILED_BLOCK_ACTIONS",
    "BlockProfiler",
    "compiled_block_actions",
    "default_actions",
    "default_loss",
    "measure_block",
    "price_segments",
    "profile",
    "run_step",
]


class BlockProfiler:
    """Profile every block of the chain during one real forward/backward step.

    >>> with BlockProfiler(model) as prof:
    ...     loss_fn(model(**batch)).backward()
    >>> costs = prof.cost_table()

    With ``reuse_identical`` (the default) a block whose signature and footprint under ``keep`` match an
    already measured block's gets a copy of that block's row; pass ``False`` to time every block.
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: BlocksArg = None,
        *,
        policies: str | Iterable[str] = _policies.PROFILED_BY_DEFAULT,
        actions: Sequence[str] | None = None,
        repeats: int = 3,
        io: Sequence[BlockIO] | None = None,
        reuse_identical: bool = True,
        lossy: Iterable[str] = (),
        clock: Clock = time.perf_counter,
        step_actions: Sequence[str] | None = None,
    ) -> None:
        self.model = model
        self.clock = clock
        self.step_actions = step_actions  # what the profiled step runs each block with (None: keep)
        self.chains = resolve_chains(model, blocks)
        self.chain = [pair for chain in self.chains for pair in chain]
        self.io = list(io) if io is not None else block_ios(self.chain)
        self.policies = tuple(_policies.expand(policies))
        self.lossy = lossy_actions(lossy)
        self.actions = list(actions) if actions is not None else None
        self.repeats = repeats
        chain_of = [k for k, chain in enumerate(self.chains) for _ in chain]
        self.calls = ProfiledCalls([fqn for fqn, _ in self.chain], chain_of, len(self.chains))  # one row per call
        self.rows: dict[tuple[int, int], BlockCost] = {}  # (chain, call in the chain) -> row
        self.reuse_identical = reuse_identical
        self.reused: dict[tuple[int, int], tuple[int, int]] = {}  # row -> the measured row it copies
        self.outputs = CollectedOutputs()  # does the model's output hold blocks' outputs (output_hidden_states)?
        self.input_shapes: dict[str, list[int]] = {}  # row name -> the shape of its main input in the step
        # signature -> (row key of the call measured for it, its footprint under keep)
        self._groups: dict[Hashable, dict[Footprint, tuple[int, int]]] = {}  # signature -> footprint -> row
        self._start: float | None = None
        self._elapsed: float | None = None
        self._hooks: list[Any] = []
        self._tracker: LiveTensorTracker | None = None
        self._bounds: ChainBounds | None = None
        self._busy = False
        self._device: torch.device | None = None
        self._autocast: AutocastSpec | None = None

    def __enter__(self) -> BlockProfiler:
        i = 0
        for k, chain in enumerate(self.chains):
            for j, (fqn, module) in enumerate(chain):
                # eager(): a compiled block calls its hooks inside its compiled call; they must not be traced
                self._hooks.append(module.register_forward_pre_hook(eager(self._pre_hook(i, fqn, k)), with_kwargs=True))
                last = j == len(chain) - 1
                self._hooks.append(module.register_forward_hook(eager(self._output_hook(i, k, last)), with_kwargs=True))
                i += 1
        self._hooks.append(self.model.register_forward_hook(self._model_output_hook))
        # With compiled blocks the step's tracker leaves compiled code compiled (and does not see inside it).
        compiled = any(is_compiled(module) for _, module in self.chain)
        self._tracker = CompiledCodeIgnoringTracker() if compiled else LiveTensorTracker()
        self._bounds = ChainBounds(self._tracker, len(self.chains))
        self._tracker.__enter__()
        self._start = time.perf_counter()
        self._elapsed = None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._start is not None:
            self._elapsed = time.perf_counter() - self._start
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._tracker is not None:
            self._tracker.exit_anywhere()  # the step may be found to have ended inside a later measure()
            self._tracker.close()

    def _pre_hook(self, i: int, fqn: str, k: int = 0) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._busy or not torch.is_grad_enabled():
                return
            if self.calls.called(i) and self._in_backward():  # recomputed (a later call in forward is a row)
                return
            main = self.io[i].input_tensor(args, kwargs)
            key, name = self.calls.call(i)
            self.input_shapes.setdefault(name, list(main.shape))
            self._device = main.device
            self._autocast = AutocastSpec.current(main.device.type)
            if self._bounds is not None:
                self._bounds.block_called(args, kwargs, main, k)
                self._tracker.mark(f"call{key[0]}.{key[1]}")
            actions = self.actions or default_actions(main.device, self.policies, self.lossy)
            if is_compiled(module):
                actions = compiled_block_actions(name, actions, [*(self.actions or ()), *self.lossy], module)
            self._busy = True
            try:
                # Step off every dispatch mode (the step's tracker included) so the block is timed and
                # measured as it runs in training, not through Python dispatch.
                with _disable_current_modes(), extra_run(module):
                    self._measure_or_reuse(key, i, name, module, args, kwargs, actions)
            except RuntimeError as error:
                if "in-place" in str(error) or "inplace" in str(error):
                    raise in_place_error(name, "while remat profiles it alone") from error
                raise
            finally:
                self._busy = False

        return hook

    def _in_backward(self) -> bool:
        """Whether the step's backward runs (a block called now is recomputed, not called by the forward)."""
        return in_backward() or (self._bounds is not None and self._bounds.backward_started)

    def _measure_or_reuse(
        self,
        key: tuple[int, int],
        i: int,
        fqn: str,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        actions: list[str],
    ) -> None:
        if self.reuse_identical:
            io = self.io[i]
            group = (block_signature(module, args, kwargs, io.input_slot(args, kwargs)), tuple(actions))
            footprint = keep_footprint(module, args, kwargs, io, log_operators=not is_compiled(module))
            measured = self._groups.setdefault(group, {})
            if footprint in measured:
                self.rows[key] = renamed(self.rows[measured[footprint]], fqn)
                self.reused[key] = measured[footprint]
                return
            measured[footprint] = key
        self.rows[key] = measure_block(
            fqn, module, args, kwargs, actions, repeats=self.repeats, io=self.io[i], clock=self.clock,
            blocks_in_step=len(self.chain),
        )  # fmt: skip

    def _main_output(self, i: int, args: Any, kwargs: dict[str, Any], output: Any) -> torch.Tensor | None:
        io = self.io[i]
        return io.output(output, io.input_tensor(args, kwargs).shape)

    def _output_hook(self, i: int, k: int, last: bool) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
            if self._busy or not torch.is_grad_enabled():
                return
            out = self._main_output(i, args, kwargs, output)
            self.outputs.block_output(out)
            # The chain's forward ends with its last block, or, once a block was called again (a loop), with
            # the latest call of any of its blocks.
            looped = self.calls.looped(k)
            if self._bounds is not None and (last or looped) and not self._in_backward():
                self._bounds.chain_output(out, k, move=looped)

        return hook

    def _model_output_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._busy:
            self.outputs.model_output(output, len(self.chains))

    def cost_table(self) -> CostTable:
        """The measured table; raises if the step did not run every block with grad enabled."""
        missing = self.calls.missing()
        if missing:
            raise RuntimeError(
                f"blocks {missing} did not run during the profiled step (with grad enabled); profile a full "
                "forward and backward of the model. A model that skips layers at random in training is profiled with "
                "its Hugging Face LayerDrop settings at 0 (config.layerdrop, encoder_layerdrop...); switch off any "
                "other random skipping (stochastic depth that skips a whole block) for the profile"
            )
        keys = self.calls.keys()
        rows = [self.rows[key] for key in keys]
        bounds: dict[str, Any] = {}
        if self._bounds is not None:
            lengths = self.calls.lengths()
            acts = [KEEP] * len(rows)
            if self.step_actions is not None:  # per row, or per block (each call of a block under its action)
                per_row = len(self.step_actions) == len(rows)
                acts = [self.step_actions[n if per_row else self.calls.block_of(key)] for n, key in enumerate(keys)]
            kept = [r.saved(a) if a in r.saved_bytes else r.saved(CHECKPOINT) for r, a in zip(rows, acts, strict=True)]
            bounds = self._bounds.table_fields(kept, lengths)
            if len(self.chains) > 1:
                names = [chain_name(c) for c in self.chains]
                rows = self._bounds.in_call_order(rows, lengths, names)
                keys = self._bounds.in_call_order(keys, lengths, names)
        if self.calls.repeated():
            grads = [
                sum(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad) for _, m in self.chain
            ]
            bounds["call_grad_bytes"] = waiting_grad_bytes([self.calls.block_of(key) for key in keys], grads)
        device = self._device or torch.device("cpu")
        return CostTable(
            blocks=rows,
            **bounds,
            outputs_kept=self.outputs.kept,
            device=device.type,
            source="measured",
            info={
                "torch": str(torch.__version__),
                "device_name": device_name(device),
                "profile_s": self._profile_seconds(),
                "blocks_measured": len(self.rows) - len(self.reused),
                "blocks_reused": len(self.reused),
                "input_shapes": dict(self.input_shapes),
                "same_costs_as": {self.rows[k].fqn: self.rows[src].fqn for k, src in self.reused.items()},
                **({"called_more_than_once": self.calls.repeated()} if self.calls.repeated() else {}),
            },
            autocast=(self._autocast or AutocastSpec.current(device.type)).to_dict(),
        )

    def _profile_seconds(self) -> float:
        """Wall time of the profiled step (up to now while it is still open)."""
        if self._elapsed is not None:
            return self._elapsed
        return time.perf_counter() - self._start if self._start is not None else 0.0


def profile(
    model: nn.Module,
    batch: Batch,
    *,
    step: StepSpec | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    blocks: BlocksArg = None,
    policies: str | Iterable[str] = _policies.PROFILED_BY_DEFAULT,
    repeats: int | None = None,
    main_input: InputName | Mapping[str, InputName] = None,
    main_output: OutputName | Mapping[str, OutputName] = None,
    reuse_identical: bool = True,
    autocast: AutocastArg = None,
    lossy: Iterable[str] = (),
    clock: Clock = time.perf_counter,
    holds_output: bool | None = None,
    actions_in_steps: bool = True,
    price_segments: bool = True,
) -> CostTable:
    """Measure the :class:`CostTable` of ``model`` on ``batch`` (a tensor, a tuple of positional args or a
    dict of keyword args). ``step``: the training step (:class:`remat.StepSpec`); its fields may be given as
    keywords instead. ``loss_fn(output)`` defaults to ``output.loss`` or ``output.sum()``.
    ``main_input``/``main_output`` name the hidden state a block takes and returns where remat's guess is
    wrong (see :mod:`remat.chains.blocks`). ``policies``: the per-operator policies measured as ``selective:<name>``
    actions (names, or ``"menu"`` for :data:`remat.policies.MENU`). Parameter gradients are left as they were.
    Blocks that cost the same are measured once unless ``reuse_identical`` is false (see
    :class:`BlockProfiler`); ``info["profile_s"]`` is the profile's wall time. ``lossy`` adds compress actions
    (formats such as ``"int8"``, ``"fp8"``, or ``"compress:int8:matmul"``), with their measured gradient error.

    Mixed precision: called inside the training loop's ``torch.autocast`` context, the step is measured under
    it. ``autocast=`` names the setting instead (``torch.bfloat16``, ``"fp16"``, a dict ``{"dtype": ...,
    "device_type": ...}``, a :class:`remat.core.precision.AutocastSpec`, or ``False`` for none): the forward and the
    loss then run under that autocast, the backward outside it, as in a training step. Either way the step runs
    with autocast's weight-cast cache off (see :mod:`remat.core.precision`), and the table records the setting.
    One untimed plain step runs first (warm-up), unless a step of the model on a batch of this structure ran in
    this process already (:func:`remat.chains.stepped_before`). After the profiled step, plain steps are timed for
    ``outside_s``: each step less the time its blocks took in it (:mod:`remat.profiling.outside_time`), or on CUDA
    the step less the blocks' isolated times. Where the blocks were timed within those steps, ``actions_in_steps``
    (default) times every action within whole steps too, three rounds of steps that mix the actions over blocks
    that cost the same, and two pairs of steps price a segment (:mod:`remat.profiling.action_steps`,
    ``info["action_times_from"]``); one plain step comes before them then, three otherwise. ``repeats``: timed
    runs per action of a block alone (default 1 where the steps will time the actions, on the CPU, else 3).
    ``price_segments=False`` leaves out the segment's pairs of steps (``info["segments_priced"]`` is then
    False where they could run): :func:`price_segments` runs them once a plan holds a segment.

    ``clock`` is what every time is read from: wall-clock ``time.perf_counter`` by default; on a shared CPU
    with one intra-op thread, ``time.process_time`` gives the seconds the step would take on a machine of its
    own, however busy this one is (it counts every thread's CPU time, so not with several).

    ``holds_output``: whether the training loop holds the model's output through the backward, as
    ``out = model(**batch); out.loss.backward()`` does (the default, the safe side). A loop that keeps only the
    loss (``model(**batch).loss.backward()``, Hugging Face's Trainer, a Lightning ``training_step`` returning the
    loss) frees the output's other tensors (the logits) before the backward: profile it with
    ``holds_output=False`` so the head's figures leave them out and the predicted peak is that loop's, not the
    logits higher. A table profiled so under-predicts a loop that holds the output by what the output holds;
    ``info["holds_output"]`` records the setting."""
    started = time.perf_counter()
    step = StepSpec.of(step, loss_fn=loss_fn, blocks=blocks, main_input=main_input, main_output=main_output,
                       autocast=autocast, holds_output=holds_output)  # fmt: skip
    loss_fn, main_input, main_output, holds_output = step.loss_fn, step.main_input, step.main_output, step.holds_output
    warn_if_evaluating(model, "remat.profile")
    device = model_device(model).type
    spec = autocast_spec(step.autocast, device)
    if repeats is None:  # the steps replace every exact action's isolated figures but its recomputation
        repeats = 1 if actions_in_steps and device == "cpu" else 3
    chains = resolve_chains(model, step.blocks)
    joined = [pair for chain in chains for pair in chain]
    refuse_recomputed_blocks(joined)
    io = block_ios(joined, main_input, main_output)
    profiler = BlockProfiler(
        model,
        chains,
        policies=policies,
        repeats=repeats,
        io=io,
        reuse_identical=reuse_identical,
        lossy=lossy,
        clock=clock,
    )
    def kept() -> CostTable:
        """The profile of steps that keep every block."""
        with GradsRestored(model), profiled_step(model):
            # One untimed plain step first unless one ran already: the first step in a process runs slower
            # (allocator growth, first-touch page faults, lazy initialisation; 5% in the median on a CPU, up to
            # 30%), and the one block timed of a group of identical ones prices them all.
            if not stepped_before(model, batch):
                with aside_from_step(model, device):
                    run_step(model, batch, loss_fn, autocast=spec, holds_output=holds_output)
            with profiler, casts_uncached():
                run_step(model, batch, loss_fn, autocast=spec, holds_output=holds_output)
            costs = profiler.cost_table()
            costs.info["holds_output"] = holds_output
            costs.info["clock"] = getattr(clock, "__name__", repr(clock))
            # The step outside the chain's blocks, and the blocks' keep times within it: plain steps (no plan). Where
            # the actions are timed within steps next, one plain step is enough: those steps anchor the table again.
            fqns = [fqn for fqn, _ in profiler.chain]
            modules = [module for _, module in profiler.chain]
            in_steps = actions_in_steps and costs.device == "cpu" and bool(actions_to_time(costs))
            with aside_from_step(model, costs.device):
                steps = 1 if in_steps else 3
                plain = plain_steps(model, batch, loss_fn, modules, io, steps=steps, autocast=spec, clock=clock)
            anchor_to_plain_steps(costs, plain, fqns)
            if actions_in_steps:
                run = StepRun(model, batch, loss_fn, profiler.chain, io, main_input, main_output, spec, clock,
                              holds_output)  # fmt: skip
                with aside_from_step(model, costs.device, suspend=False):
                    time_actions_in_steps(run, costs, segment_pairs=SEGMENT_PAIRS if price_segments else 0)
            else:
                costs.info["action_times_from"] = f"{ISOLATED} (actions_in_steps=False)"
            if in_steps and not costs.info["action_times_from"].startswith(STEPS):  # not anchored by the steps
                with aside_from_step(model, costs.device):
                    more = plain_steps(model, batch, loss_fn, modules, io, steps=3, autocast=spec, clock=clock)
                anchor_to_plain_steps(costs, more, fqns)
        return costs

    costs, _ = within_memory(kept, model_device(model))  # invariant 1
    if costs is None:
        costs = _profiled_checkpointed(model, batch, step, spec, chains, io, policies, repeats, reuse_identical,
                                       lossy, clock)  # fmt: skip
    if device == "cuda" and any(OFFLOAD in row.saved_bytes for row in costs.blocks):
        moved = max(row.saved(KEEP) - row.saved(OFFLOAD) for row in costs.blocks if OFFLOAD in row.saved_bytes)
        costs.copy_bytes_per_s = copy_bandwidth(model_device(model), moved)
        costs = overlap_priced(costs)  # offload costs what its copies leave exposed (planning.offload_overlap)
    if drops_layers(model):  # measured with every layer run (chains.hf_guards): plans keep to single blocks
        costs.info["layer_drop"] = True
    costs.info["profile_s"] = time.perf_counter() - started
    return costs


def _profiled_checkpointed(model: nn.Module, batch: Batch, step: StepSpec, spec: AutocastSpec | None,
                           chains: list[list[tuple[str, nn.Module]]], io: list[BlockIO],
                           policies: str | Iterable[str], repeats: int, reuse_identical: bool, lossy: Iterable[str],
                           clock: Clock) -> CostTable:  # fmt: skip
    """Invariant 1: the profile of a step that runs with every block checkpointed, as a first training step is
    profiled without a sample batch. Each block is measured alone under every action as in a kept step (the same
    bytes: a block's run alone does not depend on what the step keeps), the step holds only the checkpoints
    beside it. Steps under the same plan give ``outside_s``; where the host times the blocks within them (a CPU),
    every block time is scaled so that the plan's predicted blocks take what they took there (isolated runs of
    small blocks read slower than within a step), else ``outside_s`` is the step less the blocks' isolated times.
    A segment's price is left unmeasured."""
    joined = [pair for chain in chains for pair in chain]
    fqns = [fqn for fqn, _ in joined]
    plan = Plan(dict.fromkeys(fqns, CHECKPOINT), strategy="profiling")
    training = applied.owner_of(model)  # a plan the training runs (a profile before a batch beyond the measured)
    if training is not None and training.fqns != fqns:
        raise RuntimeError(
            f"remat.profile: the step keeping every block ran out of memory, and the plan applied to the model acts "
            f"on {training.fqns}, not on the blocks profiled ({fqns}): profile the blocks it acts on"
        )
    handle = training if training is not None else apply(model, plan, step=replace(step, blocks=fqns))
    device = model_device(model).type
    try:
        with GradsRestored(model), profiled_step(model), (training.running(plan) if training else nullcontext()):
            with aside_from_step(model, device, suspend=False):
                run_step(model, batch, step.loss_fn, autocast=spec, holds_output=step.holds_output)  # warm-up
            profiler = BlockProfiler(model, chains, policies=policies, repeats=max(repeats, 3), io=handle.io,
                                     reuse_identical=reuse_identical, lossy=lossy, clock=clock,
                                     step_actions=[CHECKPOINT] * len(joined))  # fmt: skip
            with profiler, casts_uncached():
                run_step(model, batch, step.loss_fn, autocast=spec, holds_output=step.holds_output)
            costs = profiler.cost_table()
            with aside_from_step(model, device, suspend=False):
                plain = plain_steps(model, batch, step.loss_fn, [m for _, m in joined], handle.io, steps=3,
                                    autocast=spec, clock=clock)  # fmt: skip
    finally:
        if training is None:
            handle.remove()
    checkpointed = simulate(costs, [CHECKPOINT] * len(costs)).step_s  # the blocks' isolated times, outside none
    if plain.outside_s is not None:  # the blocks' windows within the steps (a CPU): their times brought to them
        factor = (plain.step_s - plain.outside_s) / checkpointed if checkpointed > 0 else 1.0
        costs.blocks = [row.times_scaled(factor) for row in costs.blocks]
        costs.outside_s = plain.outside_s
    else:  # a device whose blocks the host cannot time within the step: the step less their isolated times
        costs.outside_s = plain.step_s - checkpointed
    costs.info.update(holds_output=step.holds_output, clock=getattr(clock, "__name__", repr(clock)),
                      profiled_under=CHECKPOINT, times_from="isolated runs", action_times_from=ISOLATED)  # fmt: skip
    return costs


def price_segments(
    model: nn.Module,
    batch: Batch,
    costs: CostTable,
    *,
    plan: Plan | None = None,
    step: StepSpec | None = None,
    clock: Clock = time.perf_counter,
) -> bool:
    """Measure, in ``costs`` (``model``'s profile on ``batch``, taken with ``price_segments=False``), what a
    segment's waiting blocks cost (:func:`remat.profiling.action_steps.price_segments_in_steps`: two pairs of
    steps), where the table left it unmeasured and, with ``plan``, only where that plan holds a segment: the
    measurement a budget that segments do not serve never needs. Returns whether it measured (plan again
    then). Parameter gradients, buffers and the RNG state are left as they were."""
    if costs.info.get("segments_priced") is not False:
        return False
    if plan is not None and not any(Action.parse(a).kind == SEGMENT for a in plan.actions.values()):
        return False
    step = step or StepSpec()
    chains = resolve_chains(model, step.blocks)
    chain = [pair for c in chains for pair in c]
    io = block_ios(chain, step.main_input, step.main_output)
    spec = autocast_spec(step.autocast, costs.device)
    run = StepRun(model, batch, step.loss_fn, chain, io, step.main_input, step.main_output, spec, clock,
                  step.holds_output)  # fmt: skip
    with GradsRestored(model), profiled_step(model), aside_from_step(model, costs.device, suspend=False):
        return price_segments_in_steps(run, costs)
