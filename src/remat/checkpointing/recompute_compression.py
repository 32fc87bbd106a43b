"""Checkpointing a block whose recomputation is stored compressed: the ``recompute+compress:<format>`` action.

A checkpointed block keeps its input and nothing else; in backward it re-runs the block and holds every tensor the
re-run saves, at full precision, until backward has used it: that is the least any exact plan can hold while a block's
backward runs. Here the re-run's saved tensors are stored compressed as they are made (the codecs and rules of
:mod:`remat.checkpointing.compression`: floating-point tensors the block creates, 4 KiB or more), and each is restored
when backward uses it and dropped afterwards. The block's backward then holds about what a ``compress:<format>`` block
holds, not what a kept one does. The forward and the stored input are exact; the gradients are those of the compressed
saved tensors.

It is done with saved-tensor hooks alone, as torch's non-reentrant checkpoint is, with one difference: in
forward the hooks keep nothing (a numbered placeholder per saved tensor); at the first unpack in backward the
block is re-run once (``rerun()``, under grad, with the forward's RNG state), its saved tensors captured in
order and compressed, and each placeholder is answered by the tensor of the same number. The re-run must save
the same tensors in the same order as the forward did (the block is deterministic given its RNG state, as
checkpointing requires anyway); a mismatch raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..chains import BlockIO
from ..core import COMPRESS, RECOMPUTE_COMPRESS, Action, AutocastSpec
from .compression import CompressingHooks, Packed, saving_context
from .offload_streams import block_tensors
from .regions import CallRecord
from .rng import Forked


class CompressedRecompute:
    """The saved-tensor hooks of one block's forward under a ``recompute+compress:<format>`` action."""

    def __init__(self, action: str, existing: list[Any], rerun: Callable[[], Any], device_type: str) -> None:
        self.action = Action(COMPRESS, Action.parse(action).expect(RECOMPUTE_COMPRESS).arg).text
        self.existing = existing  # the block's parameters, buffers and arguments: restored as they are
        self.rerun = rerun
        self.autocast = AutocastSpec.current(device_type)  # the forward's, for the re-run in backward
        self.count = 0
        self.stored: dict[int, Any] | None = None

    def pack_hook(self, t: torch.Tensor) -> int:
        self.count += 1
        return self.count - 1

    def unpack_hook(self, index: int) -> torch.Tensor:
        if self.stored is None:
            self.stored = self._recompute()
        value = self.stored.pop(index, None)
        if value is None:
            raise RuntimeError(
                f"a recompute+compress block was asked for saved tensor {index} a second time or the re-run "
                "did not save it: backward through it runs once (no retain_graph), and the block must save the "
                "same tensors in every run. Use 'checkpoint' for this block."
            )
        return value.restore() if isinstance(value, Packed) else value

    def _recompute(self) -> dict[int, Any]:
        hooks = CompressingHooks(self.action, self.existing)
        captured: list[Any] = []

        def capture(t: torch.Tensor) -> None:
            captured.append(hooks.pack_hook(t))

        with (
            torch.enable_grad(),
            self.autocast.context(cache_enabled=False),
            hooks.active(),  # under the matmul policy it marks matrix products
            torch.autograd.graph.saved_tensors_hooks(capture, lambda _: None),
        ):
            self.rerun()
        if len(captured) != self.count:
            raise RuntimeError(
                f"the re-run of a recompute+compress block saved {len(captured)} tensors for backward where its "
                f"forward saved {self.count}: the block does not run the same way twice. Use 'checkpoint'."
            )
        return dict(enumerate(captured))

    @contextmanager
    def active(self) -> Iterator[CompressedRecompute]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack_hook, self.unpack_hook):
            yield self


def recompute_compressed(
    action: str, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], rerun: Callable[[], Any]
) -> Any:
    """A context manager for ``module``'s forward on ``args``/``kwargs`` under ``action``
    (``recompute+compress:<format>[:<policy>]``); ``rerun()`` re-runs the block in backward."""
    existing = block_tensors(module, args, kwargs)
    device = next((t.device.type for t in existing if isinstance(t, torch.Tensor)), "cpu")
    return CompressedRecompute(action, existing, rerun, device).active()


def storing_context(
    action: str, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
    recompute: Callable[[CallRecord, torch.Tensor], Any], index: int, io: BlockIO,
) -> Any:  # fmt: skip
    """The context storing what block ``index`` (``module``) saves under ``action`` elsewhere than as is: on
    the host (``offload``), compressed (``compress:``), or not at all until a compressed re-run in backward
    (``recompute+compress:``, by ``recompute(record, input)`` with the record of this call)."""
    if Action.parse(action).kind != RECOMPUTE_COMPRESS:
        return saving_context(action, module, args, kwargs)
    record, main = CallRecord.take(index, args, kwargs, io)
    return recompute_compressed(
        action, module, args, kwargs, lambda: recompute(record, main.detach().requires_grad_(record.requires_grad))
    )


def run_recompute_compressed(
    module: Callable[..., Any], action: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``module(*args, **kwargs)`` under ``action``, its re-run replaying the forward's RNG state."""
    record, main = CallRecord.take(0, args, kwargs)

    def rerun() -> None:
        with Forked(record.rng.devices, record.rng.device_type):
            record.rng.restore()
            call_args, call_kwargs = record.arguments(main.detach().requires_grad_(main.requires_grad))
            module(*call_args, **call_kwargs)

    with recompute_compressed(action, module, args, kwargs, rerun):
        return module(*args, **kwargs)


__all__ = ["CompressedRecompute", "recompute_compressed", "run_recompute_compressed", "storing_context"]
