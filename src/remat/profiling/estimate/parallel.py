"""Activation memory and plans per pipeline stage for a model split across stages, tensor-parallel ranks and
data-parallel ranks, from one micro-batch's CostTable (measured, or computed on the ``meta`` device).

* Pipeline: stage ``p`` owns consecutive rows of the chain (the stem on the first stage, the head on the last,
  :func:`remat.dynamic.pgac.pipeline.stage_costs`) and holds the activations of
  :func:`remat.integrations.pipeline.in_flight` micro-batches at once (GPipe: all of them; 1F1B:
  ``min(M, S - p)``). A stage's budget is divided by that count to plan one micro-batch.
* Tensor parallel of degree ``t`` (Megatron-style, Korthikanti et al. 2022): in a transformer layer the
  tensors inside attention and the MLP are split across the ``t`` ranks, while the layer norms' inputs, the
  inputs of the first projections and the dropout masks after them are replicated. With 16-bit activations
  a layer keeps ``sbh(10 + 24/t + 5as/(ht))`` instead of ``sbh(34 + 5as/h)``; with sequence parallelism the
  replicated part is split along the sequence too: ``sbh(34/t + 5as/(ht))``
  (:func:`~remat.profiling.estimate.activation_formula.transformer_layer_activation_bytes`). Each block's byte fields
  are scaled by that ratio for the block's shape; the hidden states crossing blocks (inputs, outputs, stem,
  head) are divided by ``t`` only under sequence parallelism.
* Data parallel (DDP, FSDP/ZeRO): each rank runs whole micro-batches; FSDP shards parameters, gradients and
  optimizer state, never activations, so the figures here are per rank whatever the data-parallel degree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ...core import CHECKPOINT, KEEP, BudgetError, CostTable, parse_budget
from ...planning import Plan, in_flight, make_plan, no_checkpoint_peak, simulate, split_stages, stage_costs
from .activation_formula import transformer_layer_activation_bytes


@dataclass(frozen=True)
class LayerShape:
    """What the tensor-parallel split of a transformer layer depends on."""

    seq: int
    micro_batch: int
    hidden: int
    heads: int
    bytes_per_element: int = 2
    dropout: bool = True
    flash_attention: bool = False

    def layer_bytes(self, tp: int = 1, sequence_parallel: bool = False) -> int:
        return transformer_layer_activation_bytes(
            self.seq,
            self.micro_batch,
            self.hidden,
            self.heads,
            bytes_per_element=self.bytes_per_element,
            mask_bytes=1 if self.bytes_per_element <= 2 else self.bytes_per_element,
            dropout=self.dropout,
            flash_attention=self.flash_attention,
            tensor_parallel=tp,
            sequence_parallel=sequence_parallel,
        )


def shard_costs(costs: CostTable, shape: LayerShape, tp: int, sequence_parallel: bool) -> CostTable:
    """The CostTable one tensor-parallel rank sees: block bytes scaled by the layer formula's ratio, block
    seconds (each action's overhead included) divided by ``tp``."""
    if tp < 1:
        raise ValueError(f"the tensor-parallel degree must be >= 1, got {tp}")
    if tp == 1:
        return costs
    ratio = shape.layer_bytes(tp, sequence_parallel) / shape.layer_bytes(1)
    hidden = 1.0 / tp if sequence_parallel else 1.0

    def scaled(n: int, factor: float) -> int:
        return int(round(n * factor))

    blocks = [
        replace(
            b,
            input_bytes=scaled(b.input_bytes, hidden),
            output_bytes=scaled(b.output_bytes, hidden),
            saved_bytes={a: scaled(v, ratio) for a, v in b.saved_bytes.items()},
            fwd_temp_bytes=scaled(b.fwd_temp_bytes, ratio),
            bwd_temp_bytes=scaled(b.bwd_temp_bytes, ratio),
            bwd_extra_bytes={a: scaled(v, ratio) for a, v in b.bwd_extra_bytes.items()},
            fwd_s=b.fwd_s / tp,
            bwd_s=b.bwd_s / tp,
            recompute_s={a: v / tp for a, v in b.recompute_s.items()},
            fwd_s_by_action={a: v / tp for a, v in b.fwd_s_by_action.items()},
            bwd_s_by_action={a: v / tp for a, v in b.bwd_s_by_action.items()},
            overhead_s={a: v / tp for a, v in b.overhead_s.items()},
            nograd_fwd_s=None if b.nograd_fwd_s is None else b.nograd_fwd_s / tp,
        )
        for b in costs.blocks
    ]
    return replace(
        costs,
        blocks=blocks,
        stem_bytes=scaled(costs.stem_bytes, hidden),
        head_bytes=scaled(costs.head_bytes, hidden),
        head_retained_bytes=scaled(costs.head_retained_bytes, hidden),
    )


@dataclass
class StageEstimate:
    """One pipeline stage: its blocks, micro-batches in flight, activation bytes and plan."""

    index: int
    start: int
    end: int
    in_flight: int
    micro_batch_bytes: int  # no checkpointing, one micro-batch
    formula_bytes: int | None  # the layer formula times the stage's blocks, one micro-batch
    budget_bytes: int | None  # the whole stage's budget
    plan: Plan | None
    error: str | None = None

    @property
    def stage_bytes(self) -> int:
        return self.in_flight * self.micro_batch_bytes

    @property
    def planned_stage_bytes(self) -> int | None:
        return self.in_flight * self.plan.predicted_peak_bytes if self.plan and self.plan.predicted_peak_bytes else None


def stage_sizes_even(n_blocks: int, stages: int) -> list[int]:
    if not 1 <= stages <= n_blocks:
        raise ValueError(f"--stages must be between 1 and the {n_blocks} blocks of the chain, got {stages}")
    return [n_blocks // stages + (1 if p < n_blocks % stages else 0) for p in range(stages)]


def estimate_stages(
    costs: CostTable,
    *,
    stages: int,
    schedule: str,
    n_microbatches: int,
    budget: int | float | str | None | Sequence[int | float | str | None] = None,
    strategy: str = "optimal",
    formula_layer_bytes: int | None = None,
    stage_sizes: Sequence[int] | None = None,
) -> list[StageEstimate]:
    """Per stage: activation bytes with its micro-batches in flight and, with ``budget`` (bytes per stage, or
    a fraction of the stage's no-checkpoint memory with its micro-batches in flight), its plan for one
    micro-batch; a list gives one budget per stage. A stage whose share is below what it needs gets
    ``error`` instead of a plan."""
    sizes = list(stage_sizes) if stage_sizes is not None else stage_sizes_even(len(costs), stages)
    budgets = list(budget) if isinstance(budget, list | tuple) else [budget] * stages
    if len(budgets) != stages:
        raise ValueError(f"give one budget per stage ({stages}), got {len(budgets)}")
    out = []
    for p, (s, e) in enumerate(split_stages(len(costs), sizes)):
        budget = budgets[p]
        rows = stage_costs(costs, s, e)
        flight = in_flight(schedule, stages, p, n_microbatches)
        mb_bytes = no_checkpoint_peak(rows)
        total = parse_budget(budget, flight * mb_bytes) if budget is not None else None
        chosen, error = None, None
        if total is not None and total // flight < 1:
            error = f"a stage budget of {total} bytes leaves nothing for each of {flight} micro-batches in flight"
        elif total is not None:
            try:
                chosen = make_plan(rows, strategy, total // flight)
            except BudgetError as err:
                error = str(err)
        formula = formula_layer_bytes * (e - s) if formula_layer_bytes is not None else None
        out.append(StageEstimate(p, s, e, flight, mb_bytes, formula, total, chosen, error))
    return out


def kept_bytes(costs: CostTable, start: int, end: int) -> int:
    """What the stage's blocks keep with no checkpointing (the part the layer formula describes)."""
    return sum(b.saved(KEEP) for b in costs.blocks[start:end])


def minimum_micro_batch_bytes(costs: CostTable, start: int, end: int) -> int:
    rows = stage_costs(costs, start, end)
    return simulate(rows, [CHECKPOINT] * len(rows)).peak_bytes
