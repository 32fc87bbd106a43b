"""Checkpoint regions opened and closed by module hooks: the frame, the recorded block calls, the open state.

torch's non-reentrant checkpoint is a generator (``_checkpoint_without_reentrant_generator``): advanced once,
it installs the saved-tensor hooks of a checkpoint frame; advanced again, it removes them. The runtime
(:mod:`remat.runtime`) advances it from a block's forward pre-hook and from a forward hook (of the same block,
or of the last block of a segment), as ``torch.distributed``'s composable checkpoint does. This module owns
that use of the generator (:func:`open_checkpoint_frame`), the record a recomputation re-runs a block from
(:class:`CallRecord`), the state of a region between its two hooks and how it is closed (:class:`OpenRegion`,
which also runs the region with autocast's weight-cast cache off, see :mod:`remat.precision`), and the two checks
the hooks rely on (:func:`same_tensor`, :func:`eager`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator

from .blocks import InputSlot, main_input_slot, replace_slot, slot_value, without_caches
from .precision import casts_uncached
from .rng import RngSnapshot
from .simulator import Unit

_GENERATOR_HAS_EARLY_STOP = "early_stop" in inspect.signature(_checkpoint_without_reentrant_generator).parameters


def open_checkpoint_frame(recompute: Callable[..., None], context_fn: Callable[[], Any], *inputs: Any) -> Any:
    """Open a non-reentrant checkpoint frame around what runs next; returns the generator that closes it when
    advanced once more. In backward, ``recompute(*inputs)`` re-runs what ran inside under ``context_fn()``'s
    contexts, stopping early once it has rebuilt what backward needs. The frame does not save RNG state: the
    runtime's records do, per block (Note [3] in :mod:`remat.runtime`)."""
    head = (recompute, False, context_fn, "default", False)
    if _GENERATOR_HAS_EARLY_STOP:
        head = (*head, True)
    gen = _checkpoint_without_reentrant_generator(*head, *inputs)
    next(gen)
    return gen


@dataclass
class CallRecord:
    """What a block was called with in forward, without its main input (which must not be kept alive)."""

    index: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    slot: InputSlot
    requires_grad: bool
    rng: RngSnapshot

    @classmethod
    def take(cls, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[CallRecord, torch.Tensor]:
        """The record of block ``index`` called with ``args``/``kwargs`` (caches dropped, RNG state taken now,
        before the block runs), and its main input."""
        slot = main_input_slot(args, kwargs)
        main = slot_value(args, kwargs, slot)
        stripped_args, stripped_kwargs = without_caches(*replace_slot(args, kwargs, slot, None))
        rng = RngSnapshot.take(main)
        return cls(index, stripped_args, stripped_kwargs, slot, main.requires_grad, rng), main

    def arguments(self, main: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The recorded call's arguments with ``main`` as its main input."""
        return replace_slot(self.args, self.kwargs, self.slot, main)


@dataclass
class OpenRegion:
    """A region between its opening pre-hook and its closing forward hook."""

    unit: Unit
    generator: Any = None
    context: Any = None
    casts: Any = None  # the entered remat.precision.casts_uncached() context, left when the region closes
    records: list[CallRecord] = field(default_factory=list)
    last_output: torch.Tensor | None = None

    def uncache_casts(self) -> None:
        """Turn autocast's weight-cast cache off until the region closes; call before its frame or context
        opens, so the frame records (and its recomputation replays) the uncached state."""
        self.casts = casts_uncached()
        self.casts.__enter__()

    def close(self) -> None:
        """Leave the region's context, close its checkpoint frame, then turn the cast cache back on."""
        try:
            if self.context is not None:
                self.context.__exit__(None, None, None)
            if self.generator is not None:
                try:
                    next(self.generator)
                except StopIteration:
                    pass
                else:
                    raise RuntimeError("internal error: a checkpoint region did not close")
        finally:
            if self.casts is not None:
                self.casts.__exit__(None, None, None)


def same_tensor(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether ``a`` is ``b``, or ``b`` passed through an identity autograd function (a new tensor object on the
    same memory, as FSDP2's pre-forward hook makes of every block input): what segments need to hold."""
    if a is b:
        return True
    if b is None or a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype:
        return False
    return a.data_ptr() == b.data_ptr() and a.device == b.device


def eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook``, never traced by ``torch.compile`` (as FSDP2 does with its hooks): with compiled blocks
    (``block.compile()``) the checkpoint regions open and close in eager code around the compiled forward."""
    return torch.compiler.disable(hook)
