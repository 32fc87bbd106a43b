"""``remat.fitting.advice``: a table scaled to a larger batch predicts proportionally more of every byte and second, and
the advice charges a plan's whole time cost (recomputation and each action's overhead), as ``optimal`` does."""

import pytest

from remat.core import BlockCost, CostTable
from remat.fitting import advise_costs
from remat.fitting.advice import scale_costs
from remat.planning import Plan, no_checkpoint_peak, simulate
from remat.planning.simulator import keep_step_s

MIB = 1 << 20


def table(overhead_s: float) -> CostTable:
    blocks = [
        BlockCost(
            f"layers.{i}",
            fwd_s=0.010,
            bwd_s=0.020,
            input_bytes=MIB,
            output_bytes=MIB,
            saved_bytes={"keep": 8 * MIB, "checkpoint": MIB},
            recompute_s={"keep": 0.0, "checkpoint": 0.010},
            fwd_s_by_action={"keep": 0.010, "checkpoint": 0.011},
            bwd_s_by_action={"keep": 0.020, "checkpoint": 0.031},
            overhead_s={"keep": 0.0, "checkpoint": overhead_s},
            nograd_fwd_s=0.008,
        )
        for i in range(4)
    ]
    return CostTable(blocks, stem_bytes=MIB, head_bytes=2 * MIB, head_retained_bytes=MIB // 2, outside_s=0.005)


@pytest.mark.parametrize("actions", [["keep"] * 4, ["checkpoint"] * 4, ["checkpoint", "keep", "checkpoint", "keep"]])
def test_a_scaled_table_predicts_every_figure_in_proportion(actions):
    costs = table(overhead_s=0.004)
    base, doubled = simulate(costs, actions), simulate(scale_costs(costs, 2), actions)
    assert doubled.peak_bytes == 2 * base.peak_bytes
    assert doubled.step_s == pytest.approx(2 * base.step_s)
    assert doubled.overhead_s == pytest.approx(2 * base.overhead_s)
    assert (base.overhead_s > 0) == ("checkpoint" in actions)
    assert keep_step_s(scale_costs(costs, 3)) == pytest.approx(3 * keep_step_s(costs))


def test_advice_charges_recomputation_and_overhead():
    costs = table(overhead_s=0.004)
    budget = no_checkpoint_peak(costs) // 2
    advice = advise_costs(costs, batch_size=4, device_memory=budget, state_bytes=0, reserve_fraction=0.0)
    assert advice.needs_checkpointing and advice.plan is not None
    checkpointed = sum(a == "checkpoint" for a in advice.plan.actions.values())
    assert checkpointed > 0
    assert advice.plan_time_cost_s == pytest.approx(checkpointed * (0.010 + 0.004))
    assert advice.overhead == pytest.approx(advice.plan_time_cost_s / sum(0.030 for _ in costs.blocks))
    assert f"{advice.plan_time_cost_s * 1e3:.1f} ms of recomputation and overhead" in advice.text()
    first = advice.batch_options[0]
    assert first.batch_size == 4 and first.step_s == pytest.approx(0.120 + advice.plan_time_cost_s)


def test_advice_without_checkpointing_costs_nothing():
    costs = table(overhead_s=0.004)
    advice = advise_costs(costs, batch_size=4, device_memory=64 * no_checkpoint_peak(costs), state_bytes=0)
    assert not advice.needs_checkpointing
    assert advice.plan_time_cost_s == 0.0 and advice.overhead == 0.0
    assert isinstance(advice.plan, Plan) and set(advice.plan.actions.values()) == {"keep"}
