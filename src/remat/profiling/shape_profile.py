"""A model's costs at every input shape: :func:`profile_shapes` profiles the batch given, then the same batch cut to
half its sequence, half its batch and half of both (a batch of one row: half and a quarter of its sequence), and
returns the :class:`~remat.core.ShapeCosts` through the tables.

The batch is cut, never padded: every tensor of the batch whose first dimension is the batch size keeps its first
rows, and every one whose second dimension is the sequence length keeps its first positions (``input_ids``,
``attention_mask``, ``labels`` of a language model). The sequence is read from the first block's main input,
``(b, s, ...)``. Where no tensor of the batch has that second dimension (``pixel_values`` of an image model, whose
first block sees patches or feature-map channels the model makes; a 2-D input, whose second dimension is 1), the
batch is cut in rows only, to half its rows: the costs then vary with the batch size alone
(:attr:`~remat.core.ShapeCosts.fixed_second`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core import Batch, CostTable, ShapeCosts, shape_of
from .profiler import profile

MIN_SEQUENCE = 4  # the shortest profiled sequence a quarter of which is still a sequence


def batch_at(batch: Batch, reference: tuple[int, int], shape: tuple[int, int]) -> Batch:
    """``batch`` (made at ``reference``, (batch, sequence)) cut to ``shape``: leading rows and positions kept."""
    rows, positions = shape
    ref_rows, ref_positions = reference
    if rows > ref_rows or positions > ref_positions:
        raise ValueError(f"a batch is cut, not grown: {shape} from {reference}")

    def cut(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        if x.shape[0] == ref_rows:
            x = x[:rows]
        if x.dim() >= 2 and x.shape[1] == ref_positions and ref_positions > 1:
            x = x[:, :positions]
        return x.contiguous()  # as a data loader makes it (a model may view it flat)

    if isinstance(batch, dict):
        return {k: cut(v) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(cut(v) for v in batch)
    return cut(batch)


def has_sequence(batch: Batch, reference: tuple[int, int]) -> bool:
    """Whether some tensor of ``batch`` has the reference's sequence as its second dimension (so that cutting the
    batch shortens the sequence the first block sees)."""
    rows, positions = reference
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, tuple) else (batch,)
    return positions > 1 and any(
        isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == positions for x in values
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


__all__ = ["batch_at", "has_sequence", "measured_shapes", "profile_shapes"]
