"""Keeping a model's state as a plain step leaves it when remat runs a block more often than the step does.

The profiler runs each block several times on its own, and a recomputation runs a block again in backward. A
plain step runs it once. Whatever such an extra run would change must be put back:

* **buffers**: a BatchNorm in training mode updates its running statistics (and ``num_batches_tracked``) on every
  forward; torch's own checkpointing lets a recomputation update them a second time. :func:`buffers_kept`
  copies a module's persistent buffers (the ones in its ``state_dict``: model state, not constants or caches)
  and puts their values back without moving their versions, so a buffer that an autograd graph saved
  (BatchNorm saves its running statistics) is not bumped to a new version.
* **collected outputs**: Hugging Face collects ``output_hidden_states``, attentions and router logits with hooks
  on the layers while the model's forward runs; an isolated run inside that forward must not add to them
  (:func:`remat.chains.hf_guards.outputs_not_collected`).

:func:`extra_run` applies both around a block run that the step itself does not make, and
:func:`detached_from_step` cuts an isolated run's arguments from the step's autograd graph.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_buffer_registration_hook, register_module_module_registration_hook
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from .hf_guards import outputs_collected, outputs_not_collected

# Note [1] Where a block's persistent buffers live, cached.
# persistent_buffers runs before every recomputation of a block; walking the block's module tree each time cost
# ~45 us per Llama layer on the CPU (its Python objects are cold after the block's kernels). The walk's result is
# cached per module as (submodule, name) slots, read again at each call, so buffers replaced in place of a slot
# (``model.to``, ``model.half``) are seen. Slots hold weak references: a cache entry must not keep its own key,
# or a submodule deleted from the tree, alive. The slots change only when a module of the tree registers a buffer
# or a submodule (``register_buffer``, ``add_module``, or assigning either as an attribute): torch's global
# registration hooks then drop the cache of every tree holding that module. A global generation counter would
# not do: Hugging Face models slice their ModuleList in every forward, registering modules of a new list. A tree
# with a module class that is not hashable is walked at every call.
# Inside code torch.compile traces, the hook returns at once: dynamo would trace the cache lookup and guard the
# compiled graph on the cache's size, so every model whose forward registers a module (that ModuleList slice)
# would recompile whenever remat cached another tree. A module registered there is new (the slice's list, held by
# no cached tree); a buffer registered in compiled code on a module of a cached tree would not reach the cache.
_Slot = tuple[weakref.ref[nn.Module], str]
_SLOTS: weakref.WeakKeyDictionary[nn.Module, tuple[_Slot, ...]] = weakref.WeakKeyDictionary()
_TREES_HOLDING: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[nn.Module]] = weakref.WeakKeyDictionary()


def _registered(module: nn.Module, *_: Any) -> None:
    if torch.compiler.is_compiling():  # Note [1]
        return
    try:
        trees = _TREES_HOLDING.get(module)
    except TypeError:  # a module class that is not hashable is never cached (_buffer_slots)
        return
    if trees:
        for root in list(trees):
            _SLOTS.pop(root, None)
    # returns None: torch keeps the registered buffer or module as it is


register_module_buffer_registration_hook(_registered)
register_module_module_registration_hook(_registered)


def _walk_slots(module: nn.Module) -> tuple[tuple[_Slot, ...], list[nn.Module]]:
    """The (submodule, name) of every persistent buffer slot in ``module``'s tree, and the tree's modules."""
    slots: list[_Slot] = []
    members: list[nn.Module] = []
    seen: set[int] = set()
    stack = [module]
    while stack:
        sub = stack.pop()
        if id(sub) in seen:
            continue
        seen.add(id(sub))
        members.append(sub)
        slots.extend((weakref.ref(sub), name) for name in sub._buffers if name not in sub._non_persistent_buffers_set)
        stack.extend(child for child in sub._modules.values() if child is not None)
    return tuple(slots), members


def _buffer_slots(module: nn.Module) -> tuple[_Slot, ...]:
    try:
        cached = _SLOTS.get(module)
        if cached is None:
            cached, members = _walk_slots(module)
            for sub in members:
                _TREES_HOLDING.setdefault(sub, weakref.WeakSet()).add(module)
            _SLOTS[module] = cached
    except TypeError:  # a module class of the tree is not hashable: walk every time
        return _walk_slots(module)[0]
    return cached


def persistent_buffers(module: nn.Module) -> list[torch.Tensor]:
    """The buffers of ``module`` and its submodules that its ``state_dict`` holds (each once); Note [1]."""
    found: list[torch.Tensor] = []
    for ref, name in _buffer_slots(module):
        sub = ref()
        buffer = sub._buffers.get(name) if sub is not None else None
        if buffer is not None and all(buffer is not other for other in found):
            found.append(buffer)
    return found


class BufferSnapshot:
    """Copies of a module's persistent buffers; :meth:`restore` writes their values back.

    Both run outside every dispatch mode: inside a recomputation a selective-checkpoint mode counts the
    operators the block runs, and the copies are not the block's.
    """

    def __init__(self, module: nn.Module) -> None:
        buffers = persistent_buffers(module)
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        if not buffers:  # most blocks (transformer layers) have none: no mode switches per recomputation
            return
        with torch.no_grad(), _disable_current_modes():
            self.saved = [(buffer, buffer.detach().clone()) for buffer in buffers]

    def restore(self) -> None:
        """Put back every buffer's value. Through ``.data``: the buffer's version does not move (an autograd
        graph may have saved it: BatchNorm saves its running statistics), and nothing is compared, which on
        CUDA would wait for the device once per buffer."""
        if not self.saved:
            return
        with torch.no_grad(), _disable_current_modes():
            for buffer, copy in self.saved:
                if buffer.is_inference():  # no .data write outside inference mode: only where it changed
                    if not torch.equal(buffer, copy):
                        buffer.copy_(copy)
                else:
                    buffer.data.copy_(copy)


@contextmanager
def buffers_kept(module: nn.Module) -> Iterator[None]:
    """Within this context ``module``'s persistent buffers may change; on exit they are as they were."""
    snapshot = BufferSnapshot(module)
    try:
        yield
    finally:
        snapshot.restore()


def extra_run(module: nn.Module) -> AbstractContextManager[None]:
    """Run ``module`` in here when the step would not: its buffers are restored and its outputs not collected.
    Runs before every recomputation, so where there is nothing to guard (no persistent buffer, no Hugging Face
    output collection under way) it is a no-op context without generator frames."""
    collected = outputs_collected()
    if not collected and not _buffer_slots(module):  # a transformer layer: nothing to guard, nothing to copy
        return _NOTHING_TO_GUARD
    snapshot = BufferSnapshot(module)
    if not snapshot.saved and not collected:
        return _NOTHING_TO_GUARD
    return _guarded(snapshot)


_NOTHING_TO_GUARD = nullcontext()  # reusable: entering it does nothing


@contextmanager
def _guarded(snapshot: BufferSnapshot) -> Iterator[None]:
    try:
        with outputs_not_collected():
            yield
    finally:
        snapshot.restore()


def detached_from_step(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A block's arguments for a run on its own: every tensor that is part of the step's autograd graph (T5's
    position bias from the first layer, a decoder's encoder states) becomes a detached leaf that still requires
    grad, so the run's backward computes the same gradients without reaching into the step's graph."""

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.requires_grad and not isinstance(value, nn.Parameter):
            return value.detach().requires_grad_(True)
        return value

    return tree_map(cut, args), tree_map(cut, kwargs)
