"""remat under ``torch.distributed.pipelining``: two CPU stages over gloo, GPipe and 1F1B, four micro-batches.

On each stage a static plan, then a PGAC with local and with global thresholds, runs beside the same stage
without checkpointing under the same schedule; losses and gradients must be equal at every step, PGAC's mask
must change between steps, and the stage's measured activation peak must stay within the stage budget (the
reference without checkpointing must exceed it, so the budget binds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

import remat
from remat.integrations import pipeline
from remat.planning import no_checkpoint_peak, simulate, stages

STAGES, MICRO, BATCH, SEQ, D, VOCAB, LAYERS, STEPS = 2, 4, 8, 16, 32, 64, 8, 5


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(SEQ, D)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1]))


class Block(nn.Module):
    """A GPT-2 block: causal self-attention and an MLP, pre-norm, with dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 4, D // 4).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D)
        x = x + self.drop(self.proj(att))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


def make_stage(rank: int) -> pipeline.Stage:
    torch.manual_seed(0)  # the same whole model on every rank; each keeps its own stage
    blocks = [Block() for _ in range(LAYERS)]
    head = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, VOCAB))
    return pipeline.split_chain(blocks, STAGES, stem=Embed(), head=head)[rank]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def sample(rank: int) -> torch.Tensor:
    """One micro-batch of what this stage receives, for profiling."""
    mb = BATCH // MICRO
    return torch.randint(0, VOCAB, (mb, SEQ)) if rank == 0 else torch.randn(mb, SEQ, D)


def run_step(rank: int, schedule, step: int, seed: int) -> tuple[float | None, int]:
    x, y = batch(step)
    torch.manual_seed(seed)
    losses: list[torch.Tensor] = []
    with remat.measure("cpu") as m:
        if rank == 0:
            schedule.step(x, return_outputs=False)
        else:
            schedule.step(target=y, losses=losses, return_outputs=False)
    return (float(torch.stack(losses).detach().sum()) if losses else None), m.activation_bytes


def grad_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p.grad - q.grad).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def run_mode(rank: int, kind: str, mode: str | None, costs, stage_budget: int) -> list[dict]:
    stage, ref = make_stage(rank), make_stage(rank)
    if mode is None:
        control = pipeline.apply_stage_plan(stage, costs, stage_budget, kind, n_microbatches=MICRO)
    else:
        control = pipeline.stage_pgac(
            stage, stage_budget, kind, n_microbatches=MICRO, costs=costs, thresholds=mode, alpha=0.5, q=0.5
        )
    one = sample(rank)  # the stage's shapes, so that pipelining runs no inference on uninitialised tensors
    _, schedule = pipeline.build(stage, rank, STAGES, kind, n_microbatches=MICRO, sample=one, loss_fn=loss_fn)
    _, ref_schedule = pipeline.build(ref, rank, STAGES, kind, n_microbatches=MICRO, sample=one, loss_fn=loss_fn)
    opt, ref_opt = torch.optim.SGD(stage.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    if mode is not None:
        control.attach(opt)
    records = []
    for t in range(STEPS if mode is not None else 2):
        loss, peak = run_step(rank, schedule, t, 1000 + t)
        ref_loss, ref_peak = run_step(rank, ref_schedule, t, 1000 + t)
        diff = grad_diff(stage, ref)
        actions = list(control.plan.actions.values())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        records.append(
            {
                "loss": loss,
                "ref_loss": ref_loss,
                "diff": diff,
                "peak": peak,
                "ref_peak": ref_peak,
                "actions": actions,
                "tau": control.tau if mode is not None else None,
                "scores": list(control.scores.values()) if mode is not None else [],
                "missed": sum(control.scorer.missed) if mode is not None else 0,
            }
        )
    control.remove()
    return records


def worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        mb_target = torch.randint(0, VOCAB, (BATCH // MICRO, SEQ))
        last_loss = (lambda out: loss_fn(out, mb_target)) if rank == STAGES - 1 else None
        costs = remat.profile(make_stage(rank), sample(rank), loss_fn=last_loss, repeats=1)
        result = {}
        for kind in stages.SCHEDULES:
            flight = stages.in_flight(kind, STAGES, rank, MICRO)
            lowest = simulate(costs, ["checkpoint"] * len(costs)).peak_bytes
            stage_budget = flight * (lowest + no_checkpoint_peak(costs)) // 2
            result[kind] = {"budget": stage_budget, "flight": flight}
            for mode in (None, "local", "global"):
                result[kind][str(mode)] = run_mode(rank, kind, mode, costs, stage_budget)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    # Done and torn down: leave without the interpreter's teardown, where a gloo thread still joinable at exit
    # aborted a rank ("terminate called without an active exception") on a loaded machine.
    os._exit(0)


def test_in_flight_counts_and_budget_share():
    assert [stages.in_flight("gpipe", 4, p, 8) for p in range(4)] == [8, 8, 8, 8]
    assert [stages.in_flight("1f1b", 4, p, 8) for p in range(4)] == [4, 3, 2, 1]
    assert [stages.in_flight("1f1b", 4, p, 2) for p in range(4)] == [2, 2, 2, 1]
    assert stages.micro_batch_budget("1KiB", "1f1b", 4, 0, 8) == 256
    with pytest.raises(ValueError, match="schedule must be one of gpipe, 1f1b"):
        stages.in_flight("zero-bubble", 4, 0, 8)


def test_a_stage_before_the_last_sets_aside_its_output_gradient_buffer():
    costs = remat.profile(make_stage(0), sample(0), repeats=1)
    output = costs.blocks[-1].output_bytes
    assert output == (BATCH // MICRO) * SEQ * D * 4
    assert stages.stage_share(costs, 10**6, "1f1b", 2, 0, MICRO) == (10**6 - output) // 2
    last = stages.micro_batch_budget(10**6, "1f1b", 2, 1, MICRO)
    assert stages.stage_share(costs, "1MB", "1f1b", 2, 1, MICRO) == last  # the last stage computes the loss


def test_split_chain_keeps_order_stem_and_head():
    blocks = [nn.Linear(2, 2) for _ in range(5)]
    stem, head = nn.Identity(), nn.Identity()
    stages = pipeline.split_chain(blocks, 2, stem=stem, head=head)
    assert [len(s.blocks) for s in stages] == [3, 2] and [s.first_block for s in stages] == [0, 3]
    assert stages[0].stem is stem and stages[0].head is None and stages[1].head is head
    assert stages[1].blocks[0] is blocks[3]
    assert [name for name, _ in remat.find_blocks(stages[1])] == ["blocks.0", "blocks.1"]
    with pytest.raises(ValueError, match="between 1 and the 5 blocks"):
        pipeline.split_chain(blocks, 6)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_stages_plans_and_pgac_match_no_checkpointing_within_stage_budgets(tmp_path, free_port):
    mp.spawn(worker, args=(STAGES, free_port(), str(tmp_path)), nprocs=STAGES, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(STAGES)]
    for kind in stages.SCHEDULES:
        for r, res in enumerate(ranks):
            assert res[kind]["flight"] == stages.in_flight(kind, STAGES, r, MICRO)
            for mode in ("None", "local", "global"):
                for step in res[kind][mode]:
                    assert step["diff"] <= 1e-6, (kind, mode, r, step)
                    assert step["loss"] == step["ref_loss"]
                    assert step["peak"] <= res[kind]["budget"] < step["ref_peak"], (kind, mode, r, step)
                    assert any(a != "keep" for a in step["actions"])
                    assert all(0 < s < 1e3 for s in step["scores"]), step["scores"]  # real gradients scored
                    assert step["missed"] == 0  # every micro-batch in flight scored
        last = ranks[-1][kind]["global"]
        assert all(step["loss"] is not None for step in last)
        for mode in ("local", "global"):
            masks = {tuple(step["actions"]) for r in range(STAGES) for step in ranks[r][kind][mode]}
            assert len(masks) > 1, (kind, mode, masks)  # PGAC switched masks between steps
        glob = [[step["tau"] for step in ranks[r][kind]["global"]] for r in range(STAGES)]
        assert glob[0] == glob[1]  # one threshold for the whole chain
        local = [[step["tau"] for step in ranks[r][kind]["local"]] for r in range(STAGES)]
        assert local[0] != local[1]  # each stage's own


@pytest.mark.slow
def test_example_train_pipeline_runs_under_torchrun(tmp_path, free_port):
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    cmd += [str(root / "examples" / "train_pipeline.py"), "--steps", "2", "--pgac", "--thresholds", "global"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    if proc.returncode != 0 and "terminate called without an active exception" in proc.stderr:
        # a worker aborted in torch's teardown after its last line (seen once on a loaded 2-core machine):
        # run again, and fail if it does it again
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len([line for line in proc.stdout.splitlines() if line.startswith("step ")]) == 2
    assert proc.stdout.count("within its budget") == 2 and "OVER" not in proc.stdout
