"""Rematerialization: getting an evicted cell back by replaying its record, evicted ancestors first.

:class:`Rematerializer` is the part of :class:`~remat.dynamic.dtr.runtime.DTRRuntime` that rebuilds
tensors. It walks the evicted ancestors without recursion (chains can be thousands of operators long),
keeps the parents of the operator being replayed resident while room is made for its outputs, replays
random operators with the RNG state they first ran with, and gives each rebuilt storage the layout the
original had, so the views autograd saved of it stay valid.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...checkpointing import Forked
from ...core import format_bytes
from .graph import CONST, FRESH, SCRATCH, SELF, ArgRef, Cell, Geometry, Record, Step, alias, geometry


def tensor_on(storage: torch.UntypedStorage, geom: Geometry) -> torch.Tensor:
    dtype, size, stride, offset = geom
    return torch.empty((0,), dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


def clone_storage(src: torch.Tensor, geom: Geometry) -> torch.Tensor:
    """A copy of ``src``'s whole storage, viewed with ``geom``."""
    old = src.untyped_storage()
    new = torch.empty(old.nbytes(), dtype=torch.uint8, device=src.device).untyped_storage()
    new.copy_(old)
    return tensor_on(new, geom)


def _conform(t: torch.Tensor, cell: Cell) -> torch.Tensor:
    """Copy a recomputed tensor into a storage laid out as the original was."""
    storage = torch.empty(cell.nbytes, dtype=torch.uint8, device=t.device).untyped_storage()
    out = tensor_on(storage, cell.canon)
    out.copy_(t)
    return out


def _run(step: Step, args: tuple, kwargs: dict) -> Any:
    if step.rng is None:
        return step.func(*args, **kwargs)
    with Forked(step.rng.devices, step.rng.device_type):
        step.rng.restore()
        gen = kwargs.get("generator")
        if gen is None or step.generator_state is None:
            return step.func(*args, **kwargs)
        before = gen.get_state()
        gen.set_state(step.generator_state)
        try:
            return step.func(*args, **kwargs)
        finally:
            gen.set_state(before)


class Rematerializer:
    """Mixin of :class:`DTRRuntime`; uses its ``storage_of``, ``make_room``, ``register`` and counters."""

    budget: int | None
    active: bool
    internal: int
    clock: int
    held: dict[int, Cell]
    stats: Any

    def materialize(self, target: Cell) -> torch.Tensor:
        """The contents of ``target``, recomputing it (and its evicted ancestors, parents first) if needed."""
        frames: list[list[Any]] = [[target, [], False]]  # cell, parents locked for it, parents visited
        while frames:
            frame = frames[-1]
            cell, locked = frame[0], frame[1]
            if cell.resident:
                frames.pop()
                if frames:  # keep it until the operator that needs it has run
                    cell.locks += 1
                    frames[-1][1].append(cell)
                continue
            rec = cell.record
            if cell.lost or rec is None or not rec.replayable:
                raise RuntimeError(
                    f"DTR cannot rematerialize a tensor of {format_bytes(cell.nbytes)}: its contents were "
                    "overwritten in place or released, and its operator cannot be replayed. Avoid in-place "
                    "updates of tensors that autograd saved, or run this step without DTR."
                )
            if not frame[2]:
                frame[2] = True
                for p in rec.parents():
                    if p.resident:
                        p.locks += 1
                        locked.append(p)
            missing = next((p for p in rec.parents() if not p.resident), None)
            if missing is not None:
                frames.append([missing, [], False])
                continue
            for p in rec.parents():  # a parent another frame rematerialized (and unlocked) is resident but unlocked
                if not any(p is q for q in locked):
                    p.locks += 1
                    locked.append(p)
            try:
                self._replay(rec)
            finally:
                for p in locked:
                    p.locks -= 1
                locked.clear()
            if not cell.resident:
                raise RuntimeError("DTR replayed an operator but did not get its tensor back")
        return self.storage_of(target)

    def _replay(self, rec: Record) -> None:
        self.internal += 1
        start = time.perf_counter()
        try:
            if self.budget is not None and self.active:
                in_bytes = sum(p.nbytes for p in rec.parents())
                func = rec.steps[0].func
                if in_bytes + rec.out_bytes > self.budget:
                    raise self.too_small(func, in_bytes, rec.out_bytes)
                self.make_room(rec.out_bytes, func)
            buffer: torch.Tensor | None = None
            outs: list[Any] = []
            with torch.no_grad():
                for index, step in enumerate(rec.steps):
                    values: list[Any] = []
                    for leaf in step.leaves:
                        if not isinstance(leaf, ArgRef):
                            values.append(leaf)
                        elif leaf.kind == CONST:
                            if leaf.tensor._version != leaf.version:
                                raise RuntimeError(
                                    "DTR cannot rematerialize a tensor: an input from outside the tracked "
                                    "region was modified in place after it was used. Avoid in-place updates "
                                    "of such tensors during the step."
                                )
                            values.append(leaf.tensor)
                        elif leaf.kind == SCRATCH:
                            values.append(leaf.tensor.clone())
                        elif leaf.kind == FRESH:
                            buffer = clone_storage(self.storage_of(leaf.cell), leaf.cell.canon)
                            values.append(alias(buffer, leaf.geom))
                        elif leaf.kind == SELF:
                            values.append(alias(buffer, leaf.geom))
                        else:
                            values.append(alias(self.storage_of(leaf.cell), leaf.geom))
                    args, kwargs = tree_unflatten(values, step.spec)
                    out = _run(step, args, kwargs)
                    if index == 0:
                        outs = tree_flatten(out)[0]
                        if buffer is None and len(rec.produces) == 1 and rec.produces[0][1] >= 0:
                            buffer = outs[rec.produces[0][1]]
            for ref, i in rec.produces:
                cell = ref()
                if cell is None or cell.resident:
                    continue
                t = buffer if i < 0 or len(rec.steps) > 1 else outs[i]
                if geometry(t) != cell.canon or t.untyped_storage().nbytes() != cell.nbytes:
                    t = _conform(t, cell)
                self._adopt(cell, t)
        finally:
            self.internal -= 1
            self.stats.recompute_s += time.perf_counter() - start

    def _adopt(self, cell: Cell, t: torch.Tensor) -> None:
        if cell.uf is not None:
            cell.uf.root().cost -= cell.cost
            cell.uf = None
        self.register(cell, t)
        cell.own = t
        cell.last_access = self.clock
        if self.active:
            self.held[cell.key] = cell
        self.stats.rematerializations += 1

    # provided by DTRRuntime
    def storage_of(self, cell: Cell) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def make_room(self, incoming: int, func: Any) -> None:  # pragma: no cover
        raise NotImplementedError

    def register(self, cell: Cell, t: torch.Tensor, pending: bool = False) -> None:  # pragma: no cover
        raise NotImplementedError

    def too_small(self, func: Any, in_bytes: int, out_bytes: int) -> Exception:  # pragma: no cover
        raise NotImplementedError
