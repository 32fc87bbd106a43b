"""The knapsack policy (:mod:`remat.checkpointing.knapsack`): the solver against brute force, the op profile of a block,
a GPT-2 block's gradients bit for bit those of no checkpointing under it (fp32 and bf16), the bytes it keeps within its
capacity, its choice no worse than ``dots_saveable``'s under the same profile, and a model profiled with knapsack
actions whose predicted peaks equal the measured ones."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn
from toy_models import assert_same_step, tiny_gpt2_config
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import remat
from remat.checkpointing import knapsack, policies
from remat.checkpointing.knapsack import OpCall
from remat.meters import LiveTensorTracker

aten = torch.ops.aten


def _best_by_brute_force(calls: list[OpCall], capacity: int) -> float:
    best = 0.0
    for r in range(len(calls) + 1):
        for subset in itertools.combinations(calls, r):
            if sum(c.nbytes for c in subset) <= capacity:
                best = max(best, sum(c.seconds for c in subset))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_choice_equals_brute_force_at_one_byte_granule_and_never_exceeds_capacity(seed: int) -> None:
    rng = random.Random(seed)
    calls = [OpCall(aten.addmm.default, i, rng.randint(1, 60), rng.randint(1, 40) / 1024) for i in range(9)]
    capacity = rng.randint(0, 250)
    by_key = {(c.op, c.index): c for c in calls}
    exact = knapsack.choose(calls, capacity, granule=1)
    assert sum(by_key[k].nbytes for k in exact) <= capacity
    assert sum(by_key[k].seconds for k in exact) == pytest.approx(_best_by_brute_force(calls, capacity))
    coarse = knapsack.choose(calls, capacity, granule=16)  # rounded up: may miss the best, never overflows
    assert sum(by_key[k].nbytes for k in coarse) <= capacity


def test_choice_refuses_a_negative_capacity() -> None:
    with pytest.raises(ValueError, match="capacity must be a number of bytes >= 0, got -1"):
        knapsack.choose([], -1)


def test_op_profile_lists_the_calls_a_policy_is_asked_about() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Dropout(0.5), nn.Linear(64, 16))
    x = torch.randn(8, 32, requires_grad=True)
    calls = knapsack.profile_ops(block, (x,))
    ops = [(c.op, c.index) for c in calls]
    # dropout's empty_like and bernoulli_ are never asked about, nor its scaling (div_, in place); the weights'
    # transposes are, but as views they keep no bytes of their own
    t, addmm = aten.t.default, aten.addmm.default
    assert ops == [(t, 0), (addmm, 0), (aten.tanh.default, 0), (aten.mul.Tensor, 0), (t, 1), (addmm, 1)]
    assert [c.nbytes for c in calls] == [0, 8 * 64 * 4, 8 * 64 * 4, 8 * 64 * 4, 0, 8 * 16 * 4]
    assert all(c.seconds > 0 for c in calls)


def _gpt2_block(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    block = GPT2Block(tiny_gpt2_config(n_layer=1, dropout=0.1)).to(dtype).train()
    return block, torch.randn(2, 32, 64, dtype=dtype, requires_grad=True)


def _run(block: nn.Module, x: torch.Tensor, policy: object) -> list[torch.Tensor]:
    block.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(3)
    out = block(x) if policy is None else remat.checkpoint(block, x, policy=policy)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().sum().backward()
    return [out.detach(), x.grad.clone(), *(p.grad.clone() for p in block.parameters())]


def _kept_after_forward(block: nn.Module, x: torch.Tensor, policy: object) -> int:
    tracker = LiveTensorTracker()
    with tracker:
        out = remat.checkpoint(block, x.detach().requires_grad_(True), policy=policy)
        tracker.mark("forward_end")
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    tracker.close()
    return tracker.bytes_at("forward_end", exclude_survivors=False)


@pytest.mark.parametrize("share", [0.2, 0.6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpt2_block_under_a_knapsack_policy_is_exact_and_keeps_what_it_chose(dtype: torch.dtype, share: float) -> None:
    block, x = _gpt2_block(dtype)
    calls = knapsack.profile_ops(block, (x,))
    capacity = int(share * knapsack.kept_for_backward(block, (x,), {}))
    policy = knapsack.knapsack_policy(calls, capacity, register=False)
    assert all(torch.equal(a, b) for a, b in zip(_run(block, x, None), _run(block, x, policy), strict=True))
    chosen = policy.save.chosen
    assert chosen  # something fits
    kept = _kept_after_forward(block, x, policy) - _kept_after_forward(block, x, "nothing_saveable")
    chosen_bytes = sum(c.nbytes for c in calls if (c.op, c.index) in chosen)
    # the last call makes the block's output, which plain checkpointing keeps too
    output = calls[-1].nbytes if (calls[-1].op, calls[-1].index) in chosen else 0
    assert kept == chosen_bytes - output and chosen_bytes <= capacity


def test_knapsack_spares_at_least_what_dots_saveable_spares_at_its_bytes() -> None:
    block, x = _gpt2_block()
    calls = knapsack.profile_ops(block, (x,))
    dots = [c for c in calls if c.op.overloadpacket in policies.DOT_OPS and c.nbytes > 0]
    chosen = knapsack.choose(calls, sum(c.nbytes for c in dots), granule=1)
    spared = sum(c.seconds for c in calls if (c.op, c.index) in chosen)
    assert spared >= sum(c.seconds for c in dots)


def test_a_model_profiled_with_knapsack_actions_is_predicted_exactly(make_gpt2) -> None:
    model = make_gpt2(n_layer=3, n_embd=64, dropout=0.1, seed=0)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    names = knapsack.register_for(model, batch, shares=(0.3, 0.7), repeats=1)
    assert len(names) == 2 and all(n.startswith("knapsack@") for n in names)
    costs = remat.profile(model, batch, policies=names, repeats=1)
    low, high = (costs.blocks[0].saved_bytes[f"selective:{n}"] for n in names)
    assert costs.blocks[0].saved_bytes["checkpoint"] < low < high < costs.blocks[0].saved_bytes["keep"]

    def step() -> tuple[torch.Tensor, dict]:
        torch.manual_seed(5)
        model.zero_grad(set_to_none=True)
        out = model(**batch)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    reference = step()
    for name in names:
        plan = remat.Plan.from_actions(costs, [f"selective:{name}"] * len(costs))
        handle = remat.apply(model, plan)
        try:
            torch.manual_seed(5)
            model.zero_grad(set_to_none=True)
            with remat.measure() as measured:
                out = model(**batch)
                out.loss.backward()
                del out
            assert plan.predicted_peak_bytes == measured.activation_bytes, name
            assert_same_step(reference, step())
        finally:
            handle.remove()


def test_saved_calls_count_afresh_per_region_and_again_in_each_recompute() -> None:
    from torch.utils.checkpoint import SelectiveCheckpointContext

    addmm, tanh = aten.addmm.default, aten.tanh.default
    policy = knapsack.knapsack_policy(
        [OpCall(addmm, 0, 64, 1.0), OpCall(tanh, 0, 64, 0.1), OpCall(addmm, 1, 64, 2.0)], 128, register=False
    )
    decide = policy.for_region().save
    ops = [addmm, tanh, addmm]
    forward = [decide(SelectiveCheckpointContext(is_recompute=False), op) for op in ops]
    assert forward == [True, False, True]
    for _ in range(2):  # torch < 2.6 asks again in recompute
        decide.recompute_started()
        assert [decide(SelectiveCheckpointContext(is_recompute=True), op) for op in ops] == forward
    assert [policy.for_region().save(SelectiveCheckpointContext(is_recompute=False), op) for op in ops] == forward
