"""Measuring a CostTable on the real device: each block run in isolation under each action.

:class:`BlockProfiler` hooks the chain's blocks for one forward/backward step. When a block is first called it
takes the block's real inputs and, aside from the step (RNG forked, gradients restored, other remat hooks
suspended), runs the block alone under every action (:func:`measure_block`): a live-tensor tracker gives the
bytes kept after the forward, the forward and backward transients (:mod:`remat.block_bytes`); timed repeats
give forward, backward and recompute seconds (:mod:`remat.block_timing`). The step itself is tracked too, for
the memory before the chain (stem) and after it (head) (:mod:`remat.chain_bounds`). What the step keeps during a chain's
forward beyond the blocks' own kept bytes (T5's position biases, returned by the first block and passed to the
others) is alive from then on under every action, and a plan that recomputes holds it through the backward: it
counts in the stem (and not again in the held arguments).

Under an offload policy (``selective:offload_dots``...) the host copies are not device memory on CUDA and
the tracker does not count them; on CPU they are, and it does (see :mod:`remat.host_copies`). Such an
action's recompute seconds are the recomputation plus the forward's extra time (the copies it queues).

Several chains (``blocks=remat.find_chains(model)``) are profiled in the same step: the table holds their rows
in the order the step runs them, with ``chain_lengths`` and the bytes between them (``between_bytes``).

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
from .block_bytes import ByteTerms, run_tracked, tensor_bytes
from .block_run import GradsRestored, edge_backward_supported
from .block_timing import time_action
from .blocks import (
    BlocksArg,
    main_input,
    main_input_slot,
    main_tensor,
    replace_slot,
    resolve_chains,
    slot_value,
    without_caches,
)
from .chain_bounds import ChainBounds
from .costs import CHECKPOINT, KEEP, OFFLOAD, SELECTIVE_PREFIX, BlockCost, CostTable
from .hf_guards import profiled_step
from .memory import LiveTensorTracker
from .model_state import detached_from_step, extra_run
from .suspension import suspend_all
from .training_step import Batch, default_loss, run_step

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
    times: dict[str, tuple[float, float, float]] = {}
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
            times[action] = time_action(module, action, args, kwargs, main, device, repeats)
    terms = ByteTerms.from_trackers(trackers)
    fwd_s, bwd_s, _ = times[KEEP]
    recompute: dict[str, float] = {}
    for action in actions:
        a_fwd, a_bwd, a_recompute = times[action]
        if action == KEEP:
            recompute[action] = 0.0
        elif action == CHECKPOINT:
            recompute[action] = fwd_s
        elif action == OFFLOAD:
            recompute[action] = max((a_fwd - fwd_s) + (a_bwd - bwd_s), 0.0)
        elif _policies.get(action[len(SELECTIVE_PREFIX) :]).offload is not None:
            # copies back in recompute, plus the copies to host the forward queued
            recompute[action] = a_recompute + max(a_fwd - fwd_s, 0.0)
        else:
            recompute[action] = min(a_recompute, fwd_s)
    return BlockCost(
        fqn=fqn,
        fwd_s=fwd_s,
        bwd_s=bwd_s,
        input_bytes=tensor_bytes(main),
        output_bytes=output_bytes,
        saved_bytes=terms.saved,
        recompute_s=recompute,
        fwd_temp_bytes=terms.fwd_temp,
        bwd_temp_bytes=terms.bwd_temp,
        bwd_extra_bytes=terms.bwd_extra,
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
        self.chains = resolve_chains(model, blocks)
        self.chain = [pair for chain in self.chains for pair in chain]
        self.policies = tuple(policies)
        self.actions = list(actions) if actions is not None else None
        self.repeats = repeats
        self.rows: dict[int, BlockCost] = {}
        self._block_outputs: set[int] = set()  # storages of the blocks' outputs in the step
        self.outputs_kept = False  # whether the model's output holds blocks' outputs (output_hidden_states)
        self._hooks: list[Any] = []
        self._tracker: LiveTensorTracker | None = None
        self._bounds: ChainBounds | None = None
        self._busy = False
        self._device: torch.device | None = None

    def __enter__(self) -> BlockProfiler:
        i = 0
        for k, chain in enumerate(self.chains):
            for fqn, module in chain:
                self._hooks.append(module.register_forward_pre_hook(self._pre_hook(i, fqn, k), with_kwargs=True))
                i += 1
            self._hooks.append(chain[-1][1].register_forward_hook(self._chain_end_hook(k)))
        for _, module in self.chain:
            self._hooks.append(module.register_forward_hook(self._output_hook))
        self._hooks.append(self.model.register_forward_hook(self._model_output_hook))
        self._tracker = LiveTensorTracker()
        self._bounds = ChainBounds(self._tracker, len(self.chains))
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
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
            main = main_input(args, kwargs)
            self._device = main.device
            if self._bounds is not None:
                self._bounds.block_called(args, kwargs, k)
                self._tracker.mark(f"call{i}")
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

    def _output_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        out = main_tensor(output)
        if out is not None and not self._busy and torch.is_grad_enabled():
            self._block_outputs.add(out.untyped_storage().data_ptr())

    def _model_output_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        """The model returned: does its output hold blocks' outputs (Hugging Face's collected hidden states)?"""
        if self._busy or not self._block_outputs:
            return
        held = [t for t in _tensors(output) if t.untyped_storage().data_ptr() in self._block_outputs]
        self.outputs_kept = len(held) > len(self.chains)  # more than each chain's last output

    def _chain_end_hook(self, k: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._bounds is not None and not self._busy:
                self._bounds.chain_output(output, k)

        return hook

    def cost_table(self) -> CostTable:
        """The measured table; raises if the step did not run every block with grad enabled."""
        missing = [self.chain[i][0] for i in range(len(self.chain)) if i not in self.rows]
        if missing:
            raise RuntimeError(
                f"blocks {missing} did not run during the profiled step (with grad enabled); "
                "profile a full forward and backward of the model"
            )
        bounds = self._bounds.figures() if self._bounds is not None else {}
        rows = [self.rows[i] for i in range(len(self.chain))]
        made = self._kept_beside_blocks(rows)
        if made and bounds:  # alive from early in the forward to the end of the backward, under every plan
            bounds["stem_bytes"] += made
            bounds["held_args_bytes"] = max(0, bounds["held_args_bytes"] - made)
        if len(self.chains) > 1:
            rows, bounds["chain_lengths"] = self._rows_in_call_order(rows)
        device = self._device or torch.device("cpu")
        return CostTable(
            blocks=rows,
            **bounds,
            outputs_kept=self.outputs_kept,
            device=device.type,
            source="measured",
            info={"torch": torch.__version__, "device_name": _device_name(device)},
        )

    def _kept_beside_blocks(self, rows: list[BlockCost]) -> int:
        """What the step kept during each chain's forward beyond what its blocks keep when measured alone: from
        one block's call to the next's (or the chain's end), the growth less the block's kept bytes, summed where
        positive (T5's first block returns position biases that the others take)."""
        tracker = self._tracker
        if tracker is None:
            return 0
        made, start = 0, 0
        for k, chain in enumerate(self.chains):
            for j in range(len(chain)):
                i = start + j
                after = f"call{i + 1}" if j + 1 < len(chain) else f"end{k}"
                if tracker.has_mark(f"call{i}") and tracker.has_mark(after):
                    growth = tracker.bytes_at(after) - tracker.bytes_at(f"call{i}")
                    made += max(0, growth - rows[i].saved(KEEP))
            start += len(chain)
        return made

    def _rows_in_call_order(self, rows: list[BlockCost]) -> tuple[list[BlockCost], list[int]]:
        """The rows chain by chain in the order the step ran the chains, and the chains' lengths."""
        assert self._bounds is not None
        if self._bounds.interleaved():
            raise RuntimeError(
                f"the chains {[c[0][0].rsplit('.', 1)[0] for c in self.chains]} ran interleaved (one started before "
                "the one before it ended): they cannot be planned as a sequence. Profile and apply one chain at a "
                "time (blocks=chain)"
            )
        starts = [sum(len(c) for c in self.chains[:k]) for k in range(len(self.chains))]
        ordered: list[BlockCost] = []
        for k in self._bounds.order:
            ordered += rows[starts[k] : starts[k] + len(self.chains[k])]
        return ordered, [len(self.chains[k]) for k in self._bounds.order]


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in a model output (tensors, tuples, lists, dicts and Hugging Face ModelOutputs)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    elif hasattr(value, "to_tuple"):
        value = list(value.to_tuple())
    if isinstance(value, tuple | list):
        return [t for item in value for t in _tensors(item)]
    return []


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
    Parameter gradients are left as they were."""
    profiler = BlockProfiler(model, blocks, policies=policies, repeats=repeats)
    with GradsRestored(model), profiled_step(model), profiler:
        run_step(model, batch, loss_fn)
    return profiler.cost_table()
