"""The tensor graph that DTR keeps during a step: cells, the records that produce them, and eviction scores.

* A :class:`Cell` stands for the contents of one storage at one version: the bytes it occupies, the
  record that computes it, whether it is resident, who holds it. An in-place operator on a storage either
  extends the record of its cell (when nothing has read the old contents yet) or starts a new cell, so a
  record always describes the contents its cell had.
* A :class:`Record` is a short program of operator calls (:class:`Step`) whose arguments are constants
  (tensors from outside the tracked region, kept with their version), views of parent cells, or views of
  the storage being rebuilt. Random operators keep the RNG state they ran with.
* A :class:`Handle` is what autograd saves instead of a tensor: a cell and the view geometry.
* :class:`EqClass` is the union-find of evicted cells used by the ``dtr`` heuristic (the paper's
  DTR-EqClass approximation of the evicted neighbourhood), and ``HEURISTICS`` are the eviction scores:
  the cell with the smallest score is evicted first.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

Geometry = tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]

CONST, CELL, SELF, FRESH, SCRATCH = range(5)  # kinds of record arguments, see ArgRef


def geometry(t: torch.Tensor) -> Geometry:
    return (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())


def alias(src: torch.Tensor, geom: Geometry) -> torch.Tensor:
    """A tensor without autograd history that views ``src``'s storage with geometry ``geom``."""
    with torch.no_grad():
        base = src.detach()
        if geometry(base) == geom:
            return base
        # Not ``as_strided``: a view would keep a second reference to the storage through its base.
        dtype, size, stride, offset = geom
        return torch.empty((0,), dtype=dtype, device=base.device).set_(base.untyped_storage(), offset, size, stride)


def storage_refs(t: torch.Tensor) -> int:
    """How many tensors (and storage objects) reference ``t``'s storage, not counting this query."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1


class EqClass:
    """Union-find node over evicted cells; ``cost`` is the recompute seconds of the class's members."""

    __slots__ = ("parent", "cost")

    def __init__(self, cost: float) -> None:
        self.parent: EqClass | None = None
        self.cost = cost

    def root(self) -> EqClass:
        node = self
        while node.parent is not None:
            node = node.parent
        walk = self
        while walk.parent is not None and walk.parent is not node:
            walk.parent, walk = node, walk.parent
        return node

    def union(self, other: EqClass) -> EqClass:
        a, b = self.root(), other.root()
        if a is b:
            return a
        b.parent = a
        a.cost += b.cost
        return a


class ArgRef:
    """One tensor argument of a :class:`Step`: ``CONST`` (a tensor from outside the region, with the version
    it had), ``CELL`` (a view of a parent cell), ``SELF`` (a view of the storage the record rebuilds),
    ``FRESH`` (a private copy of a parent cell that becomes the rebuilt storage: in-place operators) or
    ``SCRATCH`` (a tensor the operator updates as a side effect, such as batch-norm running statistics:
    a replay gets a throw-away copy so the real one is updated once)."""

    __slots__ = ("kind", "cell", "tensor", "geom", "version")

    def __init__(self, kind: int, cell: Cell | None, tensor: torch.Tensor | None, geom: Geometry | None):
        self.kind = kind
        self.cell = cell
        self.tensor = tensor
        self.geom = geom
        self.version = tensor._version if tensor is not None else 0


@dataclass(eq=False)
class Step:
    func: Any  # an OpOverload
    spec: Any  # pytree spec of (args, kwargs)
    leaves: list[Any]  # flattened (args, kwargs); tensors replaced by ArgRef
    rng: Any = None  # RngSnapshot of a random operator
    generator_state: torch.Tensor | None = None


class Record:
    """How to compute the cells it produces. ``produces`` holds weak references: (cell, output index) for
    outputs of the first step, (cell, -1) for the rebuilt storage of an in-place program."""

    __slots__ = ("steps", "produces", "replayable", "out_bytes")

    def __init__(self, steps: list[Step], replayable: bool, out_bytes: int) -> None:
        self.steps = steps
        self.produces: list[tuple[weakref.ref[Cell], int]] = []
        self.replayable = replayable
        self.out_bytes = out_bytes  # bytes of the new storages a replay creates

    def parents(self) -> Iterator[Cell]:
        seen: set[int] = set()
        for step in self.steps:
            for leaf in step.leaves:
                if isinstance(leaf, ArgRef) and leaf.cell is not None and id(leaf.cell) not in seen:
                    seen.add(id(leaf.cell))
                    yield leaf.cell

    def consts(self) -> Iterator[ArgRef]:
        for step in self.steps:
            for leaf in step.leaves:
                if isinstance(leaf, ArgRef) and leaf.kind == CONST:
                    yield leaf


class Cell:
    """The contents of one storage at one version."""

    __slots__ = (
        "key", "nbytes", "canon", "record", "cost", "resident", "own", "handles", "locks", "last_access",
        "children", "uf", "secure", "lost", "anchored", "pending", "__weakref__",
    )  # fmt: skip

    def __init__(self, key: int, nbytes: int, canon: Geometry, record: Record | None, cost: float) -> None:
        self.key = key
        self.nbytes = nbytes
        self.canon = canon  # geometry of the tensor that defines the storage
        self.record = record
        self.cost = cost  # seconds to run the record
        self.resident = True
        self.own: torch.Tensor | None = None  # DTR's own reference to the storage, when it holds one
        self.handles = 0  # live autograd handles
        self.locks = 0  # > 0 while an operator that reads it is being prepared
        self.last_access = 0
        self.children: list[weakref.ref[Cell]] = []
        self.uf: EqClass | None = None  # set while not resident
        self.secure = False  # can be recomputed whatever happens to other tensors (memoized)
        self.lost = False  # can never be recomputed again
        self.anchored = False  # kept resident by DTR because evicted descendants need it
        self.pending = False  # a parameter gradient in the making: not activation memory, not counted

    def evicted_neighbours(self) -> Iterator[Cell]:
        if self.record is not None:
            for p in self.record.parents():
                if not p.resident and p.uf is not None:
                    yield p
        for ref in self.children:
            c = ref()
            if c is not None and not c.resident and c.uf is not None:
                yield c

    def prune_children(self) -> None:
        if len(self.children) > 32:
            self.children = [r for r in self.children if r() is not None]


class Handle:
    """What autograd saves for a tracked tensor: the cell and the geometry of the saved view."""

    __slots__ = ("cell", "geom", "on_release")

    def __init__(self, cell: Cell, geom: Geometry, on_release: Callable[[Cell], None]) -> None:
        self.cell = cell
        self.geom = geom
        self.on_release = on_release
        cell.handles += 1

    def __del__(self) -> None:
        cell = self.cell
        cell.handles -= 1
        if cell.handles == 0:
            with contextlib.suppress(Exception):  # a finalizer must not raise (e.g. at interpreter exit)
                self.on_release(cell)


# Eviction scores: the resident evictable cell with the smallest score is evicted first.
def _dtr_eq(cell: Cell, clock: int) -> float:
    roots = {id(r): r for r in (n.uf.root() for n in cell.evicted_neighbours() if n.uf is not None)}
    cost = cell.cost + sum(r.cost for r in roots.values())
    return cost / (cell.nbytes * (clock - cell.last_access + 1))


def _dtr_local(cell: Cell, clock: int) -> float:
    return cell.cost / (cell.nbytes * (clock - cell.last_access + 1))


def _lru(cell: Cell, clock: int) -> float:
    return -float(clock - cell.last_access)


def _size(cell: Cell, clock: int) -> float:
    return -float(cell.nbytes) - (1.0 - 1.0 / (clock - cell.last_access + 2))


HEURISTICS: dict[str, Callable[[Cell, int], float]] = {
    "dtr": _dtr_eq,
    "dtr_local": _dtr_local,
    "lru": _lru,
    "size": _size,
}
