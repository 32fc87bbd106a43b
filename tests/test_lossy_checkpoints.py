"""Checkpoints with lossy storage: ``checkpoint+compress:<format>`` (the stored input compressed) and
``recompute+compress:<format>`` (the re-run's saved tensors compressed). Their bytes measured against the
prediction, a budget below every exact plan met in a real step, the gradient error, and exact blocks beside them
bitwise exact (tiny GPT-2, CPU)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from toy_models import assert_same_step, lm_step, planned_lm_step

import remat
from remat.checkpointing.compression import pack
from remat.core import CHECKPOINT, KEEP, Action, CostTable, lossy_actions
from remat.planning.lossy import lossy_actions_of
from remat.profiling.grad_error import compare

CI8 = "checkpoint+compress:int8"
RI8 = "recompute+compress:int8"


@pytest.fixture(scope="module")
def gpt2(make_gpt2) -> tuple[torch.nn.Module, dict[str, torch.Tensor], CostTable]:
    model = make_gpt2(n_layer=4, n_embd=64, dropout=0.1, seed=0)
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    return model, batch, remat.profile(model, batch, repeats=1, lossy=("int8",))


def test_the_action_is_spelled_and_checked_like_the_others() -> None:
    assert Action.input_compress("fp8").text == "checkpoint+compress:fp8"
    assert lossy_actions(("int8", "fp8:matmul")) == [
        "compress:int8",
        RI8,
        CI8,
        "compress:fp8:matmul",
        "recompute+compress:fp8:matmul",
    ]
    with pytest.raises(ValueError, match="unknown compression format 'int4'.*int8, int8_channel"):
        lossy_actions(("checkpoint+compress:int4",))
    with pytest.raises(ValueError, match="no policy"):
        lossy_actions(("checkpoint+compress:int8:matmul",))
    with pytest.raises(ValueError, match="unknown compression policy 'dots'"):
        lossy_actions(("recompute+compress:int8:dots",))


def test_the_profiled_bytes_are_the_output_and_the_compressed_input(gpt2) -> None:
    """Measured, not assumed: what the block retains is its output plus the int8 codes and scales of its input,
    the input itself no longer counted (it is freed once the block's forward ends)."""
    _, _, costs = gpt2
    for row in costs.blocks:
        packed = pack(torch.zeros(row.input_bytes // 4), "int8").nbytes
        assert row.saved_bytes[CI8] == row.saved_bytes[CHECKPOINT] - row.input_bytes + packed
        assert row.saved_bytes[CI8] < 0.3 * row.saved_bytes[CHECKPOINT]
        assert 0 < row.grad_error[CI8] < 0.02 and 0.999 < row.grad_cosine[CI8] < 1
        assert row.recompute_s[CI8] > 0  # it recomputes the block, as checkpoint does


def test_a_compressed_recomputation_holds_what_a_compressed_block_holds_in_backward(gpt2) -> None:
    """Measured: it retains what checkpoint retains, and its backward peaks far below keep's, near compress's."""
    _, _, costs = gpt2
    for row in costs.blocks:
        assert row.saved_bytes[RI8] == row.saved_bytes[CHECKPOINT]
        assert row.bwd_extra_bytes[RI8] < -0.5 * row.saved_bytes["compress:int8"]
        assert abs(row.bwd_extra_bytes[RI8] - row.bwd_extra_bytes["compress:int8"]) < 0.2 * row.saved_bytes[KEEP]
        assert 0 < row.grad_error[RI8] < 0.02 and 0.999 < row.grad_cosine[RI8] < 1
        assert row.recompute_s[RI8] == row.recompute_s[CHECKPOINT]  # keep's forward, run again


@pytest.mark.parametrize("lossy_action", [CI8, RI8])
def test_measured_saving_matches_the_predicted_saving(gpt2, lossy_action: str) -> None:
    model, batch, costs = gpt2
    _, exact, exact_plan = planned_lm_step(model, batch, costs, [CHECKPOINT] * 4)
    _, lossy, lossy_plan = planned_lm_step(model, batch, costs, [lossy_action] * 4)
    predicted = exact_plan.predicted_peak_bytes - lossy_plan.predicted_peak_bytes
    assert predicted > 0 and lossy < exact
    assert abs((exact - lossy) - predicted) <= 0.05 * predicted, (exact - lossy, predicted)
    assert lossy <= lossy_plan.predicted_peak_bytes <= 1.1 * lossy


def test_a_budget_below_every_exact_plan_trains_within_it(gpt2) -> None:
    model, batch, costs = gpt2
    with pytest.raises(remat.BudgetError, match="checkpoint\\+compress:int8") as refused:
        remat.plan(costs, "optimal", "1KiB")
    budget = refused.value.floor - 1
    with pytest.raises(remat.BudgetError, match="With lossy storage it fits"):
        remat.plan(costs, "optimal", budget)
    plan = remat.plan(costs, "optimal", budget, allow_lossy=True)
    assert {CI8, RI8} & set(plan.actions.values())
    reference = lm_step(model, batch)
    (loss, grads), measured, _ = planned_lm_step(model, batch, costs, list(plan.actions.values()))
    assert measured <= plan.predicted_peak_bytes <= budget
    assert torch.equal(loss, reference[0])  # the forward is exact; only the recomputation sees the rounded input
    names = list(reference[1])
    step = compare([reference[1][n] for n in names], [grads[n] for n in names])
    assert 0 < step.relative < 0.05 and 0.999 < step.cosine < 1


@pytest.mark.parametrize("lossy_action", [CI8, RI8])
def test_exact_blocks_stay_bitwise_exact_beside_it(gpt2, lossy_action: str) -> None:
    model, batch, costs = gpt2
    reference = lm_step(model, batch)
    one, _, _ = planned_lm_step(model, batch, costs, [lossy_action, KEEP, CHECKPOINT, KEEP])
    other, _, _ = planned_lm_step(model, batch, costs, [lossy_action, "segment:a", "segment:a", CHECKPOINT])
    assert_same_step(one, other)
    changed = {name for name, grad in reference[1].items() if not torch.equal(one[1][name], grad)}
    assert not {n for n in changed if n.startswith(("transformer.h.1.", "transformer.h.2.", "transformer.h.3."))}
    assert "transformer.h.0.attn.c_attn.weight" in changed  # the lossy block's own gradients move


def test_a_recompute_that_saves_differently_is_refused() -> None:
    """The re-run must save what the forward saved; a block that branches on a counter does not."""

    class Fickle(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(32, 32)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            y = self.lin(x)
            return torch.tanh(y) if self.calls % 2 else y * 2

    from remat.profiling.block_run import run_action

    x = torch.randn(64, 32, requires_grad=True)
    out = run_action(Fickle(), RI8, (x,), {})
    with pytest.raises(RuntimeError, match="does not run the same way twice. Use 'checkpoint'"):
        out.sum().backward()


def test_a_model_that_keeps_every_output_does_not_plan_it(gpt2) -> None:
    _, _, costs = gpt2
    assert CI8 in lossy_actions_of(costs)
    kept = replace(costs, outputs_kept=True)
    assert CI8 not in lossy_actions_of(kept)
    plan = remat.plan(kept, "optimal", 0.6, allow_lossy=True)
    assert CI8 not in plan.actions.values()


def test_pgac_q_recomputes_compressed_below_every_exact_plan(gpt2) -> None:
    """PGAC-Q's planner fallback may use recompute+compress in its format, never checkpoint+compress (its
    gradient scorer holds every block's output, the input that action would free)."""
    from remat.dynamic.pgac.q_mask import COMPRESS_STATE, QuantizedMaskFitter, state_of

    _, _, costs = gpt2
    with pytest.raises(remat.BudgetError) as refused:
        remat.plan(costs, "optimal", "1KiB")
    budget = refused.value.floor - 1
    fitter = QuantizedMaskFitter(costs, budget, "compress:int8")
    assert RI8 in fitter.allowed and CI8 not in fitter.allowed
    mask = fitter.fit([False] * 4, [0.0, 1.0, 2.0, 3.0])
    assert mask.peak_bytes <= budget and RI8 in mask.actions
    assert state_of(RI8) == COMPRESS_STATE


def test_a_second_backward_through_a_compressed_recomputation_is_refused() -> None:
    from remat.profiling.block_run import run_action

    block = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    x = torch.randn(64, 32, requires_grad=True)
    out = run_action(block, RI8, (x,), {})
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="a second time.*Use 'checkpoint'"):
        out.sum().backward()


@pytest.mark.parametrize("lossy_action", [CI8, RI8])
def test_the_profiled_error_is_the_error_a_training_step_sees(gpt2, lossy_action: str) -> None:
    """One block under the action in a real step: its parameter gradients' relative error against an exact step
    is within a factor 1.5 of what the profiler measured (as for compress:, tests/test_lossy.py)."""
    model, batch, costs = gpt2
    reference = lm_step(model, batch)[1]
    for i, fqn in enumerate(costs.fqns):
        actions = [KEEP] * len(costs)
        actions[i] = lossy_action
        (_, grads), _, _ = planned_lm_step(model, batch, costs, actions)
        names = [n for n in reference if n.startswith(fqn + ".")]
        seen = compare([reference[n] for n in names], [grads[n] for n in names]).relative
        profiled = costs.blocks[i].grad_error[lossy_action]
        assert profiled / 1.5 <= seen <= profiled * 1.5, (fqn, seen, profiled)
