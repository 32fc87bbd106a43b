"""Timing one block under one action on the real device: forward, backward and recomputation seconds.

Runs after a warm-up, every action once per round (:func:`time_actions`), so that the runs of one round can be
paired, and where asked a forward under ``torch.no_grad`` too (:data:`NO_GRAD_FORWARD`, how a memory-poor group
re-runs its inner blocks); on CUDA the device is synchronised around every timed region. The
recomputation is timed directly (the block's second call under a checkpoint), not as a difference of backward
times: it is a fraction of them, and their noise would swamp it.

On the CPU the caches are flushed (:class:`CacheFlush`, untimed) between each timed forward and its backward.
In a training step a block's backward, and any recomputation in it, runs after the rest of the model's forward
and the later blocks' backward have gone through the caches; timed right after its own forward, a block finds
its saved tensors and weights in cache and its backward, above all a recomputation, runs faster than it does
in the step, the more so when another process shares the last-level cache. The flush writes as many bytes as
that traffic (``traffic_bytes``, the profiler's estimate of the step's activations), at most twice the
last-level cache: a flush larger than the step's own traffic leaves the block colder than the step does (on a
host reporting a 480 MiB last-level cache, a 960 MiB flush priced a small GPT-2 block's checkpoint 17-63% above
what it added to the step).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..chains import main_tensor
from ..core import autocast_off
from .block_run import clear_grads, run_action

Clock = Callable[[], float]  # seconds: time.perf_counter (wall-clock, the default) or time.process_time


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on other devices."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    """The device's model name (the GPU's, or the host processor's)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine()


def last_level_cache_bytes(default: int = 32 * 2**20) -> int:
    """The largest CPU cache Linux reports for CPU 0 (``default`` where it reports none)."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=default)


def flush_bytes(traffic_bytes: int | None = None) -> int:
    """How many bytes :class:`CacheFlush` writes: ``traffic_bytes`` (what the step moves between a block's
    forward and its backward), at most twice the last-level cache; twice that cache where no traffic is given."""
    ceiling = 2 * last_level_cache_bytes()
    return ceiling if traffic_bytes is None else max(0, min(ceiling, traffic_bytes))


class CacheFlush:
    """Evicts from the CPU caches what ``traffic_bytes`` of a step's own traffic would, by writing a buffer of
    :func:`flush_bytes` (nothing on other devices, whose caches are small next to their memory traffic)."""

    def __init__(self, device: torch.device, traffic_bytes: int | None = None) -> None:
        self.buffer: torch.Tensor | None = None
        elements = flush_bytes(traffic_bytes) // 4
        if device.type == "cpu" and elements:
            self.buffer = torch.empty(elements, dtype=torch.float32)

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.fill_(1.0)


class TimedCalls:
    """Calls ``module`` and records how long each call took: under a checkpoint the first call is the forward
    and the second the recomputation in backward (cut short, like in training, once it has rebuilt what
    backward needs)."""

    def __init__(self, module: nn.Module, device: torch.device, clock: Clock = time.perf_counter) -> None:
        self.module = module
        self.device = device
        self.clock = clock
        self.seconds: list[float] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = self.clock()
        try:
            return self.module(*args, **kwargs)
        finally:
            sync(self.device)
            self.seconds.append(self.clock() - start)


Timing = tuple[float, float, float]  # forward, backward, recomputation seconds of one run
NO_GRAD_FORWARD = "no_grad forward"  # the key of the no-grad forward's runs (backward and recomputation 0)


def time_once(
    module: nn.Module,
    action: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    main: torch.Tensor,
    device: torch.device,
    pick: Callable[[Any], torch.Tensor | None] = main_tensor,
    clock: Clock = time.perf_counter,
    flush: Callable[[], None] = lambda: None,
) -> Timing:
    """Forward, backward and recomputation seconds of one run of the block under ``action``, read from
    ``clock``; the backward starts from the main output, which ``pick`` takes from what the block returns.
    ``flush`` runs (untimed) between the forward and the backward."""
    timed = TimedCalls(module, device, clock)
    grad = torch.ones_like(main)
    sync(device)
    t0 = clock()
    out = pick(run_action(timed, action, args, kwargs, compiled=module))
    sync(device)
    t1 = clock()
    if out.shape != grad.shape:
        grad = torch.ones_like(out)
    flush()
    t_bwd = clock()
    with autocast_off():
        torch.autograd.backward(out, grad)
    sync(device)
    t2 = clock()
    del out
    main.grad = None
    clear_grads(module)
    return t1 - t0, t2 - t_bwd, sum(timed.seconds[1:])


def time_forward_without_grad(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: torch.device,
    clock: Clock = time.perf_counter,
    flush: Callable[[], None] = lambda: None,
) -> Timing:
    """Seconds of one forward of the block under ``torch.no_grad`` (after ``flush``, untimed: a memory-poor
    group re-runs it in the step's backward, with the caches as the rest of the step left them)."""
    flush()
    sync(device)
    start = clock()
    with torch.no_grad():
        out = module(*args, **kwargs)
    sync(device)
    seconds = clock() - start
    del out
    return seconds, 0.0, 0.0


def time_actions(
    module: nn.Module,
    actions: Sequence[str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    main: torch.Tensor,
    device: torch.device,
    repeats: int,
    pick: Callable[[Any], torch.Tensor | None] = main_tensor,
    clock: Clock = time.perf_counter,
    no_grad_forward: bool = False,
    traffic_bytes: int | None = None,
) -> dict[str, list[Timing]]:
    """``repeats`` timed runs of the block under each of ``actions``, after one warm-up round. The actions
    run interleaved (every round runs each once), so drift on a busy machine touches them alike and the
    runs of one round can be compared with each other. With ``no_grad_forward`` each round also times a
    forward under ``torch.no_grad``, under the key :data:`NO_GRAD_FORWARD`. Each backward (and the no-grad
    forward) follows a :class:`CacheFlush` of ``traffic_bytes``."""
    runs: dict[str, list[Timing]] = {action: [] for action in actions}
    if no_grad_forward:
        runs[NO_GRAD_FORWARD] = []
    flush = CacheFlush(device, traffic_bytes)
    for round_ in range(repeats + 1):
        for action in actions:
            timing = time_once(module, action, args, kwargs, main, device, pick, clock, flush)
            if round_:
                runs[action].append(timing)
        if no_grad_forward:
            timing = time_forward_without_grad(module, args, kwargs, device, clock, flush)
            if round_:
                runs[NO_GRAD_FORWARD].append(timing)
    return runs


def time_action(
    module: nn.Module,
    action: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    main: torch.Tensor,
    device: torch.device,
    repeats: int,
    pick: Callable[[Any], torch.Tensor | None] = main_tensor,
) -> Timing:
    """Median forward, backward and recomputation seconds of the block under ``action`` (after one warm-up);
    the backward starts from the main output, which ``pick`` takes from what the block returns."""
    runs = time_actions(module, [action], args, kwargs, main, device, repeats, pick=pick)[action]
    return tuple(statistics.median(column) for column in zip(*runs, strict=True))  # type: ignore[return-value]


COPY_SAMPLE_BYTES = 256 * 2**20  # the most a bandwidth measurement copies at once


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 3) -> dict[str, float]:
    """Bytes per second of a copy of ``nbytes`` (at most :data:`COPY_SAMPLE_BYTES`) between ``device`` (CUDA) and
    pinned host memory, each way (``"to_host"``, ``"to_device"``), on a side stream as the ``offload`` action
    copies: the median of ``repeats`` after one untimed copy each way."""
    if device.type != "cuda":
        raise ValueError(f"copy bandwidth is measured between a CUDA device and its host, not on {device}")
    size = max(2**20, min(int(nbytes), COPY_SAMPLE_BYTES))
    on_device = torch.empty(size, dtype=torch.uint8, device=device)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream(device)
    rates: dict[str, list[float]] = {"to_host": [], "to_device": []}
    sync(device)
    for repeat in range(repeats + 1):
        for way, (target, source) in (("to_host", (host, on_device)), ("to_device", (on_device, host))):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(side):
                start.record(side)
                target.copy_(source, non_blocking=True)
                end.record(side)
            end.synchronize()
            if repeat:
                rates[way].append(size / (start.elapsed_time(end) / 1e3))
    return {way: statistics.median(values) for way, values in rates.items()}
