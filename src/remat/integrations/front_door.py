"""``remat.fit(model, "22GiB")``: the one call that makes a training step fit the device's memory.

:func:`fit` returns a :class:`~remat.integrations.session.RematSession` (on a Hugging Face model the
:class:`~remat.integrations.hf.HFSession`, which also switches Hugging Face's own checkpointing flag off with
one warning). ``memory`` is the device's memory for the whole step (:mod:`remat.fitting.whole_step`);
``activations=`` is a budget of activation bytes or a fraction of the no-checkpoint activations instead. With a
``batch`` the plan is fitted by measuring whole steps and applies from the first step
(:mod:`remat.fitting.device_fit`); without one, the first training step runs with every block checkpointed and
is profiled, and the plan applies from the second. The other doors (``hf.enable``, the Lightning callback,
``distributed.prepare``) take the same ``memory=`` and ``optimizer=`` and return the same handle. With
``compile=True`` (and a batch) the eager plan competes with the compiled routes and the fastest that fits is set
up in place (:class:`~remat.integrations.compiled_session.CompiledSession`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..core import AutocastArg, BlocksArg, CostTable, StepSpec
from ..meters import is_compiled
from ..planning import Plan
from .compiled_session import CompiledSession, compiled_route
from .hf import enable, is_hugging_face
from .session import RematSession


def fit(
    model: nn.Module,
    memory: int | str | None = None,
    *,
    batch: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    step: StepSpec | None = None,
    activations: int | float | str | None = None,
    strategy: str = "optimal",
    costs: CostTable | None = None,
    plan: Plan | None = None,
    blocks: BlocksArg = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    autocast: AutocastArg = None,
    compile: bool | dict[str, Any] = False,  # noqa: A002 (torch's word for it)
    **options: Any,
) -> RematSession | CompiledSession:
    """Make ``model``'s training step fit ``memory`` at the smallest time cost, and return the handle.

    ``memory``: the device's memory for the whole step (parameters, gradients, optimizer state, buffers,
    activations and temporaries): bytes, ``"22GiB"``, or ``"90%"`` of the device's free memory. ``optimizer``:
    the optimizer that will step the model (its state is counted; without it, the first optimizer that steps
    the model's parameters is used). ``batch``: a sample batch, to plan before the first step; without it the
    first training step is profiled. ``activations``: a budget of activations instead of ``memory`` (bytes or a
    fraction of the no-checkpoint activations). ``step`` (or ``loss_fn``, ``blocks``, ``autocast``) describes the
    training step; every chain of the model is planned under one budget unless ``blocks=`` names others.
    ``strategy`` and ``options`` are :func:`remat.plan`'s (``allow_lossy=True``...) or PGAC's
    (``strategy="pgac"`` with ``activations=``). ``shapes=True`` (or a :class:`remat.Buckets`), with ``memory``
    and ``batch`` the largest batch the run will see: a plan per input shape within the same memory, switched
    before each forward's first block, and a batch no plan fits refused there (``on_overflow=``:
    :class:`remat.ShapePlans`; ``docs/shapes.md``). ``compile=True`` (or a dict of ``backend``, ``mode``,
    ``options``, ``dynamic``, ``budgets``, ``partition_budgets``, ``rounds``), with ``memory`` and ``batch``: the
    fastest route whose whole step fits, among the eager plan, the whole model compiled under a fitted
    ``activation_memory_budget`` and the plan on compiled blocks, measured head to head and set up in place
    (``docs/compile.md``).

    The handle has ``plan``, ``costs``, ``stats``, ``describe()``, ``set_memory(...)`` and ``remove()``. Raises
    :class:`remat.BudgetError` where no plan fits, naming the least memory and what to do.
    """
    if memory is None and activations is None and strategy in ("optimal", "pgac") and plan is None:
        raise ValueError(
            "remat.fit needs the device's memory for the step (remat.fit(model, '22GiB')) or activations= (bytes "
            "or a fraction of the no-checkpoint activations)"
        )
    if memory is not None and activations is not None:
        raise ValueError("give memory (the whole step) or activations= (the activations alone), not both")
    spec = StepSpec.of(step, loss_fn=loss_fn, blocks=blocks, autocast=autocast)
    _refuse_whole_model_compiled(model, compile)
    if compile:
        return compiled_route(
            model, memory, batch=batch, optimizer=optimizer, step=spec, compile=compile, activations=activations,
            plan=plan, costs=costs, strategy=strategy, **options,
        )  # fmt: skip
    arguments = dict(costs=costs, batch=batch, plan=plan, memory=memory, optimizer=optimizer, **options)
    if is_hugging_face(model):
        return enable(model, strategy, activations, step=spec, **arguments)
    return RematSession(model, strategy, activations, step=spec, **arguments)


def _refuse_whole_model_compiled(model: nn.Module, compile: bool | dict[str, Any]) -> None:
    """A model compiled whole is never planned as if it ran eagerly: ``torch.compile``'s wrapper is refused (the
    loop would call it, whatever route is chosen), and a model compiled in place needs ``compile=True``."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise ValueError(
            "remat.fit was given torch.compile's wrapper: pass the model itself (wrapper._orig_mod) with "
            "compile=True and train that model; remat compiles the route it chooses in place (docs/compile.md)"
        )
    if not compile and is_compiled(model):
        raise ValueError(
            "the model is compiled (model.compile()): remat.fit(model, memory, batch=..., compile=True) fits it "
            "on the faster of the compiled routes and the eager plan, set up in place (docs/compile.md)"
        )
