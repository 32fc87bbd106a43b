"""Checkpoint regions opened and closed by module hooks: the frame, the recorded block calls, the open state.

torch's non-reentrant checkpoint is a generator (``_checkpoint_without_reentrant_generator``): advanced once,
it installs the saved-tensor hooks of a checkpoint frame; advanced again, it removes them. The runtime
(:mod:`remat.runtime.handle`) advances it from a block's forward pre-hook and from a forward hook (of the same block,
or of the last block of a segment), as ``torch.distributed``'s composable checkpoint does. This module owns
that use of the generator (:func:`open_checkpoint_frame`), the record a recomputation re-runs a block from
(:class:`CallRecord`), the state of a region between its two hooks and how it is closed (:class:`OpenRegion`,
which also runs the region with autocast's weight-cast cache off, see :mod:`remat.core.precision`), the two checks
the hooks rely on (:func:`same_tensor`, :func:`eager`), and the refusal of a forward that itself runs under
``torch.compile`` while regions would open in it (:func:`compiled_caller_check`).
"""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator

from ..chains import HOW_TO_NAME, BlockIO, InputSlot, replace_slot, slot_value, without_caches
from ..core import SEGMENT, Unit, casts_uncached
from .rng import RngSnapshot

_GENERATOR_HAS_EARLY_STOP = "early_stop" in inspect.signature(_checkpoint_without_reentrant_generator).parameters


def open_checkpoint_frame(recompute: Callable[..., None], context_fn: Callable[[], Any], *inputs: Any) -> Any:
    """Open a non-reentrant checkpoint frame around what runs next; returns the generator that closes it when
    advanced once more. In backward, ``recompute(*inputs)`` re-runs what ran inside under ``context_fn()``'s
    contexts, stopping early once it has rebuilt what backward needs. The frame does not save RNG state: the
    runtime's records do, per block (Note [3] in :mod:`remat.runtime.handle`)."""
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
    shape: torch.Size
    versions: tuple[int, ...]

    @classmethod
    def take(
        cls, index: int, args: tuple[Any, ...], kwargs: dict[str, Any], io: BlockIO | None = None
    ) -> tuple[CallRecord, torch.Tensor]:
        """The record of block ``index`` called with ``args``/``kwargs`` (caches dropped, RNG state and tensor
        versions taken now, before the block runs), and its main input."""
        slot = (io or BlockIO()).input_slot(args, kwargs)
        main = slot_value(args, kwargs, slot)
        stripped_args, stripped_kwargs = without_caches(*replace_slot(args, kwargs, slot, None))
        rng = RngSnapshot.take(main)
        versions = _versions(main, stripped_args, stripped_kwargs)
        return cls(index, stripped_args, stripped_kwargs, slot, main.requires_grad, rng, main.shape, versions), main

    def arguments(self, main: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The recorded call's arguments with ``main`` as its main input."""
        return replace_slot(self.args, self.kwargs, self.slot, main)

    def modified_in_place(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether the block, called with ``args``/``kwargs``, changed its main input or another tensor
        argument in place since the record was taken: a recomputation would then start from changed values."""
        main = slot_value(args, kwargs, self.slot)
        return _versions(main, self.args, self.kwargs) != self.versions


def _versions(main: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
    found = [_version(main)]
    _add_versions(args, found)
    _add_versions(kwargs.values(), found)
    return tuple(found)


def _add_versions(values: Iterable[Any], found: list[int]) -> None:
    """Append the version of every tensor in ``values`` and in the lists, tuples and dicts among them (a cheap
    ``tree_flatten``: this runs twice per block and step)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(_version(v))
        elif isinstance(v, list | tuple):
            _add_versions(v, found)
        elif isinstance(v, dict):
            _add_versions(v.values(), found)


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter, and cannot be changed in a grad forward
        return -1


@dataclass
class OpenRegion:
    """A region between its opening pre-hook and its closing forward hook."""

    unit: Unit
    generator: Any = None
    context: Any = None
    casts: Any = None  # the entered remat.core.precision.casts_uncached() context, left when the region closes
    records: list[CallRecord] = field(default_factory=list)
    last_output: torch.Tensor | None = None
    last_outputs: list[tuple[Any, Any]] = field(default_factory=list)  # (index or key, weakref) of each tensor

    def uncache_casts(self) -> None:
        """Turn autocast's weight-cast cache off until the region closes; call before its frame or context
        opens, so the frame records (and its recomputation replays) the uncached state."""
        casts = casts_uncached()
        if not isinstance(casts, nullcontext):  # outside autocast: nothing to leave at close
            casts.__enter__()
            self.casts = casts

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


def output_refs(io: BlockIO, output: Any) -> list[tuple[Any, Any]]:
    """Weak references to the tensors a block returned, with their index or key: enough to tell, when the next
    block's input is not the main output, whether it was another of them."""
    return [(key, weakref.ref(t)) for key, t in io.output_positions(output)]


def handoff_error(
    previous: str, fqn: str, main: torch.Tensor, outputs: list[tuple[Any, Any]], group: str
) -> RuntimeError:
    """The error for block ``fqn`` of a segment or memory-poor group not receiving the main output of
    ``previous``: it names the output it received instead, if it was one, and how to say so."""
    other = next((key for key, ref in outputs if key is not None and same_tensor(main, ref())), None)
    if other is not None:
        return RuntimeError(
            f"block {fqn!r} receives output {other!r} of block {previous!r}, but remat took another of its outputs "
            f"as the hidden state; tell it: main_output={other!r} ({HOW_TO_NAME})"
        )
    if group == SEGMENT:
        problem = f"blocks {previous!r} and {fqn!r} cannot share a segment"
    else:
        problem = f"block {fqn!r} of a memory-poor group did not receive the previous block's output"
    return RuntimeError(
        f"{problem}: the model changes the output of {previous!r} before passing it to {fqn!r}. Checkpoint them "
        f"separately (action 'checkpoint') instead; if {fqn!r} takes another argument as its hidden state, "
        + HOW_TO_NAME
    )


def missing_start_error(fqn: str, start: str, group: str) -> RuntimeError:
    """The error for block (or call) ``fqn`` running without the start ``start`` of its ``group`` before it."""
    return RuntimeError(
        f"block {fqn!r} ran without the start of its {group} {start!r}; a {group} needs its blocks called in "
        "chain order within one forward. Give its blocks single actions ('checkpoint') instead"
    )


def in_place_error(fqn: str, when: str) -> RuntimeError:
    """The error for a block that changed one of its tensor arguments in place ``when`` it ran again (under a
    recomputing action, or measured alone)."""
    return RuntimeError(
        f"block {fqn!r} modifies its input in place (an in-place op such as add_, mul_ or += on an argument) "
        f"{when}: a recomputation (or a measurement) would start from the modified values. Clone "
        "the argument at the start of the block's forward (x = x.clone()), or keep that block (action 'keep', "
        "e.g. edit the plan's actions or leave the block out with blocks=)"
    )


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


COMPILED_CALLER_MESSAGE = (
    "the model runs under torch.compile (torch.compile(model), model.compile(), or a compiled function that calls "
    "it) while its remat plan recomputes or stores blocks' activations: the blocks would run compiled in forward "
    "and eagerly when recomputed, and their saved tensors would not match. Compile the blocks instead, after "
    "remat.apply: remat.integrations.compile.compile_blocks(model) (plans then switch without recompiling); or, "
    "without a remat plan, fit torch.compile's own budget to bytes with "
    "remat.integrations.compile.fit_compile_budget or fit_compiled (docs/compile.md)"
)

# torch's probe of the frame-evaluation callback that torch.compile installs while compiled code runs; None where
# this torch lacks it (then the check below does nothing).
_compile_callback = getattr(
    getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "get_eval_frame_callback", None
)


def compiled_caller_check(handle: Any) -> Callable[..., None]:
    """A forward pre-hook for the model that raises :data:`COMPILED_CALLER_MESSAGE` when the model's forward
    runs inside ``torch.compile`` while ``handle.opens_regions`` (a plain attribute: the hook makes no Python
    call, since under compile every frame it called would be compiled in turn). torch.compile skips the hook's
    own frame but leaves its callback installed, which is what the hook reads; :func:`eager` hooks would see it
    removed. Blocks compiled on their own (``compile_blocks``) run the model's forward eagerly and pass."""
    probe = _compile_callback
    if probe is None:
        return lambda *_: None

    def check(*_: Any) -> None:
        if handle.opens_regions and probe() is not None:
            raise RuntimeError(COMPILED_CALLER_MESSAGE)

    return torch.compiler.disable(check, recursive=False)


def exception_propagating() -> bool:
    """Whether an exception is propagating: torch calls always_call hooks with no output from its except block."""
    return sys.exc_info()[1] is not None
