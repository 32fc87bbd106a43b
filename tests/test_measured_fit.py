"""remat.fitting.measured_fit.fit: the two optimal plans (with and without per-operator policies) run on the caller's
step where they differ, the faster that fits kept and applied; on a clock that counts the blocks' forward runs
and charges a run inside a dispatch mode (a selective region's policy) ten times more."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import remat
from remat.fitting.measured_fit import CHECKPOINTS, MENU, fit, near_tie

POLICY = "selective:all_but_pointwise_saveable"
TICKS = [0]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        TICKS[0] += 10 if _get_current_dispatch_mode() is not None else 1
        h = self.up(x)
        return self.down(h * torch.sigmoid(h))  # keep saves three wide tensors, the policy one


def ticks() -> float:
    return float(TICKS[0])


def model_and_batch() -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), *[Block() for _ in range(4)], nn.Linear(16, 1)), torch.randn(32, 16)


def chain_of(model: nn.Sequential) -> list[tuple[str, nn.Module]]:
    return [(str(i), model[i]) for i in range(1, len(model) - 1)]


def policy_looks_free(costs: remat.CostTable) -> remat.CostTable:
    """The profile with the policy priced below checkpointing on every block, as a disturbed profile may read it."""
    blocks = []
    for b in costs.blocks:
        recompute = {**b.recompute_s, POLICY: b.recompute_s["checkpoint"] / 10}
        blocks.append(dataclasses.replace(b, recompute_s=recompute, overhead_s={**b.overhead_s, POLICY: 0.0}))
    return dataclasses.replace(costs, blocks=blocks)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_where_the_profile_prices_a_policy_below_checkpointing_the_measured_step_keeps_the_checkpoints():
    model, x = model_and_batch()
    chain = chain_of(model)
    costs = policy_looks_free(remat.profile(model, x, blocks=chain, policies=(POLICY[10:],), actions_in_steps=False))
    every_policy = remat.Plan.from_actions(costs, [POLICY] * 4)
    budget = every_policy.predicted_peak_bytes
    assert POLICY in remat.plan(costs, "optimal", budget).actions.values()  # the profile's choice

    model.zero_grad()
    model(x).sum().backward()  # gradients of the user's own loop: left as they were
    before, rng = grads(model), torch.get_rng_state()
    result = fit(model, x, budget, costs=costs, blocks=chain, rounds=3, clock=ticks)
    assert [t.name for t in result.trials] == [MENU, CHECKPOINTS]
    menu, checkpoints = result.trials
    assert menu.ratios == (1.0, 1.0, 1.0) and checkpoints.step_ratio < 1.0  # ten ticks a policy run
    assert result.chosen is checkpoints and POLICY not in result.plan.actions.values()
    assert result.passed_over is menu
    assert result.passed_over_text() == f"its step {1 / checkpoints.step_ratio:.3f}x the kept one's"
    assert all(t.peak_bytes is not None and t.peak_bytes <= budget and not t.refused for t in result.trials)
    assert all(torch.equal(a, b) for a, b in zip(grads(model), before, strict=True))
    assert torch.equal(torch.get_rng_state(), rng)
    assert "<- chosen" in result.describe().splitlines()[2]

    # the model trains under the chosen plan: its gradients are those of no checkpointing, bit for bit
    assert result.handle.plan.actions == result.plan.actions
    model.zero_grad()
    model(x).sum().backward()
    planned = grads(model)
    result.handle.remove()
    model.zero_grad()
    model(x).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(planned, grads(model), strict=True))


def test_plans_the_profile_tells_apart_beyond_its_noise_are_not_run_head_to_head():
    model, x = model_and_batch()
    chain = chain_of(model)
    costs = policy_looks_free(remat.profile(model, x, blocks=chain, policies=(POLICY[10:],), actions_in_steps=False))
    budget = remat.Plan.from_actions(costs, [POLICY] * 4).predicted_peak_bytes
    menu = remat.plan(costs, "optimal", budget)
    checkpoints = remat.plan(costs, "optimal", budget, actions=["keep", "checkpoint", "segment", "memory_poor"])
    gap = checkpoints.predicted_step_s - menu.predicted_step_s
    # blocks each action has more in one plan than in the other: the root of their summed squares
    more = Counter(menu.actions.values())
    more.subtract(Counter(checkpoints.actions.values()))
    distance = math.sqrt(sum(n * n for n in more.values()))
    assert gap > 0 and distance > 0
    assert near_tie(costs, menu, checkpoints)  # no noise recorded: nothing told apart
    costs.info["time_noise_s"] = gap / distance / 2 * 1.01
    assert near_tie(costs, menu, checkpoints) and near_tie(costs, checkpoints, menu)
    costs.info["time_noise_s"] = gap / distance / 2 * 0.99
    assert not near_tie(costs, menu, checkpoints)
    result = fit(model, x, budget, costs=costs, blocks=chain, rounds=3, clock=ticks)
    assert [t.name for t in result.trials] == [MENU] and result.plan.actions == menu.actions
    result.handle.remove()


def test_where_both_plans_are_the_same_its_peak_is_measured_and_no_rounds_run():
    model, x = model_and_batch()
    chain = chain_of(model)
    costs = remat.profile(model, x, blocks=chain, policies=(), actions_in_steps=False)
    result = fit(model, x, 0.5, costs=costs, blocks=chain, clock=ticks)
    assert [t.name for t in result.trials] == [MENU]
    assert result.plan.actions == remat.plan(costs, "optimal", 0.5).actions
    assert result.trials[0].peak_bytes <= result.max_bytes and not result.trials[0].ratios
    assert result.passed_over is None and result.passed_over_text() == ""
    result.handle.remove()


def test_plans_that_measure_over_the_budget_are_refused_with_the_least_peak():
    model, x = model_and_batch()
    chain = chain_of(model)
    costs = policy_looks_free(remat.profile(model, x, blocks=chain, policies=(POLICY[10:],), actions_in_steps=False))
    quarter = dataclasses.replace(costs, blocks=[
        dataclasses.replace(b, input_bytes=b.input_bytes // 4, output_bytes=b.output_bytes // 4,
                            saved_bytes={a: n // 4 for a, n in b.saved_bytes.items()})
        for b in costs.blocks
    ])  # fmt: skip
    with pytest.raises(remat.BudgetError, match="measured over it") as err:
        fit(model, x, 0.6, costs=quarter, blocks=chain, rounds=1, clock=ticks)
    assert err.value.floor is not None and err.value.floor > 0
    assert not hasattr(model, "_remat_handle")  # the model as it came
    remat.apply(model, remat.plan(costs, "none"), chain).remove()  # and free for a plan


def test_bad_input_is_refused_with_what_to_do():
    model, x = model_and_batch()
    chain = chain_of(model)
    costs = remat.profile(model, x, blocks=chain, policies=(), actions_in_steps=False)
    with pytest.raises(ValueError, match="at least one timed step"):
        fit(model, x, 0.5, costs=costs, blocks=chain, rounds=0)
    with pytest.raises(remat.BudgetError, match="minimum"):
        fit(model, x, 1, costs=costs, blocks=chain)  # one byte


def test_head_to_head_stops_timing_a_candidate_whose_rank_is_settled() -> None:
    """Trial rule 2: every candidate runs two rounds; then one whose fastest round is over 2% slower than the
    leader's slowest is timed no more; the first is timed every round; ties and near ties run every round."""
    from remat.fitting.trial import head_to_head

    seconds = {"first": 1.0, "tie": 1.0, "near": 1.015, "slow": 1.5, "slower": 3.0}
    calls: Counter[str] = Counter()

    def run(name: str) -> float:
        calls[name] += 1
        return seconds[name]

    ratios = head_to_head(list(seconds), run, rounds=5, warm=False)
    assert {name: len(r) for name, r in ratios.items()} == {"first": 5, "tie": 5, "near": 5, "slow": 2, "slower": 2}
    assert calls == {"first": 5, "tie": 5, "near": 5, "slow": 2, "slower": 2}
    assert ratios["slow"] == (1.5, 1.5) and ratios["near"] == (1.015,) * 5
    calls.clear()
    assert all(len(r) == 5 for r in head_to_head(list(seconds), run, rounds=5, settle=False).values())
    assert calls == {name: 6 for name in seconds}  # one untimed step each, then five rounds


def test_a_slow_first_candidate_is_timed_every_round_and_the_leader_too() -> None:
    from remat.fitting.trial import head_to_head

    seconds = {"slow first": 2.0, "fast": 1.0, "middle": 1.5}
    ratios = head_to_head(list(seconds), lambda name: seconds[name], rounds=4, warm=False)
    assert {name: len(r) for name, r in ratios.items()} == {"slow first": 4, "fast": 4, "middle": 2}
