"""PGAC-Q end to end on a tiny GPT-2 (CPU): three-state masks that change between steps, PGAC bit for bit when
nothing is compressed, measured peaks within the budget with gradients close to exact, budgets below every exact
plan, ranking by profiled error, checkpoints, and the error messages."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from toy_models import tiny_gpt2

import remat
from remat.core import BudgetError
from remat.dynamic.pgac.q_mask import QuantizedMaskFitter
from remat.profiling.grad_error import compare

transformers = pytest.importorskip("transformers")
INT8 = "compress:int8"


def gpt2(n_layer: int = 5, seed: int = 0) -> torch.nn.Module:
    transformers.utils.logging.set_verbosity_error()
    return tiny_gpt2(n_layer, n_embd=64, n_positions=32, vocab=64, seed=seed)


def lossy_costs(model, keep=1000, out=100, compressed=300, errors=None) -> remat.CostTable:
    """Identical hand-set blocks with keep, checkpoint and compress:int8 costs (compressing keeps 30%)."""
    rows = []
    for i, (fqn, _) in enumerate(remat.find_blocks(model)):
        row = remat.BlockCost(
            fqn, 1e-3, 2e-3, out, out, {"keep": keep, "checkpoint": out, INT8: compressed},
            {"keep": 0.0, "checkpoint": 1e-3, INT8: 2e-4},
        )  # fmt: skip
        row.grad_error[INT8] = errors[i] if errors is not None else 0.01
        row.grad_cosine[INT8] = 0.999
        rows.append(row)
    return remat.CostTable(rows)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1000 + step))


def grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_masks_hold_three_states_and_change_between_steps():
    model = gpt2()
    costs = lossy_costs(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = 8
    gammas = [1.0, 1.0, 0.0, 1e9, 1.0, 0.0, 1.0, 1.0]
    # alpha 0 and every=1000: the scores of step 0 rank the blocks for the whole test
    pgacq = remat.PGACQ(
        model, None, alpha=0.0, every=1000, gamma=lambda f: gammas[round(f * steps) % len(gammas)], costs=costs,
        total_steps=steps,
    ).attach(opt)  # fmt: skip
    seen = []
    for t in range(steps):
        x = batch(t)
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        if t == 0:
            ranked = sorted(range(5), key=lambda i: pgacq.history[0].scores[i])
            mask = [INT8] * 5
            for i in ranked[2:]:
                mask[i] = "keep"  # q 0.5, gamma 1: the 3 blocks at or above the median score are kept
            assert list(pgacq.plan.actions.values()) == mask
            mask[ranked[2]] = "checkpoint"
            budget = remat.simulate(costs, mask).peak_bytes  # tight enough that the lowest kept block recomputes
            pgacq.set_budget(budget)
            continue
        states = pgacq.states
        seen.append(tuple(states.values()))
        assert pgacq.plan.predicted_peak_bytes <= budget
        assert pgacq.compressed == {f: s == "compress" for f, s in states.items()}
        assert pgacq.mask == {f: s == "keep" for f, s in states.items()}
    # gamma 1: the lowest-impact blocks compressed, the highest kept, the one between recomputed for the budget
    assert [seen[0][i] for i in ranked] == ["compress", "compress", "recompute", "keep", "keep"]
    assert "compress" not in seen[1] and "keep" in seen[1]  # gamma 0: nothing is compressed
    assert set(seen[2]) == {"compress"}  # tau above every score: every block compressed
    assert seen[3] == seen[0] and len(set(seen)) == 3
    pgacq.remove()


def test_without_compression_it_is_pgac_bit_for_bit():
    model = gpt2(n_layer=4)
    twin, reference = copy.deepcopy(model), copy.deepcopy(model)
    costs = lossy_costs(model)
    budget = remat.simulate(costs, ["checkpoint"] * 2 + ["keep"] * 2).peak_bytes
    opts = dict(alpha=0.5, gamma="linear", total_steps=6, costs=costs)
    pgac = remat.PGAC(model, budget, **opts)
    pgacq = remat.PGACQ(twin, budget, compress=None, **opts)
    plans = set()
    for t in range(6):
        x = batch(t)
        for m in (model, twin, reference):
            torch.manual_seed(t)
            m.zero_grad(set_to_none=True)
            m(x, labels=x).loss.backward()
        assert all(torch.equal(a, b) for a, b in zip(grads(model), grads(twin), strict=True))
        assert all(torch.equal(a, b) for a, b in zip(grads(model), grads(reference), strict=True))
        pgac.step()
        pgacq.step()
        assert pgacq.plan.actions == pgac.plan.actions and pgacq.scores == pgac.scores and pgacq.tau == pgac.tau
        assert "compress" not in pgacq.states.values()
        plans.add(tuple(pgac.plan.actions.values()))
    assert len(plans) > 1  # the mask moved
    pgac.remove()
    pgacq.remove()


def test_profiles_then_keeps_the_measured_peak_within_budget_with_gradients_close_to_exact():
    model = gpt2(n_layer=4)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    pgacq = remat.PGACQ(model, 0.5, alpha=0.5).attach(opt)
    cosines, ran, measured = [], [], []
    for t in range(5):
        x = batch(t)
        reference.load_state_dict(model.state_dict())
        ran.append(tuple(pgacq.plan.actions.values()))
        torch.manual_seed(t)
        reference.zero_grad(set_to_none=True)
        reference(x, labels=x).loss.backward()
        torch.manual_seed(t)
        with remat.measure() as peak:
            model(x, labels=x).loss.backward()
        measured.append(peak.activation_bytes)
        cosines.append(compare(grads(reference), grads(model)).cosine)
        opt.step()
        opt.zero_grad()
    costs = pgacq.costs
    assert costs is not None and all(INT8 in row.grad_error for row in costs.blocks)  # profiled in step 0
    assert any(INT8 in actions for actions in ran[1:])
    budget = pgacq.budget_bytes
    assert budget == int(0.5 * remat.simulate(costs, ["keep"] * 4).peak_bytes)
    assert all(m <= budget for m in measured[1:]), (measured, budget)
    assert min(cosines) > 0.999
    pgacq.remove()


def test_budgets_below_every_exact_plan_train_with_compressed_blocks():
    model = gpt2(n_layer=4)
    costs = lossy_costs(model, keep=1000, out=100, compressed=130)
    for row in costs.blocks:
        row.bwd_temp_bytes = row.fwd_temp_bytes = 50
        row.bwd_extra_bytes[INT8] = -800  # a compressed block's backward peaks far below keep's
    exact_floor = remat.simulate(costs, ["checkpoint"] * 4).peak_bytes
    budget = 900
    with pytest.raises(BudgetError):
        remat.plan(costs, "optimal", budget)
    exact_min = remat.planning.strategies.minimum_peak_bytes(costs, ["keep", "checkpoint", "segment", "memory_poor"])
    assert budget < exact_min
    with pytest.raises(BudgetError, match=f"\\({exact_min} bytes\\)"):
        remat.PGAC(model, budget, costs=costs)  # PGAC plans exact actions only, whatever the table holds
    pgacq = remat.PGACQ(model, budget, costs=costs)
    assert pgacq.plan.options["how"] == "planner" and pgacq.plan.predicted_peak_bytes <= budget < exact_floor
    assert "compress" in pgacq.states.values()
    x = batch(0)
    model(x, labels=x).loss.backward()
    pgacq.step()
    assert pgacq.plan.predicted_peak_bytes <= budget
    pgacq.remove()
    with pytest.raises(BudgetError, match="below the minimum any plan of keep, checkpoint and compress:int8"):
        remat.PGACQ(model, 100, costs=costs)
    assert not model._forward_pre_hooks


def test_rank_by_profiled_error_compresses_the_blocks_of_least_error():
    model = gpt2(n_layer=4)
    costs = lossy_costs(model, errors=[0.04, 0.001, 0.03, 0.002])
    pgacq = remat.PGACQ(model, None, rank="error", costs=costs)
    x = batch(0)
    model(x, labels=x).loss.backward()
    pgacq.step()
    assert list(pgacq.states.values()) == ["keep", "compress", "keep", "compress"]
    assert pgacq.tau == pytest.approx((0.03 + 0.002) / 2)
    pgacq.remove()


def test_state_dict_round_trip_resumes_the_same_decisions():
    model = gpt2(n_layer=4)
    clone, third = copy.deepcopy(model), copy.deepcopy(model)
    costs = lossy_costs(model)
    budget = remat.simulate(costs, ["checkpoint", INT8, "keep", "keep"]).peak_bytes
    pgacq = remat.PGACQ(model, budget, alpha=0.5, costs=costs, gamma="linear", total_steps=10)
    for t in range(3):
        x = batch(t)
        model(x, labels=x).loss.backward()
        pgacq.step()
    state = json.loads(json.dumps(pgacq.state_dict()))  # plain values only
    assert state["compress"] == INT8 and state["rank"] == "score"
    resumed = remat.PGACQ(clone, budget, alpha=0.5, costs=None, gamma="linear", total_steps=10)
    resumed.load_state_dict(state)
    assert resumed.scores == pgacq.scores and resumed.states == pgacq.states and resumed.step_count == 3
    assert "compress" in resumed.states.values()
    pgacq.step()
    resumed.step()
    assert resumed.plan.actions == pgacq.plan.actions
    other = remat.PGACQ(third, budget, compress="fp8", costs=None)
    with pytest.raises(ValueError, match="compress='compress:int8'"):
        other.load_state_dict(state)
    for p in (pgacq, resumed, other):
        p.remove()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": "loudest"}, "rank must be 'score'"),
        ({"compress": "int4"}, "unknown compression format 'int4'"),
        ({"compress": None, "rank": "error"}, "give compress= a format"),
        ({"alpha": 1.0}, "alpha is the EMA decay"),
    ],
)
def test_bad_options_are_rejected_with_clear_errors(kwargs, match):
    model = gpt2(n_layer=2)
    with pytest.raises(ValueError, match=match):
        remat.PGACQ(model, None, **kwargs)
    assert not model._forward_pre_hooks


def test_a_cost_table_without_compress_costs_is_refused_with_how_to_get_them():
    model = gpt2(n_layer=2)
    costs = lossy_costs(model)
    with pytest.raises(ValueError, match=r"lossy=\('fp8',\)"):
        remat.PGACQ(model, None, compress="fp8", costs=costs)
    with pytest.raises(ValueError, match="one entry per block"):
        QuantizedMaskFitter(costs, None, INT8).fit([True], [0.0])
