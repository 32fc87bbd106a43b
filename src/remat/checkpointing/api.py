"""The checkpoint API: a function form, a decorator, an ``nn.Module`` wrapper and a drop-in ``checkpoint_fn``.

All are built on ``torch.utils.checkpoint`` in its non-reentrant form: only the inputs of the region are
saved and the region is re-run in backward. Outside autograd (grad disabled) they are plain calls. Inputs and
outputs may be any containers of tensors and other values; keyword arguments pass through; nested use works;
the RNG state is preserved by default, so dropout gives the same gradients as without checkpointing.

``use_reentrant=False``, which torch's documentation asks every caller to pass, is accepted and changes
nothing. ``use_reentrant=True`` is refused by :func:`checkpoint`, :func:`checkpointed` and :class:`Checkpoint`,
since the reentrant form supports neither keyword arguments nor policies. :func:`checkpoint_fn`, the drop-in that
torch's ``checkpoint_wrapper``, Hugging Face and DeepSpeed call with whatever options their own callers chose, runs
the non-reentrant form then and says so once (a warning): its gradients are those of either form wherever the
reentrant one gives gradients at all. It takes ``policy=`` for itself, so a checkpointed function's own ``policy``
argument is bound first (``functools.partial``); ``policy=`` and ``context_fn=`` together are refused.

A second backward pass through a region (``retain_graph=True`` twice, or ``create_graph=True`` for
gradients of gradients) works, and gives the gradients of the uncheckpointed function, unless a ``policy``
saves operator outputs: torch's selective checkpointing hands out each saved output once (see
:mod:`remat.planning.strategies`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from . import policies as _policies

PolicyLike = str | _policies.Policy | Callable[..., Any] | None

# Options that torch, Hugging Face and DeepSpeed pass to a checkpoint function; the rest goes to ``fn``.
_CHECKPOINT_OPTIONS = frozenset(
    {"use_reentrant", "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop", "policy"}
)


def _context_fn(policy: PolicyLike) -> Callable[[], Any]:
    """The ``context_fn`` torch's checkpoint takes for ``policy``. A ``functools.partial``, not the bound method
    ``policy.context_fn``: under ``torch.compile`` a bound method loses its ``self`` (dynamo keeps only the
    function), while a partial is kept whole."""
    p = _policies.get(policy)
    return functools.partial(type(p).context_fn, p)


def _check_use_reentrant(use_reentrant: bool | None) -> None:
    if use_reentrant:
        raise ValueError(
            "remat checkpoints with torch's non-reentrant implementation only (it supports keyword arguments, "
            "policies, nesting and inputs that need no gradient); use_reentrant=True is not supported: pass "
            "use_reentrant=False or leave it out"
        )


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    policy: PolicyLike = None,
    preserve_rng_state: bool = True,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` keeping only its inputs for backward; re-run it when gradients flow.

    ``policy`` (see :mod:`remat.policies`) keeps chosen operator outputs instead of recomputing them.
    ``use_reentrant``: ``None`` or ``False`` (torch's non-reentrant form, the only one remat uses); ``True``
    raises ValueError. A plain call when grad is disabled.
    """
    _check_use_reentrant(use_reentrant)
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    options: dict[str, Any] = {}
    if policy is not None:
        options["context_fn"] = _context_fn(policy)
        fn = _naming_second_backward(fn)
    return _torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **options, **kwargs)


def _naming_second_backward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, whose re-run under a policy raises torch's second-backward error with what to do."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _policies.naming_second_backward():
            return fn(*args, **kwargs)

    return run


def checkpointed(
    fn: Callable[..., Any] | None = None,
    *,
    policy: PolicyLike = None,
    preserve_rng_state: bool = True,
    use_reentrant: bool | None = None,
) -> Any:
    """Decorator form: ``@remat.checkpointed`` or ``@remat.checkpointed(policy="dots_saveable")``."""
    _check_use_reentrant(use_reentrant)

    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return checkpoint(f, *args, policy=policy, preserve_rng_state=preserve_rng_state, **kwargs)

        return wrapper

    return wrap(fn) if fn is not None else wrap


def checkpoint_fn(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Drop-in replacement for ``torch.utils.checkpoint.checkpoint`` and ``deepspeed.checkpointing.checkpoint``.

    Usable as ``checkpoint_wrapper(module, checkpoint_fn=remat.checkpoint_fn)`` and as a Hugging Face
    ``_gradient_checkpointing_func``. Checkpoint options (``use_reentrant``, ``preserve_rng_state``,
    ``context_fn``, ``policy``...) are taken out of ``kwargs``; remat always uses the non-reentrant form.
    """
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in _CHECKPOINT_OPTIONS}
    if options.get("policy") is not None and options.get("context_fn") is not None:
        raise ValueError(
            "checkpoint_fn got policy= and context_fn=: both choose what the region saves; give one (a policy "
            "builds its own context_fn)"
        )
    if options.get("use_reentrant"):
        _warn_reentrant_once()
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    extra: dict[str, Any] = {}
    if options.get("policy") is not None:
        try:
            extra["context_fn"] = _context_fn(options["policy"])
        except (ValueError, TypeError) as err:
            raise type(err)(
                f"{err} checkpoint_fn takes policy= for itself (remat's per-operator policy); where the checkpointed "
                "function has a policy argument of its own, bind it first: checkpoint_fn(functools.partial(fn, "
                "policy=...), ...)"
            ) from None
    elif options.get("context_fn") is not None:
        extra["context_fn"] = options["context_fn"]
    for name in ("determinism_check", "debug", "early_stop"):
        if name in options:
            extra[name] = options[name]
    return _torch_checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=options.get("preserve_rng_state", True),
        **extra,
        **kwargs,
    )


_REENTRANT_WARNED = False


def _warn_reentrant_once() -> None:
    global _REENTRANT_WARNED
    if _REENTRANT_WARNED:
        return
    _REENTRANT_WARNED = True
    warnings.warn(
        "remat.checkpoint_fn was called with use_reentrant=True and runs torch's non-reentrant checkpoint: remat "
        "uses that form only (keyword arguments, policies, nesting, inputs without gradients); gradients are the "
        "same wherever the reentrant form gives them. Pass use_reentrant=False to silence this.",
        stacklevel=3,
    )


_WRAPPED = "module."


def _strip_prefix_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for key in list(state_dict):
        if key.startswith(prefix + _WRAPPED):
            state_dict[prefix + key[len(prefix + _WRAPPED) :]] = state_dict.pop(key)


def _add_prefix_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
    for key in list(state_dict):
        if key.startswith(prefix) and not key.startswith(prefix + _WRAPPED):
            state_dict[prefix + _WRAPPED + key[len(prefix) :]] = state_dict.pop(key)


class Checkpoint(nn.Module):
    """Wrap ``module`` so its forward is checkpointed; usable inside ``nn.Sequential``.

    ``state_dict()`` keys are those of the wrapped module, so checkpoints load with or without the wrapper.
    """

    def __init__(self, module: nn.Module, policy: PolicyLike = None, preserve_rng_state: bool = True) -> None:
        super().__init__()
        self.module = module
        self.policy = policy
        self.preserve_rng_state = preserve_rng_state
        self._register_state_dict_hook(_strip_prefix_hook)
        self._register_load_state_dict_pre_hook(_add_prefix_hook, with_module=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.module, *args, policy=self.policy, preserve_rng_state=self.preserve_rng_state, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def extra_repr(self) -> str:
        name = _policies.get(self.policy).name if self.policy is not None else "recompute all"
        return f"policy={name}"
