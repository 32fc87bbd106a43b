"""DeepSpeed: remat's checkpoint function as ``PipelineModule``'s ``activation_checkpoint_func``, in place of
``deepspeed.checkpointing.checkpoint``, and a remat plan under ``deepspeed.initialize`` (ZeRO stage 1), on CPU
with one gloo rank. Skipped, with the reason, where DeepSpeed does not install or import."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.integrations import deepspeed as remat_ds

try:
    import deepspeed
    from deepspeed.pipe import PipelineModule
except Exception as err:  # ImportError, or deepspeed's own errors when it cannot set up an accelerator
    pytest.skip(f"deepspeed cannot be imported here ({type(err).__name__}: {err})", allow_module_level=True)


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(x))))


X = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", autouse=True)
def one_rank(free_port: Callable[[], int]) -> Iterator[None]:
    """DeepSpeed's pipeline and engine need torch.distributed: one gloo rank in this process, removed after."""
    import torch.distributed as dist

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_port())
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def grads(model: nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)  # dropout masks
    model.train()
    model(X).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-7, msg=name)


def pipeline(interval: int, func: Any = None) -> PipelineModule:
    torch.manual_seed(0)
    options = {} if func is None else {"activation_checkpoint_func": func}
    module = PipelineModule(layers=[Block() for _ in range(4)], num_stages=1, **options)
    module.set_checkpoint_interval(interval)
    return module


@pytest.mark.parametrize("interval,policy", [(2, None), (1, "dots_saveable")])
def test_pipeline_module_with_remat_activation_checkpoint_func(interval: int, policy: str | None) -> None:
    calls = []

    def counted(function: Any, *args: Any) -> Any:
        calls.append(len(args))
        return remat_ds.activation_checkpoint_func(policy)(function, *args)

    assert_same(grads(pipeline(0)), grads(pipeline(interval, counted)))
    assert len(calls) == 4 // interval  # DeepSpeed called remat's function once per group of layers


class CallsDeepSpeedCheckpoint(nn.Module):
    """Model code written against DeepSpeed, as in Megatron-DeepSpeed: ``deepspeed.checkpointing.checkpoint``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = deepspeed.checkpointing.checkpoint(block, x)
        return x


def test_in_place_of_deepspeed_checkpointing_checkpoint() -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(*[Block() for _ in range(3)])
    torch.manual_seed(0)
    model = CallsDeepSpeedCheckpoint()
    original = deepspeed.checkpointing.checkpoint
    with remat_ds.patched() as fn:
        assert deepspeed.checkpointing.checkpoint is fn is remat.checkpoint_fn
        got = grads(model)
    assert deepspeed.checkpointing.checkpoint is original
    ref = grads(reference)
    assert_same({k.replace("blocks.", ""): v for k, v in got.items()}, ref)
    assert remat_ds.checkpoint is remat.checkpoint_fn


def test_remat_plan_under_deepspeed_engine_zero1() -> None:
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), *[Block() for _ in range(3)])

    def train(model: nn.Module, step_fn: Any) -> list[float]:
        losses = []
        for step in range(2):
            torch.manual_seed(5 + step)
            losses.append(step_fn(model(X).square().mean()))
        return losses

    ref_model = make()
    opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)

    def ref_step(loss: torch.Tensor) -> float:
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    ref_losses = train(ref_model, ref_step)

    model = make()
    plan = remat.Plan({"1": "checkpoint", "2": "segment:0", "3": "segment:0"})
    handle = remat.apply(model, plan, blocks=["1", "2", "3"])  # the plan first, then deepspeed.initialize
    config = {
        "train_micro_batch_size_per_gpu": 3,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def ds_step(loss: torch.Tensor) -> float:
        engine.backward(loss)
        engine.step()
        return loss.item()

    losses = train(engine, ds_step)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert handle.stats.calls == {"1": 2, "2": 2, "3": 2}
    handle.remove()
