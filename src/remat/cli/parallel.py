"""``remat plan`` and ``remat advise`` for a model split across pipeline stages, tensor-parallel and
data-parallel ranks (``--stages``, ``--schedule``, ``--micro-batch``, ``--micro-batches``, ``--tp``,
``--sequence-parallel``, ``--dp``, ``--fsdp``): the per-stage table of :mod:`remat.profiling.estimate.parallel`."""

from __future__ import annotations

import argparse
from typing import Any

from ..core import KEEP, format_bytes
from ..profiling import LayerShape, StageEstimate, estimate_stages, shard_costs
from . import args as cli_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism (per-stage figures; with --stages)")
    g.add_argument("--stages", type=cli_args.positive_int, default=None, help="pipeline stages (one per rank)")
    g.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"], help="pipeline schedule")
    g.add_argument("--micro-batch", type=cli_args.positive_int, default=1, help="samples per micro-batch")
    g.add_argument(
        "--micro-batches", type=cli_args.positive_int, default=None, help="micro-batches per step (default 2x stages)"
    )
    g.add_argument("--tp", type=cli_args.positive_int, default=1, help="tensor-parallel degree")
    g.add_argument("--sequence-parallel", action="store_true", help="split the replicated activations along s too")
    g.add_argument(
        "--dp", type=cli_args.positive_int, default=1, help="data-parallel degree (does not split activations)"
    )
    g.add_argument("--fsdp", action="store_true", help="advise: parameters and optimizer state sharded over --dp")


def layer_shape(spec: Any, args: argparse.Namespace) -> LayerShape:
    cfg = spec.config
    hidden = int(cfg.get("hidden_size") or cfg.get("n_embd"))
    heads = int(cfg.get("num_heads") or cfg.get("n_head") or cfg.get("num_attention_heads"))
    if heads % args.tp:
        raise ValueError(f"--tp {args.tp} must divide the {heads} attention heads")
    return LayerShape(args.seq_len, args.micro_batch, hidden, heads, cli_args.bytes_per_element(args.dtype))


def stage_figures(args: argparse.Namespace, spec: Any, costs: Any, budgets: list[Any] | Any) -> list[StageEstimate]:
    """Costs of one micro-batch, sharded for ``--tp``, split into stages; ``budgets`` one per stage or one."""
    shape = layer_shape(spec, args)
    ranked = shard_costs(costs, shape, args.tp, args.sequence_parallel)
    n_micro = args.micro_batches or 2 * args.stages
    formula = shape.layer_bytes(args.tp, args.sequence_parallel)
    return estimate_stages(
        ranked,
        stages=args.stages,
        schedule=args.schedule,
        n_microbatches=n_micro,
        budget=budgets,
        strategy=getattr(args, "strategy", "optimal"),
        formula_layer_bytes=formula,
    )


def print_stages(
    title: str, args: argparse.Namespace, stages: list[StageEstimate], extra: list[str] | None = None
) -> None:
    n_micro = args.micro_batches or 2 * args.stages
    print(
        f"{title}\n{args.stages} stages, {args.schedule}, {n_micro} micro-batches of {args.micro_batch}, "
        f"tp {args.tp}{' + sequence parallel' if args.sequence_parallel else ''}, dp {args.dp} "
        "(data parallelism does not split activations: figures are per rank)"
    )
    head = (
        f"{'stage':>5}  {'blocks':>9}  {'in flight':>9}  {'1 micro-batch':>13}  {'formula':>10}  "
        f"{'stage, none':>11}  {'budget':>10}  {'stage, plan':>11}  {'kept':>7}  {'recompute':>10}"
    )
    print(head)
    for i, s in enumerate(stages):
        kept = sum(a == KEEP for a in s.plan.actions.values()) if s.plan else None
        rec = s.plan.predicted_recompute_s if s.plan and s.plan.predicted_recompute_s is not None else None
        planned = s.planned_stage_bytes
        row = (
            f"{s.index:>5}  {f'{s.start}-{s.end - 1}':>9}  {s.in_flight:>9}  {format_bytes(s.micro_batch_bytes):>13}  "
            f"{format_bytes(s.formula_bytes) if s.formula_bytes is not None else '-':>10}  "
            f"{format_bytes(s.stage_bytes):>11}  "
            f"{format_bytes(s.budget_bytes) if s.budget_bytes is not None else '-':>10}  "
            f"{format_bytes(planned) if planned is not None else ('no fit' if s.error else '-'):>11}  "
            f"{f'{kept}/{s.end - s.start}' if kept is not None else '-':>7}  "
            f"{f'{rec * 1e3:.1f} ms' if rec is not None else '-':>10}"
        )
        print(row + (f"  {extra[i]}" if extra else ""))
    print(
        "'1 micro-batch': predicted peak with every block kept; 'formula': the layer formula x the stage's "
        "blocks; 'stage, none' / 'stage, plan': x micro-batches in flight"
    )
    for s in stages:
        if s.error:
            print(f"stage {s.index}: {s.error}")


def stage_json(s: StageEstimate) -> dict[str, Any]:
    return {
        "stage": s.index,
        "blocks": [s.start, s.end],
        "in_flight": s.in_flight,
        "micro_batch_bytes": s.micro_batch_bytes,
        "formula_bytes": s.formula_bytes,
        "stage_bytes": s.stage_bytes,
        "budget_bytes": s.budget_bytes,
        "planned_stage_bytes": s.planned_stage_bytes,
        "actions": list(s.plan.actions.values()) if s.plan else None,
        "error": s.error,
    }


def advise_stages(args: argparse.Namespace, spec: Any, _batch: Any, costs: Any, write_json: Any) -> int:
    """Per stage: the model state one rank holds, the memory left for activations, the plan that fits it."""
    from ..fitting import model_state_bytes

    n = len(costs)
    sizes = [n // args.stages + (1 if p < n % args.stages else 0) for p in range(args.stages)]
    shard = args.tp * (args.dp if args.fsdp else 1)
    states = [
        model_state_bytes(spec.num_params * k // n, args.optimizer, args.dtype != "float32") // shard for k in sizes
    ]
    budgets: list[Any] = [max(1, args.device_memory - st) for st in states]
    stages = stage_figures(args, spec, costs, budgets)
    extra = [f"state {format_bytes(st)}" for st in states]
    label = f"{spec.name} ({spec.num_params:,} parameters) on {format_bytes(args.device_memory)} per rank"
    print_stages(label, args, stages, extra)
    print(
        "budget = device memory - model state (parameters split by blocks, then over tp"
        + (" and dp (FSDP))" if args.fsdp else ")")
    )
    for s in stages:
        if s.plan is None:
            verdict = "does not fit: more stages, a larger --tp or a smaller micro-batch"
        elif all(a == KEEP for a in s.plan.actions.values()):
            verdict = "fits without checkpointing"
        else:
            verdict = "fits with the plan above"
        print(f"stage {s.index}: {verdict}")
    write_json(
        args.json, {"stages": [stage_json(s) | {"state_bytes": st} for s, st in zip(stages, states, strict=True)]}
    )
    return 0
