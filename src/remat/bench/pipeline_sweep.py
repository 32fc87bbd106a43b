"""The pipeline ablation of PGAC: ``--sweep stage_sync=local,global`` trains the bench's model as a two-stage
pipeline and compares per-stage thresholds (``local``: each stage's own quantile) with one threshold for the
whole chain (``global``: the stages' EMA scores all-reduced over the pipeline group at every update).

``run_stage_sync_sweep`` starts ``torchrun --nproc_per_node 2 --standalone`` (as ``python -m
torch.distributed.run``) once per mode, on the CPU over gloo. Each rank builds the same model from the bench's
seed 0, keeps its stage (:mod:`remat.bench.pipeline_stages`) and runs 1F1B over the batch cut into micro-batches
(4, or 2 or 1 when the batch size does not divide by 4), with a :func:`remat.integrations.pipeline.stage_pgac`
fitted to the stage's budget: the bench's budget fraction of the stage's no-checkpoint activation memory with
its micro-batches in flight. Every rank profiles its stage on one micro-batch in the first mode's run and saves
the table in ``costs/``; later runs (the other mode, ``--resume``) load it, so both modes plan from the same
costs. Both modes see the same batches and, at every step, the same dropout seeds.

Per step, rank 0 gathers every stage's record (measured activation peak with ``remat.measure``, budget,
blocks recomputed, recompute seconds, the mask the step ran, PGAC's scores and threshold after it, step time)
and prints it as a ``REMAT {json}`` line, which the parent appends to ``pipeline.jsonl`` at once; a summary
line per mode ends the run. Step times include the live-tensor tracker, which runs on every step in both modes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .childproc import child_env, emit, parse
from .pipeline_summary import finished_modes
from .records import JsonlWriter, read_jsonl

NPROC = 2
SCHEDULE = "1f1b"
THRESHOLD_MODES = ("local", "global")


def micro_batches(batch_size: int) -> int:
    """Micro-batches per step: 4, or 2 or 1 when ``batch_size`` does not divide by 4."""
    return next(n for n in (4, 2, 1) if batch_size % n == 0)


def run_stage_sync_sweep(
    config: Any,
    layers: int | None,
    budget: dict[str, Any],
    modes: list[str],
    out_path: Path,
    costs_dir: Path,
) -> list[dict[str, Any]]:
    """Run each threshold mode not yet finished in ``out_path`` under torchrun, appending its records as
    they come; return the summaries of the modes run now."""
    done = finished_modes(read_jsonl(out_path))
    summaries = []
    writer = JsonlWriter(out_path)
    try:
        for mode in modes:
            if mode in done:
                continue
            job = {
                **config.run_fields(layers, 0),
                "threads": 1,
                "device": "cpu",
                "budget_fraction": budget["fraction"],
                "micro_batches": micro_batches(config.batch_size),
                "profile_repeats": config.profile_repeats,
                "costs_dir": str(costs_dir.resolve()),
                "stage_sync": mode,
                "options": config.pgac_options(),
            }
            summaries.append(_launch(job, writer))
    finally:
        writer.close()
    return summaries


def _launch(job: dict[str, Any], writer: Any) -> dict[str, Any]:
    env = child_env(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(NPROC)]
    cmd += ["-m", "remat.bench.pipeline_sweep", json.dumps(job)]
    started = time.perf_counter()
    summary: dict[str, Any] | None = None
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        assert proc.stdout is not None
        for line in proc.stdout:
            record = parse(line.rstrip("\n"))
            if record is None:
                continue
            if record.get("record") == "summary":
                summary = record
            else:
                writer.write(record)
        code = proc.wait()
        err.seek(0)
        tail = "\n".join(err.read().strip().splitlines()[-15:])
    if summary is None:
        summary = {
            "record": "summary",
            "stage_sync": job["stage_sync"],
            "status": "failed",
            "error": f"torchrun exited with code {code}: {tail}",
        }
    summary["wall_s"] = time.perf_counter() - started
    writer.write(summary)
    return summary


def worker(job: dict[str, Any]) -> None:
    """One stage of the sweep (run by torchrun)."""
    import torch
    import torch.distributed as dist

    import remat

    from ..core import KEEP, CostTable
    from ..integrations import pipeline
    from ..planning import no_checkpoint_peak
    from .pipeline_stages import bench_stages, stage_inputs, stage_loss, stage_sample
    from .train import build, load_data

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(job["threads"])
    data = load_data(job)  # the same seed on every rank: the same batches
    n_micro, mode = job["micro_batches"], job["stage_sync"]
    mb = job["batch_size"] // n_micro
    spec = build(job, data)
    first_input, first_target = stage_inputs(spec, data.batch_kwargs(next(data.train_batches())))
    loss_fn = stage_loss(spec)
    sample = stage_sample(spec, rank, first_input[:mb])

    costs_path = Path(job["costs_dir"]) / f"pipeline_stage{rank}_of{world}.json"
    if costs_path.exists():
        costs = CostTable.from_json(costs_path.read_text())
    else:
        last = (lambda out: loss_fn(out, first_target[:mb])) if rank == world - 1 else None
        costs = remat.profile(bench_stages(spec, world)[rank], sample, loss_fn=last, repeats=job["profile_repeats"])
        costs_path.write_text(costs.to_json())
        spec = build(job, data)  # profiling ran the stage: train from the seed's weights as the other mode does
    stage = bench_stages(spec, world)[rank]
    flight = pipeline.in_flight(SCHEDULE, world, rank, n_micro)
    stage_budget = int(job["budget_fraction"] * flight * no_checkpoint_peak(costs))
    options = {"total_steps": job["steps"], "measure": 0, **job["options"]}
    pgac = pipeline.stage_pgac(
        stage, stage_budget, SCHEDULE, n_microbatches=n_micro, costs=costs, thresholds=mode, **options
    )
    _, schedule = pipeline.build(stage, rank, world, SCHEDULE, n_microbatches=n_micro, sample=sample, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=job["lr"])
    pgac.attach(optimizer)
    batches = data.train_batches()
    for step in range(job["steps"]):
        x, target = stage_inputs(spec, data.batch_kwargs(next(batches)))
        torch.manual_seed(1_000_003 * job["seed"] + 7919 * step + rank)  # the same dropout in both modes
        actions = list(pgac.plan.actions.values())
        losses: list[torch.Tensor] = []
        started = time.perf_counter()
        with remat.measure("cpu") as mem:
            if rank == 0:
                schedule.step(x, return_outputs=False)
            elif rank == world - 1:
                schedule.step(target=target, losses=losses, return_outputs=False)
            else:
                schedule.step(return_outputs=False)
        optimizer.step()  # PGAC updates scores, threshold (the all-reduce when global) and mask here
        optimizer.zero_grad(set_to_none=True)
        record = {
            "stage": rank,
            "step_time_s": time.perf_counter() - started,
            "peak_bytes": mem.activation_bytes,
            "budget_bytes": stage_budget,
            "actions": actions,
            "recompute_fraction": sum(a != KEEP for a in actions) / len(actions),
            "recompute_time_s": pgac.handle.stats.total_seconds,
            "scores": list(pgac.scores.values()),
            "tau": pgac.tau,
            "loss": float(torch.stack(losses).detach().mean()) if losses else None,
        }
        pgac.handle.stats.reset()
        gathered: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(record, gathered if rank == 0 else None, dst=0)
        if rank == 0:
            emit(_step_record(job, step, gathered))
    pgac.remove()
    layout: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object((len(stage.blocks), flight, stage_budget), layout if rank == 0 else None, dst=0)
    if rank == 0:
        emit(
            {
                "record": "summary",
                "stage_sync": mode,
                "status": "ok",
                "stages": world,
                "schedule": SCHEDULE,
                "micro_batches": n_micro,
                "steps": job["steps"],
                "warmup": job["warmup"],
                "budget_fraction": job["budget_fraction"],
                "stage_blocks": [b for b, _, _ in layout],
                "in_flight": [f for _, f, _ in layout],
                "stage_budgets": [s for _, _, s in layout],
                "options": job["options"],
            }
        )
    dist.barrier()
    dist.destroy_process_group()


def _step_record(job: dict[str, Any], step: int, stages: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "record": "step",
        "stage_sync": job["stage_sync"],
        "step": step,
        "warmup": step < job["warmup"],
        "loss": stages[-1]["loss"],
        "step_time_s": max(s["step_time_s"] for s in stages),  # the pipeline's step ends with its slowest stage
        "stages": [{k: v for k, v in s.items() if k != "loss"} for s in stages],
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(
            "usage: torchrun --nproc_per_node 2 -m remat.bench.pipeline_sweep JOB_JSON (started by remat bench)",
            file=sys.stderr,
        )
        return 2
    worker(json.loads(args[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
