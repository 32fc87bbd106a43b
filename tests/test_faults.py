"""Fault injection: an exception thrown at any point of a step under remat (inside a block, in the model's code
between two blocks of a segment, inside a recomputation in backward, inside PGAC's update) leaves nothing behind.
After it, no saved-tensor hook or dispatch mode is active in the thread, an unrelated backward works, and the
next step is exactly the step of the same model without the fault."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from toy_models import assert_same_step, chain_costs, chain_input, seeded_chain, step

import remat

FAULT = "injected failure"


def _nothing_installed() -> None:
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None, "a saved-tensor hook is still active"
    assert not _get_current_dispatch_mode_stack(), "a dispatch mode is still active"
    a = torch.randn(4, requires_grad=True)
    a.exp().sum().backward()  # an unrelated backward
    assert torch.allclose(a.grad, a.detach().exp())


def _raise(_module: torch.nn.Module, *_: object) -> None:
    raise ValueError(FAULT)


def _in_a_block(model: torch.nn.Module) -> Callable[[], object]:
    return model.blocks[2].fc2.register_forward_pre_hook(_raise).remove


def _between_blocks(model: torch.nn.Module) -> Callable[[], object]:
    # after block 2 returns, before block 3 starts: the model's own code raises (a hook on block 2 runs there)
    return model.blocks[2].register_forward_hook(_raise).remove


def _in_recompute(model: torch.nn.Module) -> Callable[[], object]:
    def fail_in_backward(module: torch.nn.Module, args: tuple) -> None:
        if torch._C._current_graph_task_id() >= 0:  # autograd is running a backward: this is a recomputation
            raise ValueError(FAULT)

    return model.blocks[1].fc1.register_forward_pre_hook(fail_in_backward).remove


PLANS = {
    "full": {},
    "every_k": {"k": 2},  # segments (blocks 0-1, 2-3, 4-5): the faults land inside a segment
    "memory_poor": {},
    "sqrt": {},
}


@pytest.mark.parametrize("fault", [_in_a_block, _between_blocks, _in_recompute], ids=lambda f: f.__name__[1:])
@pytest.mark.parametrize("strategy", list(PLANS))
def test_a_fault_leaves_nothing_behind(fault: Callable, strategy: str) -> None:
    model, x = seeded_chain(n_blocks=6), chain_input()
    reference = step(model, x)
    handle = remat.apply(model, remat.plan(chain_costs(model), strategy, **PLANS[strategy]))
    try:
        remove_fault = fault(model)
        with pytest.raises((ValueError, RuntimeError), match=FAULT):
            step(model, x)
        remove_fault()
        model.zero_grad(set_to_none=True)
        _nothing_installed()
        assert_same_step(reference, step(model, x))
    finally:
        handle.remove()
    _nothing_installed()


def test_a_fault_in_pgac_update_leaves_the_next_step_exact() -> None:
    model, x = seeded_chain(n_blocks=6), chain_input()
    reference = step(model, x)
    pgac = remat.PGAC(model, 0.6, costs=chain_costs(model))
    try:
        step(model, x)
        scorer_collect = pgac.scorer.collect

        def failing_collect() -> object:
            raise ValueError(FAULT)

        pgac.scorer.collect = failing_collect  # type: ignore[method-assign]
        with pytest.raises(ValueError, match=FAULT):
            pgac.step()
        pgac.scorer.collect = scorer_collect  # type: ignore[method-assign]
        _nothing_installed()
        model.zero_grad(set_to_none=True)
        assert_same_step(reference, step(model, x))
        pgac.step()  # PGAC goes on updating after the failed update
        assert_same_step(reference, step(model, x))
    finally:
        pgac.remove()
    _nothing_installed()
