"""The function API under arguments copied from torch's documentation, and under second backward passes
(retain_graph=True twice, create_graph=True): what works, what torch refuses, and plans that avoid it."""

from __future__ import annotations

import copy

import pytest
import torch

import remat
from remat.core import Action
from remat.planning.strategies import check_double_backward, double_backward_actions


def block(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return torch.tanh(x @ x.T).sin() * scale


def grads_of(fn, x: torch.Tensor, **kwargs) -> torch.Tensor:
    x = x.detach().requires_grad_()
    fn(x, **kwargs).sum().backward()
    return x.grad


def test_use_reentrant_false_is_accepted_and_changes_nothing():
    x = torch.randn(5, 5)
    expected = grads_of(block, x, scale=2.0)
    got = grads_of(lambda t, **kw: remat.checkpoint(block, t, use_reentrant=False, **kw), x, scale=2.0)
    assert torch.equal(got, expected)
    decorated = remat.checkpointed(block, use_reentrant=False)
    assert torch.equal(grads_of(decorated, x, scale=2.0), expected)
    assert torch.equal(grads_of(lambda t: remat.checkpoint(block, t, use_reentrant=None), x), grads_of(block, x))


def test_use_reentrant_true_is_refused_with_the_reason():
    x = torch.randn(5, 5, requires_grad=True)
    with pytest.raises(ValueError, match="use_reentrant=True is not supported: pass use_reentrant=False"):
        remat.checkpoint(block, x, use_reentrant=True)
    with pytest.raises(ValueError, match="use_reentrant=True is not supported"):
        remat.checkpointed(use_reentrant=True)
    with torch.no_grad(), pytest.raises(ValueError, match="use_reentrant=True"):
        remat.checkpoint(block, x, use_reentrant=True)  # refused even where checkpointing would be a plain call


def second_order(fn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A gradient penalty: d/dx of ||d fn(x).sum() / dx||^2, and the first gradient."""
    x = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
    g.square().sum().backward()
    return x.grad, g.detach()


def twice(fn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_()
    y = fn(x).sum()
    y.backward(retain_graph=True)
    first = x.grad.clone()
    y.backward()
    return first, x.grad


@pytest.mark.parametrize("policy", [None, "nothing_saveable"])
def test_plain_checkpoint_supports_a_second_backward_exactly(policy):
    x = torch.randn(6, 6)
    wrapped = lambda t: remat.checkpoint(block, t, policy=policy)  # noqa: E731
    for run in (second_order, twice):
        got, expected = run(wrapped, x), run(block, x)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), run.__name__


@pytest.mark.parametrize("policy", ["dots_saveable", "everything_saveable"])
def test_selective_regions_allow_one_backward_as_documented(policy):
    """Pins torch's limit that docs/strategies.md and remat.planning.strategies describe."""
    x = torch.randn(6, 6)
    wrapped = lambda t: remat.checkpoint(block, t, policy=policy)  # noqa: E731
    for run in (second_order, twice):
        with pytest.raises(RuntimeError, match="only allowed to backward once"):
            run(wrapped, x)


@pytest.mark.parametrize(
    ("action", "safe"),
    [
        ("keep", True),
        ("checkpoint", True),
        ("offload", True),
        ("segment", True),
        ("nested", True),
        ("segment:0", True),
        ("nested:3", True),
        ("selective:nothing_saveable", True),
        ("selective:dots_saveable", False),
        ("selective:everything_saveable", False),
        ("selective:mine", False),
    ],
)
def test_which_actions_are_safe(action, safe):
    assert Action.choice(action).allows_double_backward is safe


def selective_costs(n: int = 4) -> remat.CostTable:
    """Blocks where keeping matmul outputs is cheap in memory and saves most of the recompute."""
    rows = [
        remat.BlockCost(
            f"{i}",
            1e-3,
            2e-3,
            100,
            100,
            {"keep": 1000, "checkpoint": 100, "selective:dots_saveable": 350},
            {"keep": 0.0, "checkpoint": 1e-3, "selective:dots_saveable": 1e-4},
        )
        for i in range(n)
    ]
    return remat.CostTable(rows)


def test_double_backward_plans_leave_out_selective_actions():
    costs = selective_costs()
    budget = remat.simulate(costs, ["selective:dots_saveable"] * 4).peak_bytes
    usual = remat.plan(costs, "optimal", budget)
    assert "selective:dots_saveable" in usual.actions.values()  # the restriction below is not vacuous
    safe = remat.plan(costs, "optimal", budget, double_backward=True)
    assert safe.fits and all(Action.parse(a).allows_double_backward for a in safe.actions.values())
    assert safe.predicted_recompute_s > usual.predicted_recompute_s  # the restriction has a price
    assert double_backward_actions(costs) == ["keep", "checkpoint", "segment", "memory_poor"]
    assert double_backward_actions(costs, ["keep", "selective:dots_saveable"]) == ["keep"]
    restricted = remat.plan(costs, "optimal", budget, double_backward=True, actions=["keep", "checkpoint"])
    assert set(restricted.actions.values()) <= {"keep", "checkpoint"}
    assert remat.plan(costs, "full", double_backward=True).actions == remat.plan(costs, "full").actions
    with pytest.raises(ValueError, match="double_backward=True"):
        check_double_backward(list(usual.actions.values()))


class Block(torch.nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.tanh(self.fc1(x))))


def gradient_penalty_step(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(7)
    (g,) = torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
    g.square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_a_double_backward_plan_runs_a_gradient_penalty_exactly():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Block() for _ in range(4))).train()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16)
    costs = remat.profile(model, x, loss_fn=lambda out: out.square().sum(), policies=["dots_saveable"])
    tight = remat.simulate(costs, ["checkpoint"] * 4).peak_bytes
    plan = remat.plan(costs, "optimal", tight, double_backward=True)
    handle = remat.apply(model, plan)
    try:
        got = gradient_penalty_step(model, x)
        assert handle.stats.total_calls > 0  # blocks were recomputed
    finally:
        handle.remove()
    expected = gradient_penalty_step(reference, x)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    selective = remat.Plan({fqn: "selective:dots_saveable" for fqn in plan.actions})
    handle = remat.apply(model, selective)
    try:
        with pytest.raises(RuntimeError, match="only allowed to backward once"):
            gradient_penalty_step(model, x)
    finally:
        handle.remove()
