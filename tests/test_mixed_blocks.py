"""A model whose blocks differ in which per-operator policies they can run (DeepSeek-V3's dense first layers
before its mixture-of-experts layers, whose router divides a matmul's output in place): plans use a policy on
the blocks that run it, with gradients and peaks as predicted, instead of dropping it for every block."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from toy_models import ScaledInPlace

import remat
from remat.core import BlockCost, CostTable
from remat.dynamic.pgac.mask import exact_actions
from remat.planning.optimal_plan import min_peak_bytes
from remat.planning.strategies import double_backward_actions

DOTS = "selective:dots_saveable"


class ScaledOutOfPlace(ScaledInPlace):
    """:class:`ScaledInPlace`'s computation written out of place: a policy saving the matmul runs here."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        h = h / (h.detach().abs().amax() + 1)
        return torch.tanh(h) + x


class Layer(nn.Module):
    """One class of block whose inner part differs, as DeepSeek-V3's decoder layers hold a dense MLP or a
    mixture of experts."""

    def __init__(self, width: int, in_place: bool) -> None:
        super().__init__()
        self.inner = ScaledInPlace(width) if in_place else ScaledOutOfPlace(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def mixed_model() -> nn.Sequential:
    """Every second layer changes its matmul's output in place."""
    torch.manual_seed(0)
    return nn.Sequential(*(Layer(64, in_place=i % 2 == 1) for i in range(4)))


@pytest.fixture(scope="module")
def mixed() -> tuple[nn.Sequential, torch.Tensor, CostTable]:
    model, x = mixed_model(), torch.randn(32, 64, requires_grad=True)
    with pytest.warns(UserWarning, match=r"selective:dots_saveable cannot run on Layer blocks"):
        costs = remat.profile(model, x, policies=("dots_saveable",), repeats=1)
    return model, x, costs


def test_a_policy_some_blocks_refuse_stays_plannable_on_the_others(mixed) -> None:
    _, _, costs = mixed
    assert [DOTS in row.actions for row in costs.blocks] == [True, False, True, False]
    assert DOTS not in costs.common_actions()
    assert costs.plannable_actions() == ["keep", "checkpoint", DOTS]
    assert DOTS in exact_actions(costs)  # PGAC's budget fitter plans with it too


def test_the_planner_uses_it_where_it_runs_with_exact_gradients_and_the_predicted_peak(mixed) -> None:
    model, x, costs = mixed
    actions = ["keep", DOTS]
    plan = remat.plan(costs, "optimal", budget=min_peak_bytes(costs, actions), actions=actions)
    chosen = list(plan.actions.values())
    assert chosen[1] == chosen[3] == "keep" and DOTS in chosen, chosen
    assert plan.predicted_peak_bytes < remat.plan(costs, "none").predicted_peak_bytes
    with pytest.raises(KeyError, match=r"cannot run on this block"):
        remat.Plan.from_actions(costs, [DOTS] * 4)

    def step() -> tuple[torch.Tensor, ...]:
        model.zero_grad(set_to_none=True)
        x.grad = None
        with remat.measure() as measured:
            model(x).sum().backward()
        return measured.activation_bytes, x.grad.clone(), *(p.grad.clone() for p in model.parameters())

    _, *reference = step()
    handle = remat.apply(model, plan)
    try:
        peak, *grads = step()
    finally:
        handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))
    assert peak == pytest.approx(plan.predicted_peak_bytes, rel=0.05)


class Switched(ScaledInPlace):
    """:class:`ScaledInPlace` or :class:`ScaledOutOfPlace` by a plain attribute: the same modules, parameters
    and saved tensors, so only the operators the forward runs tell the two apart."""

    def __init__(self, width: int, in_place: bool) -> None:
        super().__init__(width)
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if self.in_place else ScaledOutOfPlace.forward(self, x)


def test_blocks_that_differ_only_in_an_attribute_are_measured_apart_not_reused() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(Switched(64, in_place=i % 2 == 1) for i in range(4)))
    with pytest.warns(UserWarning, match=r"selective:dots_saveable cannot run on Switched blocks"):
        costs = remat.profile(model, torch.randn(32, 64, requires_grad=True), policies=("dots_saveable",), repeats=1)
    assert [DOTS in row.actions for row in costs.blocks] == [True, False, True, False]
    assert (costs.info["blocks_measured"], costs.info["blocks_reused"]) == (2, 2)


def test_remat_plan_and_double_backward_plans_offer_it_by_default() -> None:
    # The policy saves nearly as little as a checkpoint and recomputes much less, so a plan at the peak of
    # [policy, checkpoint, keep] uses it on block 0; block 1 cannot run it.
    saved = {"keep": 100, "checkpoint": 10, DOTS: 12}
    recompute = {"keep": 0.0, "checkpoint": 1.0, DOTS: 0.25}
    rows = [BlockCost(f"b{i}", 1.0, 2.0, 10, 10, dict(saved), dict(recompute)) for i in (0, 2)]
    rows.insert(
        1,
        BlockCost("b1", 1.0, 2.0, 10, 10, {"keep": 100, "checkpoint": 10}, {"keep": 0.0, "checkpoint": 1.0},
                  unavailable={DOTS: "a saved output is changed in place"}),
    )  # fmt: skip
    costs = CostTable(rows)
    budget = remat.Plan.from_actions(costs, [DOTS, "checkpoint", "keep"]).predicted_peak_bytes
    plan = remat.plan(costs, "optimal", budget)
    assert plan.actions["b0"] == DOTS and plan.actions["b1"] != DOTS, plan.actions
    assert remat.plan(costs, "optimal", budget, allow_lossy=True).actions == plan.actions
    assert DOTS not in double_backward_actions(costs) and "checkpoint" in double_backward_actions(costs)


def test_an_action_no_block_can_run_is_refused_with_the_reason() -> None:
    rows = [
        BlockCost(f"b{i}", 1.0, 2.0, 4, 4, {"keep": 40, "checkpoint": 4}, {"keep": 0.0, "checkpoint": 1.0},
                  unavailable={DOTS: "a saved output is changed in place"})
        for i in range(2)
    ]  # fmt: skip
    costs = CostTable(rows)
    assert costs.plannable_actions() == ["keep", "checkpoint"]
    with pytest.raises(ValueError, match=r"cannot run on any block of the cost table \(a saved output is changed"):
        remat.plan(costs, "optimal", budget=100, actions=["keep", DOTS])
    rows[0].unavailable = {}  # not measured on b0, refused on b1: profile it
    with pytest.raises(ValueError, match=r"has no costs for blocks \['b0'\].*profile with it included"):
        remat.plan(costs, "optimal", budget=100, actions=["keep", DOTS])


def test_remat_profile_prints_cannot_run_in_the_cells_of_a_refused_action(mixed, capsys) -> None:
    from remat.cli.commands import print_costs

    print_costs(mixed[2])
    lines = capsys.readouterr().out.splitlines()
    header = lines[0]
    assert header.split()[-1].startswith("selective:dots_saveab")
    rows = {line.split()[0]: line for line in lines[1:5]}
    assert rows["1"].rstrip().endswith("cannot run") and rows["3"].rstrip().endswith("cannot run")
    assert not rows["0"].rstrip().endswith("cannot run")


def test_the_bench_plots_a_refused_action_as_a_missing_bar(mixed, tmp_path) -> None:
    from remat.bench.plots import block_memory

    costs = mixed[2]
    saved = {a: [row.saved_bytes.get(a) for row in costs.blocks] for a in costs.plannable_actions()}
    assert saved[DOTS][1] is None and saved[DOTS][0] is not None
    path = block_memory(costs.fqns, saved, tmp_path / "block_memory.png", "footer")
    assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 5000
