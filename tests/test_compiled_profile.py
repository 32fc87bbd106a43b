"""remat.profile of a model whose blocks are compiled (``compile_blocks``, ``aot_eager`` with a counting
compiler, so no code generation): the blocks stay compiled while profiled, the table holds what the compiled
blocks save (less than the eager blocks), and plans made from it fit their budgets when measured by the
allocation meter (``remat.measure(allocations=True)``), with gradients bitwise equal to keep-all on the
compiled blocks."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch._dynamo
from test_integration_compile import CountingCompiler
from torch import nn
from toy_models import lm_step

import remat
from remat.fitting import compile_blocks
from remat.planning import no_checkpoint_peak

BATCH_IDS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
BATCH = {"input_ids": BATCH_IDS, "labels": BATCH_IDS}


@pytest.fixture
def models(make_gpt2: Callable[..., nn.Module]) -> tuple[nn.Module, nn.Module]:
    """An eager tiny GPT-2 (dropout on) and a copy with remat applied (keep all) and its blocks compiled."""
    torch._dynamo.reset()
    eager = make_gpt2(n_layer=3, n_embd=32, n_head=2, seed=0)
    return eager, copy.deepcopy(eager)


def _compiled(model: nn.Module, counter: CountingCompiler) -> remat.RematHandle:
    handle = remat.apply(model, remat.Plan({fqn: "keep" for fqn, _ in remat.find_blocks(model)}))
    compile_blocks(model, backend=counter.backend())
    return handle


def test_plans_from_the_compiled_profile_fit_and_keep_gradients(models: tuple[nn.Module, nn.Module]) -> None:
    eager, model = models
    counter = CountingCompiler()
    handle = _compiled(model, counter)
    lm_step(model, BATCH)  # compiles
    calls = counter.calls
    costs = remat.profile(model, BATCH, holds_output=False)
    assert counter.calls > calls  # the profile ran the compiled forwards (dynamo did not fall back to eager)
    eager_costs = remat.profile(eager, BATCH, holds_output=False)
    for row, eager_row in zip(costs.blocks, eager_costs.blocks, strict=True):
        assert set(row.saved_bytes) == {"keep", "checkpoint"}  # per-op policies do not reach compiled code
        assert row.saved("keep") < eager_row.saved("keep")  # what the compiled graphs save, not the eager blocks

    with remat.measure("cpu", allocations=True) as kept:
        reference = lm_step(model, BATCH)
    keep_all = remat.plan(costs, "none")
    assert kept.activation_bytes == pytest.approx(keep_all.predicted_peak_bytes, rel=0.05)

    budget = int(0.5 * no_checkpoint_peak(costs))
    for plan in (remat.plan(costs, "full"), remat.plan(costs, "optimal", budget)):
        handle.set_plan(plan)
        lm_step(model, BATCH)  # recompilation, if the plan's checkpoint regions cause any, happens here
        calls = counter.calls
        with remat.measure("cpu", allocations=True) as measured:
            step = lm_step(model, BATCH)
        assert counter.calls > calls  # measured compiled, not eagerly
        assert measured.activation_bytes == pytest.approx(plan.predicted_peak_bytes, rel=0.05), plan.actions
        assert measured.activation_bytes < kept.activation_bytes
        torch.testing.assert_close(step, reference, rtol=0, atol=0)  # loss and gradients bitwise
    assert measured.activation_bytes <= budget * 1.05
    handle.remove()


def test_compiled_blocks_refuse_actions_that_do_not_reach_compiled_code(
    models: tuple[nn.Module, nn.Module],
) -> None:
    _, model = models
    _compiled(model, CountingCompiler())
    with pytest.raises(ValueError, match="is compiled"):
        remat.profile(model, BATCH, lossy=("int8",))
