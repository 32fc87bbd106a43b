"""Measuring a CostTable on the real device: each block run in isolation under each action.

:class:`BlockProfiler` hooks the chain's blocks for one forward/backward step. When a block is first called it
takes the block's real inputs and, aside from the step (RNG forked, gradients restored, other remat hooks
suspended), runs the block alone under every action: a live-tensor tracker gives the bytes kept after the
forward, the forward and backward transients; timed repeats give forward, backward and recompute seconds.
The step itself is tracked too, for the memory before the chain (stem) and after it (head).

It serves both :func:`profile` (one step on a sample batch) and in-training profiling: the dynamic controllers
wrap the first real training step in a ``BlockProfiler``.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from . import policies as _policies
from .checkpointing import checkpoint
from .costs import CHECKPOINT, KEEP, OFFLOAD, SELECTIVE_PREFIX, BlockCost, CostTable
from .hf_guards import profiled_step
from .memory import LiveTensorTracker
from .model_state import detached_from_step, extra_run
from .runtime import (
    _get_slot,
    _main_input_slot,
    _resolve_blocks,
    _with_slot,
    main_tensor,
    suspend_all,
    without_caches,
)

Batch = torch.Tensor | tuple[Any, ...] | list[Any] | dict[str, Any]


def default_actions(device: torch.device, policies: Iterable[str] = ("dots_saveable",)) -> list[str]:
    actions = [KEEP, CHECKPOINT] + [SELECTIVE_PREFIX + _policies.get(p).name for p in policies]
    if device.type == "cuda":
        actions.append(OFFLOAD)
    return actions


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_action(module: Callable[..., Any], action: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if action == KEEP:
        return module(*args, **kwargs)
    if action == CHECKPOINT:
        return checkpoint(module, *args, **kwargs)
    if action.startswith(SELECTIVE_PREFIX):
        return checkpoint(module, *args, policy=action[len(SELECTIVE_PREFIX) :], **kwargs)
    if action == OFFLOAD:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return module(*args, **kwargs)
    raise ValueError(f"cannot profile action {action!r}")


class _GradsRestored:
    """Set parameter gradients aside while a measurement runs, and put them back afterwards."""

    def __init__(self, module: nn.Module) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]

    def __enter__(self) -> None:
        self.saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def __exit__(self, *exc: Any) -> None:
        for p, g in zip(self.params, self.saved):
            p.grad = g


def measure_block(
    fqn: str,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    actions: Sequence[str],
    *,
    repeats: int = 3,
) -> BlockCost:
    """Costs of one block on these inputs, under each of ``actions`` (``"keep"`` must be among them)."""
    slot = _main_input_slot(args, kwargs)
    source = _get_slot(args, kwargs, slot)
    device = source.device
    main = source.detach().requires_grad_(True)
    args, kwargs = detached_from_step(*without_caches(*_with_slot(args, kwargs, slot, main)))
    trackers: dict[str, LiveTensorTracker] = {}
    output_bytes = 0
    times: dict[str, tuple[float, float, float]] = {}
    _edge_backward_supported()  # probe once here, not inside a tracked region
    identity = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    rng_devices = [device.index or 0] if device.type == "cuda" else []
    with suspend_all(), identity, _GradsRestored(module), torch.random.fork_rng(
        devices=rng_devices, device_type=device.type
    ):
        for action in actions:
            trackers[action] = LiveTensorTracker(device)
            output_bytes = run_tracked(trackers[action], module, action, args, kwargs, main)
            times[action] = _time_action(module, action, args, kwargs, main, device, repeats)
    terms = ByteTerms.from_trackers(trackers)
    fwd_s, bwd_s, _ = times[KEEP]
    recompute: dict[str, float] = {}
    for action in actions:
        a_fwd, a_bwd, a_recompute = times[action]
        if action == KEEP:
            recompute[action] = 0.0
        elif action == CHECKPOINT:
            recompute[action] = fwd_s
        elif action == OFFLOAD:
            recompute[action] = max((a_fwd - fwd_s) + (a_bwd - bwd_s), 0.0)
        else:
            recompute[action] = min(a_recompute, fwd_s)
    return BlockCost(
        fqn=fqn,
        fwd_s=fwd_s,
        bwd_s=bwd_s,
        input_bytes=_tensor_bytes(main),
        output_bytes=output_bytes,
        saved_bytes=terms.saved,
        recompute_s=recompute,
        fwd_temp_bytes=terms.fwd_temp,
        bwd_temp_bytes=terms.bwd_temp,
        bwd_extra_bytes=terms.bwd_extra,
    )


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def clear_grads(module: nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def run_tracked(
    tracker: Any,
    module: nn.Module,
    action: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    main: torch.Tensor,
    tensor_bytes: Callable[[torch.Tensor], int] = _tensor_bytes,
) -> int:
    """One forward and backward of the block under ``action`` inside ``tracker`` (a live-bytes dispatch mode
    with ``mark``), marked ``start``, ``fwd_end``, ``bwd_start`` and ``bwd_end``; returns the output's bytes."""
    with tracker:
        tracker.mark("start")
        out = main_tensor(_run_action(module, action, args, kwargs))
        tracker.mark("fwd_end")
        grad = torch.ones_like(out)
        output_bytes = tensor_bytes(out)
        holder = [out]
        del out
        tracker.mark("bwd_start")
        _backward_releasing_output(holder, grad)
        tracker.mark("bwd_end")
        del grad
        main.grad = None
    # Close while the parameter gradients are alive: like in a real step they outlive the region, so they are
    # survivors, not activations, and stay out of the backward transient.
    tracker.close()
    clear_grads(module)
    return output_bytes


@dataclass
class ByteTerms:
    """The byte fields of a :class:`BlockCost`, read from one tracked run per action (see :func:`run_tracked`)."""

    saved: dict[str, int]
    fwd_temp: int
    bwd_temp: int
    bwd_extra: dict[str, int]

    @classmethod
    def from_trackers(cls, trackers: dict[str, Any]) -> ByteTerms:
        saved = {action: t.bytes_at("fwd_end") for action, t in trackers.items()}
        bwd_peak = {action: t.peak_between("bwd_start", "bwd_end") for action, t in trackers.items()}
        keep = trackers[KEEP]
        return cls(
            saved=saved,
            fwd_temp=max(0, keep.peak_between("start", "fwd_end") - saved[KEEP]),
            bwd_temp=max(0, bwd_peak[KEEP] - saved[KEEP]),
            # how much higher the backward peaked under an action than under keep (only the positive ones)
            bwd_extra={a: p - bwd_peak[KEEP] for a, p in bwd_peak.items() if a != KEEP and p > bwd_peak[KEEP]},
        )


def _edge_backward_supported() -> bool:
    """Whether this torch's ``autograd.backward`` accepts a ``GradientEdge`` (torch >= 2.7)."""
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


_EDGE_BACKWARD: bool | None = None


def _backward_releasing_output(holder: list[torch.Tensor], grad: torch.Tensor) -> None:
    """Backward from the tensor in ``holder`` (which is emptied) without keeping it alive during backward.

    In a real step a block's output is freed once the next block's backward has run, before the block's own
    backward starts (unless the block's own graph saved it). Backing out of the output's gradient edge
    reproduces that, so the measured backward transient does not count the output on top of the saved bytes.
    """
    out = holder.pop()
    if not _edge_backward_supported():
        torch.autograd.backward(out, grad)
        return
    from torch.autograd.graph import get_gradient_edge

    edge = get_gradient_edge(out)
    del out
    torch.autograd.backward(edge, grad)


class _TimedCalls:
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
            _sync(self.device)
            self.seconds.append(time.perf_counter() - start)


def _time_action(
    module: nn.Module,
    action: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    main: torch.Tensor,
    device: torch.device,
    repeats: int,
) -> tuple[float, float, float]:
    """Median forward, backward and recomputation seconds of the block under ``action`` (after one warm-up).
    The recomputation is timed directly, not as a difference of backward times: it is a fraction of them, and
    their noise would swamp it."""
    fwd, bwd, recompute = [], [], []
    for i in range(repeats + 1):
        timed = _TimedCalls(module, device)
        _sync(device)
        t0 = time.perf_counter()
        out = main_tensor(_run_action(timed, action, args, kwargs))
        _sync(device)
        t1 = time.perf_counter()
        torch.autograd.backward(out, torch.ones_like(out))
        _sync(device)
        t2 = time.perf_counter()
        del out
        main.grad = None
        clear_grads(module)
        if i:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            recompute.append(sum(timed.seconds[1:]))
    return statistics.median(fwd), statistics.median(bwd), statistics.median(recompute)


class BlockArguments:
    """The tensors passed to blocks besides their main input (an attention mask, position embeddings), one entry
    per storage. A plan that recomputes a block holds them for the recomputation; a step that keeps everything
    may free them before the chain's backward. :meth:`freed_bytes` sums those freed so far."""

    def __init__(self) -> None:
        self._storages: list[tuple[weakref.ref, int]] = []

    def add(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        main = _get_slot(args, kwargs, _main_input_slot(args, kwargs))
        for t in tree_flatten((args, kwargs))[0]:
            if not isinstance(t, torch.Tensor) or t is main or isinstance(t, nn.Parameter):
                continue
            storage = t.untyped_storage()
            if any(ref() is storage for ref, _ in self._storages):
                continue
            self._storages.append((weakref.ref(storage), storage.nbytes()))

    def freed_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self._storages if ref() is None)


class BlockProfiler:
    """Profile every block of the chain during one real forward/backward step.

    >>> with BlockProfiler(model) as prof:
    ...     loss_fn(model(**batch)).backward()
    >>> costs = prof.cost_table()
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[str] | Sequence[tuple[str, nn.Module]] | None = None,
        *,
        policies: Iterable[str] = ("dots_saveable",),
        actions: Sequence[str] | None = None,
        repeats: int = 3,
    ) -> None:
        self.model = model
        self.chain = _resolve_blocks(model, blocks)
        self.policies = tuple(policies)
        self.actions = list(actions) if actions is not None else None
        self.repeats = repeats
        self.rows: dict[int, BlockCost] = {}
        self._hooks: list[Any] = []
        self._tracker: LiveTensorTracker | None = None
        self._busy = False
        self._device: torch.device | None = None
        self._arguments = BlockArguments()
        self._held_args_bytes = 0

    def __enter__(self) -> BlockProfiler:
        for i, (fqn, module) in enumerate(self.chain):
            self._hooks.append(module.register_forward_pre_hook(self._pre_hook(i, fqn), with_kwargs=True))
        last = len(self.chain) - 1
        self._hooks.append(self.chain[last][1].register_forward_hook(self._chain_end_hook))
        self._tracker = LiveTensorTracker()
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._tracker is not None:
            self._tracker.__exit__(*exc)
            self._tracker.close()

    def _pre_hook(self, i: int, fqn: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._busy or i in self.rows or not torch.is_grad_enabled():
                return
            tracker = self._tracker
            if i == 0 and tracker is not None:
                tracker.mark("stem")
            main = _get_slot(args, kwargs, _main_input_slot(args, kwargs))
            self._device = main.device
            self._arguments.add(args, kwargs)
            actions = self.actions or default_actions(main.device, self.policies)
            self._busy = True
            try:
                # Step off every dispatch mode (the step's tracker included) so the block is timed and
                # measured as it runs in training, not through Python dispatch.
                with _disable_current_modes(), extra_run(module):
                    self.rows[i] = measure_block(fqn, module, args, kwargs, actions, repeats=self.repeats)
            finally:
                self._busy = False

        return hook

    def _chain_end_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        tracker = self._tracker
        out = main_tensor(output)
        if tracker is None or self._busy or out is None or not out.requires_grad or "chain_end" in self._marks():
            return
        tracker.mark("chain_end")
        out.register_hook(lambda grad: self._head_end(tracker))

    def _head_end(self, tracker: LiveTensorTracker) -> None:
        tracker.mark("head_end")
        self._held_args_bytes = self._arguments.freed_bytes()

    def _marks(self) -> set[str]:
        return {name for name, _ in self._tracker._marks} if self._tracker is not None else set()

    def cost_table(self) -> CostTable:
        """The measured table; raises if the step did not run every block with grad enabled."""
        missing = [self.chain[i][0] for i in range(len(self.chain)) if i not in self.rows]
        if missing:
            raise RuntimeError(
                f"blocks {missing} did not run during the profiled step (with grad enabled); "
                "profile a full forward and backward of the model"
            )
        marks = self._marks()
        stem = head = head_retained = 0
        if self._tracker is not None and "stem" in marks:
            stem = self._tracker.bytes_at("stem")
        if self._tracker is not None and {"chain_end", "head_end"} <= marks:
            end = self._tracker.bytes_at("chain_end")
            head = max(0, self._tracker.peak_between("chain_end", "head_end") - end)
            head_retained = max(0, self._tracker.bytes_at("head_end") - end)
        device = self._device or torch.device("cpu")
        return CostTable(
            blocks=[self.rows[i] for i in range(len(self.chain))],
            stem_bytes=stem,
            head_bytes=head,
            head_retained_bytes=head_retained,
            held_args_bytes=self._held_args_bytes,
            device=device.type,
            source="measured",
            info={"torch": torch.__version__, "device_name": _device_name(device)},
        )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine()


def run_step(model: nn.Module, batch: Batch, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> torch.Tensor:
    """One forward and backward of ``model`` on ``batch``; returns the loss (detached)."""
    if isinstance(batch, dict):
        output = model(**batch)
    elif isinstance(batch, tuple | list):
        output = model(*batch)
    else:
        output = model(batch)
    loss = loss_fn(output) if loss_fn is not None else default_loss(output)
    loss.backward()
    return loss.detach()


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` when the model returns one, else the sum of the (first) output tensor."""
    loss = getattr(output, "loss", None)
    if isinstance(output, dict) and output.get("loss") is not None:
        loss = output["loss"]
    if loss is not None:
        return loss
    tensor = main_tensor(output)
    if tensor is None:
        raise ValueError("the model output has no tensor; pass loss_fn=... to remat.profile")
    return tensor.float().sum()


def profile(
    model: nn.Module,
    batch: Batch,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    blocks: Sequence[str] | Sequence[tuple[str, nn.Module]] | None = None,
    policies: Iterable[str] = ("dots_saveable",),
    repeats: int = 3,
) -> CostTable:
    """Measure the :class:`CostTable` of ``model`` on ``batch`` (a tensor, a tuple of positional args or a
    dict of keyword args). ``loss_fn(output)`` defaults to ``output.loss`` or ``output.sum()``.
    Parameter gradients are left as they were."""
    profiler = BlockProfiler(model, blocks, policies=policies, repeats=repeats)
    with _GradsRestored(model), profiled_step(model), profiler:
        run_step(model, batch, loss_fn)
    return profiler.cost_table()
