"""Lossy storage: the ``compress:<format>`` codecs, the saved-tensor hooks that apply them, the profiler's bytes
and gradient error for them, and plans mixing lossy and exact blocks on a tiny GPT-2 (CPU)."""

from __future__ import annotations

import pytest
import torch
from toy_models import assert_same_step, lm_step, planned_lm_step, uniform_chain, uniform_costs

import remat
from remat.checkpointing.compression import BLOCK, CompressingHooks, Packed, pack
from remat.core import CHECKPOINT, KEEP, Action, CostTable
from remat.profiling.grad_error import compare

INT8 = "compress:int8"
FP8 = "compress:fp8"


@pytest.fixture(scope="module")
def gpt2(make_gpt2) -> tuple[torch.nn.Module, dict[str, torch.Tensor], CostTable]:
    model = make_gpt2(n_layer=4, n_embd=64, dropout=0.1, seed=0)
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    costs = remat.profile(model, batch, repeats=1, lossy=("int8", "fp8", "int8:matmul"))
    return model, batch, costs


# ---------------------------------------------------------------- codecs


@pytest.mark.parametrize("fmt", ["int8", "int8_channel", "fp8", "fp8_tensor"])
def test_a_packed_tensor_restores_its_shape_dtype_and_values_within_the_format_step(fmt: str) -> None:
    x = torch.randn(3, 50, 17, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 10, 17)
    packed = pack(x, fmt)
    back = packed.restore()
    assert back.shape == x.shape and back.dtype == x.dtype
    assert packed.codes.element_size() == 1  # one byte per element, plus the scales
    assert packed.nbytes < x.numel() * x.element_size() / 3
    err = (back - x).abs()
    if fmt == "int8":  # half a step of each block's absmax / 127
        rows = torch.nn.functional.pad(x.reshape(-1), (0, (-x.numel()) % BLOCK)).reshape(-1, BLOCK)
        bound = (rows.abs().amax(1, keepdim=True) / 254).expand_as(rows).reshape(-1)[: x.numel()]
        assert (err.reshape(-1) <= bound * 1.0001 + 1e-7).all()
    elif fmt == "int8_channel":
        bound = x.reshape(-1, 17).abs().amax(0) / 254
        assert (err.reshape(-1, 17) <= bound * 1.0001 + 1e-7).all()
    else:  # e4m3 keeps 3 mantissa bits: relative error at most 2**-4 above the subnormal range
        big = x.abs() > x.abs().max() / 100
        assert (err[big] <= x.abs()[big] * 2**-4 * 1.0001).all()
    assert not torch.equal(back, x)  # it is lossy


def test_exact_tensors_are_left_alone() -> None:
    weight = torch.randn(64, 64)
    hooks = CompressingHooks(INT8, [weight], min_bytes=4096)
    assert hooks.pack_hook(torch.arange(5000)) is not None
    ints = torch.arange(5000)
    assert hooks.pack_hook(ints) is ints  # integer (index) tensors
    mask = torch.rand(5000) > 0.5
    assert hooks.pack_hook(mask) is mask  # boolean tensors
    small = torch.randn(100)  # 400 bytes < 4096
    assert hooks.pack_hook(small) is small
    assert hooks.pack_hook(weight) is weight  # existed before the block ran
    view = weight[:32]
    assert hooks.pack_hook(view) is view  # a view of it too
    fresh = torch.randn(64, 64)
    packed = hooks.pack_hook(fresh)
    assert isinstance(packed, Packed)
    assert hooks.pack_hook(fresh) is packed  # saved twice, packed once
    assert hooks.packed_bytes == packed.nbytes


def test_unknown_formats_and_policies_are_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown compression format 'int4'.*int8, int8_channel, fp8"):
        Action.parse("compress:int4")
    with pytest.raises(ValueError, match="unknown compression policy 'convs'.*float, matmul"):
        Action.parse("compress:int8:convs")
    model = uniform_chain(2)
    costs = remat.profile(model, torch.randn(16, 8), repeats=1)
    with pytest.raises(ValueError, match="unknown compression format"):
        remat.Plan.from_actions(costs, [KEEP, "compress:int3"])
    with pytest.raises(ValueError, match="unknown compression format"):
        remat.profile(model, torch.randn(16, 8), repeats=1, lossy=("int3",))


# ---------------------------------------------------------------- profiler


def test_lossy_actions_are_profiled_only_when_asked(gpt2) -> None:
    model, batch, costs = gpt2
    plain = remat.profile(uniform_chain(2), torch.randn(16, 8), repeats=1)
    assert not any(a.startswith("compress:") for a in plain.common_actions())
    assert all(row.grad_error == {} for row in plain.blocks)
    for row in costs.blocks:
        assert (
            set(row.grad_error)
            == set(row.grad_cosine)
            == {
                INT8,
                FP8,
                "compress:int8:matmul",
                "checkpoint+compress:int8",
                "checkpoint+compress:fp8",
                "recompute+compress:int8",
                "recompute+compress:fp8",
                "recompute+compress:int8:matmul",
            }
        )
        # measured, not assumed: int8 keeps about a quarter of what keep keeps (the block's output is exact)
        assert row.saved_bytes[INT8] < 0.3 * row.saved_bytes[KEEP]
        assert row.saved_bytes[INT8] < row.saved_bytes["compress:int8:matmul"] < row.saved_bytes[KEEP]
        assert 0 < row.grad_error[INT8] < row.grad_error[FP8] < 0.05
        assert 0.999 < row.grad_cosine[FP8] < row.grad_cosine[INT8] < 1
        assert row.recompute_s[INT8] >= 0


def test_the_profiled_error_is_the_error_a_training_step_sees(gpt2) -> None:
    """One block compressed in a real step: its parameter gradients' relative error against an exact step is
    within a factor 1.5 of what the profiler measured (the profiler uses a random output gradient, the step the
    true one; on this model they agree within 5%)."""
    model, batch, costs = gpt2
    reference = lm_step(model, batch)[1]
    for action in (INT8, FP8):
        for i, fqn in enumerate(costs.fqns):
            actions = [KEEP] * len(costs)
            actions[i] = action
            (_, grads), _, _ = planned_lm_step(model, batch, costs, actions)
            names = [n for n in reference if n.startswith(fqn + ".")]
            seen = compare([reference[n] for n in names], [grads[n] for n in names]).relative
            profiled = costs.blocks[i].grad_error[action]
            assert profiled / 1.5 <= seen <= profiled * 1.5, (action, fqn, seen, profiled)


# ---------------------------------------------------------------- plans


def test_exact_blocks_stay_bitwise_exact_beside_lossy_ones(gpt2) -> None:
    model, batch, costs = gpt2
    reference = lm_step(model, batch)
    one, _, _ = planned_lm_step(model, batch, costs, [KEEP, INT8, CHECKPOINT, KEEP])
    other, _, _ = planned_lm_step(model, batch, costs, [CHECKPOINT, INT8, "segment:a", "segment:a"])
    assert_same_step(one, other)  # exact actions are interchangeable with a lossy block present
    # Blocks after the last lossy one, and the loss, see exactly what an exact step sees.
    assert torch.equal(one[0], reference[0])
    changed = {name for name, grad in reference[1].items() if not torch.equal(one[1][name], grad)}
    assert not {n for n in changed if n.startswith(("transformer.h.2.", "transformer.h.3.", "transformer.ln_f."))}
    # The lossy block and those before it (which its input gradient reaches) do move.
    assert "transformer.h.1.attn.c_attn.weight" in changed and "transformer.h.0.mlp.c_fc.weight" in changed


def test_predicted_peak_matches_measured_with_compressed_blocks(gpt2) -> None:
    """Within the tolerance of the exact plans' predictions (10%, see test_profile.py), and never below: a
    compressed block's forward (full tensors and compressed copies alive at once) counts in its peak."""
    model, batch, costs = gpt2
    for actions in (
        [INT8, KEEP, KEEP, KEEP],
        [INT8, INT8, CHECKPOINT, CHECKPOINT],
        [CHECKPOINT, FP8, "compress:int8:matmul", CHECKPOINT],
        [INT8] * 4,
    ):
        _, measured, plan = planned_lm_step(model, batch, costs, actions)
        ratio = plan.predicted_peak_bytes / measured
        assert 1.0 <= ratio <= 1.1, f"{actions}: predicted {plan.predicted_peak_bytes}, measured {measured}"
    _, all_keep, _ = planned_lm_step(model, batch, costs, [KEEP] * 4)
    _, all_int8, _ = planned_lm_step(model, batch, costs, [INT8] * 4)
    assert all_int8 < 0.5 * all_keep


# ---------------------------------------------------------------- planning


def _lossy_table(n: int = 4) -> CostTable:
    """Identical synthetic blocks where int8 keeps little and its backward peaks far below keep's (the case
    where lossy storage reaches below every exact plan), with hand-set gradient errors."""
    table = uniform_costs([f"b{i}" for i in range(n)], keep=1000, io=100, temp=50)
    for i, row in enumerate(table.blocks):
        row.saved_bytes[INT8] = 130
        row.recompute_s[INT8] = 1e-4
        row.bwd_extra_bytes[INT8] = -800
        row.grad_error[INT8] = 0.01 * (i + 1)  # later blocks are worse to compress
        row.grad_cosine[INT8] = 0.999
    return table


def test_lossy_actions_are_never_planned_unless_asked(gpt2) -> None:
    _, _, costs = gpt2
    for budget in (0.5, 0.75, 1.0):
        exact = remat.plan(costs, "optimal", budget)
        assert not any(a.startswith("compress:") for a in exact.actions.values())
        assert exact.options["lossy"] is False and exact.options["grad_error"] == 0.0
    lossy = remat.plan(costs, "optimal", 0.5, allow_lossy=True)
    # whether compressing beats recomputing depends on the measured times (on CPU they are close); that it is
    # chosen where it wins is checked on hand-set tables below
    assert lossy.predicted_peak_bytes <= lossy.budget_bytes
    assert lossy.options["grad_error"] == pytest.approx(
        sum(
            row.grad_error[a]
            for row, a in zip(costs.blocks, lossy.actions.values(), strict=True)
            if a in row.grad_error
        )
    )
    with pytest.raises(ValueError, match="strategy 'sqrt' plans exact actions only"):
        remat.plan(costs, "sqrt", allow_lossy=True)


def test_an_error_budget_bounds_the_sum_of_block_errors() -> None:
    table = _lossy_table()
    free = remat.plan(table, "optimal", 2000, allow_lossy=True)
    assert [a == INT8 for a in free.actions.values()] == [True, True, True, False]
    assert free.options["grad_error"] == pytest.approx(0.06)
    bounded = remat.plan(table, "optimal", 2000, max_grad_error=0.035)
    # the cheapest errors are bought first: blocks 0 and 1 (0.01 + 0.02)
    assert [a == INT8 for a in bounded.actions.values()] == [True, True, False, False]
    assert bounded.options["grad_error"] == pytest.approx(0.03) and bounded.fits
    assert (
        free.predicted_recompute_s
        < bounded.predicted_recompute_s
        < remat.plan(table, "optimal", 2000).predicted_recompute_s
    )
    none = remat.plan(table, "optimal", 2000, max_grad_error=0.0)
    assert not any(a == INT8 for a in none.actions.values())
    # below every exact plan every block must be compressed (0.1 in all)
    with pytest.raises(remat.BudgetError, match="least total gradient error reached under that byte budget is 0.1"):
        remat.plan(table, "optimal", 900, max_grad_error=0.05)
    with pytest.raises(ValueError, match="max_grad_error is a sum of relative errors"):
        remat.plan(table, "optimal", 2000, max_grad_error=-1)


def test_a_budget_below_every_exact_plan_says_which_lossy_setting_fits() -> None:
    table = _lossy_table()
    with pytest.raises(remat.BudgetError) as refused:
        remat.plan(table, "optimal", 900)
    message = str(refused.value)
    assert "allow_lossy=True" in message and "compress:int8" in message
    assert "max_grad_error=0.1 or more" in message  # below every exact plan, every block is compressed
    assert refused.value.floor == 1250  # the least exact plan
    lossy = remat.plan(table, "optimal", 900, allow_lossy=True)
    assert lossy.fits and lossy.predicted_peak_bytes <= 900
    # Without lossy costs in the table, the message says how to get them.
    exact_only = uniform_costs([f"b{i}" for i in range(4)], keep=1000, io=100, temp=50)
    with pytest.raises(remat.BudgetError, match=r"lossy=\('int8',\)\) and plan with allow_lossy=True"):
        remat.plan(exact_only, "optimal", 900)
