"""Costs of one block run alone under every action: bytes kept and transients from the live-tensor tracker,
forward, backward, recompute and overhead seconds from interleaved timed repeats, and for lossy actions the
gradient error they introduce. The run is set aside from the step (remat hooks suspended, RNG forked,
gradients restored, stand-in parameters so that no hook of the step's parameters fires)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..chains import BlockIO, detached_from_step, replace_slot, slot_value, without_caches
from ..checkpointing import compiled_partitions
from ..core import CHECKPOINT, KEEP, Action, BlockCost, casts_uncached
from ..meters import AllocationTracker, LiveTensorTracker, is_compiled
from ..runtime import suspend_all
from .action_times import action_times
from .block_bytes import ByteTerms, run_tracked, tensor_bytes, warm_up
from .block_run import GradsRestored, edge_backward_supported, parameters_detached
from .block_timing import Clock, time_actions
from .grad_error import block_grad_error

__all__ = ["measure_block"]


def measure_block(
    fqn: str,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    actions: Sequence[str],
    *,
    repeats: int = 3,
    io: BlockIO | None = None,
    clock: Clock = time.perf_counter,
    blocks_in_step: int = 1,
) -> BlockCost:
    """Costs of one block on these inputs, under each of ``actions`` (``"keep"`` must be among them), times
    read from ``clock``; ``io`` says which argument and output are its hidden state (guessed by default).
    ``blocks_in_step``: how many blocks the step runs; the step's traffic between this block's forward and its
    backward, which the timing's cache flush stands for, is taken as that many times what it saves under keep."""
    io = io or BlockIO.of(fqn, module)
    slot = io.input_slot(args, kwargs)
    source = slot_value(args, kwargs, slot)
    device = source.device
    main = source.detach().requires_grad_(True)
    args, kwargs = detached_from_step(*without_caches(*replace_slot(args, kwargs, slot, main)))
    trackers: dict[str, LiveTensorTracker | AllocationTracker] = {}
    unavailable: dict[str, str] = {}
    # A compiled block (module.compile()) is metered from the allocator's events: the live-tensor tracker, a
    # dispatch mode, would make dynamo run it eagerly (and skip its compiled code from then on).
    compiled = is_compiled(module)
    meter = AllocationTracker if compiled else LiveTensorTracker
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
        if compiled:  # what dynamo compiles on a first call is no cost of the action
            with compiled_partitions.RandomDraws(device) as draws:
                warm_up(module, KEEP, args, kwargs, main, pick)
            if draws.seen:  # a partition's recomputation may draw them anew (compiled_partitions, Invariant 3)
                actions = [
                    a
                    for a in actions
                    if not compiled_partitions.is_partition(a) or compiled_partitions.saves_draws(module, a)
                ]
            for action in actions:
                warm_up(module, action, args, kwargs, main, pick)
        for action in actions:
            tracker = meter(device)
            ran = run_tracked(tracker, module, action, args, kwargs, main, pick=pick, refused=unavailable)
            if ran is not None:
                trackers[action], output_bytes = tracker, ran
        actions = [a for a in actions if a not in unavailable]
        terms = ByteTerms.from_trackers(trackers, input_bytes=tensor_bytes(main))
        runs = time_actions(
            module, actions, args, kwargs, main, device, repeats, pick=pick, clock=clock,
            no_grad_forward=CHECKPOINT in actions, traffic_bytes=blocks_in_step * terms.saved[KEEP],
        )  # fmt: skip
        times = action_times(runs)
        errors = {a: block_grad_error(module, a, args, kwargs, main) for a in actions if Action.parse(a).is_lossy}
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
        peak_summits=terms.summits,
        grad_error={a: e.relative for a, e in errors.items()},
        grad_cosine={a: e.cosine for a, e in errors.items()},
        fwd_s_by_action=times.fwd_s_by_action,
        bwd_s_by_action=times.bwd_s_by_action,
        overhead_s=times.overhead_s,
        nograd_fwd_s=times.nograd_fwd_s,
        unavailable=unavailable,
    )
