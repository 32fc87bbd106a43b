"""A model that runs the same blocks more than once per step (a loop over shared layers, ALBERT's one layer at
every depth): the profile has a row per call (``<fqn>@<k>``), plans give each call its own action (segments and
memory-poor groups may span calls), the runtime applies the action of each call, gradients stay bitwise equal to
no checkpointing, and the measured peak is within the budget and near the prediction."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.chains.block_calls import call_name, split_call


class _Residual(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class _Looped(nn.Module):
    """Four layers run twice, as a universal transformer or ALBERT shares its layers across depth."""

    def __init__(self, d: int = 16, passes: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Residual(d) for _ in range(4))
        self.passes = passes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.passes):
            for layer in self.layers:
                x = layer(x)
        return x.square().mean()


LAYERS = [f"layers.{i}" for i in range(4)]


def test_call_names_round_trip() -> None:
    assert call_name("layers.0", 1) == "layers.0" and call_name("layers.0", 3) == "layers.0@3"
    assert split_call("layers.0@3") == ("layers.0", 3) and split_call("layers.0") == ("layers.0", 1)
    assert split_call("odd@name") == ("odd@name", 1)


def test_each_call_of_a_looped_block_is_a_row_in_step_order() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        costs = remat.profile(_Looped(), x, repeats=1)
        once = remat.profile(_Looped(passes=1), x, repeats=1)
    assert costs.fqns == LAYERS + [f"{fqn}@2" for fqn in LAYERS]
    assert costs.info["called_more_than_once"] == dict.fromkeys(LAYERS, 2)
    grads = sum(p.numel() * 4 for p in _Residual(16).parameters())
    # a layer's gradients from its second call wait from that call's backward to its first call's
    assert costs.call_grad_bytes == [grads * n for n in (1, 2, 3, 4, 4, 3, 2, 1)]
    assert costs.blocks[4].saved_bytes == costs.blocks[0].saved_bytes
    # a model without loops: its blocks' FQNs, no per-call fields
    assert once.fqns == LAYERS and once.call_grad_bytes == [] and "called_more_than_once" not in once.info
    assert remat.CostTable.from_json(costs.to_json()).call_grad_bytes == costs.call_grad_bytes


def _step_grads(model: nn.Module, run: Callable[[nn.Module], torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    run(model).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _check_plan(
    model: nn.Module, run: Callable[[nn.Module], torch.Tensor], plan: remat.Plan, blocks: Any = None
) -> int:
    """Gradients bitwise equal to no checkpointing (two steps, so the call counts restart); the measured peak."""
    expected = _step_grads(copy.deepcopy(model), run)
    handle = remat.apply(model, plan, blocks=blocks)
    try:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            with remat.measure() as meter:
                run(model).backward()
            for (name, p), q in zip(model.named_parameters(), expected, strict=True):
                assert torch.equal(p.grad, q), name
    finally:
        handle.remove()
    return meter.activation_bytes


@pytest.mark.parametrize(
    "actions",
    [
        ["checkpoint"] * 4,  # one action per block: every call runs under it
        ["segment:0"] * 2 + ["keep", "checkpoint"],
        ["keep", "checkpoint", "keep", "selective:dots_saveable", "checkpoint", "keep", "keep", "checkpoint"],
        ["keep", "keep", "segment:0", "segment:0", "segment:0", "segment:0", "keep", "checkpoint"],  # across passes
        ["checkpoint", "memory_poor:0", "memory_poor:0", "memory_poor:0", "memory_poor:0", "keep", "keep", "keep"],
    ],
)
def test_every_call_runs_under_its_own_action_with_exact_gradients(actions: list[str]) -> None:
    torch.manual_seed(0)
    model = _Looped()
    names = LAYERS if len(actions) == 4 else LAYERS + [f"{fqn}@2" for fqn in LAYERS]
    plan = remat.Plan(dict(zip(names, actions, strict=True)))
    x = torch.randn(8, 16)
    _check_plan(model, lambda m: m(x), plan)
    recomputed = {n for n, a in zip(names, actions, strict=True) if a != "keep"}
    handle = remat.apply(model, plan)
    try:
        model(x).backward()
        assert sum(handle.stats.calls.values()) >= len(recomputed)
    finally:
        handle.remove()


def test_calls_made_outside_the_models_forward_wrap_around_to_the_first() -> None:
    torch.manual_seed(0)
    model = _Looped()
    plan = remat.Plan(dict.fromkeys(LAYERS, "keep") | {"layers.0": "checkpoint"} | {f"{f}@2": "keep" for f in LAYERS})
    x = torch.randn(8, 16)
    handle = remat.apply(model, plan)
    try:
        for _ in range(3):  # the blocks called by hand: no model forward resets the counts
            h = x
            for _ in range(2):
                for layer in model.layers:
                    h = layer(h)
            h.square().mean().backward()
        assert handle.stats.calls["layers.0"] == 3  # its first call of each step only
    finally:
        handle.remove()


def test_a_plan_naming_calls_wrongly_is_refused_with_what_to_write() -> None:
    model = _Looped()
    gap = dict.fromkeys(LAYERS, "keep") | {"layers.0@3": "checkpoint"}
    with pytest.raises(ValueError, match=r"block 'layers.0' has calls \[1, 3\]"):
        remat.apply(model, remat.Plan(gap))
    unknown = dict.fromkeys(LAYERS, "keep") | {"nothing@2": "checkpoint"}
    with pytest.raises(ValueError, match=r"not blocks of the model's chain.*'nothing@2'.*'<fqn>@<k>'"):
        remat.apply(model, remat.Plan(unknown))


@pytest.mark.parametrize("budget", [0.6, 0.5, 0.35, "minimum"])
def test_optimal_plans_of_a_looped_model_fit_their_budget_and_are_predicted(budget: Any) -> None:
    torch.manual_seed(0)
    model = _Looped(d=64)
    x = torch.randn(256, 64)
    costs = remat.profile(model, x, repeats=1)
    if budget == "minimum":  # every call checkpointed: the least a plan of single actions can keep
        budget = remat.plan(costs, "full").predicted_peak_bytes
    plan = remat.plan(costs, "optimal", budget)
    assert len(plan.actions) == 8
    peak = _check_plan(model, lambda m: m(x), plan)
    assert peak <= plan.budget_bytes, (plan.actions, peak, plan.budget_bytes)
    assert abs(plan.predicted_peak_bytes - peak) <= 0.05 * peak, (plan.actions, peak, plan.predicted_peak_bytes)


def test_hugging_face_albert_shares_one_layer_across_depth_and_plans_each_call() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.AlbertConfig(
        vocab_size=100, embedding_size=32, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=256, max_position_embeddings=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    )  # fmt: skip
    model = transformers.AlbertForMaskedLM(config).train()
    ids = torch.randint(0, 100, (32, 64))
    batch = {"input_ids": ids, "labels": ids}
    blocks = ["albert.encoder.albert_layer_groups.0"]  # one module, called at each of the 4 depths
    costs = remat.profile(model, batch, blocks=blocks, repeats=1)
    assert costs.fqns == [call_name(blocks[0], k) for k in range(1, 5)]
    minimum = remat.plan(costs, "full").predicted_peak_bytes
    for budget in (0.5, minimum):
        plan = remat.plan(costs, "optimal", budget)
        peak = _check_plan(model, lambda m: m(**batch).loss, plan, blocks=blocks)
        assert peak <= plan.budget_bytes, (plan.actions, peak, plan.budget_bytes)
        assert abs(plan.predicted_peak_bytes - peak) <= 0.05 * peak, (plan.actions, peak, plan.predicted_peak_bytes)
