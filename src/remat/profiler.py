"""Measuring a CostTable on the real device: each block run in isolation under each action.

:class:`BlockProfiler` hooks the chain's blocks for one forward/backward step. When a block is first called it
takes the block's real inputs and, aside from the step (RNG forked, gradients restored, other remat hooks
suspended), runs the block alone under every action (:func:`measure_block`): a live-tensor tracker gives the
bytes kept after the forward, the forward and backward transients (:mod:`remat.block_bytes`); timed repeats
of every action, interleaved, give forward, backward, recompute and overhead seconds
(:mod:`remat.block_timing`, :mod:`remat.action_times`). The step itself is tracked too, for the memory before
the chain (stem) and after it (head), what the step keeps beside the blocks (T5's position biases, counted in
the stem) and whether the model's output collects the blocks' outputs (:mod:`remat.chain_bounds`).

Under ``torch.autocast`` the isolated runs keep the step's autocast settings but turn autocast's weight-cast
cache off (:func:`remat.precision.casts_uncached`), so each block's casts are counted where they are made; the
settings are recorded in the table (``CostTable.autocast``).

Under an offload policy (``selective:offload_dots``...) the host copies are not device memory on CUDA and
the tracker does not count them; on CPU they are, and it does (see :mod:`remat.host_copies`). Such an
action's recompute seconds are the recomputation plus the forward's extra time (the copies it queues).

Blocks that cost the same (equal :func:`~remat.block_signature.block_signature`: structure, parameter and
input shapes, the same other arguments) are measured once: the first of each group fully, the others by one
forward under ``keep`` whose saved tensors and output must match the first's
(:func:`~remat.block_signature.keep_footprint`) before its row is reused under their names; a block that
does not match is measured fully. The table's ``info`` records the profile's wall time and how many blocks
were measured and reused.

Lossy actions (``compress:<format>`` and ``checkpoint+compress:<format>``) are profiled only when asked
(``profile(..., lossy=("int8",))`` profiles both for int8): their rows also get the gradient error the action
introduces in the block (:mod:`remat.grad_error`).

Several chains (``blocks=remat.find_chains(model)``) are profiled in the same step: the table holds their rows
in the order the step runs them, with ``chain_lengths`` and the bytes between them (``between_bytes``).

It serves both :func:`profile` (one step on a sample batch) and in-training profiling: the dynamic controllers
wrap the first real training step in a ``BlockProfiler``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from . import policies as _policies
from .action_times import action_times
from .block_bytes import ByteTerms, run_tracked, tensor_bytes
from .block_run import GradsRestored, edge_backward_supported, parameters_detached
from .block_signature import Footprint, block_signature, keep_footprint, renamed
from .block_timing import time_actions
from .blocks import (
    BlockIO,
    BlocksArg,
    InputName,
    OutputName,
    block_ios,
    replace_slot,
    resolve_chains,
    slot_value,
    without_caches,
)
from .chain import chain_name
from .chain_bounds import ChainBounds, CollectedOutputs
from .costs import CHECKPOINT, KEEP, OFFLOAD, SELECTIVE_PREFIX, BlockCost, CostTable
from .grad_error import block_grad_error
from .hf_guards import profiled_step
from .lossy_actions import is_lossy, lossy_actions
from .memory import LiveTensorTracker, model_device
from .model_state import detached_from_step, extra_run
from .precision import AutocastArg, AutocastSpec, autocast_spec, casts_uncached
from .regions import in_place_error
from .suspension import suspend_all
from .training_step import Batch, default_loss, run_step, step_seconds

__all__ = ["BlockProfiler", "default_actions", "default_loss", "measure_block", "profile", "run_step"]


def default_actions(
    device: torch.device, policies: str | Iterable[str] = ("dots_saveable",), lossy: Iterable[str] = ()
) -> list[str]:
    """The actions a block is profiled under: keep, checkpoint, ``selective:<policy>`` for each of ``policies``
    (``"menu"`` for :data:`remat.policies.MENU`), offload on CUDA, and ``compress:<format>`` for each of
    ``lossy`` (formats or compress actions)."""
    actions = [KEEP, CHECKPOINT] + [SELECTIVE_PREFIX + name for name in _policies.expand(policies)]
    if device.type == "cuda":
        actions.append(OFFLOAD)
    return actions + lossy_actions(lossy)


def measure_block(
    fqn: str,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    actions: Sequence[str],
    *,
    repeats: int = 3,
    io: BlockIO | None = None,
) -> BlockCost:
    """Costs of one block on these inputs, under each of ``actions`` (``"keep"`` must be among them); ``io``
    says which argument and output are its hidden state (guessed by default)."""
    io = io or BlockIO.of(fqn, module)
    slot = io.input_slot(args, kwargs)
    source = slot_value(args, kwargs, slot)
    device = source.device
    main = source.detach().requires_grad_(True)
    args, kwargs = detached_from_step(*without_caches(*replace_slot(args, kwargs, slot, main)))
    trackers: dict[str, LiveTensorTracker] = {}
    output_bytes = 0
    edge_backward_supported()  # probe once here, not inside a tracked region

    def pick(value: Any) -> torch.Tensor | None:
        return io.output(value, main.shape)

    identity = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    rng_devices = [device.index or 0] if device.type == "cuda" else []
    with (
        suspend_all(),
        identity,
        GradsRestored(module),
        parameters_detached(module),  # no hook of the step's parameters fires (DDP's reducer)
        torch.random.fork_rng(devices=rng_devices, device_type=device.type),
        casts_uncached(),
    ):
        for action in actions:
            trackers[action] = LiveTensorTracker(device)
            output_bytes = run_tracked(trackers[action], module, action, args, kwargs, main, pick=pick)
        times = action_times(time_actions(module, actions, args, kwargs, main, device, repeats, pick=pick))
        errors = {a: block_grad_error(module, a, args, kwargs, main) for a in actions if is_lossy(a)}
    terms = ByteTerms.from_trackers(trackers, input_bytes=tensor_bytes(main))
    return BlockCost(
        fqn=fqn,
        fwd_s=times.fwd_s,
        bwd_s=times.bwd_s,
        input_bytes=tensor_bytes(main),
        output_bytes=output_bytes,
        saved_bytes=terms.saved,
        recompute_s=times.recompute_s,
        fwd_temp_bytes=terms.fwd_temp,
        bwd_temp_bytes=terms.bwd_temp,
        bwd_extra_bytes=terms.bwd_extra,
        grad_error={a: e.relative for a, e in errors.items()},
        grad_cosine={a: e.cosine for a, e in errors.items()},
        fwd_s_by_action=times.fwd_s_by_action,
        bwd_s_by_action=times.bwd_s_by_action,
        overhead_s=times.overhead_s,
    )


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
        policies: str | Iterable[str] = ("dots_saveable",),
        actions: Sequence[str] | None = None,
        repeats: int = 3,
        io: Sequence[BlockIO] | None = None,
        reuse_identical: bool = True,
        lossy: Iterable[str] = (),
    ) -> None:
        self.model = model
        self.chains = resolve_chains(model, blocks)
        self.chain = [pair for chain in self.chains for pair in chain]
        self.io = list(io) if io is not None else block_ios(self.chain)
        self.policies = tuple(_policies.expand(policies))
        self.lossy = lossy_actions(lossy)
        self.actions = list(actions) if actions is not None else None
        self.repeats = repeats
        self.rows: dict[int, BlockCost] = {}
        self.reuse_identical = reuse_identical
        self.reused: set[int] = set()
        self.outputs = CollectedOutputs()  # does the model's output hold blocks' outputs (output_hidden_states)?
        # signature -> (index of the block measured for it, its footprint under keep)
        self._groups: dict[Hashable, tuple[int, Footprint]] = {}
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
            for fqn, module in chain:
                self._hooks.append(module.register_forward_pre_hook(self._pre_hook(i, fqn, k), with_kwargs=True))
                self._hooks.append(module.register_forward_hook(self._output_hook(i), with_kwargs=True))
                i += 1
            self._hooks.append(chain[-1][1].register_forward_hook(self._chain_end_hook(i - 1, k), with_kwargs=True))
        self._hooks.append(self.model.register_forward_hook(self._model_output_hook))
        self._tracker = LiveTensorTracker()
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
            if self._busy or i in self.rows or not torch.is_grad_enabled():
                return
            main = self.io[i].input_tensor(args, kwargs)
            self._device = main.device
            self._autocast = AutocastSpec.current(main.device.type)
            if self._bounds is not None:
                self._bounds.block_called(args, kwargs, main, k)
                self._tracker.mark(f"call{i}")
            actions = self.actions or default_actions(main.device, self.policies, self.lossy)
            self._busy = True
            try:
                # Step off every dispatch mode (the step's tracker included) so the block is timed and
                # measured as it runs in training, not through Python dispatch.
                with _disable_current_modes(), extra_run(module):
                    self._measure_or_reuse(i, fqn, module, args, kwargs, actions)
            except RuntimeError as error:
                if "in-place" in str(error) or "inplace" in str(error):
                    raise in_place_error(fqn, "while remat profiles it alone") from error
                raise
            finally:
                self._busy = False

        return hook

    def _measure_or_reuse(
        self, i: int, fqn: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], actions: list[str]
    ) -> None:
        if not self.reuse_identical:
            self.rows[i] = measure_block(fqn, module, args, kwargs, actions, repeats=self.repeats, io=self.io[i])
            return
        io = self.io[i]
        key = (block_signature(module, args, kwargs, io.input_slot(args, kwargs)), tuple(actions))
        footprint = keep_footprint(module, args, kwargs, io)
        first = self._groups.get(key)
        if first is not None and first[1] == footprint:
            self.rows[i] = renamed(self.rows[first[0]], fqn)
            self.reused.add(i)
            return
        self.rows[i] = measure_block(fqn, module, args, kwargs, actions, repeats=self.repeats, io=self.io[i])
        if first is None:
            self._groups[key] = (i, footprint)

    def _main_output(self, i: int, args: Any, kwargs: dict[str, Any], output: Any) -> torch.Tensor | None:
        io = self.io[i]
        return io.output(output, io.input_tensor(args, kwargs).shape)

    def _output_hook(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
            if not self._busy and torch.is_grad_enabled():
                self.outputs.block_output(self._main_output(i, args, kwargs, output))

        return hook

    def _model_output_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._busy:
            self.outputs.model_output(output, len(self.chains))

    def _chain_end_hook(self, i: int, k: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
            if self._bounds is not None and not self._busy:
                self._bounds.chain_output(self._main_output(i, args, kwargs, output), k)

        return hook

    def cost_table(self) -> CostTable:
        """The measured table; raises if the step did not run every block with grad enabled."""
        missing = [self.chain[i][0] for i in range(len(self.chain)) if i not in self.rows]
        if missing:
            raise RuntimeError(
                f"blocks {missing} did not run during the profiled step (with grad enabled); "
                "profile a full forward and backward of the model"
            )
        rows = [self.rows[i] for i in range(len(self.chain))]
        bounds: dict[str, Any] = {}
        if self._bounds is not None:
            lengths = [len(chain) for chain in self.chains]
            bounds = self._bounds.table_fields([row.saved(KEEP) for row in rows], lengths)
            if len(self.chains) > 1:
                rows = self._bounds.in_call_order(rows, lengths, [chain_name(c) for c in self.chains])
        device = self._device or torch.device("cpu")
        return CostTable(
            blocks=rows,
            **bounds,
            outputs_kept=self.outputs.kept,
            device=device.type,
            source="measured",
            info={
                "torch": str(torch.__version__),
                "device_name": _device_name(device),
                "profile_s": self._profile_seconds(),
                "blocks_measured": len(self.rows) - len(self.reused),
                "blocks_reused": len(self.reused),
            },
            autocast=(self._autocast or AutocastSpec.current(device.type)).to_dict(),
        )

    def _profile_seconds(self) -> float:
        """Wall time of the profiled step (up to now while it is still open)."""
        if self._elapsed is not None:
            return self._elapsed
        return time.perf_counter() - self._start if self._start is not None else 0.0


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine()


def profile(
    model: nn.Module,
    batch: Batch,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    blocks: BlocksArg = None,
    policies: str | Iterable[str] = ("dots_saveable",),
    repeats: int = 3,
    main_input: InputName | Mapping[str, InputName] = None,
    main_output: OutputName | Mapping[str, OutputName] = None,
    reuse_identical: bool = True,
    autocast: AutocastArg = None,
    lossy: Iterable[str] = (),
) -> CostTable:
    """Measure the :class:`CostTable` of ``model`` on ``batch`` (a tensor, a tuple of positional args or a
    dict of keyword args). ``loss_fn(output)`` defaults to ``output.loss`` or ``output.sum()``.
    ``main_input``/``main_output`` name the hidden state a block takes and returns where remat's guess is
    wrong (see :mod:`remat.blocks`). ``policies``: the per-operator policies measured as ``selective:<name>``
    actions (names, or ``"menu"`` for :data:`remat.policies.MENU`). Parameter gradients are left as they were.
    Blocks that cost the same are measured once unless ``reuse_identical`` is false (see
    :class:`BlockProfiler`); ``info["profile_s"]`` is the profile's wall time. ``lossy`` adds compress actions
    (formats such as ``"int8"``, ``"fp8"``, or ``"compress:int8:matmul"``), with their measured gradient error.

    Mixed precision: called inside the training loop's ``torch.autocast`` context, the step is measured under
    it. ``autocast=`` names the setting instead (``torch.bfloat16``, ``"fp16"``, a dict ``{"dtype": ...,
    "device_type": ...}``, a :class:`remat.precision.AutocastSpec`, or ``False`` for none): the forward and the
    loss then run under that autocast, the backward outside it, as in a training step. Either way the step runs
    with autocast's weight-cast cache off (see :mod:`remat.precision`), and the table records the setting.
    After the profiled step, three plain steps are timed for ``outside_s`` (the step less its blocks)."""
    spec = autocast_spec(autocast, model_device(model).type)
    chains = resolve_chains(model, blocks)
    io = block_ios([pair for chain in chains for pair in chain], main_input, main_output)
    profiler = BlockProfiler(
        model, chains, policies=policies, repeats=repeats, io=io, reuse_identical=reuse_identical, lossy=lossy
    )
    with GradsRestored(model), profiled_step(model):
        with profiler, casts_uncached():
            run_step(model, batch, loss_fn, autocast=spec)
        costs = profiler.cost_table()
        # The step outside the chain's blocks: plain steps (no plan applied) timed after the profiled one.
        rng = torch.random.fork_rng(devices=[] if costs.device == "cpu" else None, device_type=costs.device)
        # no parameter hook fires, buffers (BatchNorm statistics) are left as the profiled step left them
        with suspend_all(), rng, casts_uncached(), parameters_detached(model), extra_run(model):
            step = step_seconds(model, batch, loss_fn, steps=3, autocast=spec)
    # Not floored at 0: blocks timed alone can run slower than inside a step (small blocks above all), and
    # a negative remainder keeps the predicted step of keeping everything equal to the measured one.
    costs.outside_s = step - sum(b.fwd_s + b.bwd_s for b in costs.blocks)
    return costs
