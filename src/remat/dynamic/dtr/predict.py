"""What an operator is about to allocate, known before it runs, so DTR can make room first.

* :class:`OutputPredictor`: the new storages an operator will create (shape, dtype, bytes), from a run on
  the ``meta`` device, cached per argument shapes. Outputs that alias inputs are not new. An operator whose
  meta kernel fails (``_grouped_mm`` accepts only bf16 there, data-dependent shapes) is learned instead: what
  it created the first time it ran with those argument shapes is what it is predicted to create next time.
* :class:`LeafGradients`: which outputs of the backward pass are gradients of leaves (parameters), which
  outlive the step and so are not activation memory: every output of an ``AccumulateGrad`` node, and the
  outputs of the running node whose shape (up to size-1 dimensions) and dtype match a leaf it feeds
  directly, or whose size and dtype match a leaf it feeds through view nodes (each leaf once).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

OutSpec = tuple[tuple[int, ...], torch.dtype, int]  # shape, dtype, bytes of a new storage
_CACHE_LIMIT = 8192
_VIEW_NODES = frozenset({
    "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "UnsafeViewBackward0",
    "ReshapeAliasBackward0", "AliasBackward0", "SqueezeBackward0", "SqueezeBackward1", "UnsqueezeBackward0",
})  # fmt: skip


class OutputPredictor:
    def __init__(self) -> None:
        self._cache: dict[Any, list[OutSpec]] = {}
        self._unknown: Any = None  # the signature of the running operator, when the meta run could not tell

    def new_outputs(self, func: Any, args: tuple, kwargs: dict, leaves: list) -> list[OutSpec]:
        returns = func._schema.returns
        if not returns or all(r.alias_info is not None for r in returns):
            return []
        sig: list[Any] = [func]
        for x in leaves:
            if isinstance(x, torch.Tensor):
                sig.append((tuple(x.shape), x.stride(), x.dtype, x.device.type))
            else:
                try:
                    hash(x)
                    sig.append(x)
                except TypeError:
                    sig.append(repr(x))
        key = tuple(sig)
        self._unknown = None
        hit = self._cache.get(key)
        if hit is None:
            hit = _meta_outputs(func, args, kwargs)
            if hit is None:
                self._unknown = key
                return []
            self._store(key, hit)
        return hit

    def observe(self, out: Any, leaves: list) -> None:
        """After the operator last passed to :meth:`new_outputs` ran: if its meta run could not predict its
        outputs, remember the new storages it created (``out``, minus storages of ``leaves``)."""
        if self._unknown is None:
            return
        key, self._unknown = self._unknown, None
        self._store(key, _new_storages(out, leaves))

    def _store(self, key: Any, specs: list[OutSpec]) -> None:
        if len(self._cache) > _CACHE_LIMIT:
            self._cache.clear()
        self._cache[key] = specs


def _new_storages(out: Any, leaves: list) -> list[OutSpec]:
    inputs = {t.untyped_storage()._cdata for t in leaves if isinstance(t, torch.Tensor)}
    specs, seen = [], set()
    for o in tree_flatten(out)[0]:
        if not isinstance(o, torch.Tensor):
            continue
        st = o.untyped_storage()
        if st._cdata in inputs or st._cdata in seen:
            continue
        seen.add(st._cdata)
        specs.append((tuple(o.shape), o.dtype, st.nbytes()))
    return specs


def _meta_outputs(func: Any, args: tuple, kwargs: dict) -> list[OutSpec] | None:
    """The new storages ``func`` creates on these arguments, from a run on ``meta``; None if that fails."""
    has_tensor = False

    def to_meta(x: Any) -> Any:
        nonlocal has_tensor
        if isinstance(x, torch.Tensor):
            has_tensor = True
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        return x

    try:
        with _disable_current_modes():
            margs, mkwargs = tree_map(to_meta, (args, kwargs))
            if "device" in mkwargs:
                mkwargs["device"] = torch.device("meta")
            elif not has_tensor:
                return []  # a factory without a device argument: running it would touch real memory or RNG
            out = func(*margs, **mkwargs)
            return _new_storages(out, tree_flatten((margs, mkwargs))[0])
    except Exception:  # noqa: BLE001  (no meta kernel: learned from the real run, see OutputPredictor.observe)
        return None


def _squeezed(shape: Any) -> tuple[int, ...]:
    """The shape without its size-1 dimensions: a bias gradient may arrive as (1, n) and land as (n,)."""
    return tuple(n for n in shape if n != 1)


class LeafGradients:
    """Recognizes gradients of leaves among the outputs of the backward operators of the running node."""

    def __init__(self) -> None:
        self._node: Any = None
        self._open: list[Any] = []  # (squeezed shape, dtype) of leaves fed directly, (numel, dtype) through views
        self._all = False

    def _sync(self) -> None:
        node = torch._C._current_autograd_node()
        if node is self._node:
            return
        self._node = node
        self._all = node is not None and type(node).__name__ == "AccumulateGrad"
        self._open = []
        if node is None or self._all:
            return
        for fn, _ in node.next_functions:
            through_view = False
            for _ in range(4):  # a gradient reaches its leaf directly or through a few view nodes
                if fn is None or type(fn).__name__ not in _VIEW_NODES:
                    break
                fn, through_view = fn.next_functions[0][0], True
            if fn is not None and type(fn).__name__ == "AccumulateGrad":
                leaf = fn.variable
                self._open.append((leaf.numel(), leaf.dtype) if through_view else (_squeezed(leaf.shape), leaf.dtype))

    def _match(self, shape: tuple[int, ...], dtype: torch.dtype, open_: list[Any]) -> bool:
        numel = 1
        for n in shape:
            numel *= n
        for slot in ((_squeezed(shape), dtype), (numel, dtype)):
            if slot in open_:
                open_.remove(slot)
                return True
        return False

    def expected_bytes(self, outputs: list[OutSpec]) -> int:
        """Bytes among ``outputs`` that will be leaf gradients (nothing is claimed yet)."""
        self._sync()
        if self._all:
            return sum(n for _, _, n in outputs)
        open_ = list(self._open)
        return sum(nbytes for shape, dtype, nbytes in outputs if self._match(shape, dtype, open_))

    def claim(self, t: torch.Tensor) -> bool:
        """Whether ``t``, just created by the running node, is a leaf gradient."""
        self._sync()
        if self._all:
            return True
        return self._match(tuple(t.shape), t.dtype, self._open)

    def clear(self) -> None:
        self._node = None
        self._open = []
