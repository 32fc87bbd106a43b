"""Applying a Plan to a live model: hooks installed once, actions switched between steps cheaply.

``apply(model, plan)`` registers a forward pre-hook and a forward hook on every block of the chain. At each
forward the hooks read the current plan's units and open/close the matching region around the blocks:

* ``checkpoint`` and ``selective:<policy>``: a non-reentrant checkpoint frame around the block (the same
  machinery as ``torch.utils.checkpoint``, opened by hooks as in ``torch.distributed``'s composable
  checkpoint), with a per-op policy for selective;
* ``segment`` groups: one frame opened before the first block and closed after the last, recomputed in
  backward by re-running the blocks in order from the segment's input;
* ``nested`` groups (memory-poor): one frame per block whose recomputation re-derives the block's input from
  the group's input without storing anything;
* ``offload``: ``torch.autograd.graph.save_on_cpu`` around the block.

Nothing is re-wrapped when the plan changes (``handle.set_plan``), and ``handle.remove()`` removes the hooks,
leaving the model exactly as it was. ``handle.stats`` counts block re-executions and recompute seconds.
Every recomputation restores the RNG state the block saw in forward, so dropout replays exactly.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator, noop_context_fn

from . import applied, policies
from .chain import find_blocks, only_chain
from .costs import CHECKPOINT, KEEP, OFFLOAD, SELECTIVE_PREFIX
from .hf_guards import refuse_hf_checkpointing, training_forward_guards
from .model_state import extra_run
from .rng import RngSnapshot, forked
from .simulator import Plan, Unit

_GENERATOR_HAS_EARLY_STOP = "early_stop" in inspect.signature(_checkpoint_without_reentrant_generator).parameters

OutputObserver = Callable[[int, torch.Tensor, bool], None]

_GLOBAL = threading.local()


@contextmanager
def suspend_all() -> Iterator[None]:
    """Within this context every applied plan is ignored in this thread (blocks run as without remat)."""
    _GLOBAL.suspended = getattr(_GLOBAL, "suspended", 0) + 1
    try:
        yield
    finally:
        _GLOBAL.suspended -= 1


def main_tensor(value: Any) -> torch.Tensor | None:
    """The hidden-state tensor of a block's output: the tensor itself, or the first tensor inside it."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    elif hasattr(value, "__dataclass_fields__"):
        value = [getattr(value, f) for f in value.__dataclass_fields__]
    if isinstance(value, list | tuple):
        for item in value:
            found = main_tensor(item)
            if found is not None:
                return found
    return None


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook``, never traced by ``torch.compile`` (as FSDP2 does with its hooks): with compiled blocks
    (``block.compile()``) the checkpoint regions open and close in eager code around the compiled forward."""
    return torch.compiler.disable(hook)


def _same_tensor(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether ``a`` is ``b``, or ``b`` passed through an identity autograd function (a new tensor object on the
    same memory, as FSDP2's pre-forward hook makes of every block input): what segments need to hold."""
    if a is b:
        return True
    if b is None or a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype:
        return False
    return a.data_ptr() == b.data_ptr() and a.device == b.device


def without_caches(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A block's arguments with key/value caches (Hugging Face ``*Cache`` objects) replaced by ``None``.

    A block run again (recomputation, isolated measurement) must not append to the step's cache. In training
    the cache starts empty each forward, so a layer attends to exactly its current keys with or without it.
    """

    def drop(value: Any) -> Any:
        return None if type(value).__name__.endswith("Cache") else value

    return tuple(drop(v) for v in args), {k: drop(v) for k, v in kwargs.items()}


def _main_input_slot(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Any]:
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return "arg", i
    if "hidden_states" in kwargs:
        return "kw", "hidden_states"
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            return "kw", k
    raise RuntimeError("a block was called without any tensor argument; remat cannot find its input")


def _get_slot(args: tuple[Any, ...], kwargs: dict[str, Any], slot: tuple[str, Any]) -> Any:
    return args[slot[1]] if slot[0] == "arg" else kwargs[slot[1]]


def _with_slot(args: tuple[Any, ...], kwargs: dict[str, Any], slot: tuple[str, Any], value: Any):
    if slot[0] == "arg":
        args = args[: slot[1]] + (value,) + args[slot[1] + 1 :]
    else:
        kwargs = {**kwargs, slot[1]: value}
    return args, kwargs


@dataclass
class RecomputeStats:
    """Block re-executions in backward and the seconds they took, per block FQN."""

    fqns: list[str]
    calls: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls = {f: 0 for f in self.fqns}
        self.seconds = {f: 0.0 for f in self.fqns}

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())


@dataclass
class _CallRecord:
    """What a block was called with in forward, without its main input (which must not be kept alive)."""

    index: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    slot: tuple[str, Any]
    requires_grad: bool
    rng: RngSnapshot


@dataclass
class _OpenRegion:
    unit: Unit
    generator: Any = None
    context: Any = None
    records: list[_CallRecord] = field(default_factory=list)
    last_output: torch.Tensor | None = None
    group_input: torch.Tensor | None = None


class RematHandle:
    """The live application of a plan to a model. Create it with :func:`apply`."""

    def __init__(
        self,
        model: nn.Module,
        blocks: list[tuple[str, nn.Module]],
        plan: Plan,
        *,
        time_recompute: bool = True,
    ) -> None:
        self.model = model
        self.blocks = blocks
        self.fqns = [fqn for fqn, _ in blocks]
        self.stats = RecomputeStats(self.fqns)
        self.time_recompute = time_recompute
        self._observers: list[OutputObserver] = []
        self._local = threading.local()
        self._open: dict[int, _OpenRegion] = {}
        self._hooks: list[Any] = []
        self._removed = False
        self._nested: dict[str, Any] | None = None
        self.set_plan(plan)
        for i, (_, module) in enumerate(blocks):
            pre_hook = applied.CopyRefusingHook(self._make_pre_hook(i))
            post_hook = applied.CopyRefusingHook(self._make_post_hook(i))
            self._hooks.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            self._hooks.append(module.register_forward_hook(post_hook, with_kwargs=True, always_call=True))

    # ----- plan -----
    def set_plan(self, plan: Plan) -> None:
        """Switch to ``plan`` from the next forward on; no hooks are added or removed."""
        if list(plan.actions) != self.fqns:
            unknown = [f for f in plan.actions if f not in self.fqns]
            missing = [f for f in self.fqns if f not in plan.actions]
            if unknown:
                raise ValueError(
                    f"plan names blocks not in the model's chain: {unknown}; the chain is {self.fqns}"
                )
            raise ValueError(f"plan must give an action for every block in chain order; missing {missing}")
        units = plan.units()
        for unit in units:
            if unit.kind == "single" and unit.action.startswith(SELECTIVE_PREFIX):
                policies.get(unit.action[len(SELECTIVE_PREFIX) :])
        self.plan = plan
        self._unit_of = [None] * len(self.fqns)
        for unit in units:
            for i in range(unit.start, unit.end + 1):
                self._unit_of[i] = unit

    @property
    def mask(self) -> dict[str, bool]:
        """Block FQN -> True where the block runs with its activations stored."""
        return {f: a == KEEP for f, a in self.plan.actions.items()}

    def add_output_observer(self, observer: OutputObserver) -> Callable[[], None]:
        """Call ``observer(block_index, output, recomputed)`` with each block's output, in forward and in
        recomputation. Returns a function that removes the observer."""
        self._observers.append(observer)
        return lambda: self._observers.remove(observer)

    # ----- lifecycle -----
    def remove(self) -> None:
        """Remove every hook; the model behaves and serialises exactly as before ``apply``."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._open.clear()
        self._removed = True
        applied.unregister(self.model, self)
        if getattr(self.model, "_remat_handle", None) is self:
            del self.model._remat_handle

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Run the model with every block kept, e.g. for measurement."""
        self._local.suspended = getattr(self._local, "suspended", 0) + 1
        try:
            yield
        finally:
            self._local.suspended -= 1

    # ----- hooks -----
    def _inactive(self) -> bool:
        return (
            getattr(self._local, "recomputing", 0) > 0
            or getattr(self._local, "suspended", 0) > 0
            or getattr(_GLOBAL, "suspended", 0) > 0
            or not torch.is_grad_enabled()
        )

    @contextmanager
    def _recomputing(self) -> Iterator[None]:
        self._local.recomputing = getattr(self._local, "recomputing", 0) + 1
        try:
            yield
        finally:
            self._local.recomputing -= 1

    def _make_pre_hook(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._inactive():
                return
            unit = self._unit_of[i]
            if unit.kind == "single":
                self._open_single(i, unit, module, args, kwargs)
            elif unit.kind == "segment":
                self._enter_segment_block(i, unit, args, kwargs)
            else:
                self._enter_nested_block(i, unit, args, kwargs)

        return _eager(hook)

    def _make_post_hook(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if self._inactive():
                return
            unit = self._unit_of[i]
            key = unit.start if unit.kind == "segment" else i
            region = self._open.get(key)
            out = main_tensor(output)
            if region is not None:
                region.last_output = out
                if unit.kind == "nested" and self._nested is not None:
                    self._nested["last"] = out
                if unit.kind != "segment" or i == unit.end:
                    self._close(key)
            if out is not None and torch.is_grad_enabled():
                for observer in self._observers:
                    observer(i, out, False)

        return _eager(hook)

    def _close(self, key: int) -> None:
        region = self._open.pop(key)
        if region.context is not None:
            region.context.__exit__(None, None, None)
        if region.generator is not None:
            try:
                next(region.generator)
            except StopIteration:
                pass
            else:
                raise RuntimeError("internal error: a checkpoint region did not close")
        if region.unit.kind == "nested" and key == region.unit.end:
            self._nested = None

    def _start_generator(self, recompute: Callable[..., None], context_fn: Callable[[], Any], *args: Any):
        head = (recompute, False, context_fn, "default", False)
        if _GENERATOR_HAS_EARLY_STOP:
            head = (*head, True)
        gen = _checkpoint_without_reentrant_generator(*head, *args)
        next(gen)
        return gen

    def _record(self, i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[_CallRecord, Any]:
        slot = _main_input_slot(args, kwargs)
        main = _get_slot(args, kwargs, slot)
        stripped_args, stripped_kwargs = without_caches(*_with_slot(args, kwargs, slot, None))
        rng = RngSnapshot.take(main)
        return _CallRecord(i, stripped_args, stripped_kwargs, slot, main.requires_grad, rng), main

    def _run_block(self, record: _CallRecord, main: torch.Tensor, timed: bool) -> torch.Tensor | None:
        """Re-run one block in recomputation, from ``main`` and the recorded other arguments."""
        _, module = self.blocks[record.index]
        args, kwargs = _with_slot(record.args, record.kwargs, record.slot, main)
        fqn = self.fqns[record.index]
        sync = timed and self.time_recompute and main.is_cuda
        if sync:
            torch.cuda.synchronize(main.device)
        start = time.perf_counter()
        self.stats.calls[fqn] += 1
        try:
            record.rng.restore()
            with extra_run(module):
                out = main_tensor(module(*args, **kwargs))
        finally:
            if sync:
                torch.cuda.synchronize(main.device)
            if timed and self.time_recompute:
                self.stats.seconds[fqn] += time.perf_counter() - start
        if out is not None:
            for observer in self._observers:
                observer(record.index, out, True)
        return out

    def _open_single(
        self, i: int, unit: Unit, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        action = unit.action
        if action == KEEP:
            return
        region = _OpenRegion(unit)
        if action == OFFLOAD:
            region.context = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
            region.context.__enter__()
            self._open[i] = region
            return
        record, main = self._record(i, args, kwargs)
        context_fn = noop_context_fn
        if action.startswith(SELECTIVE_PREFIX):
            context_fn = policies.get(action[len(SELECTIVE_PREFIX) :]).context_fn
        elif action != CHECKPOINT:
            raise ValueError(f"unknown action {action!r} for block {self.fqns[i]!r}")

        def recompute(saved_main: torch.Tensor) -> None:
            with self._recomputing(), forked(record.rng.devices, record.rng.device_type):
                self._run_block(record, saved_main, timed=True)

        region.records.append(record)
        self._open[i] = region
        region.generator = self._start_generator(recompute, context_fn, main)

    def _enter_segment_block(self, i: int, unit: Unit, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        record, main = self._record(i, args, kwargs)
        if i == unit.start:
            region = _OpenRegion(unit)
            records = region.records

            def recompute(saved_main: torch.Tensor) -> None:
                with self._recomputing(), forked(records[0].rng.devices, records[0].rng.device_type):
                    current = saved_main
                    for rec in records:
                        current = self._run_block(rec, current, timed=True)

            records.append(record)
            self._open[i] = region
            region.generator = self._start_generator(recompute, noop_context_fn, main)
            return
        region = self._open.get(unit.start)
        if region is None:
            raise RuntimeError(
                f"block {self.fqns[i]!r} ran without the start of its segment {self.fqns[unit.start]!r}; "
                "segments need their blocks called in chain order within one forward"
            )
        if not _same_tensor(main, region.last_output):
            raise RuntimeError(
                f"blocks {self.fqns[i - 1]!r} and {self.fqns[i]!r} cannot share a segment: the model changes "
                "the output of the first before passing it to the second. Checkpoint them separately "
                "(action 'checkpoint') instead."
            )
        region.records.append(record)

    def _enter_nested_block(self, i: int, unit: Unit, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        record, main = self._record(i, args, kwargs)
        if i == unit.start:
            self._nested = {"input": main, "records": [], "last": None}
        group = self._nested
        if group is None or (i > unit.start and not _same_tensor(main, group["last"])):
            raise RuntimeError(
                f"block {self.fqns[i]!r} of a memory-poor group did not receive the previous block's output; "
                "memory-poor groups need blocks called in chain order, each on the previous output"
            )
        previous = list(group["records"])
        group["records"].append(record)
        region = _OpenRegion(unit, records=[record])

        def recompute(group_input: torch.Tensor) -> None:
            with self._recomputing(), forked(record.rng.devices, record.rng.device_type):
                current = group_input
                with torch.no_grad():
                    for rec in previous:
                        current = self._run_block(rec, current, timed=True)
                current = current.detach().requires_grad_(record.requires_grad)
                self._run_block(record, current, timed=True)

        self._open[i] = region
        region.generator = self._start_generator(recompute, noop_context_fn, group["input"])


def _resolve_blocks(
    model: nn.Module, blocks: Sequence[str] | Sequence[tuple[str, nn.Module]] | None
) -> list[tuple[str, nn.Module]]:
    if blocks is None:
        return only_chain(model)
    blocks = list(blocks)
    if blocks and isinstance(blocks[0], str):
        return find_blocks(model, names=blocks)  # type: ignore[arg-type]
    return [(str(f), m) for f, m in blocks]  # type: ignore[misc]


def apply(
    model: nn.Module,
    plan: Plan,
    blocks: Sequence[str] | Sequence[tuple[str, nn.Module]] | None = None,
    *,
    time_recompute: bool = True,
) -> RematHandle:
    """Install ``plan`` on ``model`` and return the handle (``set_plan``, ``remove``, ``stats``)."""
    applied.refuse_overlap(model)
    refuse_hf_checkpointing(model)
    chain = _resolve_blocks(model, blocks)
    handle = RematHandle(model, chain, plan, time_recompute=time_recompute)
    handle._hooks += training_forward_guards(model, wrap=applied.CopyRefusingHook)
    applied.register(model, handle)
    model._remat_handle = handle  # type: ignore[assignment]
    return handle
