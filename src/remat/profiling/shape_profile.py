"""A model's costs at every input shape: :func:`profile_shapes` profiles the batch given, then the same batch cut to
half its sequence, half its batch and half of both (a batch of one row: half and a quarter of its sequence), and
returns the :class:`~remat.core.ShapeCosts` through the tables. :func:`measure_beyond` measures them again, before
its forward, where a batch comes beyond them.

The batch is cut, never padded: every tensor of the batch whose first dimension is the batch size keeps its first
rows, and every one whose second dimension is the sequence length keeps its first positions (``input_ids``,
``attention_mask``, ``labels`` of a language model). The sequence is read from the first block's main input,
``(b, s, ...)``. Where no tensor of the batch has that second dimension (``pixel_values`` of an image model, whose
first block sees patches or feature-map channels the model makes; a 2-D input, whose second dimension is 1), the
batch is cut in rows only, to half its rows: the costs then vary with the batch size alone
(:attr:`~remat.core.ShapeCosts.fixed_second`).
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..core import Batch, CostTable, ShapeCosts, shape_of
from ..planning import ShapePlans
from .block_run import step_aside
from .profiler import profile

logger = logging.getLogger(__name__)

MIN_SEQUENCE = 4  # the shortest profiled sequence a quarter of which is still a sequence


def batch_at(batch: Batch, reference: tuple[int, int], shape: tuple[int, int]) -> Batch:
    """``batch`` (made at ``reference``, (batch, sequence)) cut to ``shape``: leading rows and positions kept."""
    if shape[0] > reference[0] or shape[1] > reference[1]:
        raise ValueError(f"a batch is cut, not grown: {shape} from {reference}")
    return batch_resized(batch, reference, shape)


def _values(batch: Batch) -> Any:
    return batch.values() if isinstance(batch, dict) else batch if isinstance(batch, tuple) else (batch,)


def has_sequence(batch: Batch, reference: tuple[int, int]) -> bool:
    """Whether some tensor of ``batch`` has the reference's sequence as its second dimension (so that cutting the
    batch shortens the sequence the first block sees)."""
    positions = reference[1]
    return positions > 1 and any(
        isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == positions for x in _values(batch)
    )


def measured_shapes(reference: tuple[int, int], sequence: bool = True) -> list[tuple[int, int]]:
    """The reference shape and those it is cut to: half the sequence, half the batch and half of both; for a
    batch of one row, half and a quarter of the sequence; without a ``sequence`` to cut, half the batch
    (:class:`~remat.core.ShapeCosts`' three forms)."""
    rows, positions = reference
    if not sequence:
        if rows < 2:
            raise ValueError(
                f"the batch has no sequence to cut (its first block's input is {positions} wide in its second "
                "dimension, which no tensor of the batch carries), so its costs vary with the batch size alone, "
                "from two batch sizes: profile a batch of at least 2 rows"
            )
        return [reference, (rows // 2, positions)]
    if positions < MIN_SEQUENCE:
        raise ValueError(
            f"the first block's input has {positions} positions: the shape model reads batch size and sequence "
            f"length from inputs of shape (batch, sequence, ...) with a sequence of at least {MIN_SEQUENCE}; "
            "profile each input shape of the run with remat.profile instead"
        )
    if rows >= 2:
        return [reference, (rows, positions // 2), (rows // 2, positions), (rows // 2, positions // 2)]
    return [reference, (rows, positions // 2), (rows, positions // 4)]


def profile_shapes(model: nn.Module, batch: Batch, *, reference: CostTable | None = None,
                   **options: Any) -> ShapeCosts:  # fmt: skip
    """Profile ``model`` on ``batch`` and on ``batch`` cut to smaller shapes (:func:`measured_shapes`);
    ``options`` are :func:`remat.profile`'s; ``reference``: the profile of ``batch`` itself, where one was taken.
    Returns the :class:`~remat.core.ShapeCosts` through them."""
    reference_table = reference if reference is not None else profile(model, batch, **options)
    shapes = reference_table.info.get("input_shapes") or {}
    first = shapes.get(reference_table.fqns[0])
    if first is None:
        raise ValueError("the profile did not record the first block's input shape; profile_shapes needs it")
    reference = shape_of(first)
    sequence = reference[1] >= MIN_SEQUENCE and has_sequence(batch, reference)
    wanted = measured_shapes(reference, sequence)
    tables = [reference_table]
    for shape in wanted[1:]:
        tables.append(profile(model, batch_at(batch, reference, shape), **options))
    seen = [shape_of(t.info["input_shapes"][t.fqns[0]]) for t in tables]
    if seen != wanted:
        raise ValueError(
            f"cutting the batch to {wanted[1:]} gave first-block inputs of {seen[1:]}: the batch's tensors do not "
            "carry the batch size first and the sequence second; profile each shape the run uses instead"
        )
    return ShapeCosts(tables, seen)


def batch_resized(batch: Batch, current: tuple[int, int], shape: tuple[int, int]) -> Batch:
    """``batch`` (at ``current``, (batch, sequence)) brought to ``shape``: every tensor whose first dimension is the
    batch size and every one whose second is the sequence (``input_ids``, ``attention_mask``, ``labels``) keeps its
    leading rows and positions where ``shape`` is smaller, and repeats them in turn where it is larger (the batch's
    own tokens again: the same kinds of values, so the same kernels run); each made contiguous, as a data loader
    makes it (a model may view it flat)."""
    rows, positions = current

    def resize(x: Any, dim: int, have: int, want: int) -> torch.Tensor:
        if want <= have:
            return x.narrow(dim, 0, want)
        return x.index_select(dim, torch.arange(want, device=x.device) % have)

    def resized(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        if x.shape[0] == rows:
            x = resize(x, 0, rows, shape[0])
        if x.dim() >= 2 and x.shape[1] == positions and positions > 1:
            x = resize(x, 1, positions, shape[1])
        return x.contiguous()

    if isinstance(batch, dict):
        return {k: resized(v) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(resized(v) for v in batch)
    return resized(batch)


def _batch_shape(batch: Batch, sequence: bool) -> tuple[int, int] | None:
    """(rows, sequence) of a batch as its tensors carry them: the first dimension of its first tensor, the second
    of its first tensor of two or more (None where it has no tensor)."""
    tensors = [x for x in _values(batch) if isinstance(x, torch.Tensor) and x.dim() >= 1]
    if not tensors:
        return None
    rows = int(tensors[0].shape[0])
    if not sequence:
        return rows, 1
    wide = [x for x in tensors if x.dim() >= 2]
    return (rows, int(wide[0].shape[1])) if wide else None


def batch_of_call(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Batch | None:
    """The batch a forward of ``model`` was called with, in a form a profile replays (a tensor, a tuple of
    positional arguments or a dict of keyword arguments): where a call has both (``model(ids, labels=ids)``), the
    positional ones bound to their names in ``model.forward``'s signature; None where they cannot be (a
    ``*args`` forward)."""
    if not kwargs:
        return args if len(args) != 1 else args[0]
    if not args:
        return kwargs
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind(*args, **kwargs).arguments
    except TypeError:
        return None
    batch: dict[str, Any] = {}
    for name, value in bound.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            return None
        if kind is inspect.Parameter.VAR_KEYWORD:
            batch.update(value)
        else:
            batch[name] = value
    return batch


def measure_beyond(model: nn.Module, plans: ShapePlans, **options: Any) -> RemovableHandle:
    """Where a training batch comes beyond every shape ``plans``' costs were measured at, measure the costs again
    before its forward, at the larger of both in rows and in sequence (the batch's own rows and tokens repeated where
    it is the smaller), and plan from them (:meth:`ShapePlans.use_costs`): extrapolated costs are right for most
    models but not for kernels whose workspace grows in steps (``docs/shapes.md``), and the budget is to hold for
    every batch. ``options`` are :func:`profile_shapes`' (``step=``, ``loss_fn=``...), as the costs were made. The
    measuring steps leave training as it was (gradients and generators put back, :func:`step_aside`); it costs a
    shape profile (about 30 plain steps of the larger shape) each time the range grows. Its steps keep every block's
    activations at the larger shape, as a plain step does; where the device does not hold them, the profile is
    taken with every block checkpointed through the plan the training runs (:func:`remat.profile`), so no more
    memory than such a step is needed. The new costs' reference table records
    the batch shape that asked for them (``info["measured_for"]``). Returns the hook's handle (``.remove()`` stops
    it)."""
    sequence = plans.costs.fixed_second is None
    measuring = False

    def before_forward(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        nonlocal measuring
        if measuring or not torch.is_grad_enabled():
            return
        batch = batch_of_call(model, args, kwargs)
        shape = _batch_shape(batch, sequence) if batch is not None else None
        if shape is None or not plans.beyond(*shape):
            return
        top = plans.costs.largest
        wanted = (max(shape[0], top[0]), max(shape[1], top[1]) if sequence else shape[1])
        started = time.perf_counter()
        measuring = True
        try:
            with step_aside(model):
                costs = profile_shapes(model, batch_resized(batch, shape, wanted), **options)
        finally:
            measuring = False
        costs.reference.info["measured_for"] = list(shape)
        plans.use_costs(costs)
        logger.info(
            "remat: a batch of shape %s came beyond the measured %s: costs measured again at %s in %.1f s",
            list(shape),
            list(top),
            list(wanted),
            time.perf_counter() - started,
        )

    return model.register_forward_pre_hook(before_forward, with_kwargs=True)


__all__ = ["batch_at", "batch_of_call", "batch_resized", "has_sequence", "measure_beyond", "measured_shapes",
           "profile_shapes"]
