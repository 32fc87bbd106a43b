"""PGAC's gradient influence proxy: s_l = ||dL/da_l * a_l||_2 from hooks, under every kind of plan."""

from __future__ import annotations

import copy
import gc
import math

import pytest
import torch
from toy_models import tiny_gpt2

import remat
from remat.dynamic.pgac.scores import GradientScorer

transformers = pytest.importorskip("transformers")

PLANS = {
    "keep": ["keep"] * 5,
    "checkpoint": ["checkpoint"] * 5,
    "segment": ["keep", "segment:0", "segment:0", "segment:0", "checkpoint"],
    "memory_poor": ["memory_poor:0"] * 4 + ["keep"],
    "mixed": ["segment:a", "segment:a", "memory_poor:b", "memory_poor:b", "selective:dots_saveable"],
}


def gpt2(n_layer: int = 5, seed: int = 0) -> torch.nn.Module:
    transformers.utils.logging.set_verbosity_error()
    return tiny_gpt2(n_layer, n_embd=32, n_positions=32, vocab=64, seed=seed)


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(seed))


def reference_scores(model: torch.nn.Module, x: torch.Tensor, seed: int) -> list[float]:
    """||dL/da * a|| per block from retain_grad on the block outputs of a plain run."""
    outputs: list[torch.Tensor] = []

    def keep_output(_module, _inputs, out):
        out.retain_grad()
        outputs.append(out)

    hooks = [module.register_forward_hook(keep_output) for _, module in remat.find_blocks(model)]
    torch.manual_seed(seed)
    model(x, labels=x).loss.backward()
    for h in hooks:
        h.remove()
    model.zero_grad(set_to_none=True)
    return [float((a.grad * a).detach().norm()) for a in outputs]


def scored_step(model, scorer, x, seed):
    torch.manual_seed(seed)
    model(x, labels=x).loss.backward()
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", list(PLANS))
def test_score_equals_independent_computation(name):
    model = gpt2()
    reference = copy.deepcopy(model)
    fqns = [f for f, _ in remat.find_blocks(model)]
    handle = remat.apply(model, remat.Plan(dict(zip(fqns, PLANS[name], strict=True))))
    scorer = GradientScorer(handle)
    x = batch(1)
    scored_step(model, scorer, x, seed=7)
    scores, counts = scorer.collect()
    expected = reference_scores(reference, x, seed=7)
    assert counts == [1] * 5 and scorer.missed == [0] * 5
    assert scores == pytest.approx(expected, rel=1e-5)
    assert len(set(round(s, 9) for s in scores)) > 1  # the blocks really differ
    handle.remove()


def test_micro_batches_combine_by_root_sum_square():
    model = gpt2()
    reference = copy.deepcopy(model)
    fqns = [f for f, _ in remat.find_blocks(model)]
    handle = remat.apply(model, remat.Plan(dict(zip(fqns, PLANS["segment"], strict=True))))
    scorer = GradientScorer(handle)
    for seed in (3, 4):
        scored_step(model, scorer, batch(seed), seed)
    scores, counts = scorer.collect()
    first, second = (reference_scores(reference, batch(s), s) for s in (3, 4))
    assert counts == [2] * 5
    assert scores == pytest.approx([math.hypot(a, b) for a, b in zip(first, second, strict=True)], rel=1e-5)
    assert scorer.collect() is None  # cleared


@pytest.mark.parametrize("name", ["keep", "segment", "memory_poor", "mixed"])
def test_scoring_keeps_nothing_alive_that_the_plan_frees(name):
    model = gpt2()
    fqns = [f for f, _ in remat.find_blocks(model)]
    handle = remat.apply(model, remat.Plan(dict(zip(fqns, PLANS[name], strict=True))))
    scorer = GradientScorer(handle)
    x = batch(2)
    figures = {}
    gc.disable()  # a reference cycle through a hook would show up as memory that outlives the step
    try:
        for enabled in (False, True, True):
            scorer.enabled = enabled
            with remat.measure() as m:
                scored_step(model, scorer, x, seed=5)
            figures.setdefault(enabled, set()).add((m.activation_bytes, m.peak_bytes))
            assert not scorer._held
    finally:
        gc.enable()
    assert len(figures[True]) == len(figures[False]) == 1
    (act_on, peak_on), (act_off, peak_off) = figures[True].pop(), figures[False].pop()
    assert act_on == act_off
    assert 0 <= peak_on - peak_off <= 5 * 4  # the five float32 norms waiting for collect()
    handle.remove()


def test_forward_without_backward_holds_at_most_one_output_per_block():
    model = gpt2()
    fqns = [f for f, _ in remat.find_blocks(model)]
    handle = remat.apply(model, remat.Plan(dict(zip(fqns, PLANS["keep"], strict=True))))
    scorer = GradientScorer(handle)
    for seed in range(3):
        model(batch(seed), labels=batch(seed))  # grad enabled, no backward
    assert len(scorer._held) <= 5
    scorer.collect()
    assert not scorer._held
    handle.remove()


def test_pgac_scores_are_the_ema_of_the_proxy():
    model = gpt2()
    reference = copy.deepcopy(model)
    pgac = remat.PGAC(model, None, alpha=0.0, costs=_costs(model))
    x = batch(9)
    scored_step(model, None, x, seed=11)
    pgac.step()
    expected = reference_scores(reference, x, seed=11)
    assert list(pgac.scores.values()) == pytest.approx(expected, rel=1e-5)
    assert pgac.history[-1].step_scores == pytest.approx(expected, rel=1e-5)
    # alpha = 0.5: bar_s = 0.5 * previous + 0.5 * s
    pgac.alpha = 0.5
    y = batch(10)
    scored_step(model, None, y, seed=12)
    pgac.step()
    second = reference_scores(reference, y, seed=12)
    ema = [0.5 * a + 0.5 * b for a, b in zip(expected, second, strict=True)]
    assert list(pgac.scores.values()) == pytest.approx(ema, rel=1e-5)
    pgac.remove()


def _costs(model):
    rows = [
        remat.BlockCost(fqn, 1e-3, 2e-3, 100, 100, {"keep": 1000, "checkpoint": 100}, {"keep": 0.0, "checkpoint": 1e-3})
        for fqn, _ in remat.find_blocks(model)
    ]
    return remat.CostTable(rows)
