"""The DTR runtime of one step: a ``TorchDispatchMode`` plus saved-tensor hooks, evicting under a byte budget.

Every operator run in the region passes through :meth:`DTRRuntime.__torch_dispatch__`. Each new storage an
operator creates gets a :class:`~remat.dynamic.dtr.graph.Cell`; its bytes are tracked until the storage
dies (gradients of parameters excepted: they outlive the step). Autograd saves :class:`Handle` s instead of
tensors (:meth:`pack`) and DTR holds the saved storage itself, so once user code drops the tensor DTR is
its only owner. Before an operator runs, the bytes it will create are predicted and resident cells are
evicted, smallest heuristic score first, until the budget holds. A cell is evicted only if DTR is the sole
owner of its storage — the storage's reference count tells: user code, autograd and views each hold one —
and it can be recomputed (:mod:`.evict`). :meth:`unpack` rebuilds evicted cells (:mod:`.remat`). Which
operators DTR may replay, and which of their arguments they write, is at the end of the module.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ...checkpointing import RngSnapshot
from ...core import format_bytes
from .evict import Evictor
from .graph import CELL, CONST, FRESH, SCRATCH, SELF, ArgRef, Cell, EqClass, Handle, Record, Step, alias, geometry
from .predict import LeafGradients, OutputPredictor
from .remat import Rematerializer, clone_storage, tensor_on

_KEY_ATTR = "_remat_dtr_key"
_KEYS = itertools.count(1)


@dataclass
class StepStats:
    """Figures of one step under DTR."""

    evictions: int = 0
    rematerializations: int = 0
    recompute_s: float = 0.0
    peak_tracked_bytes: int = 0
    over_budget_ops: int = 0
    ops: int = 0
    step_s: float = 0.0


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return getattr(t.untyped_storage(), _KEY_ATTR, None)
    except (RuntimeError, NotImplementedError):
        return None


class DTRRuntime(Evictor, Rematerializer, TorchDispatchMode):
    """Tracks, evicts and rematerializes the tensors of one step; with ``budget=None`` it only measures."""

    def __init__(
        self, budget: int | None, score: Any, *, strict: bool = False, record: bool = True,
        predictor: OutputPredictor | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.budget = budget
        self.score = score
        self.strict = strict
        self.record = record  # keep records to recompute from (off for a measuring-only step)
        self.active = True
        self.internal = 0  # > 0 while DTR runs its own operators: they pass through untracked
        self.clock = 0
        self.registry: dict[int, Cell] = {}  # storage key -> the cell of its current contents
        self.held: dict[int, Cell] = {}  # cells whose storage DTR holds a reference to
        self.tracked = 0
        self.stats = StepStats()
        self.on_backward_end: Any = None
        self._backward_seen = False
        self._finalizers: dict[int, weakref.finalize] = {}
        self._predictor = predictor if predictor is not None else OutputPredictor()
        self._leaf_grads = LeafGradients()
        self._t0 = time.perf_counter()

    # ----------------------------------------------------------------- operators of the program
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if self.internal or not self.active:
            return func(*args, **kwargs)
        self.clock += 1
        self.stats.ops += 1
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward and not self._backward_seen:
            self._backward_seen = True
            if self.on_backward_end is not None:
                torch.autograd.Variable._execution_engine.queue_callback(self.on_backward_end)
        leaves, spec = tree_flatten((args, kwargs))
        inputs: dict[int, Cell] = {}
        for x in leaves:
            if isinstance(x, torch.Tensor):
                cell = self.cell_of(x)
                if cell is not None:
                    cell.last_access = self.clock
                    inputs[id(cell)] = cell
        outs = self._predictor.new_outputs(func, args, kwargs, leaves)  # also in a measuring step: it learns
        if self.budget is not None:
            out_bytes = sum(n for _, _, n in outs)
            if in_backward:
                out_bytes -= self._leaf_grads.expected_bytes(outs)
            in_bytes = sum(c.nbytes for c in inputs.values() if not c.pending)
            if in_bytes + out_bytes > self.budget:
                raise self.too_small(func, in_bytes, out_bytes)
            self.make_room(out_bytes, func)
        scratch = scratch_arguments(func, args)
        written = [t for t in written_arguments(func, args, kwargs) if not any(t is u for u in scratch)]
        for t in written:  # contents that evicted tensors rely on must survive the write
            cell = self.cell_of(t)
            if cell is not None and cell.anchored:
                self._copy_on_write(cell)
        record = self.record and not (in_backward and not torch.is_grad_enabled())
        rng = gen_state = None
        if record and torch.Tag.nondeterministic_seeded in func.tags:
            rng = RngSnapshot.take(*[x for x in leaves if isinstance(x, torch.Tensor)])
            gen = kwargs.get("generator")
            gen_state = gen.get_state() if gen is not None else None
        start = time.perf_counter()
        out = func(*args, **kwargs)
        cost = time.perf_counter() - start
        self._predictor.observe(out, leaves)
        self.internal += 1
        try:
            step = Step(func, spec, [], rng, gen_state)
            self._track(func, leaves, out, written, scratch, step, cost, record, in_backward)
        finally:
            self.internal -= 1
        if self.budget is not None and self.tracked > self.budget:
            before = self.stats.over_budget_ops
            self.make_room(0, func)
            if self.stats.over_budget_ops == before:  # made room after the fact: the op itself went over
                self.stats.over_budget_ops += 1
        return out

    def _track(
        self, func: Any, leaves: list, out: Any, written: list[torch.Tensor], scratch: list[torch.Tensor],
        step: Step, cost: float, record: bool, in_backward: bool,
    ) -> None:  # fmt: skip
        in_storages = set()
        for x in leaves:
            if isinstance(x, torch.Tensor):
                with contextlib.suppress(RuntimeError, NotImplementedError):
                    in_storages.add(x.untyped_storage()._cdata)
        new: list[tuple[int, torch.Tensor]] = []
        for i, o in enumerate(tree_flatten(out)[0]):
            if not isinstance(o, torch.Tensor) or o.layout != torch.strided or o.device.type == "meta":
                continue
            try:
                st = o.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if st.nbytes() and st._cdata not in in_storages and getattr(st, _KEY_ATTR, None) not in self.registry:
                in_storages.add(st._cdata)  # outputs that are views of one new storage: one cell, counted once
                new.append((i, o))
        written_cells = [c for c in (self.cell_of(t) for t in written) if c is not None]
        if not new and not written_cells:
            return
        if not record:  # accounting only (backward, measuring step): nothing will be recomputed
            for cell in written_cells:
                if cell.record is not None:
                    self._new_version(cell, None, cost)
            for _, o in new:
                pending = in_backward and self._leaf_grads.claim(o)
                self.register(Cell(0, o.untyped_storage().nbytes(), geometry(o), None, cost), o, pending)
            return
        replayable = is_replayable(func)
        if len(written_cells) != len(written):  # writes into tensors from outside the region
            replayable = False
        if len(written_cells) == 1 and not new:
            self._rewrite(written_cells[0], written[0], leaves, step, cost, replayable)
            return
        for cell in written_cells:  # rare: several tracked writes, or writes plus new outputs
            self._new_version(cell, None, cost)
            replayable = False
        step.leaves = self._refs(leaves, None, None, scratch)
        rec = Record([step], replayable, sum(o.untyped_storage().nbytes() for _, o in new))
        for i, o in new:
            cell = Cell(0, o.untyped_storage().nbytes(), geometry(o), rec, cost)
            cell.last_access = self.clock
            rec.produces.append((weakref.ref(cell), i))
            self.register(cell, o)
            for parent in rec.parents():
                parent.children.append(weakref.ref(cell))
                parent.prune_children()

    def _rewrite(
        self, cell: Cell, target: torch.Tensor, leaves: list, step: Step, cost: float, replayable: bool
    ) -> None:
        """An in-place operator on a tracked storage: extend the cell's record while nothing has read the
        old contents, otherwise the storage's contents become a new cell computed from a copy of the old."""
        rec = cell.record
        if (
            replayable and rec is not None and rec.replayable and len(rec.produces) == 1
            and rec.produces[0][0]() is cell and not cell.handles
            and not any(r() is not None for r in cell.children)
        ):  # fmt: skip
            step.leaves = self._refs(leaves, cell.key, None)
            rec.steps.append(step)
            cell.cost += cost
            cell.last_access = self.clock
            for parent in rec.parents():
                if not any(r() is cell for r in parent.children):
                    parent.children.append(weakref.ref(cell))
            return
        step.leaves = self._refs(leaves, None, target)
        self._new_version(cell, Record([step], replayable, cell.nbytes), cost)

    def _new_version(self, cell: Cell, rec: Record | None, cost: float) -> Cell:
        fresh = Cell(cell.key, cell.nbytes, cell.canon, rec, cost)
        fresh.last_access = self.clock
        fresh.pending = cell.pending
        if rec is not None:
            rec.produces.append((weakref.ref(fresh), -1))
            for parent in rec.parents():
                parent.children.append(weakref.ref(fresh))
        if self.held.get(cell.key) is cell:  # the program holds the storage it writes; DTR lets go
            del self.held[cell.key]
        self.registry[cell.key] = fresh
        self._gone(cell)
        return fresh

    def _refs(
        self, leaves: list, self_key: int | None, fresh: torch.Tensor | None, scratch: list[torch.Tensor] = ()
    ) -> list:  # fmt: skip
        refs: list[Any] = []
        for x in leaves:
            if not isinstance(x, torch.Tensor):
                refs.append(x)
                continue
            cell = self.cell_of(x)
            if any(x is t for t in scratch):
                refs.append(ArgRef(SCRATCH, None, x, None))
            elif cell is None:
                refs.append(ArgRef(CONST, None, x, None))
            elif x is fresh:
                refs.append(ArgRef(FRESH, cell, None, geometry(x)))
                fresh = None
            elif cell.key == self_key:  # no reference to the cell itself: records must not form cycles
                refs.append(ArgRef(SELF, None, None, geometry(x)))
            else:
                refs.append(ArgRef(CELL, cell, None, geometry(x)))
        return refs

    # ----------------------------------------------------------------- bookkeeping of storages
    def cell_of(self, t: torch.Tensor) -> Cell | None:
        key = _storage_key(t)
        return self.registry.get(key) if key is not None else None

    def register(self, cell: Cell, t: torch.Tensor, pending: bool = False) -> None:
        st = t.untyped_storage()
        key = next(_KEYS)
        setattr(st, _KEY_ATTR, key)
        cell.key = key
        cell.resident = True
        cell.pending = pending
        if not self.active:
            return
        self.registry[key] = cell
        if not pending:
            self.tracked += cell.nbytes
            self.stats.peak_tracked_bytes = max(self.stats.peak_tracked_bytes, self.tracked)
        self._finalizers[key] = weakref.finalize(st, self._on_free, key)

    def _on_free(self, key: int) -> None:
        self._finalizers.pop(key, None)
        cell = self.registry.pop(key, None)
        if cell is None:
            return
        if not cell.pending:
            self.tracked -= cell.nbytes
        if self.held.get(key) is cell:
            del self.held[key]
        self._gone(cell)

    def _gone(self, cell: Cell) -> None:
        """``cell``'s contents no longer exist: evicted, freed, or overwritten."""
        cell.resident = False
        cell.own = None
        if cell.record is None or not cell.record.replayable:
            cell.lost = True
            return
        cell.uf = EqClass(cell.cost)
        for n in cell.evicted_neighbours():
            if n is not cell and n.uf is not None:
                cell.uf.union(n.uf)

    def storage_of(self, cell: Cell) -> torch.Tensor:
        """A tensor with the cell's canonical geometry on its (resident) storage."""
        if cell.own is not None:
            return cell.own
        fin = self._finalizers.get(cell.key)
        alive = fin.peek() if fin is not None else None
        if alive is None:
            raise RuntimeError(f"DTR lost track of a resident tensor of {format_bytes(cell.nbytes)}")
        self.internal += 1
        try:
            return tensor_on(alive[0], cell.canon)
        finally:
            self.internal -= 1

    def hold(self, cell: Cell) -> None:
        if cell.own is None:
            cell.own = self.storage_of(cell)
        if cell.key in self.registry:
            self.held[cell.key] = cell

    def release(self, cell: Cell) -> None:
        """The last autograd handle of ``cell`` died: DTR stops holding its storage."""
        if cell.anchored or cell.own is None:
            return
        if self.held.get(cell.key) is cell:
            del self.held[cell.key]
        cell.own = None

    def grad_landed(self, param: torch.Tensor) -> None:
        """A parameter gradient outlives the step: it is not activation memory, stop counting it."""
        key = _storage_key(param.grad) if param.grad is not None else None
        cell = self.registry.pop(key, None) if key is not None else None
        if cell is None:
            return
        if not cell.pending:
            self.tracked -= cell.nbytes
        self.held.pop(key, None)
        fin = self._finalizers.pop(key, None)
        if fin is not None:
            fin.detach()

    # ----------------------------------------------------------------- copy on write
    def _copy_on_write(self, cell: Cell) -> None:
        """An anchored cell is about to be overwritten in place: move its contents to a private copy, and give
        the storage being written a new cell that cannot be recomputed."""
        self.internal += 1
        try:
            key = cell.key
            copy = clone_storage(self.storage_of(cell), cell.canon)
            placeholder = Cell(key, cell.nbytes, cell.canon, None, cell.cost)
            placeholder.last_access = self.clock
            self.registry[key] = placeholder
            self.held.pop(key, None)
            self.register(cell, copy)
            cell.own = copy
            self.held[cell.key] = cell
        finally:
            self.internal -= 1

    # ----------------------------------------------------------------- autograd hooks
    def pack(self, t: torch.Tensor) -> Any:
        if self.internal or not self.active:
            return t
        cell = self.cell_of(t)
        if cell is None:
            return t
        cell.last_access = self.clock
        self.internal += 1
        try:
            if cell.own is None:
                cell.own = alias(t, cell.canon)
            self.held[cell.key] = cell
            return Handle(cell, geometry(t), self.release)
        finally:
            self.internal -= 1

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, Handle):
            return packed
        base = self.materialize(packed.cell)
        packed.cell.last_access = self.clock
        self.internal += 1
        try:
            return alias(base, packed.geom)
        finally:
            self.internal -= 1

    # ----------------------------------------------------------------- end of step
    def close(self) -> StepStats:
        """Stop tracking. Tensors still resident are held so that a retained graph can still use them."""
        if not self.active:
            return self.stats
        for cell in list(self.registry.values()):
            if cell.own is None and (cell.handles or cell.children):
                self.hold(cell)
        self.active = False
        for fin in self._finalizers.values():
            fin.detach()
        self._finalizers.clear()
        self.registry.clear()
        self.held.clear()
        self._leaf_grads.clear()
        self.stats.step_s = time.perf_counter() - self._t0
        return self.stats


# ----------------------------------------------------------------------------------------------------
# Which operators DTR may replay, and which of their arguments they write.


_REPLAY_NAMESPACES = frozenset({"aten", "prims"})


# Operators that change a tensor's storage or have effects beyond their outputs: never replayed.
_NO_REPLAY = frozenset({"set_", "resize_", "resize_as_", "_resize_output_", "record_stream", "_assert_async"})


# Batch norm in training updates the running statistics (arguments 3 and 4) in place, declared in its schema
# or not; its outputs do not depend on them, so a replay runs on copies and updates them only once.
_BATCH_NORMS = frozenset(
    {"native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update", "cudnn_batch_norm",
     "miopen_batch_norm"}
)  # fmt: skip


_WRITES: dict[Any, list[tuple[int, str, bool]]] = {}  # operator -> its arguments declared as written


def is_replayable(func: Any) -> bool:
    """Whether DTR may replay ``func`` to rebuild its outputs."""
    return func.namespace in _REPLAY_NAMESPACES and func._opname not in _NO_REPLAY


def written_arguments(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes in place, as its schema declares them."""
    spots = _WRITES.get(func)
    if spots is None:
        spots = [
            (i, a.name, a.kwarg_only)
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        ]
        _WRITES[func] = spots
    found: list[torch.Tensor] = []
    for i, name, kwarg_only in spots:
        value = kwargs.get(name) if kwarg_only or i >= len(args) else args[i]
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                found.append(t)
    return found


def scratch_arguments(func: Any, args: tuple) -> list[torch.Tensor]:
    """The running statistics a batch norm in training updates in place (empty for other operators)."""
    if func._opname not in _BATCH_NORMS or len(args) < 5:
        return []
    if func._opname != "_batch_norm_with_update" and not (len(args) > 5 and args[5] is True):
        return []
    return [t for t in args[3:5] if isinstance(t, torch.Tensor)]
