"""PGAC's pure mask arithmetic: quantile threshold, score mask, fitting to a budget, pipeline protocol."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.core import BlockCost, BudgetError, CostTable, units_from_actions
from remat.dynamic.pgac.mask import MaskFitter, quantile, score_mask, threshold
from remat.dynamic.pgac.pipeline import simulate_pipeline_masks
from remat.planning import minimum_peak_bytes, simulate, stage_costs


def chain(keep: list[int], out: int = 100, fwd: list[float] | None = None, head: int = 0) -> CostTable:
    fwd = fwd or [1.0] * len(keep)
    rows = [
        BlockCost(
            fqn=f"b{i}",
            fwd_s=f,
            bwd_s=2 * f,
            input_bytes=out,
            output_bytes=out,
            saved_bytes={"keep": k, "checkpoint": out},
            recompute_s={"keep": 0.0, "checkpoint": f},
        )
        for i, (k, f) in enumerate(zip(keep, fwd, strict=True))
    ]
    return CostTable(rows, stem_bytes=0, head_bytes=head)


def peak(costs: CostTable, actions) -> int:
    return simulate(costs, list(actions)).peak_bytes


def test_quantile_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 12):
        xs = rng.random(n).tolist()
        for q in (0.0, 0.1, 0.5, 0.77, 1.0):
            assert quantile(xs, q) == pytest.approx(float(np.quantile(xs, q)))


def test_threshold_and_mask_follow_the_definition():
    scores = [1.0, 4.0, 2.0, 3.0]
    tau = threshold(scores, 0.5, 1.2)  # 1.2 * median 2.5
    assert tau == pytest.approx(3.0)
    assert score_mask(scores, tau) == [False, True, False, True]
    assert score_mask([0.0] * 4, threshold([0.0] * 4, 0.5, 1.0)) == [True] * 4  # bar_s = 0: all stored


def test_loose_budget_keeps_the_score_mask():
    costs = chain([1000] * 4)
    fitter = MaskFitter(costs, budget_bytes=10**9)
    fitted = fitter.fit([True, False, True, False], [4, 1, 3, 2])
    assert fitted.actions == ("keep", "checkpoint", "keep", "checkpoint")
    assert fitted.how == "mask" and fitted.dropped == ()
    assert MaskFitter(costs, None).fit([True] * 4, [0] * 4).actions == ("keep",) * 4


def test_budget_drops_the_lowest_scores_first_and_as_few_as_needed():
    costs = chain([1000] * 6)
    scores = [5.0, 1.0, 6.0, 2.0, 4.0, 3.0]
    all_keep = peak(costs, ["keep"] * 6)
    fitter = MaskFitter(costs, budget_bytes=all_keep - 1500)
    fitted = fitter.fit([True] * 6, scores)
    assert fitted.how == "dropped"
    assert fitted.peak_bytes <= fitter.budget
    # Exactly the k lowest-score blocks are recomputed, with k the least number that fits.
    k = len(fitted.dropped)
    assert sorted(fitted.dropped) == sorted(np.argsort(scores)[:k].tolist())
    order = np.argsort(scores).tolist()
    for fewer in range(k):
        actions = ["checkpoint" if i in order[:fewer] else "keep" for i in range(6)]
        assert peak(costs, actions) > fitter.budget


def test_equal_scores_drop_the_block_that_frees_most_bytes_per_second():
    costs = chain([1000, 3000, 1000, 1000], fwd=[1.0, 1.0, 1.0, 0.5])
    fitter = MaskFitter(costs, budget_bytes=peak(costs, ["keep"] * 4) - 1)
    order = fitter.drop_order([True] * 4, [0.0] * 4)
    assert order[0] == 1  # 2900 bytes per second
    assert order[1] == 3  # 900 bytes per 0.5 s beats 900 per 1 s


def test_the_tie_break_counts_a_checkpoint_overhead_as_time():
    costs = chain([1000, 1000, 1000], fwd=[1.0, 0.5, 1.0])
    costs.blocks[1].overhead_s = {"checkpoint": 1.5}  # 0.5 s of recomputation + 1.5 s of overhead: the dearest
    fitter = MaskFitter(costs, budget_bytes=peak(costs, ["keep"] * 3) - 1)
    assert fitter.drop_order([True] * 3, [0.0] * 3) == (0, 2, 1)


def test_merges_segments_when_checkpointing_everything_is_not_enough():
    costs = chain([1000] * 8, out=400)
    full = peak(costs, ["checkpoint"] * 8)
    floor = minimum_peak_bytes(costs)
    assert floor < full
    fitter = MaskFitter(costs, budget_bytes=full - 1)
    fitted = fitter.fit([True] * 8, list(range(8)))
    assert fitted.how in ("segments", "planner") and fitted.peak_bytes <= full - 1
    assert "keep" not in fitted.actions[:-1]
    assert any(u.kind == "segment" for u in units_from_actions(list(fitted.actions)))


def test_budget_below_the_minimum_names_it():
    costs = chain([1000] * 4)
    floor = minimum_peak_bytes(costs)
    with pytest.raises(BudgetError, match=str(floor)):
        MaskFitter(costs, budget_bytes=floor - 1)


def test_repeated_masks_are_served_from_the_cache():
    costs = chain([1000] * 6)
    fitter = MaskFitter(costs, budget_bytes=peak(costs, ["keep"] * 6) - 1500)
    first = fitter.fit([True] * 6, [5, 1, 6, 2, 4, 3])
    sims = fitter.simulations
    again = fitter.fit([True] * 6, [50, 10, 60, 20, 40, 30])  # same ranking, same drop order
    assert again is first and fitter.simulations == sims


@settings(max_examples=60, deadline=None)
@given(
    keep=st.lists(st.integers(200, 5000), min_size=2, max_size=7),
    data=st.data(),
)
def test_fitted_masks_fit_and_only_ever_recompute_more(keep, data):
    n = len(keep)
    costs = chain(keep, out=150, head=data.draw(st.integers(0, 2000)))
    scores = data.draw(st.lists(st.floats(0, 10), min_size=n, max_size=n))
    stored = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    lo, hi = minimum_peak_bytes(costs), peak(costs, ["keep"] * n)
    budget = data.draw(st.integers(lo, hi))
    fitted = MaskFitter(costs, budget).fit(stored, scores)
    assert fitted.peak_bytes == peak(costs, fitted.actions) <= budget
    if fitted.how in ("mask", "dropped"):
        kept = [i for i, a in enumerate(fitted.actions) if a == "keep"]
        assert all(stored[i] for i in kept)
        assert all(scores[d] <= scores[k] for d in fitted.dropped for k in kept)


# ----- pipeline protocol -----


def single_process_mask(scores, q, gamma):
    return score_mask(scores, threshold(scores, q, gamma))


def test_pipeline_global_masks_are_single_process_masks_one_step_later():
    rng = np.random.default_rng(1)
    history = [rng.random(8).tolist() for _ in range(6)]
    run = simulate_pipeline_masks(history, [3, 3, 2], q=0.5, gamma=1.1, mode="global")
    assert run.mask(0) == run.mask(1) == [True] * 8  # no scores have crossed the pipeline yet
    for t in range(len(history) - 1):
        assert run.mask(t + 2) == single_process_mask(history[t], 0.5, 1.1)
    # Only neighbours talk: scores ride forward with the activation, tau rides back with the gradient.
    for m in run.messages:
        assert abs(m.src - m.dst) == 1
        if m.direction == "forward":
            assert m.dst == m.src + 1 and m.floats == run.stages[m.src][1]
        else:
            assert m.dst == m.src - 1 and m.floats == 1
    assert len(run.messages) == (len(history) - 1) * 4


def test_pipeline_local_masks_use_each_stage_own_quantile():
    history = [[1.0, 2.0, 3.0, 10.0, 20.0, 30.0]]
    local = simulate_pipeline_masks(history, [3, 3], mode="local")
    glob = simulate_pipeline_masks(history + history, [3, 3], mode="global")
    assert local.mask(1) == [False, True, True, False, True, True]  # each stage keeps its upper half
    assert glob.mask(2) == [False, False, False, True, True, True]  # the chain's upper half
    assert local.messages == []


def test_pipeline_stages_fit_their_own_budgets_and_segments_never_cross_a_stage():
    costs = chain([1000] * 8, out=400, head=300)
    stages = [4, 4]
    budgets = []
    for s, e in [(0, 4), (4, 8)]:
        sub = stage_costs(costs, s, e)
        budgets.append(minimum_peak_bytes(sub) + 100)
    history = [list(range(8))] * 3
    run = simulate_pipeline_masks(history, stages, costs=costs, budgets=budgets, mode="global")
    for t in range(len(run.actions)):
        for p, (s, e) in enumerate(run.stages):
            sub = stage_costs(costs, s, e)
            assert peak(sub, run.actions[t][p]) <= budgets[p]
        for unit in units_from_actions(run.chain_actions(t)):
            assert any(s <= unit.start and unit.end < e for s, e in run.stages)


def test_a_stage_keeps_the_per_row_terms_of_its_rows():
    rows = replace(chain([1000] * 4, out=400, head=300), held_args_bytes=30, held_args_rows=[0, 10, 30, 30],
                   call_grad_bytes=[5, 6, 7, 8])  # fmt: skip
    second = stage_costs(rows, 2, 4)
    assert (second.held_args_rows, second.call_grad_bytes) == ([30, 30], [7, 8])
    assert simulate(second, ["checkpoint"] * 2).peak_bytes == simulate(
        replace(second, held_args_rows=[]), ["checkpoint"] * 2).peak_bytes  # fmt: skip


def test_pipeline_rejects_bad_arguments():
    with pytest.raises(ValueError, match="sum to the 4 blocks"):
        simulate_pipeline_masks([[0.0] * 4], [2, 1])
    with pytest.raises(ValueError, match="mode"):
        simulate_pipeline_masks([[0.0] * 4], [2, 2], mode="ring")
