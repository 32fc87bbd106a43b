"""One training step of a model on a sample batch: the forward, the loss, the backward.

``batch`` is what the user would pass to ``model``: a tensor, a tuple or list of positional arguments, or a
dict of keyword arguments. The loss is ``loss_fn(output)``, by default ``output.loss`` when the model returns
one, else the sum of its (first) output tensor. With an autocast setting the forward and the loss run under it
(weight-cast cache off, see :mod:`remat.core.precision`) and the backward outside it, as in a mixed-precision
training loop. The output is held through the backward (``out = model(x); loss_fn(out).backward()``) unless
``holds_output=False``, which drops it once the loss is computed, as a loop keeping only the loss does
(``model(**batch).loss.backward()``, Hugging Face's Trainer): what the output holds beyond the loss (the
logits) is then freed before the backward. :func:`timed_step` times one such step, and
:func:`interleaved_rounds` times several contenders' steps against each other (:func:`ratios_to_first`: as
ratios; :func:`ratios_text` reads them). A step whose loss does not require grad is refused with the reason
(:func:`untrainable_step_error`); :func:`warn_if_evaluating` warns that a model in eval mode is not measured as
training runs it, and :func:`in_train_mode` measures a training step of such a model in train mode (the front
door's measurements). :func:`stepped_before` says whether this process already ran a step of the model on a batch of
that structure (:func:`batch_structure`), so that a measurement can skip the warm-up a first step needs.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from ..core import AutocastSpec, Batch, autocast_off, step_autocast
from .blocks import main_tensor

Name = TypeVar("Name", bound=Hashable)
Result = TypeVar("Result")

# model -> the batch structures a step of it ran on in this process (run_step)
_STEPPED: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def batch_structure(batch: Any) -> Any:
    """The structure of ``batch`` as JSON: each tensor's shape, dtype and device type, containers kept, other
    values by type name."""
    if torch.is_tensor(batch):
        return [list(batch.shape), str(batch.dtype), batch.device.type]
    if isinstance(batch, dict):
        return {str(k): batch_structure(v) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return [batch_structure(v) for v in batch]
    return type(batch).__name__


def stepped_before(model: nn.Module, batch: Batch) -> bool:
    """Whether :func:`run_step` already ran a whole step of ``model`` on a batch of ``batch``'s structure in this
    process: the allocator has grown and lazy initialisation is done, as a warm-up step would leave them."""
    return _structure_key(batch) in _STEPPED.get(model, ())


def _structure_key(batch: Batch) -> str:
    return json.dumps(batch_structure(batch), sort_keys=True)


def run_step(
    model: nn.Module,
    batch: Batch,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    autocast: AutocastSpec | None = None,
    holds_output: bool = True,
) -> torch.Tensor:
    """One forward and backward of ``model`` on ``batch``; returns the loss (detached). With ``autocast`` the
    forward and the loss run under it (weight-cast cache off); the backward runs with autocast off. With
    ``holds_output=False`` the model's output is dropped before the backward."""
    with step_autocast(autocast):
        if isinstance(batch, dict):
            output = model(**batch)
        elif isinstance(batch, tuple | list):
            output = model(*batch)
        else:
            output = model(batch)
        loss = loss_fn(output) if loss_fn is not None else default_loss(output)
    if not loss.requires_grad:
        raise untrainable_step_error(model)
    if not holds_output:
        del output
    with autocast_off():  # also inside the user's autocast context: a loop's backward runs outside it
        loss.backward()
    _STEPPED.setdefault(model, set()).add(_structure_key(batch))
    return loss.detach()


def timed_step(
    model: nn.Module,
    batch: Batch,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    autocast: Any = None,
    clock: Callable[[], float] = time.perf_counter,
    holds_output: bool = True,
    set_to_none: bool = True,
) -> float:
    """Seconds of one plain step, read from ``clock`` (gradients set to None first, as ``zero_grad`` does, or
    zeroed in place with ``set_to_none=False``; the CUDA devices of the parameters synchronised around it). The
    caller restores gradients and RNG state if it cares."""
    devices = {p.device for p in model.parameters() if p.device.type == "cuda"}
    nn.Module.zero_grad(model, set_to_none=set_to_none)  # a wrapper's own zero_grad (DeepSpeed's) takes other arguments
    for device in devices:
        torch.cuda.synchronize(device)
    start = clock()
    run_step(model, batch, loss_fn, autocast=autocast, holds_output=holds_output)
    for device in devices:
        torch.cuda.synchronize(device)
    return clock() - start


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` when the model returns one, else the sum of the (first) output tensor."""
    loss = getattr(output, "loss", None)
    if isinstance(output, dict) and output.get("loss") is not None:
        loss = output["loss"]
    if loss is not None:
        return loss
    tensor = main_tensor(output)
    if tensor is None:
        raise ValueError("the model output has no tensor; pass loss_fn=... to remat.profile")
    return tensor.float().sum()


def interleaved_rounds(names: Sequence[Name], run: Callable[[Name], Result], rounds: int) -> dict[Name, list[Result]]:
    """``run(name)`` for each of ``names`` once per round, for ``rounds`` rounds, the order reversed every other
    round so that a change in the machine's speed hits every name alike; each name's results in round order."""
    results: dict[Name, list[Result]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            results[name].append(run(name))
    return results


def ratios_to_first(names: Sequence[Name], run: Callable[[Name], float], rounds: int) -> dict[Name, tuple[float, ...]]:
    """:func:`interleaved_rounds` of ``run`` (seconds), each name's as ratios to the first name's of the same round."""
    seconds = interleaved_rounds(names, run, rounds)
    first = seconds[names[0]]
    return {name: tuple(s / f for s, f in zip(times, first, strict=True)) for name, times in seconds.items()}


def ratios_text(ratios: Sequence[float]) -> str:
    """Per-round step ratios as a report reads them: the median and the range, ``1.012x [0.998-1.031]``."""
    return f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}]"


def untrainable_step_error(model: nn.Module) -> RuntimeError:
    """The error for a step whose loss does not require grad, with the reason that applies."""
    if not torch.is_grad_enabled():
        why = "grad is disabled here (torch.no_grad() or torch.inference_mode() around the call): call it outside"
    elif not any(p.requires_grad for p in model.parameters()):
        why = f"no parameter of {type(model).__name__} requires grad: unfreeze the ones the training updates"
    else:
        why = "the loss does not depend on a parameter that requires grad: check loss_fn (or the batch's labels)"
    return RuntimeError(f"the step's loss does not require grad, so there is no backward to measure or plan: {why}")


@contextlib.contextmanager
def in_train_mode(model: nn.Module, what: str) -> Iterator[None]:
    """Within: ``model`` in train mode where it is in eval mode (``from_pretrained`` returns models so), with one
    warning saying so, and every module's own mode put back afterwards. What is measured within is the training
    step as training runs it (dropout on: its masks are saved, normalisation on batch statistics); a model
    trained in eval mode saves no more (its dropout saves no masks), so the plan holds for it too. A model in train
    mode is left as it is, its modules held in eval mode (frozen normalisation) included."""
    if model.training:
        yield
        return
    warnings.warn(
        f"{what}: {type(model).__name__} is in eval mode (model.eval(); from_pretrained returns models so): the "
        "training step is measured in train mode, as training runs it (dropout on), and the model is put back in "
        "eval mode; call model.train() before training",
        stacklevel=4,
    )
    modes = [(module, module.training) for module in model.modules()]
    model.train()
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


def warn_if_evaluating(model: nn.Module, what: str) -> None:
    """Warn that ``what`` runs ``model`` in eval mode, so not as training runs it: dropout off, normalisation on
    running statistics (and whatever else a module does differently), hence other saved tensors and times."""
    if not model.training:
        warnings.warn(
            f"{what}: {type(model).__name__} is in eval mode (model.eval(); from_pretrained returns models so): "
            "dropout is off and normalisation reads running statistics, so the step measured is not the training "
            "step, whose activations can be larger than predicted. Call model.train() first if training runs in "
            "train mode.",
            stacklevel=3,
        )
