"""Measuring a CostTable on the real device: each block run in isolation under each action.

:class:`BlockProfiler` hooks the chain's blocks for one forward/backward step. When a block is first called it
takes the block's real inputs and, aside from the step (RNG forked, gradients restored, other remat hooks
suspended), runs the block alone under every action (:func:`measure_block`): a live-tensor tracker gives the
bytes kept after the forward, the forward and backward transients (:mod:`remat.block_bytes`); timed repeats
of every action, interleaved, give forward, backward, recompute and overhead seconds
(:mod:`remat.block_timing`, :mod:`remat.action_times`). The step itself is tracked too, for
the memory before the chain (stem) and after it (head) (:mod:`remat.chain_bounds`).

Under an offload policy (``selective:offload_dots``...) the host copies are not device memory on CUDA and
the tracker does not count them; on CPU they are, and it does (see :mod:`remat.host_copies`). Such an
action's recompute seconds are the recomputation plus the forward's extra time (the copies it queues).

It serves both :func:`profile` (one step on a sample batch) and in-training profiling: the dynamic controllers
wrap the first real training step in a ``BlockProfiler``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from . import policies as _policies
from .action_times import action_times
from .block_bytes import ByteTerms, run_tracked, tensor_bytes
from .block_run import GradsRestored, edge_backward_supported
from .block_timing import time_actions
from .blocks import BlocksArg, main_input, main_input_slot, replace_slot, resolve_blocks, slot_value, without_caches
from .chain_bounds import ChainBounds
from .costs import CHECKPOINT, KEEP, OFFLOAD, SELECTIVE_PREFIX, BlockCost, CostTable
from .hf_guards import profiled_step
from .memory import LiveTensorTracker
from .model_state import detached_from_step, extra_run
from .suspension import suspend_all
from .training_step import Batch, default_loss, run_step, step_seconds

__all__ = ["BlockProfiler", "default_actions", "default_loss", "measure_block", "profile", "run_step"]


def default_actions(device: torch.device, policies: Iterable[str] = ("dots_saveable",)) -> list[str]:
    """The actions a block is profiled under: keep, checkpoint, ``selective:<policy>`` for each of ``policies``,
    and offload on CUDA."""
    actions = [KEEP, CHECKPOINT] + [SELECTIVE_PREFIX + _policies.get(p).name for p in policies]
    if device.type == "cuda":
        actions.append(OFFLOAD)
    return actions


def measure_block(
    fqn: str,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    actions: Sequence[str],
    *,
    repeats: int = 3,
) -> BlockCost:
    """Costs of one block on these inputs, under each of ``actions`` (``"keep"`` must be among them)."""
    slot = main_input_slot(args, kwargs)
    source = slot_value(args, kwargs, slot)
    device = source.device
    main = source.detach().requires_grad_(True)
    args, kwargs = detached_from_step(*without_caches(*replace_slot(args, kwargs, slot, main)))
    trackers: dict[str, LiveTensorTracker] = {}
    output_bytes = 0
    edge_backward_supported()  # probe once here, not inside a tracked region
    identity = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    rng_devices = [device.index or 0] if device.type == "cuda" else []
    with (
        suspend_all(),
        identity,
        GradsRestored(module),
        torch.random.fork_rng(devices=rng_devices, device_type=device.type),
    ):
        for action in actions:
            trackers[action] = LiveTensorTracker(device)
            output_bytes = run_tracked(trackers[action], module, action, args, kwargs, main)
        times = action_times(time_actions(module, actions, args, kwargs, main, device, repeats))
    terms = ByteTerms.from_trackers(trackers)
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
        fwd_s_by_action=times.fwd_s_by_action,
        bwd_s_by_action=times.bwd_s_by_action,
        overhead_s=times.overhead_s,
    )


class BlockProfiler:
    """Profile every block of the chain during one real forward/backward step.

    >>> with BlockProfiler(model) as prof:
    ...     loss_fn(model(**batch)).backward()
    >>> costs = prof.cost_table()
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: BlocksArg = None,
        *,
        policies: Iterable[str] = ("dots_saveable",),
        actions: Sequence[str] | None = None,
        repeats: int = 3,
    ) -> None:
        self.model = model
        self.chain = resolve_blocks(model, blocks)
        self.policies = tuple(policies)
        self.actions = list(actions) if actions is not None else None
        self.repeats = repeats
        self.rows: dict[int, BlockCost] = {}
        self._hooks: list[Any] = []
        self._tracker: LiveTensorTracker | None = None
        self._bounds: ChainBounds | None = None
        self._busy = False
        self._device: torch.device | None = None

    def __enter__(self) -> BlockProfiler:
        for i, (fqn, module) in enumerate(self.chain):
            self._hooks.append(module.register_forward_pre_hook(self._pre_hook(i, fqn), with_kwargs=True))
        last = len(self.chain) - 1
        self._hooks.append(self.chain[last][1].register_forward_hook(self._chain_end_hook))
        self._tracker = LiveTensorTracker()
        self._bounds = ChainBounds(self._tracker)
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._tracker is not None:
            self._tracker.exit_anywhere()  # the step may be found to have ended inside a later measure()
            self._tracker.close()

    def _pre_hook(self, i: int, fqn: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._busy or i in self.rows or not torch.is_grad_enabled():
                return
            main = main_input(args, kwargs)
            self._device = main.device
            if self._bounds is not None:
                self._bounds.block_called(args, kwargs)
            actions = self.actions or default_actions(main.device, self.policies)
            self._busy = True
            try:
                # Step off every dispatch mode (the step's tracker included) so the block is timed and
                # measured as it runs in training, not through Python dispatch.
                with _disable_current_modes(), extra_run(module):
                    self.rows[i] = measure_block(fqn, module, args, kwargs, actions, repeats=self.repeats)
            finally:
                self._busy = False

        return hook

    def _chain_end_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._bounds is not None and not self._busy:
            self._bounds.chain_output(output)

    def cost_table(self) -> CostTable:
        """The measured table; raises if the step did not run every block with grad enabled."""
        missing = [self.chain[i][0] for i in range(len(self.chain)) if i not in self.rows]
        if missing:
            raise RuntimeError(
                f"blocks {missing} did not run during the profiled step (with grad enabled); "
                "profile a full forward and backward of the model"
            )
        bounds = self._bounds.figures() if self._bounds is not None else {}
        device = self._device or torch.device("cpu")
        return CostTable(
            blocks=[self.rows[i] for i in range(len(self.chain))],
            **bounds,
            device=device.type,
            source="measured",
            info={"torch": torch.__version__, "device_name": _device_name(device)},
        )


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
    policies: Iterable[str] = ("dots_saveable",),
    repeats: int = 3,
) -> CostTable:
    """Measure the :class:`CostTable` of ``model`` on ``batch`` (a tensor, a tuple of positional args or a
    dict of keyword args). ``loss_fn(output)`` defaults to ``output.loss`` or ``output.sum()``.
    After the profiled step, three plain steps are timed for ``outside_s`` (the step less its blocks).
    Parameter gradients and the RNG state are left as the profiled step left them."""
    profiler = BlockProfiler(model, blocks, policies=policies, repeats=repeats)
    with GradsRestored(model), profiled_step(model):
        with profiler:
            run_step(model, batch, loss_fn)
        costs = profiler.cost_table()
        # The step outside the chain's blocks: plain steps (no plan applied) timed after the profiled one.
        rng = torch.random.fork_rng(devices=[] if costs.device == "cpu" else None, device_type=costs.device)
        with suspend_all(), rng:
            step = step_seconds(model, batch, loss_fn, steps=3)
    # Not floored at 0: blocks timed alone can run slower than inside a step (small blocks above all), and
    # a negative remainder keeps the predicted step of keeping everything equal to the measured one.
    costs.outside_s = step - sum(b.fwd_s + b.bwd_s for b in costs.blocks)
    return costs
