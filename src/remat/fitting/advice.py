"""Advice on whether and how to checkpoint: does the model fit without it, which plan fits, what it costs,
and whether the memory freed would buy a larger batch that raises throughput (the judgement of seed 003).

:func:`advise` (``remat.advise``) measures it on the model: the plain step's whole peak and seconds at two
batch sizes (the batch and its half, or 1 and 2), a line through each (``fixed + per_sample * b``, fitted as
measured, never clamped), the fastest plan that fits (:func:`~remat.fitting.device_fit.fit_memory`) with its
predicted cost and its step measured against the plain one, and the largest batch that fits with a plan. A plain
step that runs out of the device's memory is recorded as such (``out_of_memory``) and not timed: no line is drawn
then, the plan is not measured against it, and the largest batches are read from the plain steps that ran and
the least plan's activations per sample.
:func:`advise_costs` is the same judgement from a CostTable at one batch size, the device memory and the bytes
of model state given (the CLI's ``--device meta`` estimates): activation bytes and block times scale linearly
with the batch, and the step time is the chain's or a line through two measured step times.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ..chains import interleaved_rounds, timed_step
from ..core import Batch, BudgetError, CostTable, StepSpec, autocast_spec, format_bytes
from ..meters import model_device
from ..planning import Plan, make_plan, minimum_peak_bytes, no_checkpoint_peak, simulate
from ..profiling import GradsRestored, profile, step_aside
from .device_fit import MemoryFit, MemoryFitError, applied, fit_memory, keep_all
from .device_fit import batch_size as leading_rows
from .trial import head_to_head
from .whole_step import FixedMemory, MemoryArg, device_memory, fixed_memory, whole_step_peak

_STATE_BYTES_PER_PARAM = {
    ("adam", False): 16,  # fp32 weights 4 + grads 4 + two moments 8
    ("adam", True): 16,  # bf16 weights 2 + grads 2 + fp32 master 4 + moments 8
    ("sgd", False): 12,  # weights 4 + grads 4 + momentum 4
    ("sgd", True): 10,
}


def model_state_bytes(num_params: int, optimizer: str = "adam", mixed_precision: bool = False) -> int:
    """Bytes of parameters, gradients and optimizer state for ``num_params`` parameters."""
    key = (optimizer.lower(), mixed_precision)
    if key not in _STATE_BYTES_PER_PARAM:
        raise ValueError(f"unknown optimizer {optimizer!r}; use 'adam' or 'sgd'")
    return num_params * _STATE_BYTES_PER_PARAM[key]


def scale_costs(costs: CostTable, factor: float) -> CostTable:
    """The table for ``factor`` times the batch: bytes and seconds scale linearly, each action's overhead
    included (an offload's copies grow with the batch; a selective region's per-operator dispatch does not, so
    this overstates that part at larger batches)."""

    def scale_block(b):  # noqa: ANN001, ANN202
        return replace(
            b.times_scaled(factor),
            input_bytes=int(b.input_bytes * factor),
            output_bytes=int(b.output_bytes * factor),
            saved_bytes={k: int(v * factor) for k, v in b.saved_bytes.items()},
            fwd_temp_bytes=int(b.fwd_temp_bytes * factor),
            bwd_temp_bytes=int(b.bwd_temp_bytes * factor),
            bwd_extra_bytes={k: int(v * factor) for k, v in b.bwd_extra_bytes.items()},
            peak_summits={k: [int(v * factor) for v in vs] for k, vs in b.peak_summits.items()},
        )

    return replace(
        costs,
        blocks=[scale_block(b) for b in costs.blocks],
        stem_bytes=int(costs.stem_bytes * factor),
        head_bytes=int(costs.head_bytes * factor),
        head_retained_bytes=int(costs.head_retained_bytes * factor),
        held_args_bytes=int(costs.held_args_bytes * factor),
        held_args_rows=[int(v * factor) for v in costs.held_args_rows],
        outside_s=None if costs.outside_s is None else costs.outside_s * factor,
    )


@dataclass
class BatchOption:
    batch_size: int
    plan: Plan | None
    step_s: float
    throughput: float  # items per second (samples, or tokens when items_per_sample > 1)


@dataclass
class Advice:
    device_memory_bytes: int
    state_bytes: int
    available_bytes: int
    no_checkpoint_bytes: int
    minimum_bytes: int
    needs_checkpointing: bool
    plan: Plan | None
    overhead: float | None  # seconds the plan adds (recomputation + overhead) / step seconds without checkpointing
    batch_options: list[BatchOption] = field(default_factory=list)
    time_model: str = ""
    plan_time_cost_s: float = 0.0  # the plan's recomputation plus its actions' overhead, per step

    def text(self) -> str:
        lines = [
            f"device memory {format_bytes(self.device_memory_bytes)}, model state "
            f"{format_bytes(self.state_bytes)}, left for activations {format_bytes(self.available_bytes)}",
            f"activations without checkpointing: {format_bytes(self.no_checkpoint_bytes)}; "
            f"the least any plan needs: {format_bytes(self.minimum_bytes)}",
        ]
        if self.available_bytes <= 0 or self.plan is None:
            lines.append(
                "does not fit: even the least-memory plan needs more than is left. Shrink the batch or the "
                "sequence, shard the model state (FSDP/ZeRO), or offload."
            )
        elif not self.needs_checkpointing:
            lines.append("checkpointing is not needed: everything fits; it would only cost time.")
        else:
            lines.append(
                f"checkpointing is needed. Plan '{self.plan.strategy}' fits with a predicted peak of "
                f"{format_bytes(self.plan.predicted_peak_bytes)} and "
                f"{self.plan_time_cost_s * 1e3:.1f} ms of recomputation and overhead per step "
                f"(+{100 * (self.overhead or 0):.1f}% step time)."
            )
        if self.batch_options:
            lines.append(f"larger batches ({self.time_model}):")
            for opt in self.batch_options:
                how = "does not fit" if opt.plan is None else f"plan {opt.plan.strategy}"
                lines.append(
                    f"  batch {opt.batch_size:>5}: {how:<16} step {opt.step_s * 1e3:9.1f} ms  "
                    f"throughput {opt.throughput:10.1f}/s"
                )
            fitting = [o for o in self.batch_options if o.plan is not None]
            if fitting:
                best = max(fitting, key=lambda o: o.throughput)
                base = self.batch_options[0]
                if best.batch_size != base.batch_size and best.throughput > base.throughput * 1.01:
                    lines.append(
                        f"freeing memory for batch {best.batch_size} raises throughput by "
                        f"{100 * (best.throughput / base.throughput - 1):.1f}%: worth it."
                    )
                else:
                    lines.append("a larger batch does not raise throughput here: keep the batch.")
        return "\n".join(lines)


def time_cost_s(costs: CostTable, plan: Plan | None) -> float:
    """Seconds ``plan`` adds to a step keeping everything: its recomputation plus its actions' overhead."""
    return 0.0 if plan is None else simulate(costs, plan.actions).time_cost_s


def _best_plan(costs: CostTable, budget: int) -> Plan | None:
    if no_checkpoint_peak(costs) <= budget:
        return Plan.from_actions(costs, ["keep"] * len(costs), "none", budget)
    try:
        return make_plan(costs, "optimal", budget)
    except BudgetError:
        return None


def advise_costs(
    costs: CostTable,
    *,
    batch_size: int,
    device_memory: int,
    state_bytes: int,
    reserve_fraction: float = 0.05,
    step_time_at: dict[int, float] | None = None,
    batch_multiples: tuple[int, ...] = (1, 2, 4, 8),
) -> Advice:
    """Advice for training with ``costs`` (measured at ``batch_size``) on a device of ``device_memory`` bytes.

    ``step_time_at`` maps batch sizes to measured step seconds without checkpointing (two or more points
    give the fixed and per-item time); without it step time is taken as the chain's forward plus backward
    time, proportional to the batch.
    """
    available = int(device_memory * (1 - reserve_fraction)) - state_bytes
    rich = no_checkpoint_peak(costs)
    floor = minimum_peak_bytes(costs)
    chosen = _best_plan(costs, available) if available > 0 else None
    chain_s = sum(b.fwd_s + b.bwd_s for b in costs.blocks)
    fixed, per_item = 0.0, chain_s / batch_size
    time_model = "time proportional to the batch (chain forward + backward), an estimate"
    if step_time_at and len(step_time_at) >= 2:
        (b1, t1), (b2, t2) = sorted(step_time_at.items())[:2]
        per_item = max((t2 - t1) / (b2 - b1), 1e-12)
        fixed = max(t1 - per_item * b1, 0.0)
        time_model = f"measured step time = {fixed * 1e3:.1f} ms + {per_item * 1e3:.3f} ms per sample"
    step_s = fixed + per_item * batch_size
    chosen_cost_s = time_cost_s(costs, chosen)
    overhead = chosen_cost_s / step_s if chosen is not None and step_s > 0 else None
    options = []
    for multiple in batch_multiples:
        size = batch_size * multiple
        scaled = scale_costs(costs, multiple)
        option_plan = _best_plan(scaled, available) if available > 0 else None
        step = fixed + per_item * size + time_cost_s(scaled, option_plan)
        options.append(BatchOption(size, option_plan, step, size / step if option_plan else 0.0))
    return Advice(
        device_memory_bytes=device_memory,
        state_bytes=state_bytes,
        available_bytes=available,
        no_checkpoint_bytes=rich,
        minimum_bytes=floor,
        needs_checkpointing=rich > available,
        plan=chosen,
        overhead=overhead,
        batch_options=options,
        time_model=time_model,
        plan_time_cost_s=chosen_cost_s,
    )


# ----------------------------------------------------------------------------------------------------
# remat.advise: the same judgement, measured on the model.


@dataclass(frozen=True)
class Line:
    """``fixed + per_sample * b`` through measured points (a negative ``fixed`` is kept as measured)."""

    fixed: float
    per_sample: float

    @classmethod
    def through(cls, points: dict[int, float]) -> Line:
        sizes = sorted(points)
        mean_b = statistics.fmean(sizes)
        mean_y = statistics.fmean(points[b] for b in sizes)
        spread = sum((b - mean_b) ** 2 for b in sizes)
        slope = sum((b - mean_b) * (points[b] - mean_y) for b in sizes) / spread
        return cls(mean_y - slope * mean_b, slope)

    def at(self, size: float) -> float:
        return self.fixed + self.per_sample * size


@dataclass(frozen=True)
class ModelAdvice:
    """What :func:`advise` measured and concluded (bytes, seconds)."""

    memory: int
    batch_size: int
    fixed: FixedMemory
    whole_peaks: dict[int, int]  # the plain step's whole peak per batch size, measured
    step_seconds: dict[int, float]  # the plain step's median seconds per batch size, measured
    fit: MemoryFit | None  # the fastest plan that fits at batch_size (None: the plain step fits, or nothing does)
    refusal: str = ""  # why nothing fits at batch_size
    planned_ratios: tuple[float, ...] = ()  # the plan's step over the plain step, round by round
    largest_plain_batch: int = 0
    largest_planned_batch: int = 0
    seconds: float = 0.0
    out_of_memory: tuple[int, ...] = ()  # batch sizes whose plain step ran out of the device's memory (not timed)

    @property
    def fits_plain(self) -> bool:
        return self.batch_size not in self.out_of_memory and self.whole_peaks[self.batch_size] <= self.memory

    @property
    def time_line(self) -> Line | None:
        """Through the plain steps' seconds (None where fewer than two batch sizes ran)."""
        return Line.through(self.step_seconds) if len(self.step_seconds) >= 2 else None

    @property
    def memory_line(self) -> Line | None:
        """Through the plain steps' whole peaks (None where a plain step ran out of memory)."""
        if self.out_of_memory:
            return None
        return Line.through({b: float(p) for b, p in self.whole_peaks.items()})

    def text(self) -> str:
        peak = self.whole_peaks[self.batch_size]
        if self.batch_size in self.out_of_memory:
            plain = f"ran out of the device's memory past {format_bytes(peak)}"
        else:
            plain = f"{format_bytes(peak)} measured whole, {self.step_seconds[self.batch_size] * 1e3:.1f} ms"
        lines = [
            f"memory {format_bytes(self.memory)} for the whole step; fixed: {self.fixed.describe()}",
            f"plain step at batch {self.batch_size}: {plain}",
        ]
        if self.fits_plain:
            lines.append("checkpointing is not needed: the plain step fits; checkpointing would only cost time.")
        elif self.fit is None:
            lines.append(f"no plan fits at this batch: {self.refusal}")
        else:
            costs = self.fit.costs
            assert costs is not None
            predicted = simulate(costs, self.fit.plan.actions).time_cost_s
            if self.planned_ratios:
                against = f"measured {statistics.median(self.planned_ratios):.3f}x the plain step"
            else:
                against = "the plain step does not run on this device to be measured against"
            lines.append(
                f"checkpointing is needed: plan {self.fit.plan.action_counts()} measured "
                f"{format_bytes(self.fit.measured.whole if self.fit.measured else 0)} whole; predicted "
                f"+{predicted * 1e3:.1f} ms a step, {against}"
            )
        time_line, memory_line = self.time_line, self.memory_line
        if time_line is not None and memory_line is not None:
            note = " (a negative fixed part: the measurements' noise)" if time_line.fixed < 0 else ""
            lines.append(
                f"measured at batches {sorted(self.step_seconds)}: step = {time_line.fixed * 1e3:.1f} ms + "
                f"{time_line.per_sample * 1e3:.3f} ms per sample{note}; whole peak = "
                f"{format_bytes(int(memory_line.fixed))} + {format_bytes(int(memory_line.per_sample))} per sample"
            )
        else:
            lines.append(f"plain steps at batches {list(self.out_of_memory)} ran out of the device's memory: no line "
                         "through the plain steps")  # fmt: skip
        by = "the measured lines" if memory_line is not None else "the plain steps that ran"
        lines.append(
            f"largest batch that fits: {_batches(self.largest_plain_batch, self.batch_size)} without checkpointing, "
            f"{_batches(self.largest_planned_batch, self.batch_size)} with a plan (by {by} and the least plan's "
            "activations)"
        )
        lines.append(f"advice took {self.seconds:.1f} s")
        return "\n".join(lines)


READ_LINES_TO = 16  # the lines through two measured batch sizes are read up to this many times the batch


def _batches(largest: int, measured: int) -> str:
    """A largest batch as the text says it: beyond :data:`READ_LINES_TO` times the batch measured, only that it
    is more (a straight line through two points says little that far out)."""
    reach = READ_LINES_TO * measured
    return f"more than {reach}" if largest > reach else str(largest)


def resized(batch: Batch, size: int, like: int) -> Batch:
    """``batch`` with every tensor whose leading dimension is ``like`` cut or repeated to ``size`` rows."""
    if torch.is_tensor(batch):
        if batch.dim() == 0 or batch.shape[0] != like:
            return batch
        repeats = -(-size // like)
        return batch.repeat(repeats, *([1] * (batch.dim() - 1)))[:size] if repeats > 1 else batch[:size]
    if isinstance(batch, dict):
        return {k: resized(v, size, like) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(resized(v, size, like) for v in batch)
    return batch


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def advise(
    model: nn.Module,
    batch: Batch,
    memory: MemoryArg,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    step: StepSpec | None = None,
    rounds: int = 3,
    progress: Callable[[str], None] | None = _stderr,
) -> ModelAdvice:
    """Does ``model``'s step on ``batch`` fit ``memory`` (the device's, for the whole step) without
    checkpointing; the fastest plan that fits, its predicted and measured cost; the largest batch that fits with
    a plan (module docstring). ``progress`` hears what is measured and about how long it will take."""
    started = time.perf_counter()
    spec = step or StepSpec()
    device = model_device(model)
    limit = device_memory(memory, device)
    size = leading_rows(batch)
    if size is None:
        raise ValueError("advise needs a batch whose tensors have a leading batch dimension")
    sizes = [size // 2, size] if size >= 2 else [1, 2]
    fixed = fixed_memory(model, optimizer)
    setting = autocast_spec(spec.autocast, device.type)
    say = progress or (lambda _: None)
    samples = {b: resized(batch, b, size) for b in sizes}

    def plain(b: int) -> float:
        with step_aside(model):
            return timed_step(model, samples[b], spec.loss_fn, setting, holds_output=spec.holds_output)

    say(f"remat.advise: plain steps at batches {sizes}, {rounds} rounds")
    warm = {b: whole_step_peak(model, lambda b=b: plain(b), fixed) for b in sizes}  # one warm step each, unread
    measured = {b: warm[b] if warm[b].out_of_memory else whole_step_peak(model, lambda b=b: plain(b), fixed)
                for b in sizes}  # fmt: skip
    peaks = {b: m.whole for b, m in measured.items()}
    ran = [b for b in sizes if not measured[b].out_of_memory]  # a plain step the device does not hold is not timed
    timed = interleaved_rounds(ran, plain, rounds)
    seconds = {b: statistics.median(timed[b]) for b in ran}
    fixed_fits = fixed.total + fixed.optimizer_step_bytes <= limit
    fit: MemoryFit | None = None
    refusal = ""
    ratios: tuple[float, ...] = ()
    say("remat.advise: profiling the step and fitting a plan (tens of plain steps)")
    costs: CostTable | None = None
    if measured[size].within(limit):
        costs = profile(model, batch, step=spec)
    else:
        try:
            fit = fit_memory(model, batch, limit, optimizer=optimizer, step=spec)
            costs = fit.costs
        except MemoryFitError as err:
            refusal, costs = str(err), err.costs
    if len(ran) == len(sizes):
        memory_line = Line.through({b: float(p) for b, p in peaks.items()})
        per_sample = max(memory_line.per_sample, 1.0)
        room = limit - memory_line.fixed
        largest_plain = max(0, int(room // per_sample)) if fixed_fits else 0
        largest_planned = largest_plain
        if costs is not None and fixed_fits:
            saved_per_sample = (no_checkpoint_peak(costs) - minimum_peak_bytes(costs)) / size
            largest_planned = max(largest_plain, int(room // max(per_sample - saved_per_sample, 1.0)))
    else:  # no line through plain steps: the largest that ran, and the least plan's activations per sample
        largest_plain = max([b for b in ran if peaks[b] <= limit], default=0)
        largest_planned = largest_plain
        if costs is not None and fixed_fits:
            beyond = fit.non_activation if fit is not None else fixed.total
            largest_planned = max(largest_plain, int(size * (limit - beyond) / max(minimum_peak_bytes(costs), 1)))
    if fit is not None and fit.activation_budget is not None and size in ran:
        planned, plain_plan = fit.plan, keep_all(model, spec.blocks)
        handle = applied(model, planned, spec)
        try:

            def run(name: str) -> float:
                handle.set_plan(planned if name == "plan" else plain_plan)
                with GradsRestored(model):
                    return timed_step(model, batch, spec.loss_fn, setting, holds_output=spec.holds_output)

            ratios = head_to_head(["plain", "plan"], run, rounds)["plan"]
        finally:
            handle.remove()
    return ModelAdvice(
        limit, size, fixed, peaks, seconds, fit, refusal, ratios, largest_plain, largest_planned,
        time.perf_counter() - started, tuple(b for b in sizes if b not in ran),
    )  # fmt: skip

