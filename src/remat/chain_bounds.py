"""The memory of a step around the chain: before it (stem), after it (head), and the block arguments it frees.

A tracked step (the profiler's on a real device, the estimator's on ``meta``) calls :class:`ChainBounds` from
its hooks: when a block is first called, and with the last block's output. The step's
:class:`~remat.memory.LiveTensorTracker` is marked where the chain starts (``stem``), where its forward ends
(``chain_end``) and where the gradient of its output arrives, i.e. the head's forward and backward are over
(``head_end``). :meth:`ChainBounds.figures` reads the :class:`~remat.costs.CostTable` fields from the marks.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .memory import LiveTensorTracker


class BlockArguments:
    """The tensors passed to blocks besides their main input (an attention mask, position embeddings), one entry
    per storage. A plan that recomputes a block holds them for the recomputation; a step that keeps everything
    may free them before the chain's backward. :meth:`freed_bytes` sums those freed so far."""

    def __init__(self) -> None:
        self._storages: list[tuple[weakref.ref, int]] = []

    def add(self, args: tuple[Any, ...], kwargs: dict[str, Any], main: torch.Tensor) -> None:
        for t in tree_flatten((args, kwargs))[0]:
            if not isinstance(t, torch.Tensor) or t is main or isinstance(t, nn.Parameter):
                continue
            storage = t.untyped_storage()
            if any(ref() is storage for ref, _ in self._storages):
                continue
            self._storages.append((weakref.ref(storage), storage.nbytes()))

    def freed_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self._storages if ref() is None)


class ChainBounds:
    """Marks ``tracker`` at the chain's bounds during one step and reads the stem and head bytes afterwards."""

    def __init__(self, tracker: LiveTensorTracker) -> None:
        self.tracker = tracker
        self.arguments = BlockArguments()
        self.held_args_bytes = 0
        self._inputs: dict[str, tuple[weakref.ref, int]] = {}  # main inputs of the first and the last block
        self._watched: list[tuple[weakref.ref, int]] = []
        self._inputs_freed = 0

    def block_called(self, args: tuple[Any, ...], kwargs: dict[str, Any], main: torch.Tensor) -> None:
        """A block of the chain is called for the first time in the step (with grad enabled), with ``main`` as
        its main input. The first such call ends the stem."""
        if not self.tracker.has_mark("stem"):
            self.tracker.mark("stem")
        self.arguments.add(args, kwargs, main)
        storage = main.untyped_storage()
        entry = (weakref.ref(storage), storage.nbytes())
        self._inputs.setdefault("first", entry)
        self._inputs["last"] = entry

    def chain_output(self, out: torch.Tensor | None) -> None:
        """The last block returned ``out`` as its main output: the chain's forward ends here, the head's starts."""
        if out is None or not out.requires_grad or self.tracker.has_mark("chain_end"):
            return
        self.tracker.mark("chain_end")
        alive = {id(ref()): (ref, n) for ref, n in self._inputs.values() if ref() is not None}
        self._watched = list(alive.values())
        out.register_hook(lambda grad: self._head_end())

    def _head_end(self) -> None:
        self.tracker.mark("head_end")
        self.held_args_bytes = self.arguments.freed_bytes()
        # The first and the last block's inputs die in the head (the model's forward returns) when nothing saved
        # them (a block whose first op copies its input, as a bfloat16 RMSNorm upcasting to float32 does); a plan
        # that checkpoints the block keeps them. The stem and the blocks' terms count them either way, so the
        # head's figures must not count their death.
        self._inputs_freed = sum(n for ref, n in self._watched if ref() is None)

    def figures(self) -> dict[str, int]:
        """``stem_bytes``, ``head_bytes``, ``head_retained_bytes`` and ``held_args_bytes`` of the step (0 where
        the step did not reach a mark); read after the tracker is closed."""
        tracker = self.tracker
        stem = tracker.bytes_at("stem") if tracker.has_mark("stem") else 0
        head = head_retained = 0
        if tracker.has_mark("chain_end") and tracker.has_mark("head_end"):
            end = tracker.bytes_at("chain_end")
            head = max(0, tracker.peak_between("chain_end", "head_end") - end + self._inputs_freed)
            head_retained = max(0, tracker.bytes_at("head_end") - end + self._inputs_freed)
        return {
            "stem_bytes": stem,
            "head_bytes": head,
            "head_retained_bytes": head_retained,
            "held_args_bytes": self.held_args_bytes,
        }
