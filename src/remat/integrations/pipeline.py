"""remat inside ``torch.distributed.pipelining``: stages cut from a model's chain, a schedule (GPipe or 1F1B)
over micro-batches, and on each stage its own static plan or its own PGAC mask, under a per-stage budget.

A stage's budget (bytes for all its activations) is divided by the micro-batches the schedule keeps alive on
it to plan one micro-batch (:mod:`remat.planning.stages`: :func:`in_flight`, :func:`micro_batch_budget`,
:func:`stage_share`), and a plan or PGAC mask is fitted to that share, with costs profiled on one micro-batch
(on the last stage with the real loss, whose own temporaries count). Call ``schedule.step(...,
return_outputs=False)`` in training: with the default the last stage keeps every micro-batch's output to merge
them, memory no plan accounts for.

PGAC per stage (:func:`stage_pgac`): each stage scores its own blocks over all its micro-batches and keeps its
own EMA. Thresholds are
``"local"`` (``tau_p = gamma * Quantile_q(scores of stage p)``) or ``"global"`` (the quantile of the whole
chain's scores, every stage putting its EMA scores at its offset in a zero vector as long as the chain and one
all-reduce (sum) over the pipeline group giving every stage the whole chain). Masks change only between steps:
PGAC re-plans after ``optimizer.step()``, never inside a schedule's step. :mod:`remat.dynamic.pgac.pipeline`
describes a variant that piggybacks the scores on the pipeline's own messages instead of a collective.

>>> stages = split_chain(model.blocks, 2, stem=model.embed, head=model.head)
>>> stage = stages[rank]
>>> handle = apply_stage_plan(stage, remat.profile(stage, sample), budget, "1f1b", n_microbatches=4)
>>> pipe, schedule = build(stage, rank, 2, "1f1b", n_microbatches=4, sample=sample, loss_fn=loss_fn)
>>> schedule.step(x, target=y) if rank == 0 else schedule.step(target=y)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..core import CostTable
from ..dynamic import PGAC
from ..planning import SCHEDULES, check_schedule, in_flight, make_plan, micro_batch_budget, split_stages, stage_share
from ..runtime import RematHandle, apply

THRESHOLDS = ("local", "global")


class Stage(nn.Module):
    """Consecutive blocks of a chain, with the stem (embedding) on the first stage and the head on the last.

    ``blocks`` is an ``nn.ModuleList``, so :func:`remat.find_blocks` finds the stage's chain as ``blocks.0``,
    ``blocks.1``...; ``first_block`` is the index of ``blocks.0`` in the whole chain.
    """

    def __init__(
        self, blocks: Sequence[nn.Module], first_block: int, stem: nn.Module | None, head: nn.Module | None
    ) -> None:
        super().__init__()
        self.stem = stem
        self.blocks = nn.ModuleList(blocks)
        self.head = head
        self.first_block = first_block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stem is not None:
            x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x


def split_chain(
    blocks: Sequence[nn.Module],
    num_stages: int,
    *,
    stem: nn.Module | None = None,
    head: nn.Module | None = None,
    stage_sizes: Sequence[int] | None = None,
) -> list[Stage]:
    """Cut ``blocks`` into ``num_stages`` stages of consecutive blocks (as equal as possible, earlier stages
    taking the extra block, or ``stage_sizes``). The modules are shared with the model, not copied: each rank
    keeps its own stage and drops the others."""
    n = len(blocks)
    if num_stages < 1 or num_stages > n:
        raise ValueError(f"num_stages must be between 1 and the {n} blocks of the chain, got {num_stages}")
    if stage_sizes is None:
        stage_sizes = [n // num_stages + (1 if p < n % num_stages else 0) for p in range(num_stages)]
    elif len(stage_sizes) != num_stages:
        raise ValueError(f"give one size per stage ({num_stages}), got {list(stage_sizes)}")
    bounds = split_stages(n, stage_sizes)
    return [
        Stage(
            [blocks[i] for i in range(s, e)],
            s,
            stem if p == 0 else None,
            head if p == num_stages - 1 else None,
        )
        for p, (s, e) in enumerate(bounds)
    ]


def build(
    stage: nn.Module,
    stage_index: int,
    num_stages: int,
    schedule: str,
    *,
    n_microbatches: int,
    sample: torch.Tensor | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    device: torch.device | str = "cpu",
    group: Any = None,
) -> tuple[Any, Any]:
    """The ``PipelineStage`` of this rank and its ``ScheduleGPipe`` or ``Schedule1F1B`` (``loss_fn(output,
    target)`` on the last stage).

    ``sample``: one micro-batch of what the stage receives. With it the stage's input and output shapes are
    given to ``PipelineStage`` (the stage runs once on it without gradients, the RNG state restored after).
    Without it ``torch.distributed.pipelining`` infers them in the first step by running every stage forward
    and backward on uninitialised tensors, which a PGAC on the stage would score as if they were data: give
    ``sample`` on every stage whenever PGAC runs."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    kind = ScheduleGPipe if check_schedule(schedule) == "gpipe" else Schedule1F1B
    shapes: dict[str, Any] = {}
    if sample is not None:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = stage(sample)
        # requires_grad in the metadata says which gradients cross the stage boundary.
        received = sample.detach().requires_grad_(stage_index > 0 and sample.is_floating_point())
        shapes = {"input_args": received, "output_args": out.detach().requires_grad_(out.is_floating_point())}
    pipe = PipelineStage(stage, stage_index, num_stages, torch.device(device), group=group, **shapes)
    return pipe, kind(pipe, n_microbatches=n_microbatches, loss_fn=loss_fn)


def _stage_position(stage_index: int | None, num_stages: int | None, group: Any) -> tuple[int, int]:
    if stage_index is not None and num_stages is not None:
        return stage_index, num_stages
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "give stage_index and num_stages, or initialise torch.distributed so that they are the rank and "
            "size of the pipeline group"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def apply_stage_plan(
    stage: nn.Module,
    costs: CostTable,
    stage_budget: int | str,
    schedule: str,
    *,
    n_microbatches: int,
    strategy: str = "optimal",
    stage_index: int | None = None,
    num_stages: int | None = None,
    group: Any = None,
    **plan_options: Any,
) -> RematHandle:
    """Plan the stage for one micro-batch under its share of ``stage_budget`` and apply the plan.

    ``costs``: the stage's CostTable measured on one micro-batch (``remat.profile(stage, sample,
    loss_fn=...)``, the real loss on the last stage). Raises
    :class:`remat.BudgetError` when the share is below what the stage needs."""
    p, s = _stage_position(stage_index, num_stages, group)
    budget = stage_share(costs, stage_budget, schedule, s, p, n_microbatches)
    chosen = make_plan(costs, strategy, budget, **plan_options)
    return apply(stage, chosen, costs.fqns)


class ChainScores:
    """The whole chain's EMA scores on every stage, from one all-reduce (sum) over the pipeline group of a
    vector where each stage fills its own blocks' positions. Learns the stages' block counts at its first
    call, with one more all-reduce."""

    def __init__(self, stage_index: int, num_stages: int, group: Any = None) -> None:
        self.stage_index, self.num_stages, self.group = stage_index, num_stages, group
        self.offsets: list[int] | None = None

    def _sum(self, values: list[float]) -> list[float]:
        import torch.distributed as dist

        backend = dist.get_backend(self.group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def __call__(self, own: Sequence[float]) -> list[float]:
        if self.offsets is None:
            counts = [0.0] * self.num_stages
            counts[self.stage_index] = float(len(own))
            sizes = [int(c) for c in self._sum(counts)]
            self.offsets = [sum(sizes[:p]) for p in range(self.num_stages + 1)]
        start, end = self.offsets[self.stage_index], self.offsets[self.stage_index + 1]
        if end - start != len(own):
            raise RuntimeError(f"stage {self.stage_index} had {end - start} blocks and now scores {len(own)}")
        padded = [0.0] * self.offsets[-1]
        padded[start:end] = own
        return self._sum(padded)


def stage_pgac(
    stage: nn.Module,
    stage_budget: int | str,
    schedule: str,
    *,
    n_microbatches: int,
    costs: CostTable,
    thresholds: str = "local",
    stage_index: int | None = None,
    num_stages: int | None = None,
    group: Any = None,
    **pgac_options: Any,
) -> PGAC:
    """A :class:`remat.PGAC` on the stage, fitting masks for one micro-batch under its share of
    ``stage_budget``; ``thresholds`` ``"local"`` (this stage's scores) or ``"global"`` (the whole chain's,
    by an all-reduce over ``group`` at every update: every stage must update at every step). Attach it to
    the stage's optimizer; masks change after each ``optimizer.step()``.

    ``costs``: the stage's CostTable measured on one micro-batch (``remat.profile(stage, sample)``); PGAC's
    own first-step profiling is not used under a pipeline schedule. Other keywords go to PGAC."""
    if thresholds not in THRESHOLDS:
        raise ValueError(f"thresholds must be 'local' or 'global', got {thresholds!r}")
    if "sync" in pgac_options or "threshold_scores" in pgac_options:
        raise ValueError("stage_pgac sets PGAC's thresholds itself: pass thresholds='local' or 'global'")
    p, s = _stage_position(stage_index, num_stages, group)
    budget = stage_share(costs, stage_budget, schedule, s, p, n_microbatches)
    chain = ChainScores(p, s, group) if thresholds == "global" else None
    pgac = PGAC(stage, budget, costs=costs, blocks=costs.fqns, threshold_scores=chain, **pgac_options)
    # Every micro-batch in flight is scored, not only the one whose forward ran last.
    pgac.scorer.max_pending = in_flight(schedule, s, p, n_microbatches)
    return pgac

# The stage arithmetic is the planning stage's (remat.planning.stages); this door exposes it too.
__all__ = [
    "ChainScores",
    "SCHEDULES",
    "Stage",
    "THRESHOLDS",
    "apply_stage_plan",
    "build",
    "check_schedule",
    "in_flight",
    "micro_batch_budget",
    "split_chain",
    "stage_pgac",
    "stage_share",
]
