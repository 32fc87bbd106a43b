"""Offload policies (``remat.policies.offload_dots``, ``offload_only``, ``save_and_offload``) on CPU: gradients
bit for bit those of no checkpointing (dropout included), the offloaded operators not run again in backward,
one copy per offloaded output made in forward and served in recompute, on CPU in the same memory as saving
them, usable as a ``checkpoint`` policy, a ``Checkpoint`` wrapper's policy and a plan action (profiled like
any other), and clear errors for arguments that are not operators. The device-memory saving is checked on
CUDA in ``tests/test_gpu.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from toy_models import MLPBlock, assert_same_step, chain_input, seeded_chain, step

import remat
from remat import policies
from remat.core import Action
from remat.meters import LiveTensorTracker
from remat.planning import Plan

aten = torch.ops.aten


class OpLog(TorchDispatchMode):
    """Counts calls of each overload packet while active, and the bytes of each ``clone`` output."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[Any, int] = {}
        self.cloned: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        self.counts[func.overloadpacket] = self.counts.get(func.overloadpacket, 0) + 1
        if func.overloadpacket is aten.clone:
            self.cloned.append(out.numel() * out.element_size())
        return out


def block(dropout: float = 0.3) -> nn.Module:
    torch.manual_seed(0)
    return MLPBlock(32, 32, hidden=128, dropout=dropout)


def grads(module: nn.Module, x: torch.Tensor, policy: Any, seed: int = 3) -> list[torch.Tensor]:
    module.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(seed)
    out = module(x) if policy is None else remat.checkpoint(module, x, policy=policy)
    out.square().sum().backward()
    return [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]


OFFLOADING = [
    policies.offload_dots,
    policies.offload_only("addmm"),
    policies.offload_only(aten.gelu, "aten.addmm"),
    policies.save_and_offload(save=["gelu"], offload=["addmm"]),
]


@pytest.mark.parametrize("policy", OFFLOADING, ids=lambda p: p.name)
def test_gradients_equal_no_checkpointing_bitwise_with_dropout(policy: policies.Policy) -> None:
    module = block(dropout=0.3)
    x = torch.randn(16, 32, requires_grad=True)
    reference = grads(module, x, None)
    got = grads(module, x, policy)
    assert all(torch.equal(a, b) for a, b in zip(reference, got, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(reference, grads(module, x, None, seed=4), strict=True))


def forward_and_backward_ops(module: nn.Module, policy: Any) -> tuple[OpLog, OpLog, int]:
    """The ops of the forward and of the backward of one checkpointed call, and the bytes alive after forward."""
    x = torch.randn(16, 32, requires_grad=True)
    tracker = LiveTensorTracker()
    forward, backward = OpLog(), OpLog()
    with tracker:
        with forward:
            out = remat.checkpoint(module, x, policy=policy)
        tracker.mark("forward_end")
        with backward:
            out.sum().backward()
    tracker.close()
    return forward, backward, tracker.bytes_at("forward_end", exclude_survivors=False)


def test_offloaded_ops_are_copied_once_in_forward_and_not_run_again_in_backward() -> None:
    module = block(dropout=0.0)
    plain_fwd, plain_bwd, _ = forward_and_backward_ops(module, "nothing_saveable")
    fwd, bwd, _ = forward_and_backward_ops(module, policies.offload_dots)
    # Plain checkpointing re-runs the first linear layer (addmm) in backward; offload_dots serves its copy.
    assert plain_bwd.counts.get(aten.addmm, 0) == 1
    assert bwd.counts.get(aten.addmm, 0) == 0
    assert bwd.counts.get(aten.gelu, 0) == 1  # elementwise ops are still recomputed
    # One copy per addmm output in forward (16x128 and 16x32 float32), none under plain checkpointing ...
    assert plain_fwd.cloned == [] and sorted(fwd.cloned) == [16 * 32 * 4, 16 * 128 * 4]
    # ... and in backward the one recompute needs is handed out (a copy again, on CPU), not recomputed.
    assert bwd.cloned == [16 * 128 * 4]


def test_offload_only_gelu_serves_gelu_and_recomputes_the_matmuls() -> None:
    module = block(dropout=0.0)
    fwd, bwd, _ = forward_and_backward_ops(module, policies.offload_only("gelu"))
    assert bwd.counts.get(aten.gelu, 0) == 0 and bwd.counts.get(aten.addmm, 0) == 1
    assert fwd.cloned == [16 * 128 * 4]


def test_on_cpu_the_copies_take_the_memory_saving_them_takes() -> None:
    module = block(dropout=0.0)
    _, _, offloaded = forward_and_backward_ops(module, policies.offload_dots)
    _, _, saved = forward_and_backward_ops(module, "dots_saveable")
    _, _, recomputed = forward_and_backward_ops(module, "nothing_saveable")
    assert offloaded == saved > recomputed


def test_an_in_place_op_on_an_offloaded_output_gives_exact_gradients() -> None:
    # torch's own cache refuses a saved output mutated in place; the host copy is taken before the mutation.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 64), nn.ReLU(inplace=True), nn.Dropout(0.2), nn.Linear(64, 16))
    x = torch.randn(8, 16, requires_grad=True)
    reference = grads(module, x, None)
    assert all(torch.equal(a, b) for a, b in zip(reference, grads(module, x, "offload_dots"), strict=True))
    with pytest.raises(RuntimeError, match="'dots_saveable' saved an operator's output that the region then changed"):
        grads(module, x, "dots_saveable")


def test_two_backward_passes_through_an_offload_region() -> None:
    module = block(dropout=0.3)
    x = torch.randn(16, 32, requires_grad=True)
    torch.manual_seed(3)
    loss = module(x).square().sum()
    (ref,) = torch.autograd.grad(loss, x)
    torch.manual_seed(3)
    loss = remat.checkpoint(module, x, policy="offload_dots").square().sum()
    (first,) = torch.autograd.grad(loss, x, retain_graph=True)
    (second,) = torch.autograd.grad(loss, x)
    assert torch.equal(first, ref) and torch.equal(second, ref)
    assert Action.parse("selective:offload_dots").allows_double_backward


def test_usable_as_checkpoint_wrapper_policy_and_plan_action() -> None:
    model = seeded_chain(4, dropout=0.2)
    x = chain_input()
    reference = step(model, x)
    fqns = [fqn for fqn, _ in remat.find_blocks(model)]
    handle = remat.apply(model, Plan(dict.fromkeys(fqns, "selective:offload_dots")))
    try:
        assert_same_step(reference, step(model, x))
    finally:
        handle.remove()
    wrapped = remat.Checkpoint(block(dropout=0.3), policy=policies.offload_dots)
    assert "policy=offload_dots" in repr(wrapped)
    y = torch.randn(4, 32, requires_grad=True)
    reference_grads = grads(block(dropout=0.3), y, None)
    y.grad = None
    torch.manual_seed(3)
    wrapped(y).square().sum().backward()
    got = [p.grad.clone() for p in wrapped.parameters()] + [y.grad.clone()]
    assert all(torch.equal(a, b) for a, b in zip(reference_grads, got, strict=True))


def test_profiled_like_any_selective_action() -> None:
    model = seeded_chain(3, dropout=0.0)
    costs = remat.profile(model, chain_input(), policies=("dots_saveable", "offload_dots"), repeats=1)
    for row in costs.blocks:
        # on CPU the copies are in the same memory: the saved bytes are those of saving the same outputs
        assert row.saved_bytes["selective:offload_dots"] == row.saved_bytes["selective:dots_saveable"]
        assert row.recompute_s["selective:offload_dots"] >= 0.0
    plan = remat.plan(costs, "optimal", budget=1.0, actions=["keep", "checkpoint", "selective:offload_dots"])
    assert set(plan.actions.values()) <= {"keep", "checkpoint", "selective:offload_dots"}


def test_arguments_that_are_not_operators_are_refused() -> None:
    with pytest.raises(TypeError, match="expected an operator such as torch.ops.aten.mm.*got 3"):
        policies.offload_only(3)
    with pytest.raises(TypeError, match="name the aten op they run"):
        policies.offload_only(torch.mm)
    with pytest.raises(ValueError, match="no 'not_an_op'"):
        policies.offload_only("aten.not_an_op")
    with pytest.raises(ValueError, match="at least one operator"):
        policies.offload_only()
    with pytest.raises(ValueError, match="addmm are both saved and offloaded"):
        policies.save_and_offload(save=["addmm", "gelu"], offload=[aten.addmm])
    with pytest.raises(TypeError, match="expected an operator"):
        policies.save_only(nn.Linear)


def test_names() -> None:
    assert policies.get("offload_dots") is policies.offload_dots
    assert "offload_dots" in policies.names()
    assert policies.offload_only("mm", "addmm").name == "offload_only(addmm,mm)"
    assert policies.save_and_offload(save=["gelu"], offload=["mm"]).name == "save_and_offload(save=(gelu),offload=(mm))"
    # views, random ops and fresh buffers are never offloaded, whatever the list says
    view_policy = policies.offload_only("t", "native_dropout", "empty_like", "addmm")
    assert not view_policy.offloads(aten.t.default)
    assert not view_policy.offloads(aten.native_dropout.default)
    assert not view_policy.offloads(aten.empty_like.default)
    assert view_policy.offloads(aten.addmm.default)
