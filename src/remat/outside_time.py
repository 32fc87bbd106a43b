"""The seconds of a training step spent outside the chain's blocks (``CostTable.outside_s``), read within
plain steps.

Each step is timed whole, and within it the time its blocks take: their forward calls (forward hooks) and
their backward, from the moment the gradient of a block's main output is ready to the moment the gradient of
its main input is (tensor hooks). A step's outside time is its time less its blocks' time; the figure is the
median over steps. Both sides of the difference come from the same step, so load that changes between the
blocks' isolated timing and these steps (a shared machine) does not enter it, as it does in a plain step's
time less the blocks' isolated times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .blocks import BlockIO
from .regions import eager
from .training_step import Batch, timed_step

__all__ = ["BlockWindows", "outside_seconds"]


class BlockWindows:
    """Hooks on ``blocks`` that add up, per step, the seconds spent in their forward calls and backward."""

    def __init__(self, blocks: Sequence[nn.Module], ios: Sequence[BlockIO], clock: Callable[[], float]) -> None:
        self.clock = clock
        self.ios = list(ios)
        self.inside = 0.0
        self.complete = True  # False once a block's main input or output could not be hooked
        self._depth = 0
        self._start = 0.0
        self._ready: dict[int, float] = {}  # block index -> when its output's gradient was ready
        self._hooks: list[Any] = []
        for i, block in enumerate(blocks):
            # eager(): a compiled block calls its hooks inside its compiled call; they must not be traced
            self._hooks.append(block.register_forward_pre_hook(eager(self._pre(i)), with_kwargs=True, prepend=True))
            self._hooks.append(block.register_forward_hook(eager(self._post(i)), with_kwargs=True, always_call=True))

    def reset(self) -> None:
        self.inside = 0.0
        self._ready.clear()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _main_input(self, i: int, args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
        try:
            return self.ios[i].input_tensor(args, kwargs)
        except ValueError:
            return None

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            if self._depth == 0:
                self._start = self.clock()
            self._depth += 1
            main = self._main_input(i, args, kwargs)
            if main is None or not main.requires_grad:
                self.complete = False
                return
            main.register_hook(self._input_grad(i))

        return hook

    def _post(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
            self._depth -= 1
            main = self._main_input(i, args, kwargs)
            out = self.ios[i].output(output, main.shape) if main is not None and output is not None else None
            if out is None or not out.requires_grad:
                self.complete = False
            else:
                out.register_hook(self._output_grad(i))
            if self._depth == 0:
                self.inside += self.clock() - self._start

        return hook

    def _output_grad(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._ready[i] = self.clock()

        return hook

    def _input_grad(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            ready = self._ready.pop(i, None)
            if ready is None:
                self.complete = False
            else:
                self.inside += self.clock() - ready

        return hook


def outside_seconds(
    model: nn.Module,
    batch: Batch,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    blocks: Sequence[nn.Module],
    ios: Sequence[BlockIO],
    *,
    steps: int = 3,
    autocast: Any = None,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float | None]:
    """Median seconds of ``steps`` plain steps and median seconds of each step spent outside ``blocks``; the
    latter None where a block's main input or output carries no gradient to time its backward by, and on
    CUDA, where the blocks' windows would be the host's share only. Gradients are set
    to None before each step; on CUDA the device is synchronised around each."""
    on_cuda = any(p.device.type == "cuda" for p in model.parameters())
    windows = BlockWindows(blocks, ios, clock)
    whole, outside = [], []
    try:
        for _ in range(steps):
            windows.reset()
            seconds = timed_step(model, batch, loss_fn, autocast=autocast, clock=clock)
            whole.append(seconds)
            outside.append(seconds - windows.inside)
    finally:
        windows.remove()
    if not windows.complete or on_cuda:
        return statistics.median(whole), None
    return statistics.median(whole), statistics.median(outside)
