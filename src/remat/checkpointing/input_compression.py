"""Checkpointing a block from a compressed copy of its input: the ``checkpoint+compress:<format>`` action.

A checkpointed block keeps its main input (the hidden state between blocks) to recompute from in backward.
:func:`open_compressed_input_frame` opens a non-reentrant checkpoint frame whose only saved inputs are that
input's compressed codes and scales (:func:`remat.checkpointing.compression.pack`), not the input itself: once the block
before lets go of its output, the full-precision input is freed and only its compressed copy stays alive until
backward. In backward the frame restores the input, marks it as requiring grad as the original did, and
re-runs the block from it. The forward is exact; the recomputed saved tensors, and so the block's gradients,
are those of the rounded input. Gradients still flow to the real input through the forward's graph.

:func:`run_compressed_input` runs a whole block under the action (the profiler's and the estimator's
:func:`remat.profiling.block_run.run_action`); the runtime opens the frame from its hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress
from dataclasses import replace
from typing import Any

import torch
from torch.utils.checkpoint import noop_context_fn

from ..core import INPUT_COMPRESS, Action
from .compression import pack
from .regions import CallRecord, open_checkpoint_frame
from .rng import Forked


def open_compressed_input_frame(
    action: str, main: torch.Tensor, requires_grad: bool, rerun: Callable[[torch.Tensor], Any]
) -> Any:
    """Open a checkpoint frame around what runs next (see :func:`remat.checkpointing.regions.open_checkpoint_frame`)
    that saves ``main`` compressed under ``action`` (``checkpoint+compress:<format>``) and, in backward, calls
    ``rerun(restored)`` with the restored input (requiring grad if ``requires_grad``). Returns the generator that closes
    the frame when advanced once more."""
    packed = pack(main, Action.parse(action).expect(INPUT_COMPRESS).compress_format)
    codes, scale = packed.codes, packed.scale
    template = replace(packed, codes=codes.new_empty(0), scale=scale.new_empty(0))  # the shape, not the data

    def recompute(saved_codes: torch.Tensor, saved_scale: torch.Tensor) -> None:
        restored = replace(template, codes=saved_codes, scale=saved_scale).restore()
        rerun(restored.detach().requires_grad_(requires_grad))

    del packed
    return open_checkpoint_frame(recompute, noop_context_fn, codes, scale)


def open_block_frame(
    action: str, recompute: Callable[[torch.Tensor], Any], context_fn: Callable[[], Any], main: torch.Tensor,
    requires_grad: bool,
) -> Any:  # fmt: skip
    """The checkpoint frame of one block under ``action`` (``checkpoint``, ``selective:<policy>`` through
    ``context_fn``, or ``checkpoint+compress:<format>``), recomputed by ``recompute(main)`` in backward."""
    if Action.parse(action).kind == INPUT_COMPRESS:
        return open_compressed_input_frame(action, main, requires_grad, recompute)
    return open_checkpoint_frame(recompute, context_fn, main)


def run_compressed_input(module: Callable[..., Any], action: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``module(*args, **kwargs)`` checkpointed with its main input (the first tensor argument) stored under
    ``action``; plain when grad is disabled."""
    if not torch.is_grad_enabled():
        return module(*args, **kwargs)
    record, main = CallRecord.take(0, args, kwargs)

    def rerun(restored: torch.Tensor) -> None:
        with Forked(record.rng.devices, record.rng.device_type):
            record.rng.restore()
            call_args, call_kwargs = record.arguments(restored)
            module(*call_args, **call_kwargs)

    frame = open_compressed_input_frame(action, main, main.requires_grad, rerun)
    try:
        out = module(*args, **kwargs)
    finally:
        with suppress(StopIteration):
            next(frame)
    return out


__all__ = ["open_block_frame", "open_compressed_input_frame", "run_compressed_input"]
