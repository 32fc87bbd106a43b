"""Which modules carry a live remat plan, and what copying them does.

* One plan per module tree: ``remat.apply`` on a model that already has a plan, on a module inside such a
  model, or on a model holding one that has, would hook some blocks twice (each recomputing, or one
  recomputing the other's hooks). :func:`refuse_overlap` refuses it, naming the model that has the plan.
* Copies: the hooks remat installs belong to one live handle (they recompute *its* blocks with *its* saved
  inputs), so a copy must not run them. Every hook remat installs on a user's module is a :class:`HandleHook`
  (an integration's too): in a ``copy.deepcopy`` it becomes :func:`inert_hook`, and the objects that own hooks
  (:class:`OwnsHooks`: the handle, a session, PGAC), reached through the model's attributes, copy as ``None``.
  The copy is the plain model, with one warning (:data:`COPY_WARNING`); this is what an EMA or SWA copy
  (``torch.optim.swa_utils.AveragedModel``, Lightning's ``WeightAveraging``) needs. :func:`strip_inert_hooks`
  takes the inert hooks off when a plan is applied to the copy. Pickling (``torch.save(model)``) is refused with
  :data:`PICKLE_MESSAGE`; ``model.state_dict()`` works at any time.
* Calls past remat's own hooks: a block re-run in recomputation may skip ``Module.__call__`` where the only hooks
  it would run are the handle's own (idle while recomputing): :func:`forward_past_own_hooks`.
* Every applied plan switched off in this thread, e.g. while a block is measured alone: :func:`suspend_all` is
  entered by code that runs blocks outside the step (the profiler, the meta estimator); the runtime's hooks ask
  :func:`all_suspended` and do nothing while it is true. The state is per thread, so a measurement in one thread
  does not switch plans off in another. :class:`Counting` is the per-thread counter it uses, shared with the
  runtime (a handle's own suspension and recomputation counters).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.modules import module as torch_module

PICKLE_MESSAGE = (
    "cannot pickle a module while a remat plan is applied to it (torch.save(model)): its hooks belong to the live "
    "handle. Save model.state_dict() (torch's advice for saving models), or call handle.remove() (session.remove() "
    "for an integration) first"
)
COPY_WARNING = (
    "copy.deepcopy of a model with a remat plan: the copy is the plain model (the plan stays with the original); "
    "if the copy trains, give it a plan of its own: remat.fit(copy, ...) or remat.apply(copy, plan)"
)
_COPY_WARNED = object()  # a key in a deepcopy's memo: that copy has warned


def inert_hook(*args: Any, **kwargs: Any) -> None:
    """What a :class:`HandleHook` is in a deep copy of its module: a hook that does nothing."""


class HandleHook:
    """A module hook that belongs to a live handle: nothing in a deep copy (:func:`inert_hook`), and pickling it
    is refused with :data:`PICKLE_MESSAGE`."""

    __slots__ = ("hook", "__weakref__")

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hook(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        if id(_COPY_WARNED) not in memo:
            memo[id(_COPY_WARNED)] = _COPY_WARNED
            warnings.warn(COPY_WARNING, stacklevel=2)
        return inert_hook

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(PICKLE_MESSAGE)


class OwnsHooks:
    """Base of the objects a model refers to while they own hooks on it (``model._remat_handle``, a session):
    in a deep copy of the model they are ``None``, as their hooks are inert there."""

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None


def strip_inert_hooks(model: nn.Module) -> None:
    """Take the inert hooks of a copy (:class:`HandleHook`) off ``model`` and its modules."""
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for hook_id in [k for k, hook in hooks.items() if hook is inert_hook]:
                del hooks[hook_id]
                module._forward_pre_hooks_with_kwargs.pop(hook_id, None)
                module._forward_hooks_with_kwargs.pop(hook_id, None)
                module._forward_hooks_always_called.pop(hook_id, None)


_LIVE: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def register(model: nn.Module, owner: Any) -> None:
    """Note that ``owner`` (a handle) has a plan on ``model``."""
    _LIVE[model] = owner


def unregister(model: nn.Module, owner: Any) -> None:
    if _LIVE.get(model) is owner:
        del _LIVE[model]


def owner_of(model: nn.Module) -> Any:
    """The handle with a plan on ``model`` itself, or ``None``."""
    return _LIVE.get(model)


def refuse_overlap(model: nn.Module) -> None:
    """Raise when ``model``, a module inside it, or a model containing it already has a plan applied."""
    if model in _LIVE:
        raise RuntimeError(
            "remat is already applied to this model: call handle.set_plan(plan) to change its plan, or .remove() "
            "on what remat.apply or remat.fit returned before applying or fitting again"
        )
    inside = {id(m) for m in model.modules()}
    for other in list(_LIVE.keys()):
        if id(other) in inside:
            relation = f"its submodule {type(other).__name__}"
        elif any(m is model for m in other.modules()):
            relation = f"the {type(other).__name__} that contains it"
        else:
            continue
        raise RuntimeError(
            f"remat is already applied to {relation}: a second plan would hook the same blocks twice. Use one "
            "plan for the whole model (handle.set_plan(plan) changes it), or call handle.remove() on the other "
            "one first."
        )


_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")  # fmt: skip


def forward_past_own_hooks(module: nn.Module, own: frozenset[int]) -> Callable[..., Any]:
    """What to call to run ``module``: its ``forward`` where ``module(...)`` would run no hook but those with
    handle ids ``own`` (remat's, which do nothing while it recomputes) and is not compiled (``module.compile()``);
    ``module`` itself otherwise, so every other hook (FSDP's all-gather, a user's) still runs. Calling ``forward``
    is what ``Module.__call__`` does when there is no hook, without its Python frames (~80 us per block call on a
    busy step's cold CPU caches)."""
    if (
        getattr(module, "_compiled_call_impl", None) is None
        and not module._backward_hooks
        and not module._backward_pre_hooks
        and own.issuperset(module._forward_pre_hooks)
        and own.issuperset(module._forward_hooks)
        and not any(getattr(torch_module, name, None) for name in _GLOBAL_HOOKS)
    ):
        return module.forward
    return module


# ---------------------------------------------------------------------------------------------- suspension

_STATE = threading.local()


class Counting:
    """Count ``local.<name>`` up while the context runs; restored on every exit, exceptions included. A class,
    not a generator: it is entered around every recomputation, where a generator's frames cost."""

    __slots__ = ("local", "name")

    def __init__(self, local: threading.local, name: str) -> None:
        self.local, self.name = local, name

    def __enter__(self) -> None:
        setattr(self.local, self.name, getattr(self.local, self.name, 0) + 1)

    def __exit__(self, *exc: object) -> None:
        setattr(self.local, self.name, getattr(self.local, self.name) - 1)


def suspend_all() -> contextlib.AbstractContextManager[None]:
    """Within this context every applied plan is ignored in this thread (blocks run as without remat)."""
    return Counting(_STATE, "suspended")


def all_suspended() -> bool:
    """Whether this thread is inside :func:`suspend_all`."""
    return getattr(_STATE, "suspended", 0) > 0
