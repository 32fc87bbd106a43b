"""A model that runs the same blocks more than once per step (a loop over shared layers): remat plans each block
once, so the profile warns naming the blocks and records their calls; every call runs under the block's action
and the gradients stay exact."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat


class _Residual(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class _Looped(nn.Module):
    """Four layers run twice, as a universal transformer or ALBERT shares its layers across depth."""

    def __init__(self, d: int = 16, passes: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Residual(d) for _ in range(4))
        self.passes = passes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.passes):
            for layer in self.layers:
                x = layer(x)
        return x.square().mean()


def test_a_block_called_twice_per_step_is_named_in_a_warning_and_in_the_table() -> None:
    torch.manual_seed(0)
    model = _Looped()
    x = torch.randn(8, 16)
    with pytest.warns(UserWarning, match=r"calls some blocks more than once.*layers\.0 \(2 calls\)"):
        costs = remat.profile(model, x, repeats=1)
    assert costs.info["called_more_than_once"] == {f"layers.{i}": 2 for i in range(4)}
    once = _Looped(passes=1)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a model calling each block once gets no warning
        assert "called_more_than_once" not in remat.profile(once, x, repeats=1).info


@pytest.mark.parametrize("actions", [["checkpoint"] * 4, ["segment:0"] * 2 + ["keep", "checkpoint"]])
def test_every_call_of_a_repeated_block_runs_under_its_action_with_exact_gradients(actions: list[str]) -> None:
    torch.manual_seed(0)
    model = _Looped()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16)
    reference(x).backward()
    plan = remat.Plan(dict(zip([f"layers.{i}" for i in range(4)], actions, strict=True)))
    handle = remat.apply(model, plan)
    try:
        model(x).backward()
    finally:
        handle.remove()
    assert handle.stats.total_calls > 0
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
