"""How a chain and its budget split over pipeline stages: which blocks each stage owns, the rows of the cost
table a stage plans with, how many micro-batches a schedule keeps alive on a stage, and the bytes one
micro-batch may use there.

A pipeline stage stores every micro-batch's activations from that micro-batch's forward until its backward.
How many micro-batches are alive at once on a stage depends on the schedule (:func:`in_flight`): under GPipe
all forwards run before any backward, so all ``n_microbatches`` are alive on every stage; under 1F1B stage
``p`` of ``S`` runs ``min(n_microbatches, S - p)`` forwards before its first backward and then alternates one
backward and one forward, so at most that many are alive. A stage's budget (bytes for all its activations) is
therefore divided by the in-flight count to plan one micro-batch (:func:`micro_batch_budget`; :func:`stage_share`
first sets aside the buffer a stage before the last receives its output's gradient into).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..core import CostTable, parse_budget

SCHEDULES = ("gpipe", "1f1b")


def split_stages(n_blocks: int, stage_sizes: Sequence[int]) -> list[tuple[int, int]]:
    if any(s < 1 for s in stage_sizes) or sum(stage_sizes) != n_blocks:
        raise ValueError(f"stage sizes {list(stage_sizes)} must be positive and sum to the {n_blocks} blocks")
    stages, start = [], 0
    for size in stage_sizes:
        stages.append((start, start + size))
        start += size
    return stages


def stage_costs(costs: CostTable, start: int, end: int) -> CostTable:
    """The rows a stage owns. Its stem is the activation it receives; before the last stage, its head is the
    gradient of its output that arrives from the next stage."""
    last = end == len(costs)
    rows = costs.blocks[start:end]
    stem = costs.stem_bytes if start == 0 else rows[0].input_bytes
    head = costs.head_bytes if last else rows[-1].output_bytes
    retained = costs.head_retained_bytes if last else 0
    return replace(
        costs, blocks=list(rows), stem_bytes=stem, head_bytes=head, head_retained_bytes=retained,
        chain_lengths=[], between_bytes=[], backward_bytes=[],  # a stage is planned as one chain
        call_grad_bytes=costs.call_grad_bytes[start:end], held_args_rows=costs.held_args_rows[start:end],
    )  # fmt: skip


def check_schedule(schedule: str) -> str:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    return schedule


def in_flight(schedule: str, num_stages: int, stage_index: int, n_microbatches: int) -> int:
    """How many micro-batches' activations are alive at once on stage ``stage_index`` under ``schedule``."""
    check_schedule(schedule)
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index must be in [0, {num_stages}), got {stage_index}")
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
    if schedule == "gpipe":
        return n_microbatches
    return min(n_microbatches, num_stages - stage_index)


def micro_batch_budget(
    stage_budget: int | str,
    schedule: str,
    num_stages: int,
    stage_index: int,
    n_microbatches: int,
    reserved: int = 0,
) -> int:
    """The bytes one micro-batch may use on the stage: the stage's budget, less ``reserved`` bytes the schedule
    holds beside the activations, divided by the in-flight count."""
    total = parse_budget(stage_budget) if isinstance(stage_budget, str) else int(stage_budget)
    return (total - reserved) // in_flight(schedule, num_stages, stage_index, n_microbatches)


def stage_share(
    costs: CostTable, stage_budget: int | str, schedule: str, num_stages: int, stage_index: int, n_microbatches: int
) -> int:
    """What one micro-batch's plan may use on the stage: :func:`micro_batch_budget` of the stage budget less, on a
    stage before the last, the buffer the next stage's gradient of this stage's output is received into. The
    stage's profile ends in a sum of its output, whose gradient allocates nothing of that size; in the schedule
    one such buffer is alive beside the activations (1F1B's first stage measured 4,208 B over a plan at its
    share's edge without it)."""
    receives_grad = stage_index < num_stages - 1 and costs.blocks
    reserved = costs.blocks[-1].output_bytes if receives_grad else 0
    return micro_batch_budget(stage_budget, schedule, num_stages, stage_index, n_microbatches, reserved)
