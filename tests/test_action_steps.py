"""remat.profiling.action_steps: every action timed within whole steps, with a clock that counts the blocks' forward
runs (so a recomputation shows where the step pays it), and the cases where the table keeps the isolated figures."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
import torch
from torch import nn

import remat
from remat.chains import block_ios
from remat.core import BlockCost, CostTable
from remat.planning import simulate
from remat.profiling import price_segments
from remat.profiling.action_steps import (
    StepRun,
    deferral_rate,
    in_step_block,
    mixed_schedule,
    time_actions_in_steps,
)
from remat.profiling.outside_time import plain_steps

RUNS = [0]  # forward runs of any block so far: the clock of these tests


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        RUNS[0] += 1
        return torch.tanh(self.linear(x))


def model_of(blocks: list[nn.Module]) -> nn.Sequential:
    """A stem, the ``blocks``, a head: the chain is modules ``1`` to ``len(blocks)``."""
    return nn.Sequential(nn.Linear(8, 8), *blocks, nn.Linear(8, 1))


def plain_model() -> nn.Sequential:
    return model_of([Block() for _ in range(3)])


def runs() -> float:
    return float(RUNS[0])


def chain_of(model: nn.Sequential) -> list[tuple[str, nn.Module]]:
    return [(str(i), model[i]) for i in range(1, len(model) - 1)]


def test_windows_of_a_checkpointed_step_put_the_recomputation_in_the_backward() -> None:
    model = plain_model()
    chain = chain_of(model)
    blocks, ios = [m for _, m in chain], block_ios(chain)
    costs = remat.profile(model, torch.randn(4, 8), blocks=chain, actions_in_steps=False)
    handle = remat.apply(model, remat.plan(costs, "full"), chain)
    try:
        steps = plain_steps(model, torch.randn(4, 8), None, blocks, ios, steps=1, clock=runs)
    finally:
        handle.remove()
    assert steps.block_fwd_s == [1.0] * 3  # the forward call, once: the re-run in backward is not a call
    assert steps.block_bwd_s == [1.0] * 3  # the re-run, inside the block's backward window
    plain = plain_steps(model, torch.randn(4, 8), None, blocks, ios, steps=1, clock=runs)
    assert plain.block_fwd_s == [1.0] * 3 and plain.block_bwd_s == [0.0] * 3


def test_action_figures_are_replaced_by_what_the_step_adds() -> None:
    model = plain_model()
    chain = chain_of(model)
    costs = remat.profile(model, torch.randn(4, 8), blocks=chain, actions_in_steps=False, clock=runs)
    assert costs.info["times_from"] == "plain steps"
    # Put wrong figures in place: the steps must set every block's checkpoint to what it adds there, one re-run.
    costs.blocks = [dataclasses.replace(b, overhead_s=b.overhead_s | {"checkpoint": 5.0}) for b in costs.blocks]
    time_actions_in_steps(StepRun(model, torch.randn(4, 8), None, chain, block_ios(chain), clock=runs), costs)
    assert costs.info["action_times_from"] == "steps"
    for block in costs.blocks:
        assert block.recompute_s["checkpoint"] == 1.0  # the isolated runs' figure, kept
        assert block.overhead_s["checkpoint"] == 0.0
        assert block.fwd_s_by_action["checkpoint"] == block.fwd_s == 1.0
        assert block.bwd_s_by_action["checkpoint"] == block.bwd_s + 1.0
    assert remat.runtime.applied.owner_of(model) is None and not hasattr(model, "_remat_handle")


def test_profile_times_actions_in_steps_by_default_and_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model = plain_model()
    chain = chain_of(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = torch.randn(4, 8)
    state = torch.get_rng_state()
    costs = remat.profile(model, batch, blocks=chain)
    assert costs.info["action_times_from"] == "steps"
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    remat.apply(model, remat.plan(costs, "full"), chain).remove()  # no plan left behind


def test_a_model_with_a_plan_keeps_the_isolated_figures_and_its_plan() -> None:
    model = plain_model()
    chain = chain_of(model)
    costs = remat.profile(model, torch.randn(4, 8), blocks=chain, actions_in_steps=False)
    handle = remat.apply(model, remat.plan(costs, "full"), chain)
    try:
        again = remat.profile(model, torch.randn(4, 8), blocks=chain)
        assert again.info["action_times_from"] == "isolated runs (the model has a plan applied)"
        assert remat.runtime.applied.owner_of(model) is handle
        assert set(handle.plan.actions.values()) == {"checkpoint"}
    finally:
        handle.remove()


def test_in_step_block_moves_the_action_and_floors_its_overhead() -> None:
    block = BlockCost("b", 2.0, 3.0, 1, 1, {"keep": 9, "checkpoint": 1}, {"keep": 0.0, "checkpoint": 2.0})
    moved = in_step_block(block, "checkpoint", 0.5, 2.25)
    assert (moved.fwd_s_by_action["checkpoint"], moved.bwd_s_by_action["checkpoint"]) == (2.5, 5.25)
    assert moved.overhead_s["checkpoint"] == pytest.approx(0.75)
    assert in_step_block(block, "checkpoint", -1.0, 0.0).overhead_s["checkpoint"] == -2.0  # never below -recompute
    assert block.overhead_s == {}  # a copy


class Weighted(Block):
    """A block whose forward counts ``weight`` runs: blocks of one structure that cost differently."""

    def __init__(self, weight: int) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        RUNS[0] += self.weight - 1
        return super().forward(x)


@pytest.mark.parametrize("reuse", [True, False])
def test_blocks_the_profile_found_alike_share_one_figure_per_action(reuse: bool) -> None:
    model = model_of([Weighted(w) for w in (1, 2, 3)])
    costs = remat.profile(model, torch.randn(4, 8), blocks=chain_of(model), clock=runs, reuse_identical=reuse)
    assert costs.info["action_times_from"] == "steps"
    added = [b.recompute_s["checkpoint"] + b.overhead_s["checkpoint"] for b in costs.blocks]
    if reuse:  # one block measured alone, its row copied; in the steps one figure for the three, read against keep
        assert costs.info["same_costs_as"] == {"2": "1", "3": "1"}
        # in each step, a checkpointed block of weight w runs w forward and re-runs w in backward, where the kept
        # blocks of the step run a median k forward and nothing in backward: forward shift w - k, backward w; each
        # the median over the rounds' steps (a step without a kept block reads the block's own keep figures)
        weights, forward, backward = (1, 2, 3), [], []
        actions = [a for a in costs.blocks[0].actions if a != "keep" and not a.startswith("compress")]
        for steps in mixed_schedule(costs, actions, 3):
            for step in steps:
                kept = [weights[i] for i in range(3) if step[i] == "keep"]
                for i in (i for i in range(3) if step[i] == "checkpoint"):
                    forward.append(weights[i] - (statistics.median(kept) if kept else weights[i]))
                    backward.append(weights[i])
        shifts = [statistics.median(forward) + statistics.median(backward)]
        assert len(set(added)) == 1 and added[0] == pytest.approx(shifts[0])
    else:  # each block re-runs its own forward in backward
        assert costs.info["same_costs_as"] == {}
        assert added == [1.0, 2.0, 3.0]


FORWARDS = [0]  # forward runs of the blocks below, which alone decide when a block's backward runs cold


class StampCold(torch.autograd.Function):
    """Identity that saves the count of forward runs at its forward (recomputed with the block) and, in backward,
    charges the clock one run where another block ran forward since: the block's activations went cold."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(torch.tensor(float(FORWARDS[0])))
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        (stamp,) = ctx.saved_tensors
        if FORWARDS[0] != int(stamp):
            RUNS[0] += 1
        return grad


class ColdBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        FORWARDS[0] += 1
        return StampCold.apply(super().forward(x))


def test_a_segment_is_priced_at_what_its_waiting_blocks_cost_in_steps() -> None:
    """Checkpointed, each block's backward follows its own re-run; in one segment of three, the first two wait
    while the later ones re-run: two charges, which the profile's rate must predict from the bytes they save."""
    model = model_of([ColdBlock() for _ in range(3)])
    costs = remat.profile(model, torch.randn(4, 8), blocks=chain_of(model), clock=runs)
    assert costs.info["action_times_from"] == "steps" and costs.info["outputs_feed_next_block"] is True
    waiting = sum(b.saved("keep") for b in costs.blocks[:2])
    assert costs.deferred_s_per_byte == pytest.approx(2 / waiting)
    segment = simulate(costs, ["segment:0"] * 3).step_s - simulate(costs, ["checkpoint"] * 3).step_s
    assert segment == pytest.approx(2.0, abs=1e-6)
    pairs = simulate(costs, ["segment:0"] * 2 + ["checkpoint"]).step_s - simulate(costs, ["checkpoint"] * 3).step_s
    assert pairs == pytest.approx(costs.blocks[0].saved("keep") / waiting * 2, abs=1e-6)
    # Blocks that pay nothing for waiting get no price.
    plain = plain_model()
    assert remat.profile(plain, torch.randn(4, 8), blocks=chain_of(plain), clock=runs).deferred_s_per_byte == 0.0
    # Without the step timing the table does not know the price.
    assert (
        remat.profile(model, torch.randn(4, 8), blocks=chain_of(model), actions_in_steps=False).deferred_s_per_byte
        == 0.0
    )


def test_a_segments_price_is_measured_once_a_plan_holds_a_segment() -> None:
    model = model_of([ColdBlock() for _ in range(3)])
    chain = chain_of(model)
    x = torch.randn(4, 8)
    costs = remat.profile(model, x, blocks=chain, clock=runs, price_segments=False)
    assert costs.info["segments_priced"] is False and costs.deferred_s_per_byte == 0.0
    checkpoints = remat.Plan.from_actions(costs, ["checkpoint"] * 3)
    step = remat.StepSpec(blocks=chain)
    assert not price_segments(model, x, costs, plan=checkpoints, step=step, clock=runs)  # no segment: not needed
    assert costs.deferred_s_per_byte == 0.0
    state, before = torch.get_rng_state(), {k: v.clone() for k, v in model.state_dict().items()}
    segment = remat.Plan.from_actions(costs, ["segment:0"] * 3)
    assert price_segments(model, x, costs, plan=segment, step=step, clock=runs)
    waiting = sum(b.saved("keep") for b in costs.blocks[:2])
    assert costs.deferred_s_per_byte == pytest.approx(2 / waiting)  # as a full profile prices it
    assert costs.info["segments_priced"] is True
    assert not price_segments(model, x, costs, plan=segment, step=step, clock=runs)  # measured once
    assert torch.equal(torch.get_rng_state(), state) and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert remat.runtime.applied.owner_of(model) is None


def test_deferral_rate_is_a_median_over_pairs_never_below_zero() -> None:
    blocks = [BlockCost(f"b{i}", 1.0, 1.0, 1, 1, {"keep": 10, "checkpoint": 1}, {"keep": 0.0, "checkpoint": 1.0})
              for i in range(3)]  # fmt: skip
    costs = CostTable(blocks)
    assert deferral_rate(costs, [2.0, 6.0, 1.5]) == pytest.approx(2.0 / 20)  # two blocks wait
    assert deferral_rate(costs, [-1.0, 0.5, -3.0]) == 0.0
    assert deferral_rate(costs, []) == 0.0


def _grouped_table(blocks: int, actions: list[str]) -> CostTable:
    rows = [
        BlockCost(f"b{i}", 1.0, 1.0, 1, 1, dict.fromkeys(["keep", *actions], 1), dict.fromkeys(["keep", *actions], 0.0))
        for i in range(blocks)
    ]
    return CostTable(rows, info={"same_costs_as": {f"b{i}": "b0" for i in range(1, blocks)}})


def test_mixed_schedule_runs_every_action_each_round_on_other_blocks_from_round_to_round() -> None:
    actions = ["checkpoint", "selective:a", "selective:b"]
    schedule = mixed_schedule(_grouped_table(8, actions), actions, 3)
    assert [len(steps) for steps in schedule] == [1, 1, 1]  # eight blocks deal four actions in one step
    for r, (step,) in enumerate(schedule):
        assert sorted(set(step)) == sorted(["keep", *actions]) and step.count("checkpoint") == 2
        assert step[0] == ["keep", *actions][r]  # the deal moves on by one block a round
    # two blocks and four actions: two steps a round, every action once a round
    schedule = mixed_schedule(_grouped_table(2, actions), actions, 2)
    assert [len(steps) for steps in schedule] == [2, 2]
    for steps in schedule:
        assert sorted(a for step in steps for a in step) == sorted(["keep", *actions])
    assert schedule[0][0] != schedule[1][0]
