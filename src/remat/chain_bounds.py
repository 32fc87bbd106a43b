"""The memory of a step around the chain: before it (stem), after it (head), and the block arguments it frees.

A tracked step (the profiler's on a real device, the estimator's on ``meta``) calls :class:`ChainBounds` from
its hooks: when a block is first called, and with the last block's output. The step's
:class:`~remat.memory.LiveTensorTracker` is marked where the chain starts (``stem``), where its forward ends
(``end<k>``) and where the gradient of its output arrives, i.e. the head's forward and backward are over
(``grad<k>``). With several chains each is marked where it starts (``start<k>``) and ends; the bytes that appear
between one chain's end and the next one's start are the table's ``between_bytes``. :meth:`ChainBounds.figures`
reads the :class:`~remat.costs.CostTable` fields from the marks.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .blocks import main_input, main_tensor
from .memory import LiveTensorTracker


class BlockArguments:
    """The tensors passed to blocks besides their main input (an attention mask, position embeddings), one entry
    per storage. Those that need a gradient (an encoder's output in cross-attention, a position bias computed by
    the first block) have it summed across their chain's backward: :attr:`grad_bytes` per chain. A plan that
    recomputes a block holds them for the recomputation; a step that keeps everything
    may free them before the chain's backward. :meth:`freed_bytes` sums those freed so far."""

    def __init__(self) -> None:
        self._storages: list[tuple[weakref.ref, int]] = []
        self.grad_bytes: dict[int, int] = {}  # per chain: bytes of the arguments that need a gradient

    def add(self, args: tuple[Any, ...], kwargs: dict[str, Any], chain: int = 0) -> None:
        """Record the arguments of a block call."""
        main = main_input(args, kwargs)
        for t in tree_flatten((args, kwargs))[0]:
            if not isinstance(t, torch.Tensor) or t is main or isinstance(t, nn.Parameter):
                continue
            storage = t.untyped_storage()
            if any(ref() is storage for ref, _ in self._storages):
                continue
            self._storages.append((weakref.ref(storage), storage.nbytes()))
            if t.requires_grad:
                self.grad_bytes[chain] = self.grad_bytes.get(chain, 0) + storage.nbytes()

    def freed_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self._storages if ref() is None)


class ChainBounds:
    """Marks ``tracker`` at the bounds of ``chains`` chains during one step and reads the stem, head and
    between-chain bytes afterwards. Chains are numbered as the caller holds them; the step may run them in
    another order (CLIP runs its vision tower first), which :attr:`order` records."""

    def __init__(self, tracker: LiveTensorTracker, chains: int = 1) -> None:
        self.tracker = tracker
        self.arguments = BlockArguments()
        self.chains = chains
        self.order: list[int] = []  # chains in the order their first block was called
        self._freed_at_grad: dict[int, int] = {}

    def block_called(self, args: tuple[Any, ...], kwargs: dict[str, Any], chain: int = 0) -> None:
        """A block of chain ``chain`` is called for the first time in the step (with grad enabled). The first
        such call of any chain ends the stem."""
        if chain not in self.order:
            self.order.append(chain)
            self.tracker.mark(f"start{chain}")
            if not self.tracker.has_mark("stem"):
                self.tracker.mark("stem")
        self.arguments.add(args, kwargs, chain)

    def chain_output(self, output: Any, chain: int = 0) -> None:
        """The last block of chain ``chain`` returned ``output``: the chain's forward ends here."""
        out = main_tensor(output)
        if out is None or not out.requires_grad or self.tracker.has_mark(f"end{chain}"):
            return
        self.tracker.mark(f"end{chain}")
        out.register_hook(lambda grad: self._gradient_arrived(chain))

    def _gradient_arrived(self, chain: int) -> None:
        if chain not in self._freed_at_grad:
            self.tracker.mark(f"grad{chain}")
            self._freed_at_grad[chain] = self.arguments.freed_bytes()

    @property
    def held_args_bytes(self) -> int:
        """Block arguments freed by the time the last chain's output gradient arrived (the head is over)."""
        return self._freed_at_grad.get(self.order[-1], 0) if self.order else 0

    def interleaved(self) -> bool:
        """Whether a chain started before the one called before it had ended (chains that do not run one after
        the other cannot be planned as a sequence)."""
        marks = [label for label, _ in self.tracker.marks()]
        for before, after in zip(self.order, self.order[1:], strict=False):
            if f"end{before}" not in marks or marks.index(f"end{before}") > marks.index(f"start{after}"):
                return True
        return False

    def _backward_start_excess(self, chain: int, head_retained: int) -> int:
        """What is alive when ``chain``'s backward starts beyond what was alive when its forward ended, less the
        head's retained bytes (0 for the last chain, whose difference is the head's retained bytes)."""
        tracker = self.tracker
        if chain == self.order[-1] or not (tracker.has_mark(f"end{chain}") and tracker.has_mark(f"grad{chain}")):
            return 0
        return max(0, tracker.bytes_at(f"grad{chain}") - tracker.bytes_at(f"end{chain}") - head_retained)

    def figures(self) -> dict[str, Any]:
        """``stem_bytes``, ``head_bytes``, ``head_retained_bytes`` and ``held_args_bytes`` of the step (0 where
        the step did not reach a mark), and with several chains ``between_bytes`` and ``backward_bytes`` in call
        order; read after the tracker is closed."""
        tracker = self.tracker
        stem = tracker.bytes_at("stem") if tracker.has_mark("stem") else 0
        head = head_retained = 0
        last = self.order[-1] if self.order else 0
        if tracker.has_mark(f"end{last}") and tracker.has_mark(f"grad{last}"):
            end = tracker.bytes_at(f"end{last}")
            head = max(0, tracker.peak_between(f"end{last}", f"grad{last}") - end)
            head_retained = max(0, tracker.bytes_at(f"grad{last}") - end)
        figures: dict[str, Any] = {
            "stem_bytes": stem,
            "head_bytes": head,
            "head_retained_bytes": head_retained,
            "held_args_bytes": self.held_args_bytes,
        }
        if self.chains > 1:
            figures["backward_bytes"] = [
                self.arguments.grad_bytes.get(k, 0) + self._backward_start_excess(k, head_retained) for k in self.order
            ]
            figures["between_bytes"] = [
                max(0, tracker.bytes_at(f"start{after}") - tracker.bytes_at(f"end{before}"))
                for before, after in zip(self.order, self.order[1:], strict=False)
            ]
        return figures
