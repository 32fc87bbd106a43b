"""The faster compiled route within a byte budget (``fit_compiled``): below the least peak of the whole-model
budgets the plan on compiled blocks is chosen, fits by measurement and gives the gradients of the same compiled
blocks without a plan; where both routes fit, the one whose steps measure faster is chosen and the model is left
set up for it alone; where neither fits, ``BudgetError`` names the least peak and the model is left as it came;
gradients and RNG are untouched; a model already applied or compiled is refused.

The backend is ``aot_eager_decomp_partition`` (torch's min-cut partitioner, which reads the budgets; no code
generation). Where the test needs one route to be the faster, its clock makes it so: a step reads 1 s while the
blocks are plain (the whole-model wrappers run) and ``blocks_s`` while they are compiled."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn
from toy_models import GeluBlock

import remat
from remat.fitting import compile_blocks, compiled_choice, fit_compiled, trial, uncompile_blocks
from remat.fitting.compiled_choice import BLOCKS, WHOLE_MODEL
from remat.runtime import owner_of

BACKEND = "aot_eager_decomp_partition"
X = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
WHOLE_BUDGETS = (0.5,)  # the whole model's least peak then stays near 0.76 of its unbudgeted one


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[GeluBlock() for _ in range(6)])


def _compiled(model: nn.Module) -> list[bool]:
    return [block._compiled_call_impl is not None for block in model]


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


class RouteClock:
    """Steps read 1 s with the blocks plain and ``blocks_s`` with them compiled (the blocks route)."""

    def __init__(self, model: nn.Module, blocks_s: float) -> None:
        self.model, self.blocks_s, self.now = model, blocks_s, 0.0

    def __call__(self) -> float:
        self.now += self.blocks_s if any(_compiled(self.model)) else 1.0
        return self.now


def test_below_the_whole_models_least_peak_the_blocks_route_fits_and_is_exact() -> None:
    model = _model()
    sentinel = [torch.full_like(p, 7.0) for p in model.parameters()]
    for p, g in zip(model.parameters(), sentinel, strict=True):
        p.grad = g
    rng = torch.get_rng_state()
    keep_all = copy.deepcopy(model)
    fit = fit_compiled(model, X, 0.6, backend=BACKEND, budgets=WHOLE_BUDGETS, partition_budgets=(0.1,), rounds=2)
    reference, whole, blocks = fit.trials
    assert whole.refused and whole.peak_bytes > fit.max_bytes  # the least whole-model peak is over
    assert fit.route == BLOCKS and not blocks.refused
    assert fit.max_bytes == int(0.6 * reference.peak_bytes)
    assert blocks.peak_bytes <= fit.max_bytes and fit.plan is not None
    assert any(a.startswith("partition:") for a in fit.plan.actions.values())
    assert all(p.grad is g for p, g in zip(model.parameters(), sentinel, strict=True))
    assert torch.equal(torch.get_rng_state(), rng)
    assert fit.module is model and owner_of(model) is fit.handle and all(_compiled(model))
    assert fit.handle.plan == fit.plan
    assert "<- chosen" in fit.describe() and "no activation_memory_budget fits" in fit.describe()

    model.zero_grad(set_to_none=True)
    with remat.measure("cpu", allocations=True) as measured:
        fit.module(X).sum().backward()
    assert measured.activation_bytes <= fit.max_bytes * 1.02
    compile_blocks(keep_all, backend=BACKEND)
    remat.apply(keep_all, remat.Plan({fqn: "keep" for fqn, _ in remat.find_blocks(keep_all)}))
    keep_all(X).sum().backward()
    torch.testing.assert_close(_grads(model), _grads(keep_all), rtol=0, atol=0)


@pytest.mark.parametrize(("blocks_s", "faster"), [(2.0, WHOLE_MODEL), (0.5, BLOCKS)])
def test_where_both_fit_the_route_measured_faster_is_chosen_and_set_up_alone(blocks_s: float, faster: str) -> None:
    model = _model()
    fit = fit_compiled(
        model, X, 0.9, backend=BACKEND, budgets=WHOLE_BUDGETS, partition_budgets=(0.1,), rounds=2,
        clock=RouteClock(model, blocks_s),
    )  # fmt: skip
    _, whole, blocks = fit.trials
    assert not whole.refused and not blocks.refused
    assert fit.route == faster
    assert whole.step_ratio == pytest.approx(1.0) and blocks.step_ratio == pytest.approx(blocks_s)
    if faster == WHOLE_MODEL:
        assert owner_of(model) is None and not any(_compiled(model)) and fit.handle is None and fit.plan is None
        assert fit.module is not model  # torch.compile's wrapper under the fitted budget
        fit.module(X).sum().backward()
        model.zero_grad(set_to_none=True)
        with remat.measure("cpu", allocations=True) as measured:
            fit.module(X).sum().backward()
        assert measured.activation_bytes == pytest.approx(whole.peak_bytes, rel=0.05)
    else:
        assert fit.module is model and owner_of(model) is fit.handle and all(_compiled(model))


def test_when_neither_fits_the_error_names_the_least_peak_and_the_model_is_as_it_came() -> None:
    model = _model()
    with pytest.raises(remat.BudgetError, match="no compiled route fits") as error:
        fit_compiled(model, X, 1024, backend=BACKEND, budgets=WHOLE_BUDGETS, partition_budgets=(0.1,), rounds=1)
    assert error.value.floor is not None and error.value.floor > 1024
    assert "whole model:" in str(error.value) and "blocks:" in str(error.value)
    assert owner_of(model) is None and not any(_compiled(model))
    assert all(p.grad is None for p in model.parameters())


def test_whole_model_trials_measured_once_serve_another_byte_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    first = fit_compiled(_model(), X, 0.9, backend=BACKEND, budgets=WHOLE_BUDGETS, partition_budgets=(0.1,),
                         rounds=1)  # fmt: skip
    assert not first.trials[1].refused  # the whole model fits 0.9

    def measured_again(*args: object, **kwargs: object) -> None:
        raise AssertionError("the whole-model grid was measured again")

    monkeypatch.setattr(compiled_choice, "measured_grid", measured_again)
    model = _model()  # a copy with the same weights
    second = fit_compiled(model, X, 0.6, backend=BACKEND, whole=first.budgets, partition_budgets=(0.1,), rounds=1)
    assert second.budgets is first.budgets
    reference, whole, blocks = second.trials
    assert reference.peak_bytes == first.trials[0].peak_bytes
    assert second.max_bytes == int(0.6 * reference.peak_bytes)
    assert whole.refused and second.route == BLOCKS and blocks.peak_bytes <= second.max_bytes
    with pytest.raises(ValueError, match="not both"):
        fit_compiled(_model(), X, 0.6, backend=BACKEND, whole=first.budgets, budgets=WHOLE_BUDGETS)


class SlowedClock:
    """Each reading advances 1 s (2 s while the blocks are compiled) plus what the slowed backends added since."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.now = model, 0.0

    def __call__(self) -> float:
        self.now += 2.0 if any(_compiled(self.model)) else 1.0
        return self.now

    def slowed(self, backend: Callable[..., Any], seconds: float) -> Callable[..., Any]:
        """``backend`` whose compiled forwards each add ``seconds`` to this clock."""

        def compile_slowed(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
            compiled = backend(gm, example_inputs)

            def run(*args: Any) -> Any:
                self.now += seconds
                return compiled(*args)

            return run

        return compile_slowed


def test_every_whole_model_budget_that_fits_runs_head_to_head_whatever_the_grid_ranked_first() -> None:
    first = fit_compiled(_model(), X, 0.95, backend=BACKEND, budgets=(0.5, 0.7), partition_budgets=(0.1,), rounds=1)
    assert sorted(t.budget for t in first.trials if t.name == WHOLE_MODEL and not t.refused) == [0.5, 0.7]
    assert all(len(t.ratios) == 1 for t in first.trials[1:])

    model = _model()
    clock = SlowedClock(model)
    grid = first.budgets  # rigged: its own steps rank 0.5 first, but 0.5's steps run 3 s slower head to head
    rigged = replace(
        grid, trials=tuple(replace(t, step_s={0.5: 0.1, 0.7: 0.2}.get(t.budget, t.step_s)) for t in grid.trials),
        backends={b: clock.slowed(fn, 3.0 if b == 0.5 else 0.0) for b, fn in grid.backends.items()},
    )  # fmt: skip
    fit = fit_compiled(model, X, 0.95, backend=BACKEND, whole=rigged, partition_budgets=(0.1,), rounds=2, clock=clock)
    labels = [t.label for t in fit.trials]
    assert labels == ["torch.compile, no budget", "whole model at 0.5", "whole model at 0.7", BLOCKS]
    steps = {t.label: t.step_ratio for t in fit.trials}
    assert steps == {labels[0]: 1.0, labels[1]: 4.0, labels[2]: 1.0, BLOCKS: 2.0}
    assert fit.route == WHOLE_MODEL and fit.budget == 0.7 and fit.chosen is fit.trials[2]
    assert owner_of(model) is None and not any(_compiled(model))
    with pytest.raises(ValueError, match="was not run"):
        grid.compile(model, 0.3)


class OverLimit:
    """A meter reading one byte over ``limit`` whatever the step allocated."""

    def __init__(self, limit: int) -> None:
        self.activation_bytes = limit + 1


@pytest.mark.parametrize("over", [2, 3])
def test_a_blocks_plan_measured_over_is_planned_again_for_less_by_the_most_missed(
    monkeypatch: pytest.MonkeyPatch, over: int
) -> None:
    first = fit_compiled(_model(), X, 0.6, backend=BACKEND, budgets=WHOLE_BUDGETS, partition_budgets=(0.1,),
                         rounds=1)  # fmt: skip
    assert first.route == BLOCKS
    predicted: list[int] = []
    real_plan = compiled_choice.make_plan

    def recorded(*args: Any, **kwargs: Any) -> remat.Plan:
        plan = real_plan(*args, **kwargs)
        predicted.append(plan.predicted_peak_bytes)
        return plan

    readings = iter([OverLimit(first.max_bytes) for _ in range(over)])
    real_measure = trial.measure  # the peak of each blocks plan is read by the fit's one meter

    def first_ones_over(*args: Any, **kwargs: Any) -> Any:
        meter = next(readings, None)
        return contextlib.nullcontext(meter) if meter is not None else real_measure(*args, **kwargs)

    monkeypatch.setattr(compiled_choice, "make_plan", recorded)
    monkeypatch.setattr(trial, "measure", first_ones_over)
    model = _model()
    if over > compiled_choice.REPLANS:
        with pytest.raises(remat.BudgetError, match=f"measured over .* {over} times"):
            fit_compiled(model, X, 0.6, backend=BACKEND, whole=first.budgets, partition_budgets=(0.1,), rounds=1)
        assert owner_of(model) is None and not any(_compiled(model))
        return
    fit = fit_compiled(model, X, 0.6, backend=BACKEND, whole=first.budgets, partition_budgets=(0.1,), rounds=1)
    assert fit.route == BLOCKS and fit.chosen.peak_bytes <= fit.max_bytes
    # each plan was made for the limit less the most missed so far: one byte over, so below the last prediction
    assert len(predicted) == over + 1 and all(b < a for a, b in zip(predicted, predicted[1:], strict=False))
    assert fit.chosen.predicted_bytes == predicted[-1]


def test_a_model_with_a_plan_or_compiled_blocks_is_refused() -> None:
    model = _model()
    handle = remat.apply(model, remat.Plan({fqn: "keep" for fqn, _ in remat.find_blocks(model)}))
    with pytest.raises(ValueError, match="without a plan applied"):
        fit_compiled(model, X, 0.5, backend=BACKEND)
    handle.remove()
    chain = compile_blocks(model, backend=BACKEND)
    with pytest.raises(ValueError, match="uncompile_blocks"):
        fit_compiled(model, X, 0.5, backend=BACKEND)
    uncompile_blocks(chain)
    assert not any(_compiled(model))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rounds": 0}, "at least one timed step"),
        ({"max_bytes": None}, "max_bytes is None"),
        ({"partition_budgets": (1.5,)}, "budget"),
    ],
)
def test_bad_arguments_say_what_to_pass(options: dict, message: str) -> None:
    model = _model()
    with pytest.raises(ValueError, match=message):
        fit_compiled(model, X, **{"max_bytes": 0.5, "backend": BACKEND, **options})
    assert owner_of(model) is None and not any(_compiled(model))


def test_under_bf16_autocast_the_chosen_route_fits_as_measured_in_autocast() -> None:
    model = _model()
    fit = fit_compiled(
        model, X, 0.6, backend=BACKEND, budgets=WHOLE_BUDGETS, partition_budgets=(0.1,), rounds=1,
        autocast=torch.bfloat16,
    )  # fmt: skip
    assert not fit.chosen.refused and fit.chosen.peak_bytes <= fit.max_bytes
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fit.module(X).float().sum().backward()
    model.zero_grad(set_to_none=True)
    with remat.measure("cpu", allocations=True) as measured:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fit.module(X).float().sum()
        loss.backward()
    assert measured.activation_bytes <= fit.max_bytes * 1.02
    assert measured.activation_bytes == pytest.approx(fit.chosen.peak_bytes, rel=0.05)
