"""The memory of a step around the chain: before it (stem), after it (head), and the block arguments it frees.

A tracked step (the profiler's on a real device, the estimator's on ``meta``) calls :class:`ChainBounds` from
its hooks: when a block is first called, and with the last block's output. The step's
:class:`~remat.meters.memory.LiveTensorTracker` is marked where the chain starts (``stem``), where its forward ends
(``end<k>``) and where the gradient of its output arrives, i.e. the head's forward and backward are over
(``grad<k>``). With several chains each is marked where it starts (``start<k>``) and ends; the bytes that appear
between one chain's end and the next one's start are the table's ``between_bytes``. :meth:`ChainBounds.figures`
reads the :class:`~remat.core.costs.CostTable` fields from the marks.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..meters import LiveTensorTracker

T = TypeVar("T")


class BlockArguments:
    """The tensors passed to blocks besides their main input (an attention mask, position embeddings), one entry
    per storage. Those that need a gradient (an encoder's output in cross-attention, a position bias computed by
    the first block) have it summed across their chain's backward: :attr:`grad_bytes` per chain. A plan that
    recomputes a block holds them for the recomputation; a step that keeps everything
    may free them before the chain's backward. :meth:`freed` lists those freed so far, each with the chain and
    the row of the call that first passed it."""

    def __init__(self) -> None:
        self._storages: list[tuple[weakref.ref, int, int, int]] = []  # storage, bytes, chain, row of first call
        self.grad_bytes: dict[int, int] = {}  # per chain: bytes of the arguments that need a gradient

    def add(self, args: tuple[Any, ...], kwargs: dict[str, Any], main: torch.Tensor, chain: int = 0,
            row: int = 0) -> None:  # fmt: skip
        """Record the arguments of the ``row``-th block call of chain ``chain``, whose main input is ``main``."""
        for t in tree_flatten((args, kwargs))[0]:
            if not isinstance(t, torch.Tensor) or t is main or isinstance(t, nn.Parameter):
                continue
            storage = t.untyped_storage()
            if any(entry[0]() is storage for entry in self._storages):
                continue
            self._storages.append((weakref.ref(storage), storage.nbytes(), chain, row))
            if t.requires_grad:
                self.grad_bytes[chain] = self.grad_bytes.get(chain, 0) + storage.nbytes()

    def freed(self) -> list[tuple[int, int, int]]:
        """``(bytes, chain, row of the first call passing it)`` of every argument freed so far."""
        return [(nbytes, chain, row) for ref, nbytes, chain, row in self._storages if ref() is None]


class ChainBounds:
    """Marks ``tracker`` at the bounds of ``chains`` chains during one step and reads the stem, head and
    between-chain bytes afterwards. Chains are numbered as the caller holds them; the step may run them in
    another order (CLIP runs its vision tower first), which :attr:`order` records."""

    def __init__(self, tracker: LiveTensorTracker, chains: int = 1) -> None:
        self.tracker = tracker
        self.arguments = BlockArguments()
        self.chains = chains
        self.order: list[int] = []  # chains in the order their first block was called
        self._freed_at_grad: dict[int, list[tuple[int, int, int]]] = {}  # per chain: BlockArguments.freed()
        self._calls: dict[int, int] = {}  # per chain: the block calls so far (rows)
        # main inputs of each chain's first and last block, watched from a chain's end to its gradient
        self._inputs: dict[tuple[int, str], tuple[weakref.ref, int]] = {}
        self._watched: dict[int, list[tuple[weakref.ref, int]]] = {}
        self._inputs_freed: dict[int, int] = {}
        self._grad_hooks: dict[int, Any] = {}

    def block_called(self, args: tuple[Any, ...], kwargs: dict[str, Any], main: torch.Tensor, chain: int = 0) -> None:
        """A block of chain ``chain`` is called for the first time in the step (with grad enabled), with ``main``
        as its main input. The first such call of any chain ends the stem."""
        if chain not in self.order:
            self.order.append(chain)
            self.tracker.mark(f"start{chain}")
            if not self.tracker.has_mark("stem"):
                self.tracker.mark("stem")
        self.arguments.add(args, kwargs, main, chain, self._calls.get(chain, 0))
        self._calls[chain] = self._calls.get(chain, 0) + 1
        storage = main.untyped_storage()
        entry = (weakref.ref(storage), storage.nbytes())
        self._inputs.setdefault((chain, "first"), entry)
        self._inputs[(chain, "last")] = entry

    def chain_output(self, out: torch.Tensor | None, chain: int = 0, move: bool = False) -> None:
        """The last block of chain ``chain`` returned ``out`` as its main output: the chain's forward ends here
        (after the last chain, the head's starts). Called again, it is ignored, unless ``move``: a chain whose
        blocks the forward calls again (a loop) ends with the latest call, so each call moves the end."""
        if out is None or not out.requires_grad or self.backward_started:
            return
        if self.tracker.has_mark(f"end{chain}") and not move:
            return
        self.tracker.mark(f"end{chain}")
        alive = {id(ref()): (ref, n) for ref, n in self._inputs.values() if ref() is not None}
        self._watched[chain] = list(alive.values())
        if chain in self._grad_hooks:
            self._grad_hooks[chain].remove()
        self._grad_hooks[chain] = out.register_hook(lambda grad: self._gradient_arrived(chain))

    def _gradient_arrived(self, chain: int) -> None:
        if chain in self._freed_at_grad:
            return
        self.tracker.mark(f"grad{chain}")
        self._freed_at_grad[chain] = self.arguments.freed()
        # The chains' first and last block inputs die in the head (the model's forward returns) when nothing
        # saved them (a block whose first op copies its input, as a bfloat16 RMSNorm upcasting to float32 does);
        # a plan that checkpoints the block keeps them. The stem and the blocks' terms count them either way, so
        # the head's figures must not count their death.
        self._inputs_freed[chain] = sum(n for ref, n in self._watched.get(chain, []) if ref() is None)

    @property
    def backward_started(self) -> bool:
        """Whether the gradient of a chain's output has arrived (the step's backward reached the chains)."""
        return bool(self._freed_at_grad)

    def _held(self) -> list[tuple[int, int, int]]:
        """:meth:`BlockArguments.freed` when the last chain's output gradient arrived (the head is over)."""
        return self._freed_at_grad.get(self.order[-1], []) if self.order else []

    @property
    def held_args_bytes(self) -> int:
        """Block arguments freed by the time the last chain's output gradient arrived (the head is over)."""
        return sum(nbytes for nbytes, _, _ in self._held())

    def held_args_rows(self) -> list[int]:
        """:attr:`held_args_bytes` row by row, rows in the order the step ran the chains: the arguments of the
        chains run before the row's, and those of its own chain first passed to it or an earlier row
        (:meth:`remat.core.costs.CostTable.held_args_per_row`). Empty when there are none."""
        held = self._held()
        if not held:
            return []
        position = {chain: k for k, chain in enumerate(self.order)}
        return [
            sum(nbytes for nbytes, chain, first in held
                if position.get(chain, k) < k or (chain == row_chain and first <= row))
            for k, row_chain in enumerate(self.order) for row in range(self._calls.get(row_chain, 0))
        ]  # fmt: skip

    def interleaved(self) -> bool:
        """Whether a chain started before the one called before it had ended (chains that do not run one after
        the other cannot be planned as a sequence)."""
        marks = [label for label, _ in self.tracker.marks()]
        for before, after in zip(self.order, self.order[1:], strict=False):
            if f"end{before}" not in marks:
                return True
            last_end = len(marks) - 1 - marks[::-1].index(f"end{before}")  # a looped chain's end moves
            if last_end > marks.index(f"start{after}"):
                return True
        return False

    def _backward_start_excess(self, chain: int, head_retained: int) -> int:
        """What is alive when ``chain``'s backward starts beyond what was alive when its forward ended, less the
        head's retained bytes (0 for the last chain, whose difference is the head's retained bytes)."""
        tracker = self.tracker
        if chain == self.order[-1] or not (tracker.has_mark(f"end{chain}") and tracker.has_mark(f"grad{chain}")):
            return 0
        return max(0, tracker.bytes_at(f"grad{chain}") - tracker.bytes_at(f"end{chain}") - head_retained)

    def figures(self, rows: int) -> dict[str, Any]:
        """``stem_bytes``, ``head_bytes``, ``head_retained_bytes``, ``held_args_bytes`` and ``held_args_rows`` of
        the step (0 where the step did not reach a mark; no rows where the calls were not the table's ``rows``
        rows), and with several chains ``between_bytes`` and ``backward_bytes`` in call order; read after the
        tracker is closed."""
        tracker = self.tracker
        stem = tracker.bytes_at("stem") if tracker.has_mark("stem") else 0
        head = head_retained = 0
        last = self.order[-1] if self.order else 0
        if tracker.has_mark(f"end{last}") and tracker.has_mark(f"grad{last}"):
            end = tracker.bytes_at(f"end{last}")
            freed = self._inputs_freed.get(last, 0)
            head = max(0, tracker.peak_between(f"end{last}", f"grad{last}") - end + freed)
            # signed: the model's forward frees what only it held (in the stem) before the chain's backward
            head_retained = tracker.bytes_at(f"grad{last}") - end + freed
        figures: dict[str, Any] = {
            "stem_bytes": stem,
            "head_bytes": head,
            "head_retained_bytes": head_retained,
            "held_args_bytes": self.held_args_bytes,
            "held_args_rows": held if len(held := self.held_args_rows()) == rows else [],
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

    def kept_beside_blocks(self, keep_bytes: Sequence[int], lengths: Sequence[int]) -> int:
        """What the step kept during each chain's forward beyond what its blocks keep when measured alone
        (``keep_bytes``, per row of chains of ``lengths``, the j-th call of chain k marked ``call<k>.<j>``): from
        one call to the next (or the chain's end), the growth less the block's kept bytes, summed where positive
        (T5's first block returns position biases that the others take)."""
        tracker, made, i = self.tracker, 0, 0
        for k, length in enumerate(lengths):
            for j in range(length):
                after = f"call{k}.{j + 1}" if j + 1 < length else f"end{k}"
                if tracker.has_mark(f"call{k}.{j}") and tracker.has_mark(after):
                    growth = tracker.bytes_at(after) - tracker.bytes_at(f"call{k}.{j}")
                    made += max(0, growth - keep_bytes[i])
                i += 1
        return made

    def table_fields(self, keep_bytes: Sequence[int], lengths: Sequence[int]) -> dict[str, Any]:
        """:meth:`figures` with what the step keeps beside the blocks (:meth:`kept_beside_blocks`) counted in the
        stem: alive from early in the forward to the end of the backward under a plan that recomputes. A step
        keeping everything frees it in the head (the head's figures are lower by it), so it stays in the held
        arguments too, which the simulator adds back to the head for such plans. With several chains, their
        ``chain_lengths`` in call order."""
        figures = self.figures(sum(lengths))
        made = self.kept_beside_blocks(keep_bytes, lengths)
        figures["stem_bytes"] += made
        if len(lengths) > 1:
            figures["chain_lengths"] = [lengths[k] for k in self.order]
        return figures

    def in_call_order(self, rows: Sequence[T], lengths: Sequence[int], names: Sequence[str]) -> list[T]:
        """``rows`` (chain after chain, of ``lengths``, named ``names``) chain by chain in the order the step ran
        the chains; raises when the chains ran interleaved."""
        if self.interleaved() or sorted(self.order) != list(range(len(lengths))):
            raise RuntimeError(
                f"the chains {list(names)} did not run one after the other (one started before the one before it "
                "ended, or one did not run): they cannot be planned as a sequence. Profile and apply one chain at a "
                "time (blocks=chain)"
            )
        starts = [sum(lengths[:k]) for k in range(len(lengths))]
        return [row for k in self.order for row in rows[starts[k] : starts[k] + lengths[k]]]


class CollectedOutputs:
    """Whether the model's output holds its blocks' outputs beyond each chain's last (Hugging Face's
    ``output_hidden_states`` collects them): a group's inner outputs then live to the end of the step."""

    def __init__(self) -> None:
        self._block_outputs: set[int] = set()  # storages of the blocks' main outputs in the step
        self.kept = False

    def block_output(self, out: torch.Tensor | None) -> None:
        """A block returned ``out`` as its main output in the step."""
        if out is not None:
            self._block_outputs.add(out.untyped_storage().data_ptr())

    def model_output(self, output: Any, chains: int) -> None:
        """The model returned ``output``: does it hold more block outputs than the ``chains`` chains' last?"""
        if self._block_outputs:
            held = [t for t in tensors_in(output) if t.untyped_storage().data_ptr() in self._block_outputs]
            self.kept = len(held) > chains


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a model output (tensors, tuples, lists, dicts and Hugging Face ModelOutputs)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    elif hasattr(value, "to_tuple"):
        value = list(value.to_tuple())
    if isinstance(value, tuple | list):
        return [t for item in value for t in tensors_in(item)]
    return []
