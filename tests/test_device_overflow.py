"""A device the plain step does not fit (emulated on the CPU by :class:`toy_models.DeviceOf`, which raises
``torch.OutOfMemoryError`` as CUDA's allocator does): ``remat.profile`` measures with every block checkpointed
where keeping them runs out of memory, and ``remat.fit`` with a sample batch returns a plan that runs there, with
the gradients of a plain step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from toy_models import DeviceOf, tiny_gpt2, uniform_chain

import remat
from remat.core import CHECKPOINT
from remat.fitting import fixed_memory

X = torch.randn(512, 8, generator=torch.Generator().manual_seed(3))
IDS = torch.randint(1, 256, (8, 128), generator=torch.Generator().manual_seed(4))
TEXT = {"input_ids": IDS, "labels": IDS}


def mlp_case() -> tuple[Callable[[], nn.Module], Any, Callable[[nn.Module], torch.Tensor]]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return uniform_chain(6, width=64, dropout=0.1)

    return make, X, lambda model: model(X)


def gpt2_case() -> tuple[Callable[[], nn.Module], Any, Callable[[nn.Module], torch.Tensor]]:
    return lambda: tiny_gpt2(4, 64, seed=0), TEXT, lambda model: model(**TEXT).loss


CASES = {"mlp chain": mlp_case, "hugging face gpt2": gpt2_case}


def step_peak(model: nn.Module, loss: Callable[[nn.Module], torch.Tensor], plan: remat.Plan | None = None) -> int:
    """The bytes a training step adds to the parameters: activations, temporaries and gradients."""
    handle = remat.apply(model, plan) if plan is not None else None
    try:
        with remat.measure() as meter:
            loss(model).backward()
        model.zero_grad(set_to_none=True)
    finally:
        if handle is not None:
            handle.remove()
    return meter.peak_bytes


def capacity_between_full_and_keep(model: nn.Module, loss: Callable[[nn.Module], torch.Tensor]) -> int:
    """A capacity the step with every block checkpointed fits with room and the plain step does not."""
    full = remat.Plan({fqn: CHECKPOINT for fqn, _ in remat.find_blocks(model)})
    keep, checkpointed = step_peak(model, loss), step_peak(model, loss, full)
    assert checkpointed < 0.75 * keep, (checkpointed, keep)
    return (keep + 2 * checkpointed) // 3


def trained_on(model: nn.Module, loss: Callable[[nn.Module], torch.Tensor], seed: int,
               capacity: int | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:  # fmt: skip
    """One training step's loss and gradients from RNG ``seed``, on a device of ``capacity`` bytes where given
    (the gradients read after it: they are the step's own, counted in the memory)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if capacity is None:
        value = loss(model)
        value.backward()
    else:
        with DeviceOf(capacity) as device:
            value = loss(model)
            value.backward()
        assert device.refused == 0
    return value.detach(), [p.grad.clone() for p in model.parameters()]


def trains_as_a_plain_step(model: nn.Module, reference: nn.Module, loss: Callable[[nn.Module], torch.Tensor],
                           capacity: int) -> None:  # fmt: skip
    """Two training steps of ``model`` on a device of ``capacity`` bytes: none refused an allocation, and the losses
    and gradients are bitwise those of plain steps of ``reference`` (a copy) from the same RNG seeds."""
    for seed in (1, 2):
        value, grads = trained_on(model, loss, seed, capacity)
        expected_value, expected = trained_on(reference, loss, seed)
        assert torch.equal(value, expected_value)
        assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))


def test_a_profile_that_runs_out_of_memory_keeping_every_block_is_taken_with_them_checkpointed() -> None:
    make, batch, loss = mlp_case()
    model = make()
    kept = remat.profile(model, batch)
    with DeviceOf(capacity_between_full_and_keep(model, loss)) as device:
        costs = remat.profile(model, batch)
    assert device.refused >= 1  # the step keeping every block ran out of memory there
    assert costs.info["profiled_under"] == CHECKPOINT and kept.info.get("profiled_under") is None
    for a, b in zip(costs.blocks, kept.blocks, strict=True):  # each block measured alone: the same bytes
        assert (a.saved_bytes, a.input_bytes, a.output_bytes) == (b.saved_bytes, b.input_bytes, b.output_bytes)
    for strategy in ("none", "full"):
        assert remat.plan(costs, strategy).predicted_peak_bytes == remat.plan(kept, strategy).predicted_peak_bytes


@pytest.mark.parametrize("case", list(CASES))
def test_fit_with_a_batch_on_a_device_the_plain_step_does_not_fit_returns_a_plan_that_runs_there(case: str) -> None:
    make, batch, loss = CASES[case]()
    model, reference = make(), make()
    capacity = capacity_between_full_and_keep(model, loss)
    with DeviceOf(capacity) as device:
        session = remat.fit(model, fixed_memory(model).resident + capacity, batch=batch)
    assert device.refused >= 2  # the plain step, and the profile's step keeping every block, ran out of memory
    blocks = len(session.plan.actions)
    assert session.plan.action_counts() != f"{blocks} keep"
    assert session.costs.info["profiled_under"] == CHECKPOINT
    assert "did not fit the device" in session.describe()
    trains_as_a_plain_step(model, reference, loss, capacity)
    session.remove()


def test_fit_per_shape_on_a_device_the_largest_plain_step_does_not_fit_runs_every_shape_there() -> None:
    """``remat.fit(..., shapes=True)`` with the largest batch of the run, on a device that batch's plain step does
    not fit: every batch of random shape then runs there without an allocation refused, or is refused before its
    first block (``ShapeBudgetError``)."""
    model = tiny_gpt2(4, 64, seed=0, n_positions=256)

    def text(rows: int, positions: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, 256, (rows, positions), generator=torch.Generator().manual_seed(rows * 1000 + positions))
        return {"input_ids": ids, "labels": ids}

    largest = text(4, 256)
    capacity = capacity_between_full_and_keep(model, lambda m: m(**largest).loss)
    with DeviceOf(capacity) as device:
        session = remat.fit(model, fixed_memory(model).resident + capacity, batch=largest, shapes=True)
    assert device.refused >= 2 and session.costs.info["profiled_under"] == CHECKPOINT
    shapes = torch.Generator().manual_seed(7)
    ran = 0
    for _ in range(10):
        rows = int(torch.randint(1, 5, (1,), generator=shapes))
        positions = int(torch.randint(32, 257, (1,), generator=shapes))
        model.zero_grad(set_to_none=True)
        try:
            with DeviceOf(capacity) as device:
                model(**text(rows, positions)).loss.backward()
        except remat.ShapeBudgetError:
            continue
        assert device.refused == 0, (rows, positions)
        ran += 1
    assert ran >= 5
    session.remove()


def test_advise_on_a_device_the_plain_step_does_not_fit_says_so_and_plans() -> None:
    make, batch, loss = mlp_case()
    model = make()
    capacity = capacity_between_full_and_keep(model, loss)
    with DeviceOf(capacity):
        advice = remat.advise(model, batch, fixed_memory(model).resident + capacity, progress=None)
    assert advice.out_of_memory == (512,) and not advice.fits_plain  # the half batch's plain step ran
    assert advice.largest_plain_batch == 256 and advice.largest_planned_batch > 512
    assert advice.fit is not None and advice.fit.measured is not None and not advice.fit.measured.out_of_memory
    assert advice.memory_line is None and advice.planned_ratios == ()
    text = advice.text()
    assert "plain step at batch 512: ran out of the device's memory" in text
    assert "the plain step does not run on this device to be measured against" in text


def test_measure_beyond_on_a_device_the_larger_plain_step_does_not_fit_measures_with_blocks_checkpointed() -> None:
    """Plans per shape profiled on a small batch, then a batch whose plain step the device does not hold:
    ``measure_beyond``'s profile of it runs out of memory keeping every block and is taken with them checkpointed
    through the plan the training runs (put back afterwards), and the step runs there with the gradients of a
    plain step."""
    model, reference = tiny_gpt2(4, 64, seed=0, n_positions=256), tiny_gpt2(4, 64, seed=0, n_positions=256)

    def text(rows: int, positions: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, 256, (rows, positions), generator=torch.Generator().manual_seed(rows + positions))
        return {"input_ids": ids, "labels": ids}

    small, large = text(2, 32), text(4, 256)
    capacity = capacity_between_full_and_keep(model, lambda m: m(**large).loss)
    plans = remat.ShapePlans(remat.profile_shapes(model, small, holds_output=False), capacity - (1 << 20))
    handle = remat.apply(model, remat.plan(plans.costs.reference, "none"))
    handle.plan_per_shape(plans)
    hook = remat.profiling.measure_beyond(model, plans, holds_output=False)
    loss = lambda m: m(**large).loss  # noqa: E731
    torch.manual_seed(3)
    with DeviceOf(capacity) as device, pytest.warns(UserWarning):  # planned beyond the profiled shapes
        value = loss(model)  # measured before its forward, then run
        value.backward()
    assert device.refused >= 1  # the profile's step keeping every block ran out of memory, and was caught
    assert plans.remeasured == 1 and plans.costs.reference.info["profiled_under"] == CHECKPOINT
    assert plans.costs.largest == (4, 256) and handle.plan is plans.last
    expected_value, expected = trained_on(reference, loss, seed=3)
    assert torch.equal(value.detach(), expected_value)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected, strict=True))
    assert trained_on(model, loss, seed=4, capacity=capacity)[0].isfinite()  # the next step: none refused
    hook.remove()
    handle.remove()


def test_fit_on_a_device_not_even_every_block_checkpointed_fits_is_refused_naming_the_levers() -> None:
    make, batch, loss = mlp_case()
    model = make()
    full = remat.Plan({fqn: CHECKPOINT for fqn, _ in remat.find_blocks(model)})
    capacity = step_peak(model, loss, full) // 2
    with DeviceOf(capacity), pytest.raises(remat.fitting.MemoryFitError) as refused:
        remat.fit(model, fixed_memory(model).resident + capacity, batch=batch)
    message = str(refused.value)
    assert "even the step with every block checkpointed ran out of the device's memory" in message
    assert "a batch of 256 or fewer" in message
    assert all(p.grad is None for p in model.parameters())  # nothing left of the failed steps


# Under the emulated device's dispatch mode dynamo runs the compiled wrappers eagerly: what these two tests check is
# the fit's course where a compiled step runs out of memory, not the memory of compiled code (tests/test_gpu.py).
COMPILE = {"backend": "aot_eager", "rounds": 1, "budgets": (0.5,), "partition_budgets": (0.5,)}


def test_fit_compiled_on_a_device_the_plain_step_does_not_fit_measures_the_routes_that_run_there() -> None:
    make, batch, loss = mlp_case()
    model, reference = make(), make()
    capacity = capacity_between_full_and_keep(model, loss)
    with DeviceOf(capacity) as device:
        session = remat.fit(model, fixed_memory(model).resident + capacity, batch=batch, compile=COMPILE)
    assert device.refused >= 3  # the eager plain step, the profile keeping every block, the unbudgeted compile
    text = session.describe()
    assert "torch.compile, no budget (no activation_memory_budget): not run (ran out of the device's memory)" in text
    assert "steps as ratios to blocks's" in text  # the reference did not run: the ratios say against what
    assert session.route in ("eager", "blocks") and session.plan is not None
    assert session.plan.action_counts() != f"{len(session.plan.actions)} keep"
    trains_as_a_plain_step(model, reference, loss, capacity)
    session.remove()


def test_the_whole_model_budget_grid_on_a_device_its_steps_do_not_fit_says_so() -> None:
    make, batch, loss = mlp_case()
    model = make()
    capacity = capacity_between_full_and_keep(model, loss)
    options = {k: v for k, v in COMPILE.items() if k != "partition_budgets"}
    with DeviceOf(capacity), pytest.raises(ValueError, match="is a fraction of the compiled step's peak without a"):
        remat.fitting.fit_compile_budget(model, batch, 0.5, **options)
    with DeviceOf(capacity), pytest.raises(remat.BudgetError) as refused:
        remat.fitting.fit_compile_budget(model, batch, capacity, **options)
    assert "no activation_memory_budget of the whole compiled model ran (1: ran out of the device's memory; 0.5: " \
        "ran out of the device's memory)" in str(refused.value)  # fmt: skip
    assert all(p.grad is None for p in model.parameters())
