"""One budget for every input shape a run sees: a plan per shape bucket, planned from the shape-aware costs
(:class:`~remat.core.ShapeCosts`) the first time a bucket is seen, kept, and a refusal naming what fits where no
plan does.

A bucket is the shape a batch is planned at: its sequence length rounded up (to a multiple of ``seq_multiple``, or
to a power of two with ``seq_multiple="pow2"``) and its batch size rounded up the same way (``batch_multiple``, 1 by
default: exact). A plan made for the bucket's shape fits every smaller batch in it, since no term of the costs
shrinks as the shape grows. Where no plan fits the bucket's shape but one fits the batch's own, the batch's shape
gets a plan of its own. Planning a bucket runs the planner once (milliseconds); a shape seen again is looked up
(:attr:`ShapePlans.planned` counts the plannings).

Where no plan of the bucket fits the budget, :meth:`ShapePlans.plan_for` acts by ``on_overflow``:

* ``"raise"`` (default): :class:`ShapeBudgetError` (a :class:`~remat.core.BudgetError`) naming the batch's shape,
  the least peak any plan reaches for it, and the largest sequence length at this batch size and the largest batch
  size at this sequence length that fit, so that a data loader can be set to them;
* ``"least"``: the plan of the least peak, with a warning (the budget does not hold for that batch);
* ``"warn"``: the plan of the last shape, with a warning.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from ..core import BudgetError, ShapeCosts, format_bytes, parse_budget
from .plan import Plan
from .strategies import minimum_peak_bytes
from .strategies import plan as make_plan

ON_OVERFLOW = ("raise", "least", "warn")


class ShapeBudgetError(BudgetError):
    """A batch whose shape no plan fits within the budget; ``shape``, ``floor`` (its least peak) and the largest
    ``fitting_seq`` (at its batch size) and ``fitting_batch`` (at its sequence length), 0 where none fits."""

    def __init__(self, message: str, *, shape: tuple[int, int], floor: int, fitting_seq: int,
                 fitting_batch: int) -> None:  # fmt: skip
        super().__init__(message, floor=floor)
        self.shape, self.fitting_seq, self.fitting_batch = shape, fitting_seq, fitting_batch


def round_up(value: int, multiple: int | str) -> int:
    """``value`` rounded up to a multiple of ``multiple``, or to a power of two with ``"pow2"``."""
    if multiple == "pow2":
        return 1 << max(0, math.ceil(math.log2(max(1, value))))
    if not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"a bucket multiple is a positive integer or 'pow2', got {multiple!r}")
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Buckets:
    """How shapes are grouped: sequence lengths and batch sizes rounded up (``"pow2"``: to powers of two)."""

    seq_multiple: int | str = 64
    batch_multiple: int | str = 1

    def of(self, batch: int, seq: int) -> tuple[int, int]:
        """The shape a batch of ``(batch, seq)`` is planned at."""
        return round_up(batch, self.batch_multiple), round_up(seq, self.seq_multiple) if seq > 1 else seq


@dataclass
class ShapePlans:
    """Plans per shape bucket within one byte budget (module docstring)."""

    costs: ShapeCosts
    budget: int | str
    strategy: str = "optimal"
    buckets: Buckets = field(default_factory=Buckets)
    on_overflow: str = "raise"
    options: dict[str, Any] = field(default_factory=dict)
    planned: int = 0  # plannings run (a bucket seen again is not planned again)
    plans: dict[tuple[int, int], Plan] = field(default_factory=dict)
    seen: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # shape -> its bucket
    refused: dict[tuple[int, int], ShapeBudgetError] = field(default_factory=dict)
    last: Plan | None = None
    switch_s: float = 0.0  # seconds the runtime spent choosing and setting plans (remat.runtime, Note [11])
    planning_s: float = 0.0  # of which planning new shapes (and the refusals' searches for what fits)
    warned_beyond: bool = False
    remeasured: int = 0  # times the costs were measured again for a shape beyond them (remat.profiling)

    def __post_init__(self) -> None:
        if self.on_overflow not in ON_OVERFLOW:
            raise ValueError(f"on_overflow={self.on_overflow!r}: choose one of {', '.join(ON_OVERFLOW)}")
        if isinstance(self.budget, float):
            raise ValueError(
                f"budget={self.budget}: a fraction means a different number of bytes at each shape; give bytes "
                "(an int, or a string like '2GiB')"
            )
        self.budget_bytes = parse_budget(self.budget)

    def beyond(self, batch: int, seq: int) -> bool:
        """Whether ``(batch, seq)`` lies beyond every shape the costs were measured at (its costs extrapolated)."""
        top_batch, top_seq = self.costs.largest
        return batch > top_batch or (self.costs.fixed_second is None and seq > top_seq)

    def use_costs(self, costs: ShapeCosts) -> None:
        """Plan from ``costs`` from now on (measured again, over a wider range): the plans, refusals and shapes
        seen so far were made from the old costs and are dropped."""
        self.costs = costs
        self.plans.clear()
        self.seen.clear()
        self.refused.clear()
        self.warned_beyond = False
        self.remeasured += 1

    def use_budget(self, budget_bytes: int) -> None:
        """Plan within ``budget_bytes`` from now on (what the memory leaves once an optimizer's state counts): the
        plans and refusals made so far are dropped."""
        self.budget = self.budget_bytes = int(budget_bytes)
        self.plans.clear()
        self.refused.clear()

    def shape_and_bucket(self, batch: int, seq: int, past_second: tuple[int, ...] = ()
                         ) -> tuple[tuple[int, int], tuple[int, int]]:  # fmt: skip
        """The shape a batch of ``(batch, seq)`` is known by and the bucket it is planned at. Under the batch form
        (an image model) a second dimension below the profiled one is planned at the profiled one, which holds it;
        one above it, or a first-block input larger than the profiled one past its second dimension
        (``past_second``: a larger image's feature map), raises ValueError: the costs do not price it."""
        profiled = self.costs.past_second
        if past_second and (len(past_second) != len(profiled) or any(
                d > p for d, p in zip(past_second, profiled, strict=True))):  # fmt: skip
            raise ValueError(
                f"a batch whose first block's input is {list(past_second)} past its second dimension, beyond the "
                f"{list(profiled)} its costs were profiled at (an image model's feature-map height and width): no "
                "plan here was made for activations that large. Profile a batch of the largest image size the run "
                "will see (remat.fit(..., batch=...), remat.profile_shapes), or resize the images to at most the "
                "profiled size"
            )
        fixed = self.costs.fixed_second
        if fixed is None:
            return (batch, seq), self.buckets.of(batch, seq)
        if seq > fixed:
            self.costs.at(batch, seq)  # raises, saying why
        return (batch, fixed), (self.buckets.of(batch, fixed)[0], fixed)

    def plan_for(self, batch: int, seq: int, past_second: tuple[int, ...] = ()) -> Plan:
        """The plan for a batch of ``(batch, seq)`` (its first block's input ``past_second`` past them): its
        bucket's, planned the first time the bucket is seen."""
        shape, bucket = self.shape_and_bucket(batch, seq, past_second)
        key = self.seen.setdefault(shape, bucket)
        if shape in self.refused:
            raise self.refused[shape]
        plan = self.plans.get(key)
        if plan is None:
            try:
                plan = self._plan(key, shape)
            except ShapeBudgetError as err:
                self.refused[shape] = err  # a shape refused once is refused again without planning
                raise
            self.plans.setdefault(self.seen[shape], plan)
        self.last = plan
        return plan

    def _plan(self, bucket: tuple[int, int], shape: tuple[int, int]) -> Plan:
        started = time.perf_counter()
        try:
            return self._plan_or_refuse(bucket, shape)
        finally:
            self.planning_s += time.perf_counter() - started

    def _plan_or_refuse(self, bucket: tuple[int, int], shape: tuple[int, int]) -> Plan:
        self.planned += 1
        try:
            return self._plan_at(bucket)
        except BudgetError as err:
            if shape == bucket:
                return self._overflow(bucket, shape, err)
        # The bucket's upper edge does not fit but the batch itself may: planned at its own shape then.
        self.seen[shape] = shape
        try:
            plan = self.plans[shape] = self._plan_at(shape)
            return plan
        except BudgetError as err:
            return self._overflow(shape, shape, err)

    def _plan_at(self, shape: tuple[int, int]) -> Plan:
        self._warn_beyond(shape)
        plan = make_plan(self.costs.at(*shape), self.strategy, self.budget_bytes, **self.options)
        plan.options["shape"] = list(shape)
        return plan

    def _warn_beyond(self, shape: tuple[int, int]) -> None:
        """Warn once where a shape lies beyond the profiled ones: its costs are extrapolated."""
        if self.warned_beyond or not self.beyond(*shape):
            return
        self.warned_beyond = True
        warnings.warn(
            f"remat: planning a batch of shape {list(shape)} beyond the profiled {list(self.costs.largest)}: its costs "
            f"are extrapolated on the form {self.costs.form}, which held the activation peak within 2% at 4x the "
            "sequence on GPT-2, Llama, BERT and T5, but does not foresee a kernel that changes its course at a "
            "larger size (a workspace chosen by the shape), and its times are less sure than its bytes. Profile "
            "with the largest batch the run will see (remat.profile_shapes cuts it to the smaller shapes), or let "
            "remat.profiling.measure_beyond(model, plans) measure such shapes before their forward.",
            stacklevel=4,
        )

    def _overflow(self, bucket: tuple[int, int], shape: tuple[int, int], err: BudgetError) -> Plan:
        floor = minimum_peak_bytes(self.costs.at(*bucket))
        fitting_seq = self.largest_fitting(bucket[0], None)
        fitting_batch = self.largest_fitting(None, bucket[1])
        least = format_bytes(floor)
        within = f"within {format_bytes(self.budget_bytes)}: the least peak any plan reaches for it is {least}"
        if self.costs.fixed_second is not None:  # an image model: the batch size is the one lever
            message = (
                f"no plan fits a batch of {shape[0]} (planned as {bucket[0]}) {within}. Batches up to "
                f"{fitting_batch} fit: set the data loader's batch_size to that, raise the budget, or pass "
                "on_overflow='least' to run such batches over the budget with a warning."
            )
        else:
            message = (
                f"no plan fits a batch of shape {list(shape)} (batch, sequence; planned as {list(bucket)}) {within}. "
                f"At batch size {bucket[0]} sequences up to {fitting_seq} fit; at sequence length {bucket[1]} "
                f"batches up to {fitting_batch} fit. Cut or bucket the batches to those (a data loader's max_length, "
                "batch_size), raise the budget, or pass on_overflow='least' to run such batches over the budget "
                "with a warning."
            )
        if self.on_overflow == "raise":
            raise ShapeBudgetError(message, shape=shape, floor=floor, fitting_seq=fitting_seq,
                                   fitting_batch=fitting_batch) from err  # fmt: skip
        if self.on_overflow == "least":
            warnings.warn(f"remat: {message} Running the plan of the least peak.", stacklevel=3)
            return self._least(bucket)
        warnings.warn(f"remat: {message} Running the last plan.", stacklevel=3)
        return self.last if self.last is not None else self._least(bucket)

    def _least(self, bucket: tuple[int, int]) -> Plan:
        table = self.costs.at(*bucket)
        plan = make_plan(table, "optimal", minimum_peak_bytes(table))
        plan.options["shape"] = list(bucket)
        return plan

    def largest_fitting(self, batch: int | None, seq: int | None) -> int:
        """The largest sequence length at ``batch`` (``seq`` None) or batch size at ``seq`` (``batch`` None) whose
        least peak fits the budget; 0 where none does. The least peak grows with either, so a doubling search
        then a bisection finds it."""

        def fits(n: int) -> bool:
            shape = (batch, n) if seq is None else (n, seq)
            return minimum_peak_bytes(self.costs.at(*shape)) <= self.budget_bytes  # type: ignore[arg-type]

        fixed = self.costs.fixed_second
        if seq is None and fixed is not None:  # the second dimension is the model's, not the batch's
            return fixed if fits(fixed) else 0
        if not fits(1):
            return 0
        high = 2
        while fits(high):
            high *= 2
            if high > 1 << 24:
                return high
        low = high // 2  # fits(low), not fits(high)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low

    def describe(self) -> str:
        """The shapes seen and the plan each got, one line per bucket."""
        lines = [f"plans per shape within {format_bytes(self.budget_bytes)} ({self.planned} planned):"]
        for bucket, plan in sorted(self.plans.items()):
            shapes = sorted(s for s, b in self.seen.items() if b == bucket)
            peak = plan.predicted_peak_bytes
            counts: dict[str, int] = {}
            for action in plan.actions.values():
                counts[action] = counts.get(action, 0) + 1
            actions = ", ".join(f"{n} {a}" for a, n in sorted(counts.items()))
            lines.append(f"  {list(bucket)} for {[list(s) for s in shapes]}: {actions}; predicted peak "
                         f"{format_bytes(peak) if peak is not None else '?'}")
        return "\n".join(lines)


__all__ = ["ON_OVERFLOW", "Buckets", "ShapeBudgetError", "ShapePlans", "round_up"]
