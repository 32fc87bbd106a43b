"""Timing one block under one action on the real device: forward, backward and recomputation seconds.

Medians of a few repeats after a warm-up; on CUDA the device is synchronised around every timed region. The
recomputation is timed directly (the block's second call under a checkpoint), not as a difference of backward
times: it is a fraction of them, and their noise would swamp it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .block_run import clear_grads, run_action
from .blocks import main_tensor


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on other devices."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TimedCalls:
    """Calls ``module`` and records how long each call took: under a checkpoint the first call is the forward
    and the second the recomputation in backward (cut short, like in training, once it has rebuilt what
    backward needs)."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module = module
        self.device = device
        self.seconds: list[float] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.module(*args, **kwargs)
        finally:
            sync(self.device)
            self.seconds.append(time.perf_counter() - start)


def time_action(
    module: nn.Module,
    action: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    main: torch.Tensor,
    device: torch.device,
    repeats: int,
    pick: Callable[[Any], torch.Tensor | None] = main_tensor,
) -> tuple[float, float, float]:
    """Median forward, backward and recomputation seconds of the block under ``action`` (after one warm-up);
    the backward starts from the main output, which ``pick`` takes from what the block returns."""
    fwd, bwd, recompute = [], [], []
    for i in range(repeats + 1):
        timed = TimedCalls(module, device)
        sync(device)
        t0 = time.perf_counter()
        out = pick(run_action(timed, action, args, kwargs))
        sync(device)
        t1 = time.perf_counter()
        torch.autograd.backward(out, torch.ones_like(out))
        sync(device)
        t2 = time.perf_counter()
        del out
        main.grad = None
        clear_grads(module)
        if i:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            recompute.append(sum(timed.seconds[1:]))
    return statistics.median(fwd), statistics.median(bwd), statistics.median(recompute)
