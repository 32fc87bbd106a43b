"""Plans applied to live models: every strategy and random mixes of actions give the gradients of no
checkpointing bit for bit (dropout included), re-run blocks as often as the simulator says, switch between
steps without new hooks, and come off cleanly. Plus plan serialisation, budgets and the errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from toy_models import MLPChain, assert_same_step, step, uniform_chain, uniform_costs

import remat
from remat.planners import minimum_peak_bytes
from remat.simulator import Plan, no_checkpoint_peak, resolve_budget, simulate

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


def _input(d_in: int = 8, batch: int = 5) -> torch.Tensor:
    return torch.randn(batch, d_in, generator=torch.Generator().manual_seed(11))


def _model(n_blocks: int = L, dropout: float = 0.2) -> MLPChain:
    torch.manual_seed(0)
    return uniform_chain(n_blocks, width=16, dropout=dropout)


def _hook_count(module: torch.nn.Module) -> int:
    return sum(
        len(getattr(module, name))
        for name in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_pre_hooks_with_kwargs",
            "_forward_hooks_always_called",
        )
    )


def _costs(model: MLPChain):  # noqa: ANN202
    return uniform_costs([name for name, _ in remat.find_blocks(model)])


# ---------------------------------------------------------------- every static strategy


@pytest.mark.parametrize(("strategy", "options"), STATIC, ids=[f"{s}{o.get('k', '')}" for s, o in STATIC])
def test_strategy_gives_the_gradients_of_no_checkpointing(strategy: str, options: dict) -> None:
    model, x = _model(), _input()
    reference = step(model, x)
    costs = _costs(model)
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
        "segment:0", "segment:0", "segment:1", "segment:1", "checkpoint"
    ]
    assert list(remat.plan(costs, "every_k", k=3).actions.values()) == ["segment:0"] * 3 + ["segment:1"] * 2
    assert list(remat.plan(costs, "memory_poor").actions.values()) == ["nested:0"] * 4 + ["keep"]
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


# ---------------------------------------------------------------- random chains and random plans

ACTIONS = ["keep", "checkpoint", "selective:dots_saveable", "selective:everything_saveable", "offload"]


@st.composite
def chains_and_plans(draw: st.DrawFn) -> tuple[list[int], list[float], list[str]]:
    n = draw(st.integers(1, 7))
    widths = draw(st.lists(st.sampled_from([4, 8, 12]), min_size=n + 1, max_size=n + 1))
    dropout = draw(st.lists(st.sampled_from([0.0, 0.3]), min_size=n, max_size=n))
    actions: list[str] = []
    group = 0
    while len(actions) < n:
        kind = draw(st.sampled_from([*ACTIONS, "segment", "nested"]))
        if kind in ("segment", "nested"):
            size = draw(st.integers(1, n - len(actions)))
            actions += [f"{kind}:{group}"] * size
            group += 1
        else:
            actions.append(kind)
    return widths, dropout, actions


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains_and_plans(), st.integers(0, 2**16))
def test_random_plans_on_random_chains_are_exact(case: tuple, seed: int) -> None:
    widths, dropout, actions = case
    torch.manual_seed(seed)
    model = MLPChain(widths, d_in=6, dropout=dropout, hidden=16)
    x = torch.randn(3, 6)
    reference = step(model, x, seed=seed)
    names = [f"blocks.{i}" for i in range(len(actions))]  # named: a one-block chain is not found on its own
    plan = Plan(dict(zip(names, actions, strict=True)))
    handle = remat.apply(model, plan, blocks=names)
    try:
        got = step(model, x, seed=seed)
    finally:
        handle.remove()
    assert_same_step(reference, got)
    expected = simulate(uniform_costs(names), plan.actions).reexecutions
    assert tuple(handle.stats.calls[f] for f in names) == expected
    assert all(_hook_count(block) == 0 for block in model.blocks)
    assert_same_step(reference, step(model, x, seed=seed))


def test_grad_disabled_and_eval_forwards_are_left_alone() -> None:
    model, x = _model(), _input()
    handle = remat.apply(model, remat.plan(_costs(model), "memory_poor"))
    with torch.no_grad():
        model(x)
    model.eval()
    model(x).backward()
    assert handle.stats.total_calls == L * (L - 1) // 2  # only the step with grad recomputes
    handle.remove()


# ---------------------------------------------------------------- remove and set_plan


def test_remove_leaves_the_model_as_it_was() -> None:
    model, x = _model(dropout=0.0), _input()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    reference = step(model, x)
    blocks = [block for _, block in remat.find_blocks(model)]
    before = [_hook_count(b) for b in [model, *blocks]]
    handle = remat.apply(model, remat.plan(_costs(model), "sqrt"))
    assert all(_hook_count(b) > 0 for b in blocks)
    step(model, x)
    handle.remove()
    assert [_hook_count(b) for b in [model, *blocks]] == before == [0] * (L + 1)
    assert "_remat_handle" not in model.__dict__
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert_same_step(reference, step(model, x))
    remat.apply(model, remat.plan(_costs(model), "full")).remove()  # can be applied again


def test_set_plan_switches_actions_without_new_hooks() -> None:
    model, x = _model(), _input()
    reference = step(model, x)
    costs = _costs(model)
    blocks = [block for _, block in remat.find_blocks(model)]
    handle = remat.apply(model, remat.plan(costs, "none"))
    hooks = [_hook_count(b) for b in blocks]
    expected = {"none": 0, "full": L, "sqrt": L, "every_k": L, "memory_poor": L * (L - 1) // 2}
    for strategy in ["none", "full", "memory_poor", "sqrt", "none", "every_k", "memory_poor"]:
        handle.set_plan(remat.plan(costs, strategy))
        handle.stats.reset()
        assert_same_step(reference, step(model, x))
        assert handle.stats.total_calls == expected[strategy], strategy
        assert [_hook_count(b) for b in blocks] == hooks
    handle.remove()


def test_stats_count_recompute_time() -> None:
    model, x = _model(), _input()
    handle = remat.apply(model, remat.plan(_costs(model), "full"))
    step(model, x)
    assert handle.stats.total_seconds > 0
    assert all(handle.stats.seconds[f] > 0 for f in handle.fqns)
    handle.stats.reset()
    assert handle.stats.total_calls == 0 and handle.stats.total_seconds == 0
    handle.remove()


# ---------------------------------------------------------------- plans as data


def test_plan_json_round_trip() -> None:
    costs = uniform_costs([f"b{i}" for i in range(5)])
    for strategy, options in STATIC:
        plan = remat.plan(costs, strategy, budget="1MiB", **options)
        back = Plan.from_json(plan.to_json())
        assert back == plan
        assert list(back.actions) == list(plan.actions)  # chain order survives
    custom = Plan({"a": "selective:dots_saveable", "b": "offload", "c": "nested:x", "d": "nested:x"})
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


def test_plan_naming_a_block_not_in_the_model() -> None:
    model = _model(n_blocks=3)
    bad = Plan({"blocks.0": "keep", "blocks.1": "checkpoint", "blocks.9": "checkpoint"})
    with pytest.raises(ValueError, match=r"not in the model's chain: \['blocks\.9'\]"):
        remat.apply(model, bad)
    assert "_remat_handle" not in model.__dict__
    assert all(_hook_count(b) == 0 for _, b in remat.find_blocks(model))
    handle = remat.apply(model, remat.plan(_costs(model), "full"))
    with pytest.raises(ValueError, match=r"missing \['blocks\.2'\]"):
        handle.set_plan(Plan({"blocks.0": "keep", "blocks.1": "keep"}))
    with pytest.raises(ValueError, match="unknown policy"):
        handle.set_plan(Plan(dict.fromkeys(handle.fqns, "selective:no_such_policy")))
    assert handle.plan.strategy == "full"  # a rejected plan leaves the current one in place
    handle.remove()


def test_applying_twice() -> None:
    model = _model(n_blocks=2)
    handle = remat.apply(model, remat.plan(_costs(model), "full"))
    with pytest.raises(RuntimeError, match="already applied.*set_plan"):
        remat.apply(model, remat.plan(_costs(model), "none"))
    handle.remove()


def test_unknown_action() -> None:
    with pytest.raises(ValueError, match="unknown action 'recompute'"):
        Plan({"a": "recompute"})
    with pytest.raises(ValueError, match="unknown action 'segment:'"):
        Plan({"a": "segment:"})


def test_blocks_by_name_and_module_pairs() -> None:
    model, x = _model(n_blocks=4), _input()
    reference = step(model, x)
    names = ["blocks.1", "blocks.2"]
    plan = Plan(dict.fromkeys(names, "checkpoint"))
    for blocks in (names, [(n, model.get_submodule(n)) for n in names]):
        handle = remat.apply(model, plan, blocks=blocks)
        assert_same_step(reference, step(model, x))
        assert handle.stats.calls == {"blocks.1": 1, "blocks.2": 1}
        handle.remove()


def test_sqrt_segment_length() -> None:
    for n in (1, 4, 9, 10, 16):
        plan = remat.plan(uniform_costs([f"b{i}" for i in range(n)]), "sqrt")
        assert plan.options["k"] == max(1, round(math.sqrt(n)))


# ---------------------------------------------------------------- autocast and several forwards per backward


@pytest.mark.parametrize("strategy", ["full", "sqrt", "memory_poor"])
def test_plans_under_autocast(strategy: str) -> None:
    model, x = _model(), _input()

    def autocast_step() -> tuple[torch.Tensor, dict]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return step(model, x)

    reference = autocast_step()
    handle = remat.apply(model, remat.plan(_costs(model), strategy))
    try:
        got = autocast_step()
    finally:
        handle.remove()
    assert_same_step(reference, got)
    assert reference[1]["blocks.0.fc1.weight"].dtype == torch.float32  # parameters stay float32


@pytest.mark.parametrize("strategy", ["full", "every_k", "memory_poor"])
def test_two_forwards_then_one_backward(strategy: str) -> None:
    model = _model()
    x1, x2 = _input(), _input(batch=3)

    def accumulate() -> dict[str, torch.Tensor]:
        torch.manual_seed(9)
        model.zero_grad(set_to_none=True)
        (model(x1) + 2 * model(x2)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    reference = accumulate()
    handle = remat.apply(model, remat.plan(_costs(model), strategy))
    try:
        got = accumulate()
    finally:
        handle.remove()
    assert all(torch.equal(reference[n], got[n]) for n in reference)
    assert handle.stats.total_calls == 2 * sum(simulate(_costs(model), handle.plan.actions).reexecutions)


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
