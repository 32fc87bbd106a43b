"""Which blocks of a chain cost the same, so that the profiler measures one of them and reuses its row.

:func:`block_signature` describes what decides a block's costs: its modules (types, ``extra_repr``, training
flags), its parameters and buffers (names, shapes, strides, dtypes, devices, ``requires_grad``) and its
call (tensor arguments by shape, stride, dtype, device and ``requires_grad``; other arguments by value, or by
identity where they have no plain value). Two blocks with equal signatures run the same operators on the
same sizes. What a signature cannot see (a Python attribute that changes the forward) is caught by
:func:`keep_footprint`: one forward under ``keep`` noting the shape and dtype of every tensor autograd saves
and of the output, and the operators it runs in order, compared with the measured block's footprint, taken the
same way, before its row is reused. The operators tell apart blocks that save the same tensors but compute
differently: one that changes a matmul's output in place refuses a policy saving it (see
:class:`remat.core.costs.BlockCost`'s ``unavailable``), one written out of place does not. Compiled blocks are not
run under the operator log (a dispatch mode would make dynamo run them eagerly); they run no per-operator
policies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..chains import BlockIO, InputSlot, detached_from_step, main_input_slot, replace_slot, slot_value, without_caches
from ..core import KEEP, BlockCost
from ..runtime import suspend_all
from .block_run import GradsRestored, run_action

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout)


def _tensor_signature(t: torch.Tensor) -> tuple[Any, ...]:
    return ("tensor", tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad, t.layout)


def _value_signature(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        return _tensor_signature(value)
    if isinstance(value, _PLAIN):
        return (type(value).__name__, value)
    if isinstance(value, torch.Size):
        return ("size", tuple(value))
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_value_signature(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((str(k), _value_signature(v)) for k, v in value.items()))
    # An object with no plain value (a config, a cache, a rotary module): the same object for every block
    # is the usual case and is treated as equal; different objects are not.
    return ("object", type(value).__qualname__, id(value))


def module_signature(module: nn.Module) -> Hashable:
    """The block's own structure and state shapes, independent of its name in the model."""
    modules = tuple(
        (name, type(m).__module__, type(m).__qualname__, m.extra_repr(), m.training)
        for name, m in module.named_modules()
    )
    params = tuple((name,) + _tensor_signature(p) for name, p in module.named_parameters())
    buffers = tuple((name,) + _tensor_signature(b) for name, b in module.named_buffers())
    return modules, params, buffers


def block_signature(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], slot: InputSlot | None = None
) -> Hashable:
    """What a block's costs depend on; blocks with equal signatures are expected to cost the same. The main
    input (at ``slot``, guessed by default) counts as requiring grad, as the profiler measures it (the first
    block's often does not)."""
    slot = main_input_slot(args, kwargs) if slot is None else slot
    main = slot_value(args, kwargs, slot)
    args, kwargs = replace_slot(args, kwargs, slot, main.detach().requires_grad_(main.is_floating_point()))
    return (
        module_signature(module),
        _value_signature(args),
        tuple(sorted((k, _value_signature(v)) for k, v in kwargs.items())),
        torch.is_grad_enabled(),
        torch.is_autocast_enabled(),
    )


@dataclass(frozen=True)
class Footprint:
    """What one forward under ``keep`` shows of a block: the shape and dtype of each tensor autograd saved for
    backward, in order, and of its output, and the operators the forward ran, in order (empty where not
    logged)."""

    saved: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    output_shape: tuple[int, ...]
    output_dtype: torch.dtype
    operators: tuple[str, ...] = ()


class _OperatorLog(TorchDispatchMode):
    """Notes the name of every operator that reaches the kernels while active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def keep_footprint(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    io: BlockIO | None = None,
    log_operators: bool = True,
) -> Footprint:
    """One forward of the block under ``keep`` on these inputs, noting what autograd saves and, with
    ``log_operators``, the operators it runs, set apart from the step like
    :func:`remat.profiling.block_measure.measure_block` (RNG forked, gradients restored, remat hooks suspended). No
    backward: a few percent of the block's full measurement. ``io`` says which argument and output are the
    hidden state (guessed by default)."""
    io = io or BlockIO()
    slot = io.input_slot(args, kwargs)
    source = slot_value(args, kwargs, slot)
    device = source.device
    main = source.detach().requires_grad_(True)
    args, kwargs = detached_from_step(*without_caches(*replace_slot(args, kwargs, slot, main)))
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t: torch.Tensor) -> None:
        saved.append((tuple(t.shape), t.dtype))
        # nothing is kept: the graph is never run backward, and holding nothing lets it go with its output

    rng_devices = [device.index or 0] if device.type == "cuda" else []
    log = _OperatorLog()
    with (
        suspend_all(),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None),
        GradsRestored(module),
        torch.random.fork_rng(devices=rng_devices, device_type=device.type),
        log if log_operators else contextlib.nullcontext(),
    ):
        out = io.output(run_action(module, KEEP, args, kwargs), main.shape)
        shape, dtype = tuple(out.shape), out.dtype
        del out
    return Footprint(saved=tuple(saved), output_shape=shape, output_dtype=dtype, operators=tuple(log.names))


def renamed(row: BlockCost, fqn: str) -> BlockCost:
    """A copy of ``row`` for the block ``fqn`` (every dict copied, so the rows can be edited apart)."""
    dicts = {f.name: dict(getattr(row, f.name)) for f in fields(row) if isinstance(getattr(row, f.name), dict)}
    return replace(row, fqn=fqn, **dicts)
