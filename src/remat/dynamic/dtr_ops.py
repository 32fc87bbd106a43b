"""Which operators DTR may replay, and which of their arguments they write.

DTR records every operator of the step so that an evicted tensor can be rebuilt by replaying the operators that
made it. Only ``aten`` and ``prims`` operators without effects beyond their outputs are replayed
(:func:`is_replayable`). In-place writes are read from each operator's schema (:func:`written_arguments`); batch
norm's running statistics are written whether its schema says so or not, and are treated as scratch
(:func:`scratch_arguments`): a replay runs on copies of them and updates them only once.
"""

from __future__ import annotations

from typing import Any

import torch

_REPLAY_NAMESPACES = frozenset({"aten", "prims"})
# Operators that change a tensor's storage or have effects beyond their outputs: never replayed.
_NO_REPLAY = frozenset({"set_", "resize_", "resize_as_", "_resize_output_", "record_stream", "_assert_async"})
# Batch norm in training updates the running statistics (arguments 3 and 4) in place, declared in its schema
# or not; its outputs do not depend on them, so a replay runs on copies and updates them only once.
_BATCH_NORMS = frozenset(
    {"native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update", "cudnn_batch_norm",
     "miopen_batch_norm"}
)  # fmt: skip
_WRITES: dict[Any, list[tuple[int, str, bool]]] = {}  # operator -> its arguments declared as written


def is_replayable(func: Any) -> bool:
    """Whether DTR may replay ``func`` to rebuild its outputs."""
    return func.namespace in _REPLAY_NAMESPACES and func._opname not in _NO_REPLAY


def written_arguments(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes in place, as its schema declares them."""
    spots = _WRITES.get(func)
    if spots is None:
        spots = [
            (i, a.name, a.kwarg_only)
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        ]
        _WRITES[func] = spots
    found: list[torch.Tensor] = []
    for i, name, kwarg_only in spots:
        value = kwargs.get(name) if kwarg_only or i >= len(args) else args[i]
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                found.append(t)
    return found


def scratch_arguments(func: Any, args: tuple) -> list[torch.Tensor]:
    """The running statistics a batch norm in training updates in place (empty for other operators)."""
    if func._opname not in _BATCH_NORMS or len(args) < 5:
        return []
    if func._opname != "_batch_norm_with_update" and not (len(args) > 5 and args[5] is True):
        return []
    return [t for t in args[3:5] if isinstance(t, torch.Tensor)]
