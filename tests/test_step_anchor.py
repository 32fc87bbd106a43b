"""remat.profiling.outside_time.anchor_to_plain_steps: a block's keep times come from the plain steps, its actions'
differences from its paired isolated runs."""

from __future__ import annotations

import pytest

from remat.core import CHECKPOINT, KEEP, BlockCost, CostTable
from remat.planning import simulate
from remat.profiling.outside_time import PlainSteps, anchor_to_plain_steps


def _row(fqn: str) -> BlockCost:
    return BlockCost(
        fqn=fqn,
        fwd_s=0.010,
        bwd_s=0.020,
        input_bytes=8,
        output_bytes=8,
        saved_bytes={KEEP: 100, CHECKPOINT: 8},
        recompute_s={KEEP: 0.0, CHECKPOINT: 0.011},
        fwd_s_by_action={KEEP: 0.010, CHECKPOINT: 0.009},
        bwd_s_by_action={KEEP: 0.020, CHECKPOINT: 0.033},
        overhead_s={KEEP: 0.0, CHECKPOINT: -0.001},
    )


def _table() -> CostTable:
    return CostTable(blocks=[_row("a"), _row("b")], stem_bytes=0, head_bytes=0)


def test_keep_times_come_from_the_plain_steps_and_differences_stay() -> None:
    costs = _table()
    before = [simulate(costs, [a, a]).step_s for a in (KEEP, CHECKPOINT)]
    plain = PlainSteps(step_s=0.070, outside_s=0.004, block_fwd_s=[0.008, 0.009], block_bwd_s=[0.017, 0.018])
    anchor_to_plain_steps(costs, plain, ["a", "b"])
    assert costs.info["times_from"] == "plain steps" and costs.info["plain_step_s"] == 0.070
    assert [(b.fwd_s, b.bwd_s) for b in costs.blocks] == [(0.008, 0.017), (0.009, 0.018)]
    assert costs.outside_s == 0.004
    a = costs.blocks[0]
    assert a.fwd_s_by_action == {KEEP: 0.008, CHECKPOINT: pytest.approx(0.007)}
    assert a.bwd_s_by_action == {KEEP: 0.017, CHECKPOINT: pytest.approx(0.030)}
    assert a.time_cost(CHECKPOINT) == pytest.approx(0.010) and a.recompute_s[CHECKPOINT] == 0.011
    keep_step = 0.008 + 0.017 + 0.009 + 0.018 + 0.004
    after = [simulate(costs, [x, x]).step_s for x in (KEEP, CHECKPOINT)]
    assert after[0] == pytest.approx(keep_step)
    # what checkpointing adds is what the paired isolated runs measured, before and after
    assert after[1] - after[0] == pytest.approx(before[1] - before[0])


def test_rows_are_copies() -> None:
    costs = _table()
    original = costs.blocks[0]
    plain = PlainSteps(step_s=0.070, outside_s=0.004, block_fwd_s=[0.008, 0.009], block_bwd_s=[0.017, 0.018])
    anchor_to_plain_steps(costs, plain, ["a", "b"])
    assert original.fwd_s == 0.010 and original.fwd_s_by_action[KEEP] == 0.010


@pytest.mark.parametrize(
    ("plain", "fqns", "outside"),
    [
        # the blocks' windows unreadable (a block input without gradient, CUDA): the step less isolated times
        (PlainSteps(step_s=0.070, outside_s=None, block_fwd_s=None, block_bwd_s=None), ["a", "b"], 0.010),
        # a block called twice per step: outside time known, blocks' own figures not
        (PlainSteps(step_s=0.070, outside_s=0.004, block_fwd_s=None, block_bwd_s=None), ["a", "b"], 0.004),
        # the plain steps timed other blocks than the table's
        (PlainSteps(step_s=0.070, outside_s=0.004, block_fwd_s=[0.1, 0.1], block_bwd_s=[0.1, 0.1]), ["b", "a"], 0.004),
    ],
)
def test_isolated_times_stay_where_the_blocks_were_not_timed_within_the_step(
    plain: PlainSteps, fqns: list[str], outside: float
) -> None:
    costs = _table()
    anchor_to_plain_steps(costs, plain, fqns)
    assert costs.info["times_from"] == "isolated runs"
    assert [(b.fwd_s, b.bwd_s) for b in costs.blocks] == [(0.010, 0.020)] * 2
    assert costs.outside_s == pytest.approx(outside)
