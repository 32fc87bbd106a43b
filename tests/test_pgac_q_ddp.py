"""PGAC-Q under DistributedDataParallel: two CPU ranks over gloo.

With ``sync="global"`` every rank has the same scores and the same three-state masks at every step (rank 0's
first-step cost table, gradient errors included, is broadcast); with ``sync="local"`` each rank keeps its own.
Compressed blocks make the gradients inexact: they stay within a cosine of 0.999 of DDP without checkpointing,
from the same weights, data and dropout seeds.
"""

from __future__ import annotations

import copy
import gc
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_pgac_ddp import Net, rank_batch
from torch import nn
from torch.nn import functional as F

import remat
from remat.profiling.grad_error import compare

STEPS = 6


def run_mode(rank: int, mode: str) -> list[dict]:
    torch.manual_seed(0)
    net = Net(d=64)
    ref_net = copy.deepcopy(net)
    ddp, ref_ddp = nn.parallel.DistributedDataParallel(net), nn.parallel.DistributedDataParallel(ref_net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    pgacq = remat.PGACQ(net, 0.6, alpha=0.5, sync=mode).attach(opt)  # costs measured in step 0
    records = []
    for t in range(STEPS):
        x, y = rank_batch(rank, t)
        x = x.repeat(1, 1, 4)  # width 64: the saved tensors are large enough to be compressed
        ref_net.load_state_dict(net.state_dict())
        torch.manual_seed(1000 * rank + t)
        F.mse_loss(ref_ddp(x), y).backward()
        torch.manual_seed(1000 * rank + t)
        F.mse_loss(ddp(x), y).backward()
        cosine = compare([p.grad for p in ref_ddp.parameters()], [p.grad for p in ddp.parameters()]).cosine
        ran = list(pgacq.states.values())
        opt.step()
        opt.zero_grad()
        ref_ddp.zero_grad()
        records.append({"cosine": cosine, "ran": ran, "scores": list(pgacq.scores.values())})
    pgacq.remove()
    return records


def worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        result = {mode: run_mode(rank, mode) for mode in ("global", "local")}
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        gc.collect()  # a DDP reducer outliving its gloo group can abort the process at exit
        dist.barrier()  # neither rank tears gloo down while the other still talks to it
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_ranks_global_three_state_masks_agree_and_gradients_stay_close(tmp_path, free_port):
    mp.spawn(worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for mode in ("global", "local"):
        for r in range(2):
            assert all(step["cosine"] > 0.999 for step in ranks[r][mode]), (mode, r, ranks[r][mode])
    glob = [ranks[r]["global"] for r in range(2)]
    for a, b in zip(*glob, strict=True):
        assert a["scores"] == b["scores"] and a["ran"] == b["ran"]
    assert any("compress" in step["ran"] for step in glob[0][1:])
    local = [ranks[r]["local"] for r in range(2)]
    assert any(a["scores"] != b["scores"] for a, b in zip(*local, strict=True))  # each rank keeps its own scores
    print("\nPGAC-Q DDP cosines (global, rank 0):", [round(s["cosine"], 7) for s in glob[0]])
    print("states (global):", [s["ran"] for s in glob[0]])
