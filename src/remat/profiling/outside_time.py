"""The seconds of a training step spent outside the chain's blocks (``CostTable.outside_s``), read within
plain steps.

Each step is timed whole, and within it the time its blocks take: their forward calls (forward hooks) and
their backward, from the moment the gradient of a block's main output is ready to the moment the gradient of
its main input is (tensor hooks). A step's outside time is its time less its blocks' time; the figure is the
median over steps. Both sides of the difference come from the same step, so load that changes between the
blocks' isolated timing and these steps (a shared machine) does not enter it, as it does in a plain step's
time less the blocks' isolated times.

The same windows give each block's forward and backward seconds within the step (:class:`PlainSteps`), where
every block ran once forward and once backward per step: the figures a keep-all step is made of, which
:func:`anchor_to_plain_steps` puts in place of the blocks' isolated keep times. A block called again while autograd's
engine runs (a recomputation in backward) is not a forward call: its seconds fall in the block's backward window,
so the windows time steps with a plan applied too (:mod:`remat.profiling.action_steps`). :func:`aside_from_step` is the
context the profile's steps run in, apart from the training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..chains import BlockIO, extra_run, timed_step
from ..checkpointing import eager, same_tensor
from ..core import KEEP, Batch, BlockCost, CostTable, casts_uncached
from ..runtime import suspend_all
from .block_run import parameters_detached

__all__ = [
    "BlockWindows",
    "PlainSteps",
    "anchor_to_plain_steps",
    "anchored_block",
    "aside_from_step",
    "in_backward",
    "plain_steps",
]


def in_backward() -> bool:
    """Whether autograd's engine is running a backward in this thread (a block called now is recomputed)."""
    return torch._C._current_graph_task_id() != -1


class BlockWindows:
    """Hooks on ``blocks`` that add up, per step, the seconds spent in their forward calls and backward."""

    def __init__(self, blocks: Sequence[nn.Module], ios: Sequence[BlockIO], clock: Callable[[], float]) -> None:
        self.clock = clock
        self.ios = list(ios)
        self.inside = 0.0
        self.complete = True  # False once a block's main input or output could not be hooked
        self.hands_on = True  # False once a block's main input was not the previous block's main output, this step
        n = len(self.ios)
        self.fwd_s = [0.0] * n  # per block, this step: seconds in its forward calls
        self.bwd_s = [0.0] * n  # per block, this step: seconds in its backward
        self.fwd_calls = [0] * n
        self.bwd_windows = [0] * n
        self._depth = 0
        self._start = 0.0
        self._entered: dict[int, float] = {}  # block index -> when its forward call began
        self._ready: dict[int, float] = {}  # block index -> when its output's gradient was ready
        self._outputs: dict[int, weakref.ref[torch.Tensor]] = {}  # block index -> its main output, this step
        self._hooks: list[Any] = []
        for i, block in enumerate(blocks):
            # eager(): a compiled block calls its hooks inside its compiled call; they must not be traced
            self._hooks.append(block.register_forward_pre_hook(eager(self._pre(i)), with_kwargs=True, prepend=True))
            self._hooks.append(block.register_forward_hook(eager(self._post(i)), with_kwargs=True, always_call=True))

    def reset(self) -> None:
        self.inside = 0.0
        self.hands_on = True
        self._outputs.clear()
        n = len(self.ios)
        self.fwd_s, self.bwd_s = [0.0] * n, [0.0] * n
        self.fwd_calls, self.bwd_windows = [0] * n, [0] * n
        self._entered.clear()
        self._ready.clear()

    @property
    def each_block_once(self) -> bool:
        """Whether, in this step, every block ran one forward call and one backward."""
        return self.complete and all(c == 1 for c in self.fwd_calls) and all(c == 1 for c in self.bwd_windows)

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
            if in_backward():  # a recomputation: its seconds fall in the block's backward window
                return
            now = self.clock()
            if self._depth == 0:
                self._start = now
            self._depth += 1
            self._entered[i] = now
            main = self._main_input(i, args, kwargs)
            if i > 0:
                previous = self._outputs.get(i - 1)
                self.hands_on &= main is not None and previous is not None and same_tensor(main, previous())
            if main is None or not main.requires_grad:
                self.complete = False
                return
            main.register_hook(self._input_grad(i))

        return hook

    def _post(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
            if in_backward():
                return
            self._depth -= 1
            main = self._main_input(i, args, kwargs)
            out = self.ios[i].output(output, main.shape) if main is not None and output is not None else None
            if out is None or not out.requires_grad:
                self.complete = False
            else:
                out.register_hook(self._output_grad(i))
                self._outputs[i] = weakref.ref(out)
            now = self.clock()
            entered = self._entered.pop(i, None)
            if entered is not None:
                self.fwd_s[i] += now - entered
                self.fwd_calls[i] += 1
            if self._depth == 0:
                self.inside += now - self._start

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
                seconds = self.clock() - ready
                self.inside += seconds
                self.bwd_s[i] += seconds
                self.bwd_windows[i] += 1

        return hook


@dataclass(frozen=True)
class PlainSteps:
    """Medians over plain steps: the whole step, the part outside the blocks, and each block's forward and
    backward seconds within the step (None where they could not be read: see :func:`plain_steps`)."""

    step_s: float
    outside_s: float | None
    block_fwd_s: list[float] | None
    block_bwd_s: list[float] | None
    hands_on: bool = False  # in every step, each block's main input was the previous block's main output


def aside_from_step(model: nn.Module, device: str, suspend: bool = True) -> contextlib.ExitStack:
    """Where the profile's plain steps run, apart from the training: no plan applied (unless ``suspend`` is
    false: the steps of :mod:`remat.profiling.action_steps` apply their own), the RNG stream forked, no parameter hook
    fires (stand-in parameters), buffers (BatchNorm statistics) and collected outputs left as they were."""
    stack = contextlib.ExitStack()
    if suspend:
        stack.enter_context(suspend_all())
    stack.enter_context(torch.random.fork_rng(devices=[] if device == "cpu" else None, device_type=device))
    stack.enter_context(casts_uncached())
    stack.enter_context(parameters_detached(model))
    stack.enter_context(extra_run(model))
    return stack


def plain_steps(
    model: nn.Module,
    batch: Batch,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    blocks: Sequence[nn.Module],
    ios: Sequence[BlockIO],
    *,
    steps: int = 3,
    autocast: Any = None,
    clock: Callable[[], float] = time.perf_counter,
) -> PlainSteps:
    """``steps`` plain steps timed whole and within, block by block. ``outside_s`` is None where a block's main
    input or output carries no gradient to time its backward by, and on CUDA, where the blocks' windows would
    be the host's share only; the blocks' figures are None then too, and where a block did not run exactly
    once forward and once backward in every step (a block called twice: its row prices one call). Gradients
    are set to None before each step; on CUDA the device is synchronised around each."""
    on_cuda = any(p.device.type == "cuda" for p in model.parameters())
    windows = BlockWindows(blocks, ios, clock)
    whole, outside, fwd, bwd = [], [], [], []
    once = hands_on = True
    try:
        for _ in range(steps):
            windows.reset()
            seconds = timed_step(model, batch, loss_fn, autocast=autocast, clock=clock)
            whole.append(seconds)
            outside.append(seconds - windows.inside)
            once = once and windows.each_block_once
            hands_on = hands_on and windows.hands_on
            fwd.append(windows.fwd_s)
            bwd.append(windows.bwd_s)
    finally:
        windows.remove()
    step = statistics.median(whole)
    if not windows.complete or on_cuda:
        return PlainSteps(step, None, None, None, hands_on)
    per_block = once and bool(blocks)
    return PlainSteps(
        step,
        statistics.median(outside),
        [statistics.median(f[i] for f in fwd) for i in range(len(blocks))] if per_block else None,
        [statistics.median(b[i] for b in bwd) for i in range(len(blocks))] if per_block else None,
        hands_on,
    )


def anchored_block(block: BlockCost, fwd_s: float, bwd_s: float) -> BlockCost:
    """A copy of ``block`` whose keep forward and backward are ``fwd_s`` and ``bwd_s``, its other actions'
    forward and backward moved by the same amounts (recomputation and overhead unchanged). The copy's other
    fields are ``block``'s own (the profiler's rows share none between blocks)."""
    fwd_shift, bwd_shift = fwd_s - block.fwd_s, bwd_s - block.bwd_s
    return dataclasses.replace(
        block,
        fwd_s=fwd_s,
        bwd_s=bwd_s,
        fwd_s_by_action={a: s + fwd_shift for a, s in block.fwd_s_by_action.items()} | {KEEP: fwd_s},
        bwd_s_by_action={a: s + bwd_shift for a, s in block.bwd_s_by_action.items()} | {KEEP: bwd_s},
    )


def anchor_to_plain_steps(costs: CostTable, plain: PlainSteps, fqns: Sequence[str]) -> None:
    """Sets ``costs.outside_s`` from ``plain`` (whose blocks are ``fqns``, in order) and, where ``plain`` timed
    every block within the step, each block's keep times to those. ``costs.info["times_from"]`` says which
    (``"plain steps"`` or ``"isolated runs"``), ``info["plain_step_s"]`` is the plain steps' median and
    ``info["outputs_feed_next_block"]`` whether each block's main input was the previous block's main output
    (what a segment of them needs, :mod:`remat.runtime.handle`). Where the blocks could not be timed within the step,
    ``outside_s`` is the step less the blocks' isolated times, not floored at 0: blocks timed alone can run slower
    than within a step."""
    fwd, bwd = plain.block_fwd_s, plain.block_bwd_s
    within = plain.outside_s is not None and fwd is not None and bwd is not None and list(fqns) == costs.fqns
    if within:
        costs.blocks = [anchored_block(b, f, g) for b, f, g in zip(costs.blocks, fwd, bwd, strict=True)]
    costs.info["times_from"] = "plain steps" if within else "isolated runs"
    costs.info["plain_step_s"] = plain.step_s
    costs.info["outputs_feed_next_block"] = plain.hands_on
    if plain.outside_s is not None:
        costs.outside_s = plain.outside_s
    else:
        costs.outside_s = plain.step_s - sum(b.fwd_s + b.bwd_s for b in costs.blocks)
