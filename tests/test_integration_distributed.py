"""DDP and FSDP2 with remat plans on two CPU processes (gloo): the gathered gradients of every step equal
those of the unsharded model trained without checkpointing on the same data and dropout masks. DDP runs with
and without ``static_graph=True``: the first step, profiled, must fire each parameter's gradient hook once, as
every later step does.

One ``torch.multiprocessing.spawn`` runs every scenario in turn (starting processes is the slow part); the
tests then read what each rank saved. The example script is run with ``torchrun --nproc_per_node 2``.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from toy_models import resident_bytes

import remat
from remat.integrations import distributed

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch was built without torch.distributed")

WORLD, STEPS, WIDTH = 2, 3, 16
ROOT = Path(__file__).resolve().parents[1]


class Block(nn.Module):
    def __init__(self, d: int = WIDTH) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(x))))


class Net(nn.Module):
    def __init__(self, n: int = 3, d: int = WIDTH) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(8, d), nn.Linear(d, 1)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).square().mean()


# name: (wrapper, strategy, options, profile a sample batch before wrapping)
SCENARIOS: dict[str, tuple[str, str, dict[str, Any], bool]] = {
    "ddp-optimal-first-step": ("ddp", "optimal", {"budget": 0.6}, False),
    "ddp-pgac": ("ddp", "pgac", {"budget": 0.7, "alpha": 0.5}, False),
    "ddp-static-optimal-first-step": ("ddp-static", "optimal", {"budget": 0.6}, False),
    "ddp-static-every_k-first-step": ("ddp-static", "every_k", {"k": 2}, False),
    "ddp-static-pgac": ("ddp-static", "pgac", {"budget": 0.7, "alpha": 0.5}, False),
    "fsdp-optimal": ("fsdp", "optimal", {"budget": 0.6}, True),
    "fsdp-every_k": ("fsdp", "every_k", {"k": 2}, True),
    "fsdp-memory_poor": ("fsdp", "memory_poor", {}, True),
}


def data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _scenario(rank: int, wrapper: str, strategy: str, options: dict[str, Any], sample: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    options = dict(options)
    budget = options.pop("budget", None)
    batch = (data(rank, 99),) if sample else None
    session = distributed.prepare(model, strategy, budget, batch=batch, **options)
    if wrapper.startswith("ddp"):
        trained: nn.Module = nn.parallel.DistributedDataParallel(model, static_graph=wrapper == "ddp-static")
    else:
        from torch.distributed.device_mesh import init_device_mesh

        trained = distributed.fully_shard_blocks(model, session, mesh=init_device_mesh("cpu", (WORLD,)))
    opt = torch.optim.SGD(trained.parameters(), lr=0.1)
    grads = []
    for step in range(STEPS):
        torch.manual_seed(10 * step + rank)  # this rank's dropout masks
        trained(data(rank, step)).backward()
        grads.append(distributed.full_gradients(trained))
        opt.step()
        opt.zero_grad()
    result = {
        "grads": grads,
        "actions": dict(session.plan.actions),
        "calls": dict(session.stats.calls),
        "profiling": session.profiling,
        "sync": session.sync,
        "pgac_steps": session.pgac.step_count if session.pgac is not None else None,
    }
    session.remove()
    return result


# remat.fit's memory= on every rank: name -> (wrapper, a sample batch before wrapping)
MEMORY_SCENARIOS = {"ddp-memory-first-step": ("ddp", False), "fsdp-memory": ("fsdp", True)}
MEMORY_SHARE = 0.8  # of the plain step's whole peak


def wide_net() -> Net:
    return Net(n=4, d=64)


def wide_data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(512, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def shaped_data(rank: int, step: int) -> torch.Tensor:
    """:func:`wide_data` in batches of 512, 384 and 256 rows: the first, profiled, is the largest."""
    return wide_data(rank, step)[: 512 - 128 * step]


def momentum(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.01, momentum=0.9)


def plain_whole_peak(rank: int) -> int:
    """The whole peak of a plain step on this rank's batch, once the optimizer's state exists."""
    torch.manual_seed(0)
    model = wide_net()
    optimizer = momentum(model.parameters())
    peaks = []
    for step in range(2):
        start = resident_bytes(model, optimizer)
        with remat.measure() as meter:
            model(wide_data(rank, step)).backward()
            optimizer.step()
            optimizer.zero_grad()
        peaks.append(start + meter.peak_bytes)
    return peaks[-1]


def _memory_scenario(rank: int, wrapper: str, sample: bool, shapes: bool = False) -> dict[str, Any]:
    memory = int(plain_whole_peak(0) * MEMORY_SHARE)  # the same figure on every rank
    torch.manual_seed(0)
    model = wide_net()
    batch = (wide_data(rank, 99),) if sample else None
    data_of = shaped_data if shapes else wide_data
    if wrapper == "ddp":
        session = distributed.prepare(model, memory=memory, batch=batch, **({"shapes": True} if shapes else {}))
        trained: nn.Module = nn.parallel.DistributedDataParallel(model)
        optimizer = momentum(trained.parameters())
    else:
        session = distributed.prepare(model, memory=memory, batch=batch, optimizer=momentum(model.parameters()))
        from torch.distributed.device_mesh import init_device_mesh

        trained = distributed.fully_shard_blocks(model, session, mesh=init_device_mesh("cpu", (WORLD,)))
        optimizer = momentum(trained.parameters())
    grads, peaks = [], []
    for step in range(STEPS):
        torch.manual_seed(10 * step + rank)
        start = resident_bytes(trained, optimizer)
        with remat.measure() as meter:
            trained(data_of(rank, step)).backward()
            grads.append(distributed.full_gradients(trained))
            optimizer.step()
            optimizer.zero_grad()
        peaks.append(start + meter.peak_bytes)
    result = {"grads": grads, "actions": dict(session.plan.actions), "peaks": peaks, "memory": memory,
              "profiling": session.profiling, "sync": session.sync,
              "shape_plans": session.shape_plans is not None}  # fmt: skip
    session.remove()
    return result


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        results = {name: _scenario(rank, *spec) for name, spec in SCENARIOS.items()}
        results |= {name: _memory_scenario(rank, *spec) for name, spec in MEMORY_SCENARIOS.items()}
        results["ddp-memory-shapes-first-step"] = _memory_scenario(rank, "ddp", sample=False, shapes=True)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        gc.collect()  # a DDP reducer outliving its gloo group can abort the process at exit
        dist.destroy_process_group()


def reference(
    make: Callable[[], Net] = Net, batch: Callable[[int, int], torch.Tensor] = data, optimizer: Any = None
) -> list[dict[str, torch.Tensor]]:
    """The unsharded model without checkpointing: each step's gradient is the mean over the ranks' batches."""
    torch.manual_seed(0)
    model = make()
    opt = (optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.1)))(model.parameters())
    out = []
    for step in range(STEPS):
        mean: dict[str, torch.Tensor] = {}
        for rank in range(WORLD):
            torch.manual_seed(10 * step + rank)
            model.zero_grad()
            model(batch(rank, step)).backward()
            for name, p in model.named_parameters():
                mean[name] = mean.get(name, 0) + p.grad / WORLD
        out.append(mean)
        for name, p in model.named_parameters():
            p.grad = mean[name]
        opt.step()
        opt.zero_grad()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, free_port: Callable[[], int]) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("ranks")
    mp.spawn(_worker, args=(free_port(), str(out_dir)), nprocs=WORLD, join=True)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_gradients_equal_unsharded_run_without_checkpointing(runs: list[dict[str, Any]], name: str) -> None:
    ref = reference()
    for rank, run in enumerate(runs):
        got = run[name]
        for step in range(STEPS):
            assert got["grads"][step].keys() == ref[step].keys()
            for param, g in ref[step].items():
                torch.testing.assert_close(
                    got["grads"][step][param], g, rtol=1e-5, atol=1e-6, msg=f"{name} rank {rank} step {step} {param}"
                )
        assert not got["profiling"] and got["sync"] == "global"
    assert runs[0][name]["actions"] == runs[1][name]["actions"]  # every rank runs the same plan


@pytest.mark.parametrize("name", list(MEMORY_SCENARIOS))
def test_memory_holds_the_whole_step_on_every_rank_with_exact_gradients(runs: list[dict[str, Any]], name: str) -> None:
    ref = reference(wide_net, wide_data, momentum)
    for rank, run in enumerate(runs):
        got = run[name]
        assert not got["profiling"] and got["sync"] == "global"
        assert any(a != "keep" for a in got["actions"].values()), got["actions"]
        planned = got["peaks"][1:] if name.endswith("first-step") else got["peaks"]  # step 1 may be profiled
        assert max(planned) <= got["memory"] * 1.02, (rank, got["peaks"], got["memory"])
        for step in range(STEPS):
            for param, g in ref[step].items():
                torch.testing.assert_close(got["grads"][step][param], g, rtol=1e-5, atol=1e-6, msg=f"{name} {param}")
    assert runs[0][name]["actions"] == runs[1][name]["actions"]


def test_plans_per_shape_from_the_first_training_batch_under_ddp(runs: list[dict[str, Any]]) -> None:
    """``shapes=True`` with no batch under DDP: each rank's first batch is profiled cut to smaller shapes as its
    optimizer steps (the model already wrapped: DDP's gradient hooks stay idle there), and the smaller batches after
    it run their own plans within the memory, with the gradients of the unsharded model."""
    ref = reference(wide_net, shaped_data, momentum)
    for rank, run in enumerate(runs):
        got = run["ddp-memory-shapes-first-step"]
        assert got["shape_plans"] and not got["profiling"]
        assert max(got["peaks"][1:]) <= got["memory"] * 1.02, (rank, got["peaks"], got["memory"])
        for step in range(STEPS):
            for param, g in ref[step].items():
                torch.testing.assert_close(got["grads"][step][param], g, rtol=1e-5, atol=1e-6, msg=f"{rank} {param}")


def test_plans_recompute_what_they_say(runs: list[dict[str, Any]]) -> None:
    run = runs[0]
    segments = {"blocks.0": "segment:0", "blocks.1": "segment:0", "blocks.2": "checkpoint"}
    assert run["fsdp-every_k"]["actions"] == segments
    assert run["fsdp-every_k"]["calls"] == {f"blocks.{i}": STEPS for i in range(3)}
    # memory-poor: block 0 is re-run once for its own backward and once to rebuild block 1's input
    assert run["fsdp-memory_poor"]["calls"] == {"blocks.0": 2 * STEPS, "blocks.1": STEPS, "blocks.2": 0}
    # the first step was profiled with every block checkpointed: each block re-ran at least once
    for name in ("ddp-optimal-first-step", "ddp-static-optimal-first-step", "ddp-static-every_k-first-step"):
        assert all(c >= 1 for c in run[name]["calls"].values()), name
    assert run["ddp-static-every_k-first-step"]["actions"] == segments
    assert run["ddp-pgac"]["pgac_steps"] == run["ddp-static-pgac"]["pgac_steps"] == STEPS


@pytest.mark.parametrize("policy", [None, "dots_saveable"])
def test_remat_checkpoint_fn_in_torch_checkpoint_wrapper(policy: str | None) -> None:
    """``checkpoint_wrapper(module, checkpoint_fn=remat.checkpoint_fn)``, as FSDP recipes apply it, with dropout."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    import remat

    torch.manual_seed(0)
    reference = Net()
    torch.manual_seed(0)
    model = Net()
    options = {"policy": policy} if policy is not None else {}
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_fn=remat.checkpoint_fn, **options)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, Block))
    assert all(isinstance(block, CheckpointWrapper) for block in model.blocks)
    for net in (reference, model):
        torch.manual_seed(3)
        net(data(0, 0)).backward()
    got = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_fsdp_needs_the_plan_before_sharding() -> None:
    model = Net()
    session = distributed.prepare(model, "optimal", 0.5)  # no batch: the plan would wait for the first step
    with pytest.raises(RuntimeError, match="batch="):
        distributed.fully_shard_blocks(model, session)
    session.remove()


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags", [[], ["--static-graph"], ["--pgac", "--static-graph"]], ids=["plan", "static-graph", "pgac-static-graph"]
)
def test_example_train_ddp_runs_under_torchrun(tmp_path: Path, free_port: Callable[[], int], flags: list[str]) -> None:
    pytest.importorskip("transformers")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(ROOT / "examples" / "train_ddp.py"),
        "--steps",
        "3",
        "--budget",
        "0.7",
        *flags,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and "loss" in lines[0] and "activation peak" in lines[-1]
    assert "plan:" in proc.stdout
