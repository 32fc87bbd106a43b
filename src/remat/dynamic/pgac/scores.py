"""PGAC's gradient influence proxy ``s_l = ||delta_l * a_l||_2`` per block, from what backward produces anyway.

``a_l`` is block ``l``'s output and ``delta_l = dL/da_l``. The scorer registers a tensor hook on each block's
forward output (through :meth:`RematHandle.add_output_observer`); the hook receives ``delta_l`` when backward
has finished accumulating it. Where ``a_l`` comes from depends on the plan, so that scoring never keeps a
tensor alive that the plan frees:

* ``l`` ends its unit (a single block, or the last block of a segment or memory-poor group): the next unit
  stores its input, which is ``a_l`` (the last block's output is stored by the head, e.g. a final norm).
  The hook holds the forward ``a_l``, alive anyway until the next block's backward, which is just before
  ``delta_l`` arrives.
* ``l`` is inside a segment: the forward output is freed. The segment is re-run in backward from its input
  before ``delta_l`` exists; the runtime hands the scorer each recomputed output, which the scorer holds until
  its ``delta_l`` arrives. Those outputs are inputs of the next recomputed blocks, alive until that block's
  backward, i.e. until just before ``delta_l``.
* ``l`` is inside a memory-poor group: block ``m``'s recomputation re-derives ``a_0..a_{m-1}`` of the
  group without storing them. The scorer holds only the latest one or two of these per group; the last one,
  ``a_{m-1}``, is block ``m``'s input (saved by block ``m`` anyway) and ``delta_{m-1}`` arrives right after block
  ``m``'s backward.

The product ``delta_l * a_l`` is one transient tensor of the size of the block output, freed before the block's
own backward allocates its (larger) temporaries. Norms stay on the device; :meth:`collect` moves them to the
host once per optimizer step.

The scorer also adds up the seconds its gradient hooks take (``seconds``, host clock; on the CPU that includes
the product and the norm, on CUDA only their launch): PGAC adds them to its predicted step.

Gradient accumulation: every backward adds ``||delta_l * a_l||^2`` to a per-block sum and :meth:`collect`
returns the root of the sum (root-sum-square over the micro-batches). That is exactly the score of the
whole optimizer batch seen as one batch (``delta`` and ``a`` of the micro-batches concatenated), so the score
does not depend on how a batch is split; a mean of norms would change with the split.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ...core import MEMORY_POOR, SINGLE
from ...runtime import RematHandle

FORWARD = "forward"  # a_l is the forward output; otherwise the unit kind (SEGMENT or MEMORY_POOR) says


@dataclass(frozen=True)
class _Source:
    kind: str  # FORWARD, SEGMENT or MEMORY_POOR
    group: tuple[int, int]  # first and last block of the unit


def score_sources(handle: RematHandle) -> list[_Source]:
    """Where each block's ``a_l`` is taken from under the handle's current plan."""
    sources: list[_Source] = []
    for unit in handle.plan.units():
        for i in range(unit.start, unit.end + 1):
            kind = FORWARD if i == unit.end or unit.kind == SINGLE else unit.kind
            sources.append(_Source(kind, (unit.start, unit.end)))
    return sources


class GradientScorer:
    """Per-block ``||dL/da * a||_2`` accumulated over the backward passes since the last :meth:`collect`.

    Activations waiting for their gradient are held by the scorer, keyed by block and forward call, never by
    the gradient hook itself: a hook that referenced its own tensor would form a reference cycle that keeps
    the tensor alive until the garbage collector runs. A block's new forward drops what is still held for
    its previous forward, so a forward without backward (evaluation with grad enabled) holds at most one
    output per block until the next forward or :meth:`collect`. ``max_pending`` raises that to the number of
    forwards whose backward is still to come (a pipeline stage with several micro-batches in flight): the
    oldest is dropped first. Outputs recomputed inside segments are matched to the latest forward only.
    """

    def __init__(self, handle: RematHandle) -> None:
        self.handle = handle
        self.n = len(handle.fqns)
        self.enabled = True
        self.missed = [0] * self.n  # deltas that arrived without their activation (should stay 0)
        self.seconds = 0.0  # in the gradient hooks since the last take_seconds()
        self._norms: list[tuple[int, torch.Tensor]] = []
        self.max_pending = 1
        self._held: dict[int, dict[object, torch.Tensor]] = {}  # block -> forward call token -> a_l
        self._calls: list[object | None] = [None] * self.n  # token of each block's latest forward call
        self._scored: list[object | None] = [None] * self.n  # token of the call whose score is done
        self._plan = None
        self._sources: list[_Source] = []
        self._remove: Callable[[], None] | None = handle.add_output_observer(self._observe)

    def remove(self) -> None:
        if self._remove is not None:
            self._remove()
            self._remove = None
        self._held.clear()
        self._norms.clear()

    def _source(self, i: int) -> _Source:
        if self.handle.plan is not self._plan:
            self._plan = self.handle.plan
            self._sources = score_sources(self.handle)
        return self._sources[i]

    def _observe(self, i: int, out: torch.Tensor, recomputed: bool) -> None:
        if not self.enabled:
            return
        src = self._source(i)
        if not recomputed:
            pending = self._held.get(i)
            while pending and len(pending) >= self.max_pending:
                del pending[next(iter(pending))]  # the oldest forward's
            if pending is not None and not pending:
                del self._held[i]
            if not out.requires_grad:
                return
            token = object()
            self._calls[i] = token
            if src.kind == FORWARD:
                self._held.setdefault(i, {})[token] = out
            out.register_hook(functools.partial(self._on_grad, i, token))
            return
        token = self._calls[i]
        if src.kind == FORWARD or token is None or self._scored[i] is token:
            return
        self._held[i] = {token: out.detach()}
        if src.kind == MEMORY_POOR:
            # Only the latest re-derived output of the group is alive in the group's backward.
            start, end = src.group
            for j in range(start, end + 1):
                if j != i:
                    self._held.pop(j, None)

    def _on_grad(self, i: int, token: object, delta: torch.Tensor) -> None:
        start = time.perf_counter()
        try:
            self._score(i, token, delta)
        finally:
            self.seconds += time.perf_counter() - start

    def wait_for_device(self) -> None:
        """Wait for the device work the pending scores come from (on CUDA, the backward's kernels still queued),
        which :meth:`collect` would otherwise wait for when it reads them; nothing to wait for on a CPU or when
        this step scored nothing."""
        if self._norms and self._norms[0][1].is_cuda:
            torch.cuda.synchronize(self._norms[0][1].device)

    def take_seconds(self) -> float:
        """The seconds spent in the gradient hooks since the last call (host clock); resets the count."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def _score(self, i: int, token: object, delta: torch.Tensor) -> None:
        pending = self._held.get(i)
        a = pending.pop(token, None) if pending else None
        if pending is not None and not pending:
            del self._held[i]
        if a is None:
            self.missed[i] += 1
            return
        self._scored[i] = token
        with torch.no_grad():
            self._norms.append((i, torch.linalg.vector_norm(delta * a).float()))

    def collect(self) -> tuple[list[float], list[int]] | None:
        """Root-sum-square of the norms per block since the last call, and how many backward passes scored
        each block; ``None`` when nothing was scored. Clears the accumulators."""
        self._held.clear()
        if not self._norms:
            return None
        norms, self._norms = self._norms, []
        counts = [0] * self.n
        for i, _ in norms:
            counts[i] += 1
        values = torch.stack([v for _, v in norms]).square()
        index = torch.tensor([i for i, _ in norms], device=values.device)
        sums = torch.zeros(self.n, dtype=values.dtype, device=values.device).index_add_(0, index, values)
        return [math.sqrt(max(s, 0.0)) for s in sums.tolist()], counts


def ema_update(ema: Sequence[float], scores: Sequence[float], counts: Sequence[int], alpha: float) -> list[float]:
    """``alpha * ema + (1 - alpha) * score`` per block; a block that was not scored (count 0) keeps its EMA."""
    return [alpha * e + (1 - alpha) * s if c > 0 else e for e, s, c in zip(ema, scores, counts, strict=True)]
