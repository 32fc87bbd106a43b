"""The distributed ablation of PGAC: ``sync="local"`` (each rank thresholds its own scores) against
``sync="global"`` (EMA scores averaged across ranks, one all-reduce per step, so every rank uses one mask).

``run_sync_sweep`` starts ``torchrun --nproc_per_node 2 --standalone`` (as ``python -m torch.distributed.run``)
once per mode, on the CPU over gloo. Each rank trains the same model (same seed, so the same weights) under
DistributedDataParallel on its own batches (data seed ``seed + 1000 * rank``), with PGAC planning from the
bench's seed-0 cost table at the bench's budget. Rank 0 gathers every rank's step records and prints them as
``REMAT {json}`` lines, then one summary line per mode; the parent writes them to ``ddp.jsonl``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .childproc import child_env, emit, parse
from .records import JsonlWriter

NPROC = 2


def run_sync_sweep(
    config: Any, layers: int | None, budget: dict[str, Any], modes: list[str], out_path: Path, costs_path: Path
) -> list[dict[str, Any]]:
    """Run each sync mode under torchrun; append its records to ``out_path``; return the summaries."""
    summaries = []
    writer = JsonlWriter(out_path)
    try:
        for mode in modes:
            job = {
                **config.run_fields(layers, 0),
                "threads": 1,
                "device": "cpu",
                "budget_bytes": budget["bytes"],
                "costs_path": str(costs_path.resolve()),
                "sync": mode,
                "options": config.pgac_options(),
            }
            summary = _launch(job, writer)
            summaries.append(summary)
    finally:
        writer.close()
    return summaries


def _launch(job: dict[str, Any], writer: Any) -> dict[str, Any]:
    env = child_env(OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(NPROC),
        "-m",
        "remat.bench.ddp_sweep",
        json.dumps(job),
    ]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    summary: dict[str, Any] | None = None
    for line in proc.stdout.splitlines():
        record = parse(line)
        if record is not None:
            writer.write(record)
            if record.get("record") == "summary":
                summary = record
    if summary is None:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        summary = {
            "record": "summary",
            "sync": job["sync"],
            "status": "failed",
            "error": f"torchrun exited with code {proc.returncode}: {tail}",
        }
        writer.write(summary)
    summary["wall_s"] = time.perf_counter() - started
    return summary


def worker(job: dict[str, Any]) -> None:
    """One rank of the sweep (run by torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import remat

    from ..core import KEEP, CostTable
    from .train import build, load_data

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(job["threads"])
    data = load_data({**job, "seed": job["seed"] + 1000 * rank})
    spec = build(job, data)  # the model seed is job["seed"] on every rank: identical weights
    model = spec.module
    costs = CostTable.from_json(Path(job["costs_path"]).read_text())
    pgac = remat.PGAC(
        model, job["budget_bytes"], costs=costs, sync=job["sync"], total_steps=job["steps"], measure=0, **job["options"]
    )
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=job["lr"])
    pgac.attach(optimizer)
    torch.manual_seed(job["seed"] + rank)
    batches = data.train_batches()
    records = []
    for step in range(job["steps"]):
        batch = data.batch_kwargs(next(batches))
        t0 = time.perf_counter()
        loss = spec.loss_fn(ddp(**batch))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_time = time.perf_counter() - t0
        ran = pgac.history[-1].actions
        records.append(
            {
                "record": "step",
                "sync": job["sync"],
                "rank": rank,
                "step": step,
                "loss": float(loss.detach()),
                "step_time_s": step_time,
                "recompute_time_s": pgac.handle.stats.total_seconds,
                "stored": [a == KEEP for a in ran],
                "scores": list(pgac.history[-1].scores),
                "tau": pgac.tau,
                "warmup": step < job["warmup"],
            }
        )
        pgac.handle.stats.reset()
    pgac.remove()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, records)
    if rank == 0:
        for rank_records in gathered:
            for record in rank_records:
                emit(record)
        emit(_summarize(job, gathered))
    dist.barrier()
    dist.destroy_process_group()


def _summarize(job: dict[str, Any], gathered: list[list[dict[str, Any]]]) -> dict[str, Any]:
    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    timed = [[r for r in records if not r["warmup"]] for records in gathered]
    steps = len(gathered[0])
    agree = sum(1 for i in range(steps) if all(g[i]["stored"] == gathered[0][i]["stored"] for g in gathered))
    return {
        "record": "summary",
        "sync": job["sync"],
        "status": "ok",
        "ranks": len(gathered),
        "steps": steps,
        "step_time_s": mean([r["step_time_s"] for records in timed for r in records]),
        "recompute_time_s": mean([r["recompute_time_s"] for records in timed for r in records]),
        "mask_agreement": agree / steps if steps else None,
        "final_loss": mean([records[-1]["loss"] for records in gathered]),
        "mean_stored_blocks": mean([sum(r["stored"]) for records in timed for r in records]),
        "budget_bytes": job["budget_bytes"],
        "options": job["options"],
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(
            "usage: torchrun --nproc_per_node 2 -m remat.bench.ddp_sweep JOB_JSON (started by remat bench)",
            file=sys.stderr,
        )
        return 2
    worker(json.loads(args[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
