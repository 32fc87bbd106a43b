"""The time terms of a block from its interleaved timed runs: recomputation and overhead paired round by round
with keep's run, medians over rounds, overheads floored at 0."""

from __future__ import annotations

import pytest

from remat.profiling.action_times import action_times
from remat.profiling.block_timing import NO_GRAD_FORWARD

SELECTIVE = "selective:dots_saveable"
OFFLOAD_DOTS = "selective:offload_dots"


def test_terms_pair_each_round_with_keep_and_take_medians() -> None:
    # (forward, backward, timed recomputation) per round; round 2 is slow for every action (drift).
    runs = {
        "keep": [(1.0, 2.0, 0.0), (1.0, 2.0, 0.0), (3.0, 6.0, 0.0)],
        "checkpoint": [(1.25, 3.5, 1.0), (1.25, 3.25, 1.0), (3.5, 9.5, 3.0)],
        SELECTIVE: [(1.5, 2.25, 0.25), (1.5, 2.5, 0.5), (4.0, 7.0, 0.75)],
        "offload": [(1.5, 2.5, 0.0), (1.25, 2.25, 0.0), (3.5, 6.5, 0.0)],
        OFFLOAD_DOTS: [(1.5, 2.5, 0.25), (1.25, 2.5, 0.25), (3.5, 6.75, 0.5)],
    }
    t = action_times(runs)
    assert (t.fwd_s, t.bwd_s) == (1.0, 2.0)
    assert t.fwd_s_by_action == {"keep": 1.0, "checkpoint": 1.25, SELECTIVE: 1.5, "offload": 1.5, OFFLOAD_DOTS: 1.5}
    assert t.bwd_s_by_action["checkpoint"] == 3.5
    # checkpoint: recompute = keep's forward of the round; overhead per round 0.75, 0.5, 1.0 -> median 0.75
    assert t.recompute_s["checkpoint"] == 1.0 and t.overhead_s["checkpoint"] == 0.75
    # selective: recompute = its timed recomputation (at most keep's forward): 0.25, 0.5, 0.75 -> 0.5;
    # overhead = 0.5, 0.5, 1.25 -> 0.5
    assert t.recompute_s[SELECTIVE] == 0.5 and t.overhead_s[SELECTIVE] == 0.5
    # offload: the whole difference is its recomputation (copies), nothing left as overhead
    assert t.recompute_s["offload"] == 1.0 and t.overhead_s["offload"] == 0.0
    # an offloading policy: recomputation plus the forward's excess (0.75, 0.5, 1.0 -> 0.75); the rest (0.25 in
    # every round) is overhead
    assert t.recompute_s[OFFLOAD_DOTS] == 0.75 and t.overhead_s[OFFLOAD_DOTS] == 0.25
    assert t.recompute_s["keep"] == t.overhead_s["keep"] == 0.0


def test_a_saving_is_a_negative_overhead_but_no_action_is_faster_than_keep() -> None:
    # A checkpointed forward that stores nothing runs faster: part of the recomputation is paid back.
    runs = {"keep": [(1.0, 2.0, 0.0)] * 3, "checkpoint": [(0.75, 3.0, 1.0)] * 3}
    t = action_times(runs)
    assert t.overhead_s["checkpoint"] == -0.25 and t.recompute_s["checkpoint"] + t.overhead_s["checkpoint"] == 0.75
    # Timing noise may make an action look faster than keeping; its time cost stops at 0.
    runs["checkpoint"] = [(0.5, 2.0, 1.0)] * 3
    t = action_times(runs)
    assert t.overhead_s["checkpoint"] == -1.0 and t.recompute_s["checkpoint"] + t.overhead_s["checkpoint"] == 0.0


def test_unequal_rounds_are_refused() -> None:
    with pytest.raises(ValueError, match="action 'checkpoint' has 1 timed runs and keep 2"):
        action_times({"keep": [(1.0, 2.0, 0.0)] * 2, "checkpoint": [(1.0, 2.0, 1.0)]})


def test_the_no_grad_forward_is_a_median_at_most_the_recomputation() -> None:
    runs = {
        "keep": [(1.0, 2.0, 0.0), (1.0, 2.0, 0.0), (3.0, 6.0, 0.0)],
        "checkpoint": [(1.25, 3.5, 1.0), (1.25, 3.25, 1.0), (3.5, 9.5, 3.0)],
        NO_GRAD_FORWARD: [(0.5, 0.0, 0.0), (0.75, 0.0, 0.0), (2.0, 0.0, 0.0)],
    }
    t = action_times(runs)
    assert t.nograd_fwd_s == 0.75 and NO_GRAD_FORWARD not in t.recompute_s
    # noise may time it slower than the recomputation: it is never charged more
    runs[NO_GRAD_FORWARD] = [(1.5, 0.0, 0.0)] * 3
    assert action_times(runs).nograd_fwd_s == 1.0
    # not timed, or nothing to compare it with: None (the group formulas read the recomputation)
    assert action_times({"keep": runs["keep"], "checkpoint": runs["checkpoint"]}).nograd_fwd_s is None
    assert action_times({"keep": runs["keep"], NO_GRAD_FORWARD: runs[NO_GRAD_FORWARD]}).nograd_fwd_s is None
