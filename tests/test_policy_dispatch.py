"""What a selective region puts in the way of each operator: the built-in policies decide once per operator,
a user callable is asked at every call, the forward logs CPU draws from the policy (no dispatch mode of its
own where torch passes the op's output to the policy), and a recompute with nothing to replay adds no mode."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from remat.policies import Policy
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import remat
from remat.checkpointing import replayed_draws


class Probe(nn.Module):
    """Linear, tanh, dropout, linear; notes the dispatch modes active inside its forward."""

    def __init__(self, p: float = 0.3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 16)
        self.drop = nn.Dropout(p)
        self.modes: list[list[str]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes.append([type(m).__name__ for m in _get_current_dispatch_mode_stack()])
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def _grads(block: nn.Module, x: torch.Tensor, policy: Any) -> list[torch.Tensor]:
    block.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(3)
    out = block(x) if policy is None else remat.checkpoint(block, x, policy=policy)
    out.square().sum().backward()
    return [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]


def test_a_by_op_policy_is_asked_once_per_operator_and_a_callable_every_time() -> None:
    asked: list[Any] = []

    def save_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        asked.append(op)
        return op == torch.ops.aten.addmm.default

    torch.manual_seed(0)
    block, x = Probe(), torch.randn(8, 16, requires_grad=True)
    reference = _grads(block, x, None)
    for by_op in (True, False):
        asked.clear()
        policy = Policy(f"save_mm_{by_op}", save_mm, by_op=by_op)
        for _ in range(2):
            got = _grads(block, x, policy)
            assert all(torch.equal(a, b) for a, b in zip(reference, got, strict=True))
        addmm_calls = asked.count(torch.ops.aten.addmm.default)
        assert addmm_calls == (1 if by_op else 4)  # two linears, two steps


@pytest.mark.skipif(not replayed_draws.POLICY_SEES_OUTPUT, reason="torch calls the policy before the op")
def test_the_forward_logs_draws_without_a_mode_of_its_own() -> None:
    torch.manual_seed(0)
    block, x = Probe(), torch.randn(8, 16, requires_grad=True)
    reference = _grads(block, x, None)
    block.modes.clear()
    got = _grads(block, x, "dots_saveable")
    assert all(torch.equal(a, b) for a, b in zip(reference, got, strict=True))
    forward, recompute = block.modes
    assert "RecordDraws" not in forward and "_CachingTorchDispatchMode" in forward
    assert "ReplayDraws" in recompute  # the dropout was drawn on the CPU: recompute replays it


def test_a_recompute_with_no_draws_to_replay_adds_no_mode() -> None:
    torch.manual_seed(0)
    block, x = Probe(p=0.0), torch.randn(8, 16, requires_grad=True)
    reference = _grads(block, x, None)
    block.modes.clear()
    got = _grads(block, x, "dots_saveable")
    assert all(torch.equal(a, b) for a, b in zip(reference, got, strict=True))
    assert "ReplayDraws" not in block.modes[1]
