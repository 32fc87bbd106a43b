"""torch.compile's whole-model activation memory budget fitted to a byte budget (``fit_compile_budget``): the
chosen budget's measured peak fits and it is the fastest of those that fit, compiling with it reproduces that
peak and the gradients of the unbudgeted compiled model, the model's gradients and RNG are left as they were,
no fit raises ``BudgetError`` naming the least peak, and budgets that could draw dropout anew are not tried.

The backend is ``aot_eager_decomp_partition`` (torch's min-cut partitioner, which reads the budget; no code
generation). Under inductor a budget in (0, 1) compiles with ``save_draws_pass``, tested in
``test_compiled_partitions``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat
from remat.core import format_bytes
from remat.fitting import fit_compile_budget
from remat.fitting.compile_budget import NO_BUDGET

BACKEND = "aot_eager_decomp_partition"
X = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))


def _mlp(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(dropout), nn.Linear(256, 64)) for _ in range(6)]
    )


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_chosen_budget_fits_and_is_the_fastest_that_fits() -> None:
    model = _mlp()
    sentinel = [torch.full_like(p, 7.0) for p in model.parameters()]
    for p, g in zip(model.parameters(), sentinel, strict=True):
        p.grad = g
    rng = torch.get_rng_state()
    fit = fit_compile_budget(model, X, 0.6, backend=BACKEND, budgets=(0.1, 0.3, 0.6), rounds=2)
    reference = next(t for t in fit.trials if t.budget == NO_BUDGET)
    assert [t.budget for t in fit.trials] == [NO_BUDGET, 0.1, 0.3, 0.6]
    assert fit.max_bytes == int(0.6 * reference.peak_bytes)
    fitting = [t for t in fit.trials if t.peak_bytes <= fit.max_bytes]
    assert reference not in fitting and fit.chosen in fitting
    assert fit.chosen.step_s == min(t.step_s for t in fitting)
    assert min(t.peak_bytes for t in fit.trials) < 0.5 * reference.peak_bytes  # the budgets do cut the peak
    assert all(p.grad is g for p, g in zip(model.parameters(), sentinel, strict=True))
    assert torch.equal(torch.get_rng_state(), rng)
    assert "<- chosen" in fit.describe()
    assert fit.refit(fit.max_bytes) == fit  # chosen again from the same measurements
    assert fit.refit(1.0).max_bytes == reference.peak_bytes
    with pytest.raises(remat.BudgetError):
        fit.refit(1024)


def test_compiling_with_the_fit_gives_its_peak_and_the_unbudgeted_gradients() -> None:
    model = _mlp()
    fit = fit_compile_budget(model, X, 0.6, backend=BACKEND, budgets=(0.1, 0.3), rounds=1)
    assert fit.budget in (0.1, 0.3)
    fitted, plain = copy.deepcopy(model), copy.deepcopy(model)
    compiled = fit.compile(fitted)
    compiled(X).sum().backward()  # compiled already: dynamo reuses the fit's entry
    fitted.zero_grad(set_to_none=True)
    with remat.measure("cpu", allocations=True) as measured:
        compiled(X).sum().backward()
    assert measured.activation_bytes <= fit.max_bytes * 1.02
    assert measured.activation_bytes == pytest.approx(fit.chosen.peak_bytes, rel=0.05)
    torch.compile(plain, backend=BACKEND)(X).sum().backward()
    torch.testing.assert_close(_grads(fitted), _grads(plain), rtol=0, atol=0)


def test_no_budget_that_fits_names_the_least_peak() -> None:
    with pytest.raises(remat.BudgetError, match="least peak measured is") as error:
        fit_compile_budget(_mlp(), X, 1024, backend=BACKEND, budgets=(0.1, 0.5), rounds=1)
    assert error.value.floor is not None and error.value.floor > 1024
    assert format_bytes(error.value.floor) in str(error.value)
    assert "compile_blocks" in str(error.value)


def test_dropout_model_tries_only_budgets_that_keep_its_draws() -> None:
    """``aot_eager_decomp_partition`` runs no inductor pass to save the seeds: with dropout only no budget runs."""
    fit = fit_compile_budget(_mlp(dropout=0.1), X, 1.0, backend=BACKEND, budgets=(0.1, 0.5), rounds=1)
    assert fit.budget == NO_BUDGET
    assert [t.peak_bytes is None for t in fit.trials] == [False, True, True]
    assert "draws random numbers" in fit.trials[1].refused
    with pytest.raises(remat.BudgetError, match="were not run \\(not tried: the model draws"):
        fit_compile_budget(_mlp(dropout=0.1), X, 0.5, backend=BACKEND, budgets=(0.1,), rounds=1)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"budgets": (1.5,)}, "fractions in \\[0, 1\\)"),
        ({"budgets": (True,)}, "fractions in \\[0, 1\\)"),
        ({"budgets": ()}, "budgets is empty"),
        ({"rounds": 0}, "at least one timed step"),
        ({"max_bytes": -5}, "cannot be negative"),
        ({"max_bytes": None}, "max_bytes is None"),
    ],
)
def test_bad_arguments_say_what_to_pass(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit_compile_budget(_mlp(), X, **{"max_bytes": 0.5, "backend": BACKEND, **options})


def test_gradients_zeroed_in_place_are_measured_as_the_loop_keeps_them() -> None:
    """A compiled backward returns every parameter's gradient at its end; kept from the last step (zeroed in place)
    they are accumulated into, so a graph that recomputes much peaks higher than with gradients set to None."""
    model = _mlp()
    cleared = fit_compile_budget(model, X, 1.0, backend=BACKEND, budgets=(0.1,), rounds=1)
    kept = fit_compile_budget(model, X, 1.0, backend=BACKEND, budgets=(0.1,), rounds=1, set_to_none=False)
    assert kept.trials[1].peak_bytes > cleared.trials[1].peak_bytes
    compiled = torch.compile(model, backend=kept.backends[0.1])
    compiled(X).sum().backward()
    for p in model.parameters():
        p.grad.zero_()
    with remat.measure("cpu", allocations=True) as measured:
        compiled(X).sum().backward()
    assert measured.activation_bytes == pytest.approx(kept.trials[1].peak_bytes, rel=0.05)


def test_gradients_zeroed_in_place_leave_the_callers_gradients_as_they_were() -> None:
    """Measured with ``set_to_none=False``, the steps zero gradients in place: the caller's own gradient tensors
    must be set aside, not zeroed and accumulated into."""
    model = _mlp()
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    kept = [p.grad for p in model.parameters()]
    fit_compile_budget(model, X, 1.0, backend=BACKEND, budgets=(0.1,), rounds=1, set_to_none=False)
    assert all(p.grad is g for p, g in zip(model.parameters(), kept, strict=True))
    assert all(bool((g == 7.0).all()) for g in kept)
