"""The device's memory for a whole training step: what is fixed, what a memory figure leaves for activations,
and what one step measured whole takes.

``remat.fit(model, "22GiB")`` promises the whole step, not the activations of one profiled batch: parameters,
gradients, optimizer state, buffers, whatever else the device holds (on CUDA: wrapper buckets, caches) and the
step's activations and temporaries. This module owns that accounting; :mod:`.device_fit` fits a plan to it.

Invariants, enforced here:

1. A memory figure is bytes, a size string (``"22GiB"``) or a percentage of the device's free memory
   (``"90%"``: ``torch.cuda.mem_get_info`` on CUDA, ``MemAvailable`` of ``/proc/meminfo`` on the CPU). A float is
   refused: a fraction of activations is ``activations=``. The memory is the device the model is on: a model
   still on the CPU while a CUDA device is present is warned about (:func:`warn_if_on_host`), as a fit made
   before ``model.to("cuda")`` measures the host's memory and the CPU's steps.
2. The fixed memory is measured from the live objects, each storage counted once (tied weights share one):
   parameters, buffers and optimizer state on the model's device, and one gradient per trainable parameter (its
   size and dtype). State an optimizer has not made yet (before its first step) and the temporaries of its step
   are measured by running its ``step`` on ``meta`` copies of the parameters under the live-tensor tracker
   (foreach where the real step would use it); nothing is assumed per optimizer. An optimizer of a library
   whose steps call native kernels (:data:`NATIVE_STEPS`: DeepSpeed's fused Adam, apex, bitsandbytes), which
   cannot run on ``meta``, is measured once its state exists, and refused with what to do before. An optimizer
   that wraps the one that steps (DeepSpeed's ZeRO optimizers, accelerate's and Lightning's hold it as
   ``.optimizer``) is measured through it, and the tensors it steps that are not the model's parameters (the
   float32 copies DeepSpeed's ZeRO keeps) count as ``parameter copies``. On CUDA whatever else is allocated on
   the device when the fit starts is counted too, as ``other tensors on the device``.
3. A whole step's peak is the larger of its two phases, each measured: forward and backward (what is resident
   with the gradients cleared, plus the state the optimizer will make, plus the measured peak of what the phase
   creates, gradients included) and the optimizer step (the fixed memory plus the step's temporaries). Under
   gradient accumulation (``StepSpec.accumulates``) the forward and backward measured is a second one, run after a
   first without clearing the gradients: they are resident through it, and what adding into them takes counts.
4. A step that runs out of the device's memory (``torch.OutOfMemoryError``) is a measurement, not a failure: its
   :class:`StepPeak` says ``out_of_memory``, with the peak it reached before (a floor of what it needs), and what
   it held is given back before the next step runs.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core import format_bytes, parse_bytes
from ..meters import LiveTensorTracker, measure, model_device, storage_key, within_memory
from ..profiling import GradsRestored

MemoryArg = int | str

# Rule 2: packages whose optimizers step with native kernels that cannot run on meta tensors.
NATIVE_STEPS = ("deepspeed.ops.", "apex.", "bitsandbytes.", "transformer_engine.", "torchao.")


def device_memory(memory: MemoryArg, device: torch.device) -> int:
    """Rule 1: ``memory`` in bytes on ``device``."""
    if isinstance(memory, bool) or not isinstance(memory, int | str):
        hint = " (a fraction of the activations is activations=)" if isinstance(memory, float) else ""
        raise TypeError(f"memory={memory!r}: give bytes, a size like '22GiB' or a share of free memory, '90%'{hint}")
    if isinstance(memory, int):
        if memory <= 0:
            raise ValueError(f"memory={memory}: the device's memory for the step must be positive")
        return memory
    text = memory.strip()
    if not text.endswith("%"):
        return parse_bytes(text)
    share = float(text[:-1]) / 100
    if not 0 < share <= 1:
        raise ValueError(f"memory={memory!r}: a share of the free memory is a percentage in (0, 100]")
    return int(share * free_bytes(device))


def warn_if_on_host(device: torch.device, what: str) -> None:
    """Rule 1: warn where the model is on the CPU while a CUDA device is present."""
    if device.type == "cpu" and torch.cuda.is_available():
        warnings.warn(
            f"{what}: the model is on the CPU while a CUDA device is present, so memory= is the host's and every "
            "step is measured on the CPU: a model moved to the GPU after the fit runs a plan made for another "
            "device. Move the model to its device first (model.to('cuda')), then fit",
            stacklevel=4,
        )


def free_bytes(device: torch.device) -> int:
    """The memory ``device`` has free now: the CUDA driver's figure, or the host's ``MemAvailable``."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free) + torch.cuda.memory_allocated(device)  # what this process holds is the step's to use
    if device.type == "cpu":
        match = re.search(r"^MemAvailable:\s+(\d+)\s+kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
        if match:
            return int(match.group(1)) * 1024
    raise ValueError(f"cannot read the free memory of {device}: give memory in bytes or as a size like '22GiB'")


def _storage_bytes(tensors: Iterable[Any], device: torch.device, seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if not torch.is_tensor(t) or t.device != device:
            continue
        key = storage_key(t)
        if key is None or key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


@dataclass(frozen=True)
class FixedMemory:
    """Rule 2: the step's memory that no plan changes, by part, in bytes."""

    parameters: int
    gradients: int
    optimizer_state: int
    buffers: int
    other: int = 0  # CUDA: what else was allocated on the device
    state_to_make: int = 0  # the part of optimizer_state its first step has yet to allocate
    optimizer_step_bytes: int = 0  # temporaries of the optimizer's step, above the fixed memory
    optimizer: str = ""
    parameter_copies: int = 0  # what the optimizer steps in place of the model's parameters (ZeRO's float32 copies)

    @property
    def total(self) -> int:
        held = self.parameters + self.parameter_copies + self.gradients + self.optimizer_state + self.buffers
        return held + self.other

    @property
    def resident(self) -> int:
        """Rule 3: what stays resident through a forward and backward, the optimizer's state made (the total but
        the gradients, which the phase creates)."""
        return self.total - self.gradients

    def parts(self) -> dict[str, int]:
        """Each fixed part by name (parts of 0 bytes left out)."""
        state = f"optimizer state ({self.optimizer})" if self.optimizer else "optimizer state"
        named = {
            "parameters": self.parameters,
            f"parameter copies ({self.optimizer})": self.parameter_copies,
            "gradients": self.gradients,
            state: self.optimizer_state,
            "buffers": self.buffers,
            "other tensors on the device": self.other,
            "optimizer step temporaries": self.optimizer_step_bytes,
        }
        return {name: size for name, size in named.items() if size}

    def describe(self) -> str:
        return ", ".join(f"{name} {format_bytes(size)}" for name, size in self.parts().items()) or "nothing"


def stepping_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """Rule 2: the ``torch.optim.Optimizer`` that steps, found through the wrappers that hold it as ``.optimizer``
    (DeepSpeed's ZeRO optimizers, accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``)."""
    inner, seen = optimizer, set()
    while not isinstance(inner, torch.optim.Optimizer):
        if id(inner) in seen or getattr(inner, "optimizer", None) is None:
            raise TypeError(
                f"optimizer={type(optimizer).__name__}: remat measures the state of a torch.optim.Optimizer, or of "
                "a wrapper that holds one as .optimizer; give that optimizer"
            )
        seen.add(id(inner))
        inner = inner.optimizer
    return inner


def fixed_memory(model: nn.Module, optimizer: Any = None) -> FixedMemory:
    """Rule 2: the fixed memory of a training step of ``model`` with ``optimizer`` (None: no optimizer state; a
    wrapper is measured through the optimizer it holds)."""
    device = model_device(model)
    seen: set[int] = set()
    parameters = _storage_bytes(model.parameters(), device, seen)
    buffers = _storage_bytes(model.buffers(), device, seen)
    trainable = {id(p): p for p in model.parameters() if p.requires_grad and p.device == device}
    gradients = sum(p.numel() * p.element_size() for p in trainable.values())
    state = to_make = step_bytes = copies = 0
    name = ""
    if optimizer is not None:
        name = type(optimizer).__name__
        optimizer = stepping_optimizer(optimizer)
        copies = _storage_bytes((p for group in optimizer.param_groups for p in group["params"]), device, seen)
        state = _storage_bytes((t for s in optimizer.state.values() for t in s.values()), device, seen)
        if not type(optimizer).__module__.startswith(NATIVE_STEPS):
            made, step_bytes = optimizer_dry_run(optimizer, device)
        elif any(optimizer.state.values()):
            made, step_bytes = state, 0  # its state is there to measure; its step's temporaries are not known
        else:
            raise RuntimeError(
                f"cannot measure the state {type(optimizer).__module__}.{type(optimizer).__name__} will make: its "
                "step runs native kernels that cannot run on the meta tensors remat measures with. Take one "
                "training step before remat.fit (its state is then measured), or use a torch.optim optimizer "
                '(DeepSpeed: "torch_adam": true in the optimizer\'s params)'
            )
        if made > state:
            to_make = made - state
            state = made
    other = 0
    if device.type == "cuda":
        grads_held = _storage_bytes((p.grad for p in trainable.values()), device, set())
        known = parameters + buffers + copies + (state - to_make) + grads_held
        other = max(0, torch.cuda.memory_allocated(device) - known)
    return FixedMemory(parameters, gradients, state, buffers, other, to_make, step_bytes, name, copies)


def optimizer_dry_run(optimizer: torch.optim.Optimizer, device: torch.device) -> tuple[int, int]:
    """Rule 2: the bytes of state ``optimizer`` holds after a step for its parameters on ``device``, and the peak
    of its step's temporaries, from its ``step`` run on ``meta`` copies under the live-tensor tracker."""
    copies: dict[int, torch.Tensor] = {}
    groups = []
    for group in optimizer.param_groups:
        options = {k: v for k, v in group.items() if k != "params"}
        if options.get("fused"):
            options["fused"] = False  # no fused kernels on meta; foreach allocates alike
            options["foreach"] = True
        elif options.get("foreach") is None and "foreach" in options:
            options["foreach"] = device.type == "cuda"  # what torch picks for the real parameters
        params = []
        for p in group["params"]:
            if p.device != device:
                continue
            if id(p) not in copies:
                copy = torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
                copy.grad = torch.empty_like(copy)
                copies[id(p)] = copy
            params.append(copies[id(p)])
        if params:
            groups.append({**options, "params": params})
    if not groups:
        return 0, 0
    try:
        dry = type(optimizer)(groups)
        with LiveTensorTracker("meta") as tracker:
            dry.step()
        tracker.close()
    except Exception as err:  # an optimizer that cannot step on meta: say what to do rather than guess
        raise RuntimeError(
            f"cannot measure {type(optimizer).__name__}'s state by a step on meta tensors ({type(err).__name__}: "
            f"{err}); give remat.fit no optimizer= and leave its state and its step's temporaries out of the memory "
            "yourself"
        ) from err
    state = [t for s in dry.state.values() for t in s.values()]
    made = _storage_bytes(state, torch.device("meta"), set())
    if device.type == "cpu":  # scalar state (Adam's step) is made on the CPU, whatever the parameters' device
        made += _storage_bytes(state, device, set())
    return made, tracker.peak(exclude_survivors=True)


@dataclass(frozen=True)
class StepPeak:
    """Rule 3: a whole step's measured peak, by phase, in bytes."""

    forward_backward: int
    optimizer_step: int
    out_of_memory: bool = False  # rule 4: the step ran out of the device's memory at ``forward_backward``

    @property
    def whole(self) -> int:
        return max(self.forward_backward, self.optimizer_step)

    def within(self, limit: int) -> bool:
        """Whether the step ran to its end within ``limit`` bytes."""
        return not self.out_of_memory and self.whole <= limit


def whole_step_peak(model: nn.Module, run: Callable[[], Any], fixed: FixedMemory,
                    accumulates: bool = False) -> StepPeak:  # fmt: skip
    """Rule 3: the peak of a training step whose forward and backward ``run()`` does (gradients start cleared
    and are put back afterwards; ``run`` restores the RNG if it cares); ``accumulates``: the forward and backward
    measured is a second one, the gradients of a first there. Rule 4 where it runs out of memory."""
    device = model_device(model)
    with GradsRestored(model):
        if accumulates:
            _, out_of_memory = within_memory(run, device)
            if out_of_memory:
                return StepPeak(fixed.total, fixed.total + fixed.optimizer_step_bytes, True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            resident = torch.cuda.memory_allocated(device)
        else:
            resident = fixed.resident - fixed.state_to_make + (fixed.gradients if accumulates else 0)
        with measure(device) as meter:
            _, out_of_memory = within_memory(run, device)
    forward_backward = resident + fixed.state_to_make + meter.peak_bytes
    return StepPeak(forward_backward, fixed.total + fixed.optimizer_step_bytes, out_of_memory)
