"""Running one block under one action, aside from the step, and backing out of it as a real step would.

The profiler (real device) and the meta estimator run each block alone under ``keep``, ``checkpoint``,
``selective:<policy>`` and ``offload``. They share these pieces:

* :func:`run_action`: the block's forward under an action, through the same machinery training uses;
* :func:`backward_releasing_output`: its backward without keeping the output alive, as in a real step;
* :class:`GradsRestored` and :func:`clear_grads`: parameter gradients set aside while a measurement runs;
  :func:`step_aside`: those and the random number generators, for steps run on the side of training (fits);
* :func:`parameters_detached`: the block's parameters replaced, while it is measured, by leaves on the same
  memory, so that the measurement's backward fires no hook of the step's parameters (DDP's reducer counts
  those; with ``static_graph=True`` it expects the first step's count in every later step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..checkpointing import (
    checkpoint,
    compiled_partitions,
    compressed_saving,
    run_compressed_input,
    run_recompute_compressed,
    saved_on_host,
)
from ..core import CHECKPOINT, COMPRESS, INPUT_COMPRESS, OFFLOAD, RECOMPUTE_COMPRESS, SELECTIVE, Action, autocast_off
from ..meters import model_device


def run_action(
    module: Callable[..., Any],
    action: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    compiled: nn.Module | None = None,
) -> Any:
    """``module(*args, **kwargs)`` under ``action``: plainly (``keep``), in a non-reentrant checkpoint
    (``checkpoint``, ``selective:<policy>``), with saved tensors on CPU (``offload``) or compressed
    (``compress:<format>``), checkpointed from a compressed input (``checkpoint+compress:<format>``), or as the
    compiled variant of ``partition:<budget>``; ``compiled``: the module whose variant that is, where ``module``
    is a callable around it."""
    with compiled_partitions.running(compiled if compiled is not None else module, action):
        return _run(module, action, args, kwargs)


def _run(module: Callable[..., Any], action: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if compiled_partitions.runs_plainly(action):
        return module(*args, **kwargs)
    parsed = Action.parse(action)
    if parsed.kind == CHECKPOINT:
        return checkpoint(module, *args, **kwargs)
    if parsed.kind == SELECTIVE:
        return checkpoint(module, *args, policy=parsed.policy, **kwargs)
    if parsed.kind == OFFLOAD:
        with saved_on_host():
            return module(*args, **kwargs)
    if parsed.kind == INPUT_COMPRESS:
        return run_compressed_input(module, action, args, kwargs)
    if parsed.kind == RECOMPUTE_COMPRESS:
        return run_recompute_compressed(module, action, args, kwargs)
    if parsed.kind == COMPRESS:
        with compressed_saving(action, module, args, kwargs):
            return module(*args, **kwargs)
    raise ValueError(f"cannot profile action {action!r}")


class GradsRestored:
    """Set parameter gradients aside while a measurement runs, and put them back afterwards."""

    def __init__(self, module: nn.Module) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]

    def __enter__(self) -> None:
        self.saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def __exit__(self, *exc: Any) -> None:
        for p, g in zip(self.params, self.saved, strict=True):
            p.grad = g


@contextmanager
def step_aside(model: nn.Module) -> Iterator[None]:
    """Steps run here leave training as it was: ``model``'s parameter gradients and the generators of the CPU and of
    its device are put back afterwards (a fit's measured steps draw dropout masks the training run must draw)."""
    device = model_device(model)
    cpu = device.type == "cpu"
    with GradsRestored(model), torch.random.fork_rng(devices=[] if cpu else None, device_type=device.type):
        yield


@contextmanager
def parameters_detached(module: nn.Module) -> Iterator[None]:
    """Within this context ``module``'s parameters are new leaves on the same memory (no copy, tied parameters
    stay tied): gradients of a measured backward go to them, and hooks on the real parameters do not fire.
    Parameters of a ``Parameter`` subclass are left in place."""
    stand_ins: dict[int, nn.Parameter] = {}
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if type(p) is not nn.Parameter:  # a subclass (quantized, sharded) may not survive a detach
                    continue
                if id(p) not in stand_ins:
                    stand_ins[id(p)] = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
                sub._parameters[name] = stand_ins[id(p)]
                swapped.append((sub, name, p))
        yield
    finally:
        for sub, name, p in reversed(swapped):
            sub._parameters[name] = p


def clear_grads(module: nn.Module) -> None:
    """Drop the gradients a measured backward left on ``module``'s parameters."""
    for p in module.parameters():
        p.grad = None


_EDGE_BACKWARD: bool | None = None


def edge_backward_supported() -> bool:
    """Whether this torch's ``autograd.backward`` accepts a ``GradientEdge`` (torch >= 2.7). Probed once; call
    it before a tracked region so the probe's tensors are not counted."""
    global _EDGE_BACKWARD
    if _EDGE_BACKWARD is None:
        try:
            from torch.autograd.graph import get_gradient_edge

            probe = torch.zeros(1, requires_grad=True)
            torch.autograd.backward(get_gradient_edge(probe * 2), torch.ones(1))
            _EDGE_BACKWARD = True
        except (ImportError, TypeError, RuntimeError, AttributeError):
            _EDGE_BACKWARD = False
    return _EDGE_BACKWARD


def backward_releasing_output(holder: list[torch.Tensor], grad: torch.Tensor) -> None:
    """Backward from the tensor in ``holder`` (which is emptied) without keeping it alive during backward.

    In a real step a block's output is freed once the next block's backward has run, before the block's own
    backward starts (unless the block's own graph saved it). Backing out of the output's gradient edge
    reproduces that, so the measured backward transient does not count the output on top of the saved bytes.
    """
    target: Any = holder.pop()
    if edge_backward_supported():
        from torch.autograd.graph import get_gradient_edge

        target = get_gradient_edge(target)  # the edge only: the output itself is no longer referenced here
    with autocast_off():
        torch.autograd.backward(target, grad)
