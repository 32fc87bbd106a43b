"""A block's per-operator save set chosen by a 0/1 knapsack: the eager counterpart of the knapsack torch.compile
solves over its partitioner's saved values (``torch._functorch.config.activation_memory_budget``), which PyTorch
only ships for compiled code.

:func:`profile_ops` runs a block forward a few times under a dispatch mode and records each call a policy is
asked about (fresh buffers, in-place and random ops never are): its operator, its index among the calls of that
operator in the region, the bytes of its output (0 for views, which are not worth saving) and its seconds
(median over the runs). :func:`choose` solves the knapsack: the calls whose outputs fit ``capacity`` bytes and
whose seconds, the recomputation they spare, sum highest; an exact dynamic programme over bytes rounded up to a
granule, so the chosen outputs never exceed the capacity. :func:`knapsack_policy` makes the choice a
:class:`~remat.policies.Policy` named ``knapsack@<bytes>`` that saves exactly those calls (the k-th call of an
operator in each region run, counted afresh in every region and apart in recompute, as torch keys its own
cache), registered so that plans can name ``selective:knapsack@<bytes>``; :func:`register_for` makes one per
share of the bytes a model's first block keeps for backward. Profile the blocks with those names like any policy::

    names = remat.checkpointing.knapsack.register_for(model, batch, shares=(0.25, 0.5, 0.75))
    costs = remat.profile(model, batch, policies=["menu", *names])

The knapsack's model is additive: a recompute runs every call whose output was not saved (torch stops early once
backward has what it needs), and each saved output keeps its bytes. What the model misses, the profile measures:
a knapsack action's bytes and recompute seconds are measured like any other action's, so the simulator stays
exact, and gradients are exact whatever is saved. Calls are keyed by position: a block with another sequence of
operators keeps other outputs under the same name (still exact and measured, but not the knapsack's choice for
it). The policies live in this process's registry: register them again before applying a saved plan that
names them.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS

from ..chains import detached_from_step, main_input_slot, replace_slot, resolve_blocks, slot_value, without_caches
from ..core import Batch, BlocksArg
from ..meters import LiveTensorTracker
from . import policies
from .op_kinds import asks_policy, worth_saving

MAX_CELLS = 4096  # capacity cells of the dynamic programme: the granule is the capacity over this, rounded up


@dataclass(frozen=True)
class OpCall:
    """One call a policy is asked about in a region run: ``op`` (an overload), its ``index`` among the calls of
    ``op`` so far in the region, the bytes a saved output keeps (0 for views) and the seconds it took."""

    op: Any
    index: int
    nbytes: int
    seconds: float


def _output_bytes(out: Any) -> int:
    tensors = out if isinstance(out, list | tuple) else (out,)
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class _CallRecorder(TorchDispatchMode):
    """Times every call a policy would be asked about, in order."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.calls: list[OpCall] = []
        self.counts: dict[Any, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in SAC_IGNORED_OPS or not asks_policy(func, args, kwargs):
            return func(*args, **kwargs)
        self.sync()
        start = time.perf_counter()
        out = func(*args, **kwargs)
        self.sync()
        seconds = time.perf_counter() - start
        nbytes = _output_bytes(out) if worth_saving(func) else 0
        self.calls.append(OpCall(func, self.counts[func], nbytes, seconds))
        self.counts[func] += 1
        return out


def profile_ops(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, *, repeats: int = 3
) -> list[OpCall]:
    """The calls a policy is asked about in ``module(*args, **kwargs)``, in order, with their output bytes and
    median seconds over ``repeats`` forward runs (grad enabled, as in training; the RNG is left as it was)."""
    kwargs = kwargs or {}
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    runs: list[list[OpCall]] = []
    rng_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices, device_type=device.type), torch.enable_grad():
        for _ in range(max(1, repeats) + 1):  # the first run warms up
            recorder = _CallRecorder(device)
            with recorder:
                module(*args, **kwargs)
            runs.append(recorder.calls)
    runs = runs[1:]
    if any([(c.op, c.index) for c in run] != [(c.op, c.index) for c in runs[0]] for run in runs):
        raise RuntimeError(
            "the block ran different operators from one forward to the next, so no save set can be keyed by "
            "position; use a fixed policy (remat.policies.MENU) for it"
        )
    return [
        OpCall(call.op, call.index, call.nbytes, statistics.median(run[i].seconds for run in runs))
        for i, call in enumerate(runs[0])
    ]


def choose(calls: Sequence[OpCall], capacity: int, *, granule: int | None = None) -> frozenset[tuple[Any, int]]:
    """The ``(op, index)`` of the calls to save: the largest total seconds whose output bytes fit ``capacity``.

    Exact over bytes rounded up to ``granule`` (default: the capacity over :data:`MAX_CELLS`, at least 1 byte),
    so the chosen bytes never exceed ``capacity``; with ``granule=1`` exact over bytes. Outputs of no bytes (and
    some seconds) are always chosen; views (0 bytes, see :func:`profile_ops`) never are.
    """
    if capacity < 0:
        raise ValueError(f"capacity must be a number of bytes >= 0, got {capacity}")
    chosen = {(c.op, c.index) for c in calls if c.nbytes == 0 and c.seconds > 0 and worth_saving(c.op)}
    items = [c for c in calls if 0 < c.nbytes <= capacity and c.seconds > 0]
    if not items:
        return frozenset(chosen)
    granule = granule or max(1, -(-capacity // MAX_CELLS))
    cells = capacity // granule
    weights = [-(-c.nbytes // granule) for c in items]
    best = np.zeros(cells + 1)  # best[j]: the most seconds spared within j cells
    took = np.zeros((len(items), cells + 1), dtype=bool)
    for i, (item, weight) in enumerate(zip(items, weights, strict=True)):
        if weight > cells:
            continue
        with_item = best[: cells + 1 - weight] + item.seconds
        better = with_item > best[weight:]
        took[i, weight:] = better
        best[weight:] = np.where(better, with_item, best[weight:])
    j = cells
    for i in range(len(items) - 1, -1, -1):
        if took[i, j]:
            chosen.add((items[i].op, items[i].index))
            j -= weights[i]
    return frozenset(chosen)


class SavedCalls:
    """The decisions of a knapsack policy for one region run: save the k-th call of an operator when ``(op, k)``
    was chosen; the count restarts in every region (:meth:`fresh`) and is kept apart for the recompute."""

    def __init__(self, chosen: frozenset[tuple[Any, int]]) -> None:
        self.chosen = chosen
        self.calls: dict[bool, dict[Any, int]] = {False: defaultdict(int), True: defaultdict(int)}

    def fresh(self) -> SavedCalls:
        return SavedCalls(self.chosen)

    def recompute_started(self) -> None:
        self.calls[True].clear()

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        counts = self.calls[bool(getattr(ctx, "is_recompute", False))]
        index = counts[op]
        counts[op] += 1
        return (op, index) in self.chosen


def knapsack_policy(
    calls: Sequence[OpCall], capacity: int, *, name: str | None = None, register: bool = True
) -> policies.Policy:
    """A policy saving the calls :func:`choose` picks for ``capacity`` bytes, named ``knapsack@<capacity>``
    (registered unless ``register=False``)."""
    policy = policies.Policy(name or f"knapsack@{int(capacity)}", SavedCalls(choose(calls, int(capacity))))
    return policies.register(policy) if register else policy


class _Captured(Exception):
    pass


def first_block_call(
    model: nn.Module, batch: Batch, blocks: BlocksArg = None
) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """The chain's first block and its arguments in a forward of ``model`` on ``batch`` (stopped there), the
    main input a detached leaf that requires grad."""
    _, block = resolve_blocks(model, blocks)[0]
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def capture(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.append((args, kwargs))
        raise _Captured

    hook = block.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            if isinstance(batch, dict):
                model(**batch)
            else:
                model(*batch) if isinstance(batch, tuple | list) else model(batch)
    except _Captured:
        pass
    finally:
        hook.remove()
    if not seen:
        raise RuntimeError("the model's forward did not call its first block; check blocks= and the batch")
    args, kwargs = seen[0]
    slot = main_input_slot(args, kwargs)
    main = slot_value(args, kwargs, slot).detach().requires_grad_(True)
    args, kwargs = detached_from_step(*without_caches(*replace_slot(args, kwargs, slot, main)))
    return block, args, kwargs


def kept_for_backward(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes a plain forward of ``module`` leaves alive for its backward (its output included)."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    tracker = LiveTensorTracker(device)
    rng_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices, device_type=device.type), torch.enable_grad():
        with tracker:
            out = module(*args, **kwargs)
            tracker.mark("forward_end")
            del out
        tracker.close()
    return tracker.bytes_at("forward_end", exclude_survivors=False)


def register_for(
    model: nn.Module,
    batch: Batch,
    *,
    shares: Iterable[float] = (0.25, 0.5, 0.75),
    blocks: BlocksArg = None,
    repeats: int = 3,
) -> list[str]:
    """Register one knapsack policy per byte share of what the first block keeps for backward without
    checkpointing (its ``keep`` bytes), from a profile of its calls, and return their names, for
    ``remat.profile(..., policies=...)``."""
    block, args, kwargs = first_block_call(model, batch, blocks)
    calls = profile_ops(block, args, kwargs, repeats=repeats)
    keep = kept_for_backward(block, args, kwargs)
    names: list[str] = []
    for share in shares:
        if not 0 < share <= 1:
            raise ValueError(f"shares are fractions in (0, 1] of the bytes a block keeps for backward, got {share}")
        name = knapsack_policy(calls, int(share * keep)).name
        if name not in names:
            names.append(name)
    return names
