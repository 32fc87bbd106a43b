"""PGAC under DistributedDataParallel: two CPU ranks over gloo.

``sync="global"`` must give every rank the same scores and masks at every step; ``sync="local"`` keeps a
mask per rank (scores differ with different data per rank). In both, gradients equal those of DDP without
checkpointing, from the same weights, data and dropout seeds.
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
from torch import nn
from torch.nn import functional as F

import remat

STEPS = 6


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def rank_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(8, 12, 16, generator=g) * (1.0 + 2.0 * rank)  # ranks see differently scaled data
    return x, torch.randn(8, 12, 1, generator=g)


def run_mode(rank: int, mode: str, model, reference, opt, ref_opt) -> list[dict]:
    ddp, ref_ddp = model["ddp"], reference["ddp"]
    pgac = remat.PGAC(model["module"], 0.6, alpha=0.5, sync=mode).attach(opt)  # costs measured in step 0
    records = []
    for t in range(STEPS):
        x, y = rank_batch(rank, t)
        torch.manual_seed(1000 * rank + t)
        F.mse_loss(ddp(x), y).backward()
        torch.manual_seed(1000 * rank + t)
        F.mse_loss(ref_ddp(x), y).backward()
        pairs = zip(ddp.parameters(), ref_ddp.parameters(), strict=True)
        diff = max(float((p.grad - q.grad).abs().max()) for p, q in pairs)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        records.append({"diff": diff, "scores": list(pgac.scores.values()), "mask": list(pgac.mask.values())})
    pgac.remove()
    return records


def train(rank: int, out: str) -> None:
    torch.manual_seed(0)
    net = Net()
    ref_net = copy.deepcopy(net)
    model = {"module": net, "ddp": nn.parallel.DistributedDataParallel(net)}
    reference = {"module": ref_net, "ddp": nn.parallel.DistributedDataParallel(ref_net)}
    opt = torch.optim.SGD(model["ddp"].parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference["ddp"].parameters(), lr=0.05)
    result = {mode: run_mode(rank, mode, model, reference, opt, ref_opt) for mode in ("global", "local")}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        train(rank, out)  # the DDP wrappers live only in there: freed before the group is destroyed
    finally:
        gc.collect()  # a DDP reducer outliving its gloo group can abort the process at exit
        dist.barrier()  # neither rank tears gloo down while the other still talks to it
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_ranks_global_masks_agree_and_gradients_match_ddp(tmp_path, free_port):
    mp.spawn(worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for mode in ("global", "local"):
        for r in range(2):
            assert all(step["diff"] <= 1e-6 for step in ranks[r][mode]), (mode, r, ranks[r][mode])
    glob = [ranks[r]["global"] for r in range(2)]
    for a, b in zip(*glob, strict=True):
        assert a["scores"] == b["scores"] and a["mask"] == b["mask"]
    assert any(any(s > 0 for s in step["scores"]) for step in glob[0])
    assert any(not all(step["mask"]) for step in glob[0])  # the budget and threshold recompute some blocks
    local = [ranks[r]["local"] for r in range(2)]
    assert all(a["scores"] != b["scores"] for a, b in zip(*local, strict=True))  # each rank keeps its own scores
    assert any(a["mask"] != b["mask"] for a, b in zip(*local, strict=True))  # and, with these data, its own mask
