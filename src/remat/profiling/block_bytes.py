"""The byte fields of a block's :class:`~remat.core.costs.BlockCost`, from one tracked run per action.

:func:`run_tracked` runs one forward and backward of a block under an action inside a live-bytes tracker
(:class:`~remat.meters.memory.LiveTensorTracker`) and marks the moments the fields are read at; :class:`ByteTerms`
derives the fields from the trackers of all actions: the summits of each run (its live bytes before each free,
``BlockCost.peak_summits``) and the transients read from their largest (:func:`remat.core.temp_terms`). The
profiler (real device) and the meta estimator (``meta`` device) share both, so their byte figures are derived alike.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..chains import main_tensor
from ..checkpointing import SavedOutputChanged
from ..core import INPUT_COMPRESS, KEEP, SELECTIVE, kind_of, reads_own_peaks, temp_terms
from ..meters import AllocationTracker, LiveTensorTracker
from .block_run import backward_releasing_output, clear_grads, run_action


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (not of its whole storage)."""
    return t.numel() * t.element_size()


def run_tracked(
    tracker: LiveTensorTracker | AllocationTracker,
    module: nn.Module,
    action: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    main: torch.Tensor,
    output_bytes: Callable[[torch.Tensor], int] = tensor_bytes,
    pick: Callable[[Any], torch.Tensor | None] = main_tensor,
    refused: dict[str, str] | None = None,
) -> int | None:
    """One forward and backward of the block under ``action`` inside ``tracker``, marked ``start``,
    ``fwd_end``, ``bwd_start`` and ``bwd_end``; returns ``output_bytes`` of the output (its main output,
    which ``pick`` takes from what the block returns).

    With ``refused``, a per-operator policy the block cannot run returns None instead of raising, with why in
    ``refused[action]`` and a warning (once per block class). The usual cause: the policy saves an operator's
    output that the block then changes in place (``x /= x.sum()``, ``x += residual``), which torch's selective
    checkpointing refuses in the backward rather than recompute from a changed value."""
    try:
        with tracker:
            tracker.mark("start")
            out = pick(run_action(module, action, args, kwargs))
            tracker.mark("fwd_end")
            grad = torch.ones_like(out)
            nbytes = output_bytes(out)
            holder = [out]
            del out
            tracker.mark("bwd_start")
            backward_releasing_output(holder, grad)
            tracker.mark("bwd_end")
            del grad
            main.grad = None
    except RuntimeError as error:
        if refused is None or kind_of(action) != SELECTIVE:
            raise
        refused[action] = _refusal(module, action, error)
        nbytes, main.grad = None, None
        forget_frames(error)
    # Close while the parameter gradients are alive: like in a real step they outlive the region, so they are
    # survivors, not activations, and stay out of the backward transient.
    tracker.close()
    clear_grads(module)
    return nbytes


def forget_frames(error: BaseException) -> None:
    """Clear the locals of the finished frames ``error``'s traceback holds, and those of the exceptions it chains:
    the frames of the step that raised hold its tensors (the block's arguments), and a frame that holds the
    exception back makes a reference cycle, which would keep them alive until the garbage collector runs (so
    that the tracker of the step around them counted them as surviving it, out of every figure)."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        pending += [current.__cause__, current.__context__]


def _refusal(module: nn.Module, action: str, error: RuntimeError) -> str:
    """Why ``module`` cannot run the policy ``action``, from its error; warns with it."""
    if isinstance(error, SavedOutputChanged):
        why = (
            "the policy saves an operator's output that the block then changes in place, which torch's selective "
            "checkpointing refuses in the backward"
        )
    else:
        why = " ".join(str(error).split())
    warnings.warn(
        f"remat: {action} cannot run on {type(module).__name__} blocks: {why}; it is left out of their costs "
        "(BlockCost.unavailable), so plans do not choose it",
        stacklevel=3,
    )
    return why


def warm_up(
    module: nn.Module,
    action: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    main: torch.Tensor,
    pick: Callable[[Any], torch.Tensor | None] = main_tensor,
) -> None:
    """One untracked forward and backward of the block under ``action`` (a compiled block compiles on it)."""
    holder = [pick(run_action(module, action, args, kwargs))]
    backward_releasing_output(holder, torch.ones_like(holder[0]))
    main.grad = None
    clear_grads(module)


@dataclass
class ByteTerms:
    """The byte fields of a :class:`BlockCost`, read from one tracked run per action (see :func:`run_tracked`)."""

    saved: dict[str, int]
    fwd_temp: int
    bwd_temp: int
    bwd_extra: dict[str, int]
    summits: dict[str, list[int]]  # BlockCost.peak_summits

    @classmethod
    def from_trackers(
        cls, trackers: Mapping[str, LiveTensorTracker | AllocationTracker], input_bytes: int = 0
    ) -> ByteTerms:
        """The fields from the tracked runs; ``input_bytes`` are the bytes of the block's main input, which
        the runs held throughout (as the block before does in a step)."""
        saved = {action: t.bytes_at("fwd_end") for action, t in trackers.items()}
        summits = {"forward": trackers[KEEP].summits_between("start", "fwd_end")}
        for action, t in trackers.items():
            backward = t.summits_between("bwd_start", "bwd_end")
            if kind_of(action) == INPUT_COMPRESS:
                # In a step the input is freed once this block's forward ends: only its compressed copy stays,
                # and in backward the restored copy (tracked as new) stands in for it. So the input leaves what
                # the block retains, and its backward peak counts the input once.
                saved[action] -= input_bytes
                backward = [live - input_bytes for live in backward]
            if reads_own_peaks(action):
                backward += t.summits_between("start", "fwd_end")
            summits[action] = backward
        fwd_temp, bwd_temp, bwd_extra = temp_terms(
            saved[KEEP], max(summits["forward"]), {action: max(summits[action]) for action in trackers}
        )
        return cls(saved=saved, fwd_temp=fwd_temp, bwd_temp=bwd_temp, bwd_extra=bwd_extra, summits=summits)
