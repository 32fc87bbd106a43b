"""Advice on whether and how to checkpoint: does the model fit without it, which plan fits, what it costs,
and whether the memory freed would buy a larger batch that raises throughput (the judgement of seed 003).

Inputs are a CostTable at one batch size, the device memory, the bytes of model state (parameters, gradients,
optimizer state) and optionally the measured step time at two batch sizes, which gives a time model
``step(b) = fixed + per_item * b``. Activation bytes and block times scale linearly with the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..core import BudgetError, CostTable, format_bytes
from ..planning import Plan, make_plan, minimum_peak_bytes, no_checkpoint_peak, simulate

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
            b,
            fwd_s=b.fwd_s * factor,
            bwd_s=b.bwd_s * factor,
            input_bytes=int(b.input_bytes * factor),
            output_bytes=int(b.output_bytes * factor),
            saved_bytes={k: int(v * factor) for k, v in b.saved_bytes.items()},
            recompute_s={k: v * factor for k, v in b.recompute_s.items()},
            fwd_s_by_action={k: v * factor for k, v in b.fwd_s_by_action.items()},
            bwd_s_by_action={k: v * factor for k, v in b.bwd_s_by_action.items()},
            overhead_s={k: v * factor for k, v in b.overhead_s.items()},
            nograd_fwd_s=None if b.nograd_fwd_s is None else b.nograd_fwd_s * factor,
            fwd_temp_bytes=int(b.fwd_temp_bytes * factor),
            bwd_temp_bytes=int(b.bwd_temp_bytes * factor),
            bwd_extra_bytes={k: int(v * factor) for k, v in b.bwd_extra_bytes.items()},
        )

    return replace(
        costs,
        blocks=[scale_block(b) for b in costs.blocks],
        stem_bytes=int(costs.stem_bytes * factor),
        head_bytes=int(costs.head_bytes * factor),
        head_retained_bytes=int(costs.head_retained_bytes * factor),
        held_args_bytes=int(costs.held_args_bytes * factor),
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


def advise(
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
