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
from remat.meters import held_bytes

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
    # A process group of an earlier test (docs/deepspeed.md's example) was destroyed; DeepSpeed still caches its
    # world group, which the engines made here must not use.
    import deepspeed.utils.groups as ds_groups

    ds_groups._WORLD_GROUP = None
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


# ----------------------------------------------------------------------------------------------------
# remat.fit(engine, memory): the whole step under ZeRO-1, DeepSpeed's own buffers included.


class Wide(nn.Module):
    def __init__(self, d: int = 128) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.relu(self.up(x))))


WIDE_BATCH = torch.randn(1024, 32, generator=torch.Generator().manual_seed(3))
THROUGH = ("deepspeed", "torch", "transformers")  # whose objects' attributes hold the engine's tensors
BUCKET = 1_000_000  # reduce_bucket_size in elements: a 4 MB float32 bucket, allocated in every backward
ZERO1 = {
    "train_micro_batch_size_per_gpu": 1024,
    "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
    "zero_optimization": {"stage": 1, "reduce_bucket_size": BUCKET},
    "zero_allow_untested_optimizer": True,
}


def wide_engine(stage: int = 1) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), *[Wide() for _ in range(6)], nn.Linear(128, 4))
    config = {**ZERO1, "zero_optimization": {**ZERO1["zero_optimization"], "stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def engine_steps(engine: Any, steps: int) -> tuple[list[int], list[float]]:
    """``steps`` training steps through the engine (forward, ``loss.backward()``, ``engine.step()``): each step's
    whole peak (what the engine holds before it plus the peak of what the step makes) and its loss."""
    peaks, losses = [], []
    for step in range(steps):
        torch.manual_seed(20 + step)  # dropout masks, replayed by remat's recomputation
        resident = held_bytes(engine, through=THROUGH)
        with remat.measure() as meter:
            loss = engine(WIDE_BATCH).square().mean()
            loss.backward()
            engine.step()
        peaks.append(resident + meter.peak_bytes)
        losses.append(loss.item())
    return peaks, losses


@pytest.fixture(scope="module")
def zero1_plain() -> tuple[int, list[float], list[torch.Tensor]]:
    engine = wide_engine()
    peaks, losses = engine_steps(engine, 3)
    return max(peaks), losses, [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("share, stage", [(0.9, 1), (0.75, 1), (0.75, 2)])
def test_remat_fit_on_a_zero_engine_keeps_the_whole_step_within_memory_exactly(
    zero1_plain: tuple[int, list[float], list[torch.Tensor]], share: float, stage: int
) -> None:
    plain, plain_losses, plain_weights = zero1_plain  # ZeRO-2 on one rank holds what ZeRO-1 holds
    memory = int(plain * share)
    engine = wide_engine(stage)
    session = remat.fit(engine, memory, batch=WIDE_BATCH, loss_fn=lambda out: out.square().mean())
    assert session.model is engine.module and session.plan.action_counts() != "6 keep"
    parts = session.fitted.fixed.parts()
    assert parts["parameter copies (DeepSpeedZeroOptimizer)"] == parts["parameters"]  # ZeRO's float32 copies
    assert parts["optimizer state (DeepSpeedZeroOptimizer)"] == parts["parameters"]  # momentum, before step 1
    peaks, losses = engine_steps(engine, 3)
    assert max(peaks) <= memory * 1.02, (peaks, memory, session.describe())
    assert losses == plain_losses  # bitwise: the fit's own runs left DeepSpeed's gradients and steps alone
    assert all(torch.equal(p, q) for p, q in zip(engine.module.parameters(), plain_weights, strict=True))
    assert sum(session.stats.calls.values()) > 0
    session.remove()


def test_remat_fit_on_a_zero1_engine_refuses_what_nothing_fits_naming_deepspeeds_parts(
    zero1_plain: tuple[int, list[float], list[torch.Tensor]],
) -> None:
    engine = wide_engine()
    with pytest.raises(remat.BudgetError, match=r"parameter copies \(DeepSpeedZeroOptimizer\)") as caught:
        remat.fit(engine, int(zero1_plain[0] * 0.5), batch=WIDE_BATCH, loss_fn=lambda out: out.square().mean())
    assert "the least any plan reaches is" in str(caught.value)
    _, losses = engine_steps(engine, 1)  # the refused fit left the engine training as before
    assert losses == zero1_plain[1][:1]
    with pytest.raises(ValueError, match="pass batch="):
        remat.fit(engine, int(zero1_plain[0] * 0.8))
    with pytest.raises(ValueError, match="at stage 0 DeepSpeed takes only engine.backward"):
        remat.fit(wide_engine(stage=0), int(zero1_plain[0] * 0.8), batch=WIDE_BATCH)
    with pytest.raises(ValueError, match="not measured through a DeepSpeed engine"):
        remat.fit(engine, int(zero1_plain[0] * 0.8), batch=WIDE_BATCH, step=remat.StepSpec(accumulates=True))


def gpt2_engine() -> tuple[Any, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1000, n_positions=128, bos_token_id=0,
                        eos_token_id=0)  # fmt: skip
    model = GPT2LMHeadModel(config)
    model.gradient_checkpointing_enable()
    adam = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    ds_config = {**ZERO1, "train_micro_batch_size_per_gpu": 4, "optimizer": adam}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    return engine, model


GPT2_IDS = torch.randint(0, 1000, (4, 128), generator=torch.Generator().manual_seed(0))


def gpt2_steps(engine: Any, steps: int) -> tuple[list[int], list[float]]:
    peaks, losses = [], []
    for step in range(steps):
        torch.manual_seed(30 + step)
        resident = held_bytes(engine, through=THROUGH)
        with remat.measure() as meter:
            loss = engine(input_ids=GPT2_IDS, labels=GPT2_IDS).loss
            loss.backward()
            engine.step()
        peaks.append(resident + meter.peak_bytes)
        losses.append(loss.item())
    return peaks, losses


def test_a_hugging_face_model_under_zero1_goes_through_the_hf_door_within_memory(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine, model = gpt2_engine()
    model.gradient_checkpointing_disable()
    plain_peaks, plain_losses = gpt2_steps(engine, 2)
    engine, model = gpt2_engine()
    memory = int(max(plain_peaks) * 0.85)
    with caplog.at_level("WARNING", logger="remat"):
        session = remat.fit(engine, memory, batch={"input_ids": GPT2_IDS, "labels": GPT2_IDS})
    assert type(session).__name__ == "HFSession" and model.config.use_cache is False
    assert session.plan.action_counts() != "4 keep"
    assert sum("gradient checkpointing was on" in r.message for r in caplog.records) == 1
    assert not model.transformer.gradient_checkpointing
    peaks, losses = gpt2_steps(engine, 2)
    assert max(peaks) <= memory * 1.02, (peaks, memory, session.describe())
    assert losses == plain_losses
    session.remove()
    assert model.transformer.gradient_checkpointing  # Hugging Face's flag back on


def test_deepspeeds_fused_adam_is_refused_before_its_state_exists_saying_what_to_do() -> None:
    """DeepSpeed's FusedAdam steps with a native kernel that cannot run on meta tensors: before its first step the
    fit refuses it and names the two ways out. The optimizer is DeepSpeed's own class, made without loading its
    kernel (a JIT build of about a minute on a fresh machine), which the refusal never reaches."""
    from deepspeed.ops.adam import FusedAdam

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), *[Wide() for _ in range(2)], nn.Linear(128, 4))
    fused = FusedAdam.__new__(FusedAdam)
    torch.optim.Optimizer.__init__(fused, model.parameters(), {"lr": 1e-3})
    with pytest.raises(RuntimeError, match=r"deepspeed\.ops\.adam\.fused_adam\.FusedAdam.*native kernels.*Take one "
                                           r"training step before remat\.fit.*\"torch_adam\": true"):
        remat.fit(model, "1GiB", batch=torch.randn(8, 32), optimizer=fused, loss_fn=lambda out: out.square().mean())


def test_a_first_step_profiled_under_zero1_does_not_count_the_reduce_bucket_as_activations(
    zero1_plain: tuple[int, list[float], list[torch.Tensor]],
) -> None:
    from remat.planning import no_checkpoint_peak

    bucket = 50_000_000  # 200 MB of float32, about ten times the step's activations
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), *[Wide() for _ in range(6)], nn.Linear(128, 4))
    config = {**ZERO1, "zero_optimization": {"stage": 1, "reduce_bucket_size": bucket}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    session = remat.fit(engine, activations=0.5, loss_fn=lambda out: out.square().mean())
    assert session.profiling
    _, losses = engine_steps(engine, 3)  # the first step is profiled, the plan runs from the second
    assert not session.profiling and session.plan.action_counts() != "6 keep"
    assert no_checkpoint_peak(session.costs) < bucket * 4 / 4  # the 200 MB bucket is DeepSpeed's, not the step's
    assert losses == zero1_plain[1]
    session.remove()
