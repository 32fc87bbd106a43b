"""CPU dropout draws inside selective-checkpoint regions: recorded once in forward at one byte per element,
replayed (not drawn again) in recompute.

On CPU, ``F.dropout`` is ``empty_like(x).bernoulli_(1 - p)``, ``div_`` and ``mul``. The draw is an in-place
op, which a per-op policy can never save (torch's selective checkpoint refuses a cache entry mutated
afterwards), so every selective region drew its masks again in backward; on CPU those draws are about a
quarter of a transformer block's forward, and they made any selective policy cost most of a full recompute.

:func:`contexts` gives the pair of dispatch modes that sit under torch's selective-checkpoint modes. In
forward, :class:`RecordDraws` keeps the values of each CPU ``bernoulli_`` (0 or 1, so ``bool`` holds them
exactly) and the generator state after it. In recompute, :class:`ReplayDraws` fills the same buffer from the
kept values instead of drawing and moves the generator to the recorded state, so any random op later in the
region draws what it drew in forward, and the result is bit for bit the forward's. Draws on other devices
(CUDA dropout is one fused op, cheap to draw again) are left alone; so is code that ``torch.compile`` traced.

Where torch calls the selective-checkpoint policy after each forward op with the op run (torch 2.5 and later:
``SelectiveCheckpointContext.op_output``), the forward needs no mode of its own: :func:`recording` wraps the
policy so that it logs the draws as torch asks it about them, which saves a Python dispatch frame per op.
A recompute whose forward drew nothing on the CPU skips its replay mode too (CUDA regions, no dropout).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SelectiveCheckpointContext

_BERNOULLI_INPLACE = torch.ops.aten.bernoulli_
# by id: an OpOverload hashes in Python, which costs more per op than the rest of the check; overloads are
# created once and kept by their packet, so their ids are stable
_BERNOULLI_IDS = frozenset(id(getattr(_BERNOULLI_INPLACE, name)) for name in _BERNOULLI_INPLACE.overloads())

# torch calls the policy after the op has run (and passes its output) where the context has ``op_output``
POLICY_SEES_OUTPUT = "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters


@dataclass
class DrawLog:
    """The draws one region made in forward, in order: (values as bool, CPU generator state after)."""

    draws: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def _cpu_draw(func: Any, args: tuple[Any, ...]) -> torch.Tensor | None:
    """The buffer a CPU ``bernoulli_`` fills, or ``None`` for any other op. The ``meta`` device runs dropout
    the way CPU does, so meta estimates (:func:`remat.profiling.estimate.meta_cost_table`) log its draws too."""
    if getattr(func, "overloadpacket", None) is not _BERNOULLI_INPLACE or not args:
        return None
    target = args[0]
    if type(target) is not torch.Tensor or target.device.type not in ("cpu", "meta"):
        return None
    return target


class RecordDraws(TorchDispatchMode):
    """Forward: run every op; after each CPU ``bernoulli_``, log its values and the generator state."""

    def __init__(self, log: DrawLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        target = _cpu_draw(func, args)
        if target is not None:
            self.log.draws.append((target.to(torch.bool), torch.get_rng_state()))
        return out


def recording(policy: Callable[..., Any], log: DrawLog) -> Callable[..., Any]:
    """``policy``, also logging into ``log`` each CPU ``bernoulli_`` it is asked about (after the draw: use
    only where :data:`POLICY_SEES_OUTPUT`); the forward then needs no :class:`RecordDraws`."""
    draws = log.draws

    def policy_fn(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if id(func) in _BERNOULLI_IDS and args:
            target = args[0]
            if type(target) is torch.Tensor and target.device.type in ("cpu", "meta"):
                draws.append((target.to(torch.bool), torch.get_rng_state()))
        return policy(ctx, func, *args, **kwargs)

    return policy_fn


class ReplayDraws(TorchDispatchMode):
    """Recompute: serve each CPU ``bernoulli_`` from the log, in order, instead of drawing. Where forward drew
    nothing on the CPU it stays out of the dispatch stack."""

    def __init__(self, log: DrawLog) -> None:
        super().__init__()
        self.log = log
        self.position = 0
        self._active = False

    def __enter__(self) -> ReplayDraws:
        self.position = 0  # a region may be recomputed more than once (retain_graph)
        self._active = bool(self.log.draws)
        if not self._active:
            return self
        # Replays move the generator; put it back on exit so that a recompute without torch's RNG fork
        # (preserve_rng_state=False) leaves the caller's random stream as it found it.
        self._outer_state = torch.get_rng_state()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        if not self._active:
            return
        try:
            super().__exit__(*exc)
        finally:
            torch.set_rng_state(self._outer_state)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        target = _cpu_draw(func, args)
        if target is None:
            return func(*args, **(kwargs or {}))
        if self.position >= len(self.log.draws):
            raise RuntimeError(
                "a selective-checkpoint region drew more random numbers in recompute than in forward: "
                "its code must take the same path both times"
            )
        values, state_after = self.log.draws[self.position]
        self.position += 1
        if values.shape != target.shape:
            raise RuntimeError(
                f"a selective-checkpoint region drew a {tuple(target.shape)} tensor in recompute where forward "
                f"drew {tuple(values.shape)}: its code must take the same path both times"
            )
        target.copy_(values)
        torch.set_rng_state(state_after)
        return target


def contexts() -> tuple[RecordDraws, ReplayDraws]:
    """A fresh (forward, recompute) pair sharing one log; enter each under torch's selective-checkpoint mode."""
    log = DrawLog()
    return RecordDraws(log), ReplayDraws(log)


def tracing() -> bool:
    """Whether torch.compile is tracing (dynamo, or AOT autograd under a fake or proxy mode)."""
    if torch.compiler.is_compiling():
        return True
    mode_keys = getattr(torch._C, "_TorchDispatchModeKey", None)
    if mode_keys is None:
        return False
    return any(torch._C._get_dispatch_mode(key) is not None for key in (mode_keys.FAKE, mode_keys.PROXY))


class StackedContexts:
    """Enter several context managers as one (in order) and leave them in reverse; unlike a generator-based
    context manager it can be entered again (a region recomputed twice under ``retain_graph``)."""

    def __init__(self, *contexts: Any) -> None:
        self.contexts = contexts

    def __enter__(self) -> StackedContexts:
        with contextlib.ExitStack() as stack:
            for ctx in self.contexts:
                stack.enter_context(ctx)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: Any) -> bool:
        return bool(self._stack.__exit__(*exc))
