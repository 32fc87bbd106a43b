"""``remat.DTR``: Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021) with stock PyTorch.

DTR works on tensors, online, inside a training step: it tracks every tensor the step creates together with
the operator and inputs that produced it, and when tracked memory would exceed the byte budget it evicts
(frees) the saved activation with the smallest score h(t) = c(t) / (m(t) * s(t)) — recompute cost over
memory times staleness, with the cost of the evicted neighbourhood in the default ``dtr`` heuristic.
An evicted tensor that autograd (or the recomputation of another tensor) needs again is recomputed by
re-running its operator, its evicted inputs first. Random operators replay with the RNG state they had,
so gradients are exactly those of the step without DTR.

Two ways to use it::

    dtr = remat.DTR(model, "200MiB")           # or 0.5: half of the no-checkpoint activation memory
    with dtr:                                  # one training step
        loss = model(x).sum()
        loss.backward()

    dtr.attach()                               # every forward opens a step that ends with its backward
    ...
    dtr.detach()

Keep ``optimizer.step()`` outside the ``with`` block: the optimizer state it creates on the first step would
otherwise count as tracked memory of that step.

Tensors that user code can still reach (parameters, buffers, inputs, anything referenced outside DTR,
views included) are never evicted. ``dtr.stats`` has evictions, rematerializations, recompute seconds and
the peak tracked bytes, for the last step and in total. The engine is in :mod:`.runtime`, the graph and
the heuristics in :mod:`.graph`, eviction in :mod:`.evict`, rematerialization in :mod:`.remat`,
which operators replay in the same module, output prediction in :mod:`.predict`.

What the budget covers: every storage created during the step while it is alive, except gradients of
parameters (they outlive the step); that is ``remat.measure().activation_bytes`` plus whatever the step
creates and the caller keeps (the loss, say). Memory held by user code and gradients in flight cannot be
evicted; when they alone exceed the budget DTR warns (or raises with ``strict=True``).

Limits: every operator passes through Python, which costs time even when nothing is evicted (1.2-1.9x on
the small CPU models of ``benchmarks/dtr.py``); the cost c(t) is the operator's wall-clock time, which on
CUDA is only its launch time; ``torch.compile``d code is not seen; the outputs of operators that cannot be
replayed (outside ``aten``, or writing tensors from outside the step other than batch-norm statistics) are
kept once an evicted tensor depends on them; one step runs in one thread at a time. When attached, the
dispatch mode stays on the stack (at its bottom) from a forward until the next forward or ``detach()``.
"""

from __future__ import annotations

import copy
import functools
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import (
    _get_dispatch_stack_at,
    _len_torch_dispatch_stack,
    _pop_mode,
    _push_mode,
)

from ...core import format_bytes, normalize_budget, parse_bytes
from .graph import HEURISTICS
from .predict import OutputPredictor
from .runtime import DTRRuntime, StepStats

__all__ = ["DTR", "DTRStats", "HEURISTICS", "StepStats"]


_ATTACHED = ("__deepcopy__", "__reduce_ex__")


def _plain_copy(model: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``copy.deepcopy`` of a model DTR is attached to: the plain model (DTR stays with the original)."""
    held = {k: model.__dict__.pop(k) for k in ("forward", *_ATTACHED) if k in model.__dict__}
    try:
        copied = copy.deepcopy(model, memo)
    finally:
        model.__dict__.update(held)
    warnings.warn(
        "copy.deepcopy of a model with DTR attached: the copy is the plain model (DTR stays with the original); "
        "attach a DTR of its own to the copy: remat.DTR(copy, budget).attach()",
        stacklevel=3,
    )
    return copied


def _refuse_pickle(protocol: int) -> Any:
    raise TypeError(
        "a model with DTR attached cannot be pickled (torch.save(model)): its forward runs through DTR. Save "
        "model.state_dict() (torch's advice for saving models), or call dtr.detach() first"
    )


@dataclass
class DTRStats:
    """Totals over the steps run under one :class:`DTR`, and the figures of the last step."""

    steps: int = 0
    calibration_steps: int = 0
    evictions: int = 0
    rematerializations: int = 0
    recompute_s: float = 0.0
    step_s: float = 0.0
    peak_tracked_bytes: int = 0
    over_budget_ops: int = 0
    last_step: StepStats = field(default_factory=StepStats)

    def add(self, step: StepStats) -> None:
        self.steps += 1
        self.evictions += step.evictions
        self.rematerializations += step.rematerializations
        self.recompute_s += step.recompute_s
        self.step_s += step.step_s
        self.peak_tracked_bytes = max(self.peak_tracked_bytes, step.peak_tracked_bytes)
        self.over_budget_ops += step.over_budget_ops
        self.last_step = step

    @property
    def recompute_fraction(self) -> float:
        """Recompute seconds over step seconds, over all steps."""
        return self.recompute_s / self.step_s if self.step_s else 0.0


class DTR:
    """Dynamic tensor rematerialization of ``model``'s training steps under ``budget`` bytes of tracked memory.

    ``budget``: bytes (int), a string like ``"1.5GiB"``, or a float in (0, 1] meaning that fraction of the
    no-checkpoint activation memory, which is taken from ``baseline_bytes`` or measured by running the first
    step without evicting anything. ``heuristic``: ``"dtr"`` (cost of the evicted neighbourhood, the paper's
    DTR-EqClass), ``"dtr_local"`` (the tensor's own cost), ``"lru"`` or ``"size"`` (largest first).
    ``strict``: raise :class:`remat.BudgetError` instead of warning when nothing can be evicted.
    A budget below what a single operator needs (its inputs and outputs at once) always raises.
    """

    def __init__(
        self,
        model: nn.Module | None,
        budget: int | float | str,
        heuristic: str = "dtr",
        *,
        baseline_bytes: int | None = None,
        strict: bool = False,
    ) -> None:
        if heuristic not in HEURISTICS:
            raise ValueError(f"unknown DTR heuristic {heuristic!r}; choose one of: {', '.join(HEURISTICS)}")
        budget = normalize_budget(budget)  # int bytes or a float fraction (rules: remat.core.sizes)
        self.model = model
        self.budget = budget
        self.heuristic = heuristic
        self.strict = strict
        self.baseline_bytes = baseline_bytes
        self.stats = DTRStats()
        self._runtime: DTRRuntime | None = None
        self._predictor = OutputPredictor()  # output sizes per operator and shapes, kept across steps
        self._saved_hooks: Any = None
        self._grad_hooks: list[Any] = []
        self._calibrating = False
        self._forward: Any = None  # the model's forward while attached
        self._had_forward_attr = False
        self._in_forward = False
        self._lingering = False  # attached: the mode stays on the stack until the next forward

    @property
    def budget_bytes(self) -> int | None:
        """The budget in bytes; ``None`` while a fractional budget waits for its calibration step."""
        if isinstance(self.budget, float):
            return None if self.baseline_bytes is None else max(1, int(self.budget * self.baseline_bytes))
        return parse_bytes(self.budget)

    def reset_stats(self) -> None:
        self.stats = DTRStats()

    def __repr__(self) -> str:
        budget = self.budget_bytes
        shown = format_bytes(budget) if budget is not None else f"{self.budget:.0%} (not calibrated yet)"
        return f"DTR(budget={shown}, heuristic={self.heuristic!r}, steps={self.stats.steps})"

    # ----------------------------------------------------------------- context manager
    def __enter__(self) -> DTR:
        if self._forward is not None:
            raise RuntimeError("this DTR is attached to the model; detach() it before using it with `with`")
        if self._runtime is not None:
            raise RuntimeError("this DTR is already running a step; `with` blocks of one DTR cannot nest")
        self._open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._close()

    # ----------------------------------------------------------------- attached to the model's forward
    def attach(self) -> DTR:
        """Run every training forward of the model (and the backward that follows) under DTR."""
        if self._forward is not None:
            return self
        if self._runtime is not None:
            raise RuntimeError("attach() cannot be called inside a `with` block of the same DTR")
        if self.model is None:
            raise ValueError("attach() needs the model: create the DTR with the model as first argument")
        model = self.model
        self._had_forward_attr = "forward" in model.__dict__
        original = model.forward
        self._forward = original

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._attached_forward(original, args, kwargs)

        model.forward = forward
        # The wrapper holds this model: a deep copy would call it (the copy training the original), and pickle
        # cannot store it. A copy is made of the plain model instead; pickling says what to do.
        model.__dict__["__deepcopy__"] = functools.partial(_plain_copy, model)
        model.__dict__["__reduce_ex__"] = _refuse_pickle
        return self

    def detach(self) -> None:
        """Undo :meth:`attach`: end the open step and give the model its own forward back."""
        if self._forward is None:
            return
        self._close()
        if self._had_forward_attr:
            self.model.forward = self._forward
        else:
            del self.model.__dict__["forward"]
        for name in _ATTACHED:
            self.model.__dict__.pop(name, None)
        self._forward = None

    def _attached_forward(self, original: Any, args: tuple, kwargs: dict) -> Any:
        if self._in_forward or not torch.is_grad_enabled():  # a nested call, or not a training step
            return original(*args, **kwargs)
        self._close()
        self._open(on_backward_end=self._backward_done)
        self._in_forward = True
        try:
            out = original(*args, **kwargs)
        except BaseException:
            self._in_forward = False
            self._close()
            raise
        self._in_forward = False
        self._saved_hooks.__exit__(None, None, None)
        self._saved_hooks = None
        # The backward that follows must run under the mode. Modes entered around the step are exited
        # after this returns, so the mode moves to the bottom of the stack, out of their way.
        _move_to_bottom(self._runtime)
        self._lingering = True
        return out

    def _backward_done(self) -> None:
        runtime = self._runtime
        if runtime is not None and runtime.active:
            self._finish(runtime)

    # ----------------------------------------------------------------- steps
    def _open(self, on_backward_end: Any = None) -> None:
        budget = self.budget_bytes
        self._calibrating = budget is None
        runtime = DTRRuntime(
            budget, HEURISTICS[self.heuristic], strict=self.strict, record=budget is not None,
            predictor=self._predictor,
        )  # fmt: skip
        runtime.on_backward_end = on_backward_end
        if self.model is not None:
            self._grad_hooks = [
                p.register_post_accumulate_grad_hook(runtime.grad_landed)
                for p in self.model.parameters()
                if p.requires_grad
            ]
        self._runtime = runtime
        runtime.__enter__()
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(runtime.pack, runtime.unpack)
        self._saved_hooks.__enter__()

    def _close(self) -> None:
        runtime = self._runtime
        if runtime is None:
            return
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        if self._lingering:
            _remove(runtime)
            self._lingering = False
        else:
            runtime.__exit__(None, None, None)
        self._runtime = None
        if runtime.active:
            self._finish(runtime)

    def _finish(self, runtime: DTRRuntime) -> None:
        step = runtime.close()
        for hook in self._grad_hooks:
            hook.remove()
        self._grad_hooks = []
        if self._calibrating:
            self.baseline_bytes = step.peak_tracked_bytes
            self.stats.calibration_steps += 1
            self._calibrating = False
        else:
            self.stats.add(step)


def _move_to_bottom(mode: DTRRuntime) -> None:
    n = _len_torch_dispatch_stack()
    modes = [_get_dispatch_stack_at(i) for i in range(n)]
    if not modes or modes[-1] is not mode or any(m.is_infra_mode() for m in modes):
        return
    for _ in range(n):
        _pop_mode()
    _push_mode(mode)
    for m in modes[:-1]:
        _push_mode(m)


def _remove(mode: DTRRuntime) -> None:
    """Take ``mode`` off the dispatch-mode stack wherever it is, leaving the other modes in order."""
    n = _len_torch_dispatch_stack()
    modes = [_get_dispatch_stack_at(i) for i in range(n)]
    if mode not in modes:
        return
    above = modes[modes.index(mode) + 1 :]
    for _ in above:
        _pop_mode()
    mode.__exit__(None, None, None)  # pops it
    for m in above:
        _push_mode(m)
    _sync_mode_flags()


def _sync_mode_flags() -> None:
    """Make torch's module-level "inside a dispatch mode" flags describe the stack as it now is.

    ``__exit__`` restores the flags saved at ``__enter__``; after the stack was reordered those are stale, and a
    flag left set with no mode on the stack makes dynamo guard and recompile for nothing.
    """
    from torch.utils import _python_dispatch as dispatch

    modes = [_get_dispatch_stack_at(i) for i in range(_len_torch_dispatch_stack())]
    dispatch._is_in_torch_dispatch_mode = bool(modes)
    dispatch._is_in_non_infra_torch_dispatch_mode = any(not m.is_infra_mode() for m in modes)
    without_ignore = any(not m.ignore_compile_internals() for m in modes)
    dispatch._is_in_any_mode_without_ignore_compile_internals = without_ignore
    setter = getattr(dispatch, "set_is_in_mode_without_ignore_compile_internals", None)
    if setter is not None:
        setter(without_ignore)
