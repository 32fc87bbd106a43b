"""Mixed precision: predictions against measured peaks under bf16 autocast, exact gradients under autocast,
autocast's weight casts freed with the checkpointed block, and the training precision detected by the
integrations."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.chains import run_step
from remat.core import AutocastSpec, precision_mismatch
from remat.integrations.lightning import precision_autocast
from remat.meters import LiveTensorTracker
from remat.planning import Plan

BF16 = {"device_type": "cpu", "dtype": "bfloat16", "enabled": True}
EXACT_PLANS = ["checkpoint", "selective:dots_saveable", "segment", "memory_poor", "offload"]


def bf16() -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def gpt2_batch(vocab: int = 256, shape: tuple[int, int] = (2, 32)) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def actions_for(kind: str, n: int) -> list[str]:
    """Every block under ``kind``; groups as two groups of consecutive blocks."""
    if kind in ("segment", "memory_poor"):
        return [f"{kind}:{2 * i // n}" for i in range(n)]
    return [kind] * n


def training_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A mixed-precision step: forward and loss under bf16 autocast, backward outside it, the output held
    until the backward is over. Returns the loss."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # the same dropout draws in every step
    with bf16():
        output = model(**batch)
    output.loss.backward()
    return output.loss.detach()


def step_and_grads(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = training_step(model, batch)
    return loss, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["keep", *EXACT_PLANS[:-1]])  # offload is not profiled on the CPU
def test_predicted_peak_matches_measured_under_bf16_autocast(make_gpt2: Callable[..., nn.Module], kind: str) -> None:
    model, batch = make_gpt2(4, 64, seed=0), gpt2_batch()
    with bf16():
        costs = remat.profile(model, batch)
    assert costs.autocast == BF16
    plan = Plan.from_actions(costs, actions_for(kind, len(costs)))
    handle = remat.apply(model, plan)
    try:
        training_step(model, batch)  # lazy state settles
        with remat.measure() as mem:
            training_step(model, batch)
    finally:
        handle.remove()
    assert mem.activation_bytes == pytest.approx(plan.predicted_peak_bytes, rel=0.05), kind


def test_profile_takes_autocast_explicitly(make_gpt2: Callable[..., nn.Module]) -> None:
    model, batch = make_gpt2(2, 64, seed=0), gpt2_batch()
    with bf16():
        inside = remat.profile(model, batch)
    explicit = remat.profile(model, batch, autocast=torch.bfloat16)
    plain = remat.profile(model, batch)
    assert explicit.autocast == BF16
    assert plain.autocast is not None and not plain.autocast["enabled"]
    assert [b.saved_bytes for b in explicit.blocks] == [b.saved_bytes for b in inside.blocks]
    assert explicit.stem_bytes == inside.stem_bytes and explicit.head_bytes == inside.head_bytes
    # autocast changes what a block keeps: its matmul outputs are bf16, its layer norms float32
    assert explicit.blocks[0].saved_bytes["keep"] != plain.blocks[0].saved_bytes["keep"]


@pytest.mark.parametrize("kind", EXACT_PLANS)
def test_gradients_under_autocast_equal_the_same_autocast_step_without_remat(
    make_gpt2: Callable[..., nn.Module], kind: str
) -> None:
    model, batch = make_gpt2(4, 64, seed=0), gpt2_batch()
    reference_loss, reference = step_and_grads(model, batch)
    fqns = [fqn for fqn, _ in remat.find_blocks(model)]
    handle = remat.apply(model, Plan(dict(zip(fqns, actions_for(kind, len(fqns)), strict=True))))
    try:
        loss, grads = step_and_grads(model, batch)
    finally:
        handle.remove()
    assert torch.equal(loss, reference_loss)
    assert grads.keys() == reference.keys()
    different = [name for name in grads if not torch.equal(grads[name], reference[name])]
    assert not different, f"{kind}: gradients differ from the autocast step without remat in {different[:3]}"


class WideChain(nn.Module):
    """Blocks with large weights and small activations: their bf16 weight casts dwarf what they keep."""

    def __init__(self, n: int = 4, width: int = 512) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def bytes_after_forward(model: nn.Module, x: torch.Tensor) -> int:
    """Live bytes at the end of a forward under bf16 autocast (weight-cast cache on, torch's default)."""
    tracker = LiveTensorTracker()
    with tracker:
        with bf16():
            out = model(x)
            tracker.mark("forward_end")
        out.float().sum().backward()
        del out
    tracker.close()
    return tracker.bytes_at("forward_end")


def test_checkpointed_blocks_leave_no_weight_casts_alive() -> None:
    torch.manual_seed(0)
    model, x = WideChain(), torch.randn(2, 512, requires_grad=True)
    cast_bytes = 512 * 512 * 2  # one weight in bf16
    kept = bytes_after_forward(model, x)
    assert kept >= 4 * cast_bytes  # without remat, every block's weight cast is alive (saved and cached)
    fqns = [fqn for fqn, _ in remat.find_blocks(model)]
    handle = remat.apply(model, Plan({f: "checkpoint" for f in fqns}))
    try:
        checkpointed = bytes_after_forward(model, x)
    finally:
        handle.remove()
    assert checkpointed < cast_bytes, f"{checkpointed} bytes alive after the forward: weight casts kept"


def test_precision_mismatch_names_both_settings() -> None:
    assert precision_mismatch(BF16, AutocastSpec("cpu", torch.bfloat16)) is None
    assert precision_mismatch(None, AutocastSpec("cpu", torch.bfloat16)) is None
    off = {"device_type": "cpu", "dtype": "float32", "enabled": False}
    assert precision_mismatch(off, AutocastSpec("cpu", torch.float16, enabled=False)) is None
    message = precision_mismatch(off, AutocastSpec("cpu", torch.bfloat16))
    assert message is not None and "no autocast" in message and "cpu autocast to bfloat16" in message


# ---------------------------------------------------------------- detection where a training loop is visible


def hf_train_step(model: nn.Module, batch: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)
    with bf16():
        loss = model(**batch).loss
    loss.backward()
    optimizer.step()


def test_hf_enable_profiles_the_first_step_under_the_loops_autocast(make_gpt2: Callable[..., nn.Module]) -> None:
    from remat.integrations import hf

    model, batch = make_gpt2(2, 64, seed=0), gpt2_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    session = hf.enable(model, "sqrt")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing to warn about: the costs come from this very step
            hf_train_step(model, batch, optimizer)
            hf_train_step(model, batch, optimizer)
        assert session.costs is not None and session.costs.autocast == BF16
        assert session.step_autocast == AutocastSpec("cpu", torch.bfloat16)
        assert not session.profiling
    finally:
        session.remove()


def test_hf_enable_warns_when_the_costs_were_measured_in_another_precision(
    make_gpt2: Callable[..., nn.Module],
) -> None:
    from remat.integrations import hf

    model, batch = make_gpt2(2, 64, seed=0), gpt2_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    session = hf.enable(model, "sqrt", batch=batch)  # profiled now, without autocast
    try:
        with pytest.warns(UserWarning, match="measured under no autocast.*cpu autocast to bfloat16"):
            hf_train_step(model, batch, optimizer)
    finally:
        session.remove()
    session = hf.enable(model, "sqrt", batch=batch, autocast=torch.bfloat16)
    try:
        assert session.costs is not None and session.costs.autocast == BF16
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            hf_train_step(model, batch, optimizer)
    finally:
        session.remove()


def test_trainer_and_lightning_settings_name_their_autocast() -> None:
    from remat.integrations.hf import trainer_autocast

    assert trainer_autocast(SimpleNamespace(bf16=True, fp16=False)) == AutocastSpec("cpu", torch.bfloat16)
    assert trainer_autocast(SimpleNamespace(bf16=False, fp16=True), "cuda") == AutocastSpec("cuda", torch.float16)
    assert not trainer_autocast(SimpleNamespace(bf16=False, fp16=False)).enabled
    from remat.integrations.hf import trainer_step

    step = trainer_step(SimpleNamespace(bf16=True, fp16=False, gradient_accumulation_steps=4))
    assert step.autocast == AutocastSpec("cpu", torch.bfloat16) and step.accumulates and not step.holds_output
    assert not trainer_step(SimpleNamespace(bf16=False, fp16=False, gradient_accumulation_steps=1)).accumulates
    cpu = SimpleNamespace(root_device=torch.device("cpu"))
    assert precision_autocast(SimpleNamespace(precision="bf16-mixed", strategy=cpu)) == AutocastSpec(
        "cpu", torch.bfloat16
    )
    assert precision_autocast(SimpleNamespace(precision="16-mixed", strategy=cpu)).dtype == torch.float16
    assert not precision_autocast(SimpleNamespace(precision="bf16-true", strategy=cpu)).enabled


def test_meta_estimate_says_it_cannot_see_autocast() -> None:
    from remat.profiling import meta_cost_table

    def model() -> nn.Module:
        return WideChain(n=2, width=32)

    plain = meta_cost_table(model, torch.zeros(4, 32), device_flops="cpu")
    with pytest.warns(UserWarning, match="no autocast on the meta device"), bf16():
        under = meta_cost_table(model, torch.zeros(4, 32), device_flops="cpu")
    assert under.autocast == plain.autocast == {"device_type": "meta", "dtype": "float32", "enabled": False}
    assert [b.saved_bytes for b in under.blocks] == [b.saved_bytes for b in plain.blocks]
    assert precision_mismatch(under.autocast, AutocastSpec("cpu", torch.bfloat16)) is not None


class _BackwardAutocastProbe(torch.autograd.Function):
    """Identity whose backward records whether autocast was on while it ran."""

    seen: list[bool] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _BackwardAutocastProbe.seen.append(torch.is_autocast_enabled("cpu"))
        return grad


class _ProbedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _BackwardAutocastProbe.apply(torch.tanh(self.linear(x)))


def test_profile_inside_the_users_autocast_runs_every_backward_outside_it() -> None:
    """A loop runs its backward outside the forward's autocast; autocast left on there runs other kernels (in
    bf16 on a CPU: faster, other gradients), so a profile called inside the context must not time that."""
    model = nn.Sequential(nn.Linear(16, 16), *[_ProbedBlock() for _ in range(3)], nn.Linear(16, 1))
    _BackwardAutocastProbe.seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        costs = remat.profile(model, torch.randn(8, 16), blocks=[f"{i}" for i in range(1, 4)], repeats=1)
        run_step(model, torch.randn(8, 16))
        assert torch.is_autocast_enabled("cpu")  # the user's context is left as it was
    assert costs.autocast["enabled"] and costs.autocast["dtype"] == "bfloat16"
    assert len(_BackwardAutocastProbe.seen) > 10 and not any(_BackwardAutocastProbe.seen)
