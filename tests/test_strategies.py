"""The strategies of ``remat.plan``: each static strategy applied to a live model gives the gradients of no
checkpointing bit for bit (dropout included) and re-runs blocks as often as the simulator says; the shapes of
their plans and their memory/recompute order; plan serialisation, budgets and the errors. How plans run on a
model (hooks, ``set_plan``, ``remove``) is tested in test_runtime.py."""

from __future__ import annotations

import math

import pytest
from toy_models import assert_same_step, chain_costs, chain_input, seeded_chain, step, uniform_costs

import remat
from remat.planning import Plan, minimum_peak_bytes, no_checkpoint_peak, resolve_budget, simulate

L = 6
STATIC = [
    ("none", {}),
    ("full", {}),
    ("every_k", {"k": 2}),
    ("every_k", {"k": 3}),
    ("sqrt", {}),
    ("memory_poor", {}),
    ("random", {"fraction": 0.5, "seed": 3}),
]


# ---------------------------------------------------------------- every static strategy


@pytest.mark.parametrize(("strategy", "options"), STATIC, ids=[f"{s}{o.get('k', '')}" for s, o in STATIC])
def test_strategy_gives_the_gradients_of_no_checkpointing(strategy: str, options: dict) -> None:
    model, x = seeded_chain(), chain_input()
    reference = step(model, x)
    costs = chain_costs(model)
    plan = remat.plan(costs, strategy, **options)
    handle = remat.apply(model, plan)
    try:
        got = step(model, x)
    finally:
        handle.remove()
    assert_same_step(reference, got)
    # The runtime re-runs each block exactly as often as the simulator predicts.
    expected = simulate(costs, plan.actions).reexecutions
    assert tuple(handle.stats.calls[f] for f in plan.actions) == expected
    total = {"none": 0, "full": L, "memory_poor": L * (L - 1) // 2}.get(strategy)
    if total is not None:
        assert handle.stats.total_calls == total


def test_strategy_action_shapes() -> None:
    costs = uniform_costs([f"b{i}" for i in range(5)])
    assert list(remat.plan(costs, "every_k", k=2).actions.values()) == [
        "segment:0",
        "segment:0",
        "segment:1",
        "segment:1",
        "checkpoint",
    ]
    assert list(remat.plan(costs, "every_k", k=3).actions.values()) == ["segment:0"] * 3 + ["segment:1"] * 2
    assert list(remat.plan(costs, "memory_poor").actions.values()) == ["memory_poor:0"] * 4 + ["keep"]
    assert remat.plan(costs, "sqrt").options == {"k": 2}
    chosen = remat.plan(costs, "random", fraction=0.4, seed=1)
    assert chosen.count("checkpoint") == 2 and chosen.count("keep") == 3
    assert chosen.actions == remat.plan(costs, "random", fraction=0.4, seed=1).actions


def test_memory_and_recompute_order_of_strategies() -> None:
    costs = uniform_costs([f"b{i}" for i in range(16)])
    plans = {name: remat.plan(costs, name) for name in ("none", "full", "sqrt", "memory_poor")}
    peaks = {name: p.predicted_peak_bytes for name, p in plans.items()}
    assert peaks["memory_poor"] < peaks["sqrt"] < peaks["none"]
    assert peaks["full"] < peaks["none"]
    recompute = {name: p.predicted_recompute_s for name, p in plans.items()}
    assert recompute["none"] == 0 < recompute["full"] < recompute["memory_poor"]
    assert recompute["sqrt"] == pytest.approx(recompute["full"])  # one extra forward for both
    assert recompute["memory_poor"] == pytest.approx(15 * 16 / 2 * 1e-3)  # L(L-1)/2 block forwards


# ---------------------------------------------------------------- plans as data


def test_plan_json_round_trip() -> None:
    costs = uniform_costs([f"b{i}" for i in range(5)])
    for strategy, options in STATIC:
        plan = remat.plan(costs, strategy, budget="1MiB", **options)
        back = Plan.from_json(plan.to_json())
        assert back == plan
        assert list(back.actions) == list(plan.actions)  # chain order survives
    custom = Plan({"a": "selective:dots_saveable", "b": "offload", "c": "memory_poor:x", "d": "memory_poor:x"})
    assert Plan.from_json(custom.to_json()) == custom


def test_plan_table_lists_every_block() -> None:
    costs = uniform_costs([f"b{i}" for i in range(4)])
    text = remat.plan(costs, "sqrt").table(costs)
    assert "predicted peak" in text
    assert all(f"b{i}" in text for i in range(4)) and "segment:0" in text


# ---------------------------------------------------------------- budgets


def test_budgets_as_bytes_strings_and_fractions() -> None:
    costs = uniform_costs([f"b{i}" for i in range(6)])
    assert resolve_budget(None) is None
    assert resolve_budget(123_456) == 123_456
    assert resolve_budget("1.5GiB") == 3 * 2**29
    assert resolve_budget("512 MiB") == 2**29
    assert resolve_budget(0.5, costs) == int(0.5 * no_checkpoint_peak(costs))
    assert resolve_budget(1.0, costs) == no_checkpoint_peak(costs)
    assert remat.plan(costs, "none", budget=1.0).budget_bytes == no_checkpoint_peak(costs)
    plan = remat.plan(costs, "full", budget=0.5)
    assert plan.fits and plan.predicted_peak_bytes <= plan.budget_bytes
    assert remat.plan(costs, "full", budget="1GiB").budget_bytes == 2**30


@pytest.mark.parametrize("bad", [0.0, 1.5, -0.2])
def test_fraction_outside_the_unit_interval(bad: float) -> None:
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        resolve_budget(bad, uniform_costs(["a"]))


def test_fraction_needs_a_cost_table() -> None:
    with pytest.raises(ValueError, match="needs a cost table"):
        resolve_budget(0.5)


# ---------------------------------------------------------------- errors


def test_unknown_strategy_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown strategy 'sqrt_n'") as info:
        remat.plan(uniform_costs(["a", "b"]), "sqrt_n")
    for name in ("none", "full", "every_k", "sqrt", "memory_poor", "random", "optimal"):
        assert name in str(info.value)


def test_budget_below_what_any_plan_reaches_names_the_minimum() -> None:
    costs = uniform_costs([f"b{i}" for i in range(8)])
    floor = minimum_peak_bytes(costs)
    assert floor <= remat.plan(costs, "memory_poor").predicted_peak_bytes
    with pytest.raises(remat.BudgetError) as info:
        remat.plan(costs, "full", budget=floor - 1)
    assert remat.format_bytes(floor) in str(info.value)
    assert "below the feasible minimum" in str(info.value)
    assert isinstance(info.value, ValueError)
    # A budget that memory_poor meets but full does not: the error points at a better strategy.
    budget = remat.plan(costs, "memory_poor").predicted_peak_bytes
    with pytest.raises(remat.BudgetError, match="try strategy='optimal'"):
        remat.plan(costs, "none", budget=budget)
    assert not remat.plan(costs, "none", budget=budget, strict=False).fits


def test_unknown_action() -> None:
    with pytest.raises(ValueError, match="unknown action 'recompute'"):
        Plan({"a": "recompute"})
    with pytest.raises(ValueError, match="unknown action 'segment:'"):
        Plan({"a": "segment:"})


def test_sqrt_segment_length() -> None:
    for n in (1, 4, 9, 10, 16):
        plan = remat.plan(uniform_costs([f"b{i}" for i in range(n)]), "sqrt")
        assert plan.options["k"] == max(1, round(math.sqrt(n)))


def test_held_arguments_count_once_any_block_is_recomputed() -> None:
    from dataclasses import replace

    fqns = [f"blocks.{i}" for i in range(4)]
    base = uniform_costs(fqns)
    held = replace(base, held_args_bytes=700)
    assert simulate(held, ["keep"] * 4) == simulate(base, ["keep"] * 4)
    for actions in (
        ["checkpoint", "keep", "keep", "keep"],
        ["keep", "keep", "keep", "checkpoint"],
        ["segment:0", "segment:0", "selective:dots_saveable", "keep"],
    ):
        with_held, without = simulate(held, actions), simulate(base, actions)
        assert with_held.unit_peaks == tuple(p + 700 for p in without.unit_peaks), actions
        assert with_held.peak_bytes >= without.peak_bytes
    # The optimal planner, which weighs keeping everything apart, still never exceeds the budget.
    budget = simulate(held, ["keep"] * 4).peak_bytes
    assert remat.plan(held, "optimal", budget).actions == dict.fromkeys(fqns, "keep")
    tighter = remat.plan(held, "optimal", budget - 1)
    assert tighter.predicted_peak_bytes <= budget - 1 and set(tighter.actions.values()) != {"keep"}
