"""``remat.runtime.handle``: a Plan applied to a live model through hooks. Random mixes of every action give the
gradients of no checkpointing bit for bit (dropout replayed from the forward's RNG state), blocks re-run as
often as the simulator says, plans switch between steps without new hooks, ``remove()`` leaves the model as it
was, suspension, output observers, the helpers that find a block's main tensor and strip caches, and the
errors."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from toy_models import (
    MLPChain,
    assert_same_step,
    chain_costs,
    chain_input,
    hook_count,
    seeded_chain,
    step,
    uniform_chain,
    uniform_costs,
)

import remat
from remat.chains import main_tensor, without_caches
from remat.planning import Plan, simulate
from remat.runtime import RecomputeStats, suspend_all

L = 6
ACTIONS = ["keep", "checkpoint", "selective:dots_saveable", "selective:everything_saveable", "offload"]


# ---------------------------------------------------------------- random chains and random plans


@st.composite
def chains_and_plans(draw: st.DrawFn) -> tuple[list[int], list[float], list[str]]:
    n = draw(st.integers(1, 7))
    widths = draw(st.lists(st.sampled_from([4, 8, 12]), min_size=n + 1, max_size=n + 1))
    dropout = draw(st.lists(st.sampled_from([0.0, 0.3]), min_size=n, max_size=n))
    actions: list[str] = []
    group = 0
    while len(actions) < n:
        kind = draw(st.sampled_from([*ACTIONS, "segment", "memory_poor"]))
        if kind in ("segment", "memory_poor"):
            size = draw(st.integers(1, n - len(actions)))
            actions += [f"{kind}:{group}"] * size
            group += 1
        else:
            actions.append(kind)
    return widths, dropout, actions


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains_and_plans(), st.integers(0, 2**16))
def test_random_plans_on_random_chains_are_exact(case: tuple, seed: int) -> None:
    widths, dropout, actions = case
    torch.manual_seed(seed)
    model = MLPChain(widths, d_in=6, dropout=dropout, hidden=16)
    x = torch.randn(3, 6)
    reference = step(model, x, seed=seed)
    names = [f"blocks.{i}" for i in range(len(actions))]  # named: a one-block chain is not found on its own
    plan = Plan(dict(zip(names, actions, strict=True)))
    handle = remat.apply(model, plan, blocks=names)
    try:
        got = step(model, x, seed=seed)
    finally:
        handle.remove()
    assert_same_step(reference, got)
    expected = simulate(uniform_costs(names), plan.actions).reexecutions
    assert tuple(handle.stats.calls[f] for f in names) == expected
    assert all(hook_count(block) == 0 for block in model.blocks)
    assert_same_step(reference, step(model, x, seed=seed))


# ---------------------------------------------------------------- RNG replay


@pytest.mark.parametrize("strategy", ["full", "every_k", "memory_poor"])
def test_recomputation_replays_dropout_and_leaves_the_rng_where_a_plain_step_does(strategy: str) -> None:
    model, x = seeded_chain(dropout=0.5), chain_input()

    def step_and_rng_state() -> tuple[tuple[torch.Tensor, dict], torch.Tensor]:
        result = step(model, x, seed=7)
        return result, torch.get_rng_state()

    reference, state_after = step_and_rng_state()
    other_masks = step(model, x, seed=8)
    assert not torch.equal(reference[1]["blocks.0.fc1.weight"], other_masks[1]["blocks.0.fc1.weight"])  # dropout bites
    handle = remat.apply(model, remat.plan(chain_costs(model), strategy, **({"k": 2} if strategy == "every_k" else {})))
    try:
        got, state = step_and_rng_state()
    finally:
        handle.remove()
    assert handle.stats.total_calls >= L  # every block's dropout ran a second time, in backward
    assert_same_step(reference, got)
    assert torch.equal(state, state_after)  # recomputation forks the RNG instead of drawing from it


# ---------------------------------------------------------------- grad modes, suspension, observers


def test_grad_disabled_and_eval_forwards_are_left_alone() -> None:
    model, x = seeded_chain(), chain_input()
    handle = remat.apply(model, remat.plan(chain_costs(model), "memory_poor"))
    with torch.no_grad():
        model(x)
    model.eval()
    model(x).backward()
    assert handle.stats.total_calls == L * (L - 1) // 2  # only the step with grad recomputes
    handle.remove()


def test_suspended_and_suspend_all_run_every_block_kept() -> None:
    model, x = seeded_chain(), chain_input()
    other = seeded_chain(n_blocks=3)
    reference = step(model, x)
    handle = remat.apply(model, remat.plan(chain_costs(model), "full"))
    other_handle = remat.apply(other, remat.plan(chain_costs(other), "full"))
    with handle.suspended():
        assert_same_step(reference, step(model, x))
        step(other, x)
    assert handle.stats.total_calls == 0 and other_handle.stats.total_calls == 3  # one handle only
    with suspend_all():
        step(model, x)
        step(other, x)
    assert handle.stats.total_calls == 0 and other_handle.stats.total_calls == 3  # every handle
    assert_same_step(reference, step(model, x))
    assert handle.stats.total_calls == L  # the plan is back after the context
    handle.remove()
    other_handle.remove()


def test_output_observers_see_forward_and_recomputed_outputs_until_removed() -> None:
    model, x = seeded_chain(n_blocks=3, dropout=0.5), chain_input()
    handle = remat.apply(model, Plan({"blocks.0": "segment:0", "blocks.1": "segment:0", "blocks.2": "keep"}))
    seen: list[tuple[int, torch.Tensor, bool]] = []
    stop = handle.add_output_observer(lambda i, out, recomputed: seen.append((i, out.detach().clone(), recomputed)))
    step(model, x)
    # Backward re-runs the segment from its input: block 0's output feeds block 1 and is handed over; block 1's
    # recomputation stops once it has re-made what its backward needs (checkpoint's early stop), before its output.
    assert [(i, recomputed) for i, _, recomputed in seen] == [(0, False), (1, False), (2, False), (0, True)]
    assert torch.equal(seen[0][1], seen[3][1])  # the recomputed output is the forward's, dropout mask included
    stop()
    seen.clear()
    step(model, x)
    assert seen == []
    handle.remove()


# ---------------------------------------------------------------- remove and set_plan


def test_remove_leaves_the_model_as_it_was() -> None:
    model, x = seeded_chain(dropout=0.0), chain_input()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    reference = step(model, x)
    blocks = [block for _, block in remat.find_blocks(model)]
    before = [hook_count(b) for b in [model, *blocks]]
    handle = remat.apply(model, remat.plan(chain_costs(model), "sqrt"))
    assert all(hook_count(b) > 0 for b in blocks)
    step(model, x)
    handle.remove()
    assert [hook_count(b) for b in [model, *blocks]] == before == [0] * (L + 1)
    assert all(hook_count(m) == 0 for m in model.modules())
    assert "_remat_handle" not in model.__dict__
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert_same_step(reference, step(model, x))
    remat.apply(model, remat.plan(chain_costs(model), "full")).remove()  # can be applied again


def test_set_plan_switches_actions_without_new_hooks() -> None:
    model, x = seeded_chain(), chain_input()
    reference = step(model, x)
    costs = chain_costs(model)
    blocks = [block for _, block in remat.find_blocks(model)]
    handle = remat.apply(model, remat.plan(costs, "none"))
    hooks = [hook_count(b) for b in blocks]
    expected = {"none": 0, "full": L, "sqrt": L, "every_k": L, "memory_poor": L * (L - 1) // 2}
    for strategy in ["none", "full", "memory_poor", "sqrt", "none", "every_k", "memory_poor"]:
        handle.set_plan(remat.plan(costs, strategy))
        handle.stats.reset()
        assert_same_step(reference, step(model, x))
        assert handle.stats.total_calls == expected[strategy], strategy
        assert [hook_count(b) for b in blocks] == hooks
    handle.remove()


def test_mask_follows_the_current_plan() -> None:
    model = seeded_chain(n_blocks=3)
    handle = remat.apply(model, Plan({"blocks.0": "keep", "blocks.1": "checkpoint", "blocks.2": "offload"}))
    assert handle.mask == {"blocks.0": True, "blocks.1": False, "blocks.2": False}
    handle.set_plan(Plan(dict.fromkeys(handle.fqns, "keep")))
    assert handle.mask == dict.fromkeys(handle.fqns, True)
    handle.remove()


def test_stats_count_recompute_time() -> None:
    model, x = seeded_chain(), chain_input()
    handle = remat.apply(model, remat.plan(chain_costs(model), "full"))
    step(model, x)
    assert handle.stats.total_seconds > 0
    assert all(handle.stats.seconds[f] > 0 for f in handle.fqns)
    handle.stats.reset()
    assert handle.stats.total_calls == 0 and handle.stats.total_seconds == 0
    handle.remove()


def test_untimed_handle_counts_calls_only() -> None:
    model, x = seeded_chain(), chain_input()
    handle = remat.apply(model, remat.plan(chain_costs(model), "full"), time_recompute=False)
    step(model, x)
    assert handle.stats.calls == dict.fromkeys(handle.fqns, 1)
    assert handle.stats.seconds == dict.fromkeys(handle.fqns, 0.0)
    handle.remove()


@pytest.mark.parametrize("where", ["block", "global", "compiled"])
def test_recomputation_runs_every_hook_but_remats_own(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recomputation may call a block's forward past remat's own (idle) hooks, but never past another's: a
    block hook (FSDP's all-gather), a global module hook, a compiled call (``module.compile()``)."""
    model, x = seeded_chain(n_blocks=3), chain_input()
    reference = step(model, x)
    block = model.blocks[1]
    calls: list[bool] = []
    if where == "block":
        hook = block.register_forward_pre_hook(lambda m, a: calls.append(torch.is_grad_enabled()))
    elif where == "global":
        hook = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda m, a: calls.append(torch.is_grad_enabled()) if m is block else None
        )
    else:  # what Module.__call__ runs for a compiled module, counted
        real_call = block._call_impl
        monkeypatch.setattr(block, "_compiled_call_impl", lambda *a, **k: calls.append(True) or real_call(*a, **k))
    handle = remat.apply(model, Plan(dict.fromkeys(["blocks.0", "blocks.1", "blocks.2"], "checkpoint")))
    try:
        assert_same_step(reference, step(model, x))
    finally:
        handle.remove()
        if where != "compiled":
            hook.remove()
    assert len(calls) == 2  # the forward and its recomputation
    assert handle.stats.calls == {"blocks.0": 1, "blocks.1": 1, "blocks.2": 1}


def test_recompute_stats_totals_and_reset() -> None:
    stats = RecomputeStats(["a", "b"])
    assert stats.calls == {"a": 0, "b": 0} and stats.total_seconds == 0
    stats.calls["a"], stats.calls["b"] = 2, 3
    stats.seconds["a"], stats.seconds["b"] = 0.25, 0.5
    assert stats.total_calls == 5 and stats.total_seconds == 0.75
    stats.reset()
    assert stats.calls == {"a": 0, "b": 0} and stats.seconds == {"a": 0.0, "b": 0.0}


def test_blocks_by_name_and_module_pairs() -> None:
    model, x = seeded_chain(n_blocks=4), chain_input()
    reference = step(model, x)
    names = ["blocks.1", "blocks.2"]
    plan = Plan(dict.fromkeys(names, "checkpoint"))
    for blocks in (names, [(n, model.get_submodule(n)) for n in names]):
        handle = remat.apply(model, plan, blocks=blocks)
        assert_same_step(reference, step(model, x))
        assert handle.stats.calls == {"blocks.1": 1, "blocks.2": 1}
        handle.remove()


# ---------------------------------------------------------------- autocast and several forwards per backward


@pytest.mark.parametrize("strategy", ["full", "sqrt", "memory_poor"])
def test_plans_under_autocast(strategy: str) -> None:
    model, x = seeded_chain(), chain_input()

    def autocast_step() -> tuple[torch.Tensor, dict]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return step(model, x)

    reference = autocast_step()
    handle = remat.apply(model, remat.plan(chain_costs(model), strategy))
    try:
        got = autocast_step()
    finally:
        handle.remove()
    assert_same_step(reference, got)
    assert reference[1]["blocks.0.fc1.weight"].dtype == torch.float32  # parameters stay float32


@pytest.mark.parametrize("strategy", ["full", "every_k", "memory_poor"])
def test_two_forwards_then_one_backward(strategy: str) -> None:
    model = seeded_chain()
    x1, x2 = chain_input(), chain_input(batch=3)

    def accumulate() -> dict[str, torch.Tensor]:
        torch.manual_seed(9)
        model.zero_grad(set_to_none=True)
        (model(x1) + 2 * model(x2)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    reference = accumulate()
    handle = remat.apply(model, remat.plan(chain_costs(model), strategy))
    try:
        got = accumulate()
    finally:
        handle.remove()
    assert all(torch.equal(reference[n], got[n]) for n in reference)
    assert handle.stats.total_calls == 2 * sum(simulate(chain_costs(model), handle.plan.actions).reexecutions)


# ---------------------------------------------------------------- a block's main tensor and its caches


@dataclass
class _Output:
    note: str
    hidden: torch.Tensor
    extra: torch.Tensor


def test_main_tensor_is_the_first_tensor_found() -> None:
    t, u = torch.ones(2), torch.zeros(3)
    assert main_tensor(t) is t
    assert main_tensor((None, "text", t, u)) is t
    assert main_tensor({"note": 1, "hidden": t, "extra": u}) is t
    assert main_tensor(_Output("x", t, u)) is t
    assert main_tensor([[None], [(t,)], u]) is t
    assert main_tensor(("text", 1, None)) is None


def test_without_caches_drops_cache_objects_only() -> None:
    class DynamicCache:
        pass

    class Cached:  # a name that merely contains "Cache" is kept
        pass

    t, kept = torch.ones(2), Cached()
    args, kwargs = without_caches((t, DynamicCache(), kept), {"past_key_values": DynamicCache(), "mask": t})
    assert args == (t, None, kept)
    assert kwargs == {"past_key_values": None, "mask": t}


# ---------------------------------------------------------------- errors and exceptions


def test_plan_naming_a_block_not_in_the_model() -> None:
    model = seeded_chain(n_blocks=3)
    bad = Plan({"blocks.0": "keep", "blocks.1": "checkpoint", "blocks.9": "checkpoint"})
    with pytest.raises(ValueError, match=r"not in the model's chain: \['blocks\.9'\]"):
        remat.apply(model, bad)
    assert "_remat_handle" not in model.__dict__
    assert all(hook_count(b) == 0 for _, b in remat.find_blocks(model))
    handle = remat.apply(model, remat.plan(chain_costs(model), "full"))
    with pytest.raises(ValueError, match=r"gives no action for blocks \['blocks\.2'\]"):
        handle.set_plan(Plan({"blocks.0": "keep", "blocks.1": "keep"}))
    with pytest.raises(ValueError, match="unknown policy"):
        handle.set_plan(Plan(dict.fromkeys(handle.fqns, "selective:no_such_policy")))
    assert handle.plan.strategy == "full"  # a rejected plan leaves the current one in place
    handle.set_plan(Plan({"blocks.1": "keep", "blocks.0": "keep", "blocks.2": "keep"}))  # named: put in order
    assert list(handle.plan.actions) == ["blocks.0", "blocks.1", "blocks.2"]
    handle.remove()


def test_applying_twice() -> None:
    model = seeded_chain(n_blocks=2)
    handle = remat.apply(model, remat.plan(chain_costs(model), "full"))
    with pytest.raises(RuntimeError, match="already applied.*set_plan"):
        remat.apply(model, remat.plan(chain_costs(model), "none"))
    handle.remove()


class _ScaledBetweenBlocks(MLPChain):
    """Doubles the first block's output before the second block sees it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i == 0:
                h = h * 2
        return self.head(h).square().mean()


@pytest.mark.parametrize(
    ("kind", "message"),
    [("segment", "cannot share a segment"), ("memory_poor", "did not receive the previous block's output")],
)
def test_groups_need_each_block_on_the_previous_output(kind: str, message: str) -> None:
    torch.manual_seed(0)
    model = _ScaledBetweenBlocks([16] * 4)
    handle = remat.apply(model, Plan({"blocks.0": f"{kind}:0", "blocks.1": f"{kind}:0", "blocks.2": "keep"}))
    try:
        with pytest.raises(RuntimeError, match=message):
            step(model, chain_input())
    finally:
        handle.remove()


def test_segment_block_called_without_its_start() -> None:
    model = seeded_chain(n_blocks=3)
    handle = remat.apply(model, Plan({"blocks.0": "keep", "blocks.1": "segment:0", "blocks.2": "segment:0"}))
    h = torch.randn(4, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="ran without the start of its segment 'blocks.1'"):
        model.blocks[2](h)
    handle.remove()


def _raise_in_block(model: MLPChain, index: int) -> torch.utils.hooks.RemovableHandle:
    def fail(_module: torch.nn.Module, _args: tuple) -> None:
        raise ValueError("injected failure")

    return model.blocks[index].fc2.register_forward_pre_hook(fail)


@pytest.mark.parametrize(
    "plan",
    [
        "full",
        "memory_poor",
        "every_k",
    ],
)
def test_an_exception_in_a_block_leaves_the_next_step_exact(plan: str) -> None:
    model, x = seeded_chain(n_blocks=4), chain_input()
    reference = step(model, x)
    handle = remat.apply(model, remat.plan(chain_costs(model), plan, **({"k": 2} if plan == "every_k" else {})))
    try:
        failing = _raise_in_block(model, 2)  # with every_k (k=2), the first block of the second segment
        with pytest.raises(ValueError, match="injected failure"):
            step(model, x)
        failing.remove()
        assert_same_step(reference, step(model, x))
    finally:
        handle.remove()


def test_an_input_larger_than_the_plan_was_made_for_is_warned_about_once_per_shape() -> None:
    """Note [9] of remat.runtime.handle: the plan's predicted peak holds for the profiled input only."""
    model = uniform_chain(4, width=16)
    x = torch.randn(8, 8)
    costs = remat.profile(model, x)
    assert costs.info["input_shapes"]["blocks.0"] == [8, 16]
    plan = remat.plan(costs, "optimal", 0.6)
    assert plan.options["planned_input"] == {"block": "blocks.0", "shape": [8, 16]}
    handle = remat.apply(model, plan)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for batch in (16, 16, 4, 8, 32):
                handle.set_plan(plan)  # as PGAC does every step: a shape warned about stays warned about
                model(torch.randn(batch, 8)).backward()
        texts = [str(w.message) for w in seen if "its plan was made for" in str(w.message)]
        assert len(texts) == 2  # shapes [16, 16] and [32, 16], each once; smaller and equal inputs fit
        assert "input of shape [16, 16], 2.00x the elements of the [8, 16]" in texts[0]
        assert f"budget of {remat.format_bytes(plan.budget_bytes)} do not hold" in texts[0]
        assert "[32, 16], 4.00x" in texts[1]
    finally:
        handle.remove()
    # A plan without a budget promises no peak: nothing to warn about.
    handle = remat.apply(model, remat.plan(costs, "full"))
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model(torch.randn(32, 8)).backward()
        assert not [w for w in seen if "its plan was made for" in str(w.message)]
    finally:
        handle.remove()


def test_a_plan_naming_the_blocks_in_another_order_runs_reordered_and_a_split_group_is_named() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(4)])
    x = torch.randn(4, 8, requires_grad=True)
    model(x).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    shuffled = Plan({"2": "checkpoint", "0": "segment:0", "1": "segment:0", "3": "keep"})  # groups stay whole
    handle = remat.apply(model, shuffled)
    model(x).sum().backward()
    assert list(handle.plan.actions) == ["0", "1", "2", "3"]
    assert all(torch.equal(a, p.grad) for a, p in zip(want, model.parameters(), strict=True))
    handle.remove()
    split = Plan({"0": "segment:0", "2": "segment:0", "1": "keep", "3": "keep"})  # in chain order, not consecutive
    with pytest.raises(ValueError, match=r"position 1 holds '2' where '1' belongs.*must be consecutive blocks"):
        remat.apply(model, split)
    with pytest.raises(ValueError, match=r"gives no action for blocks \['3'\]"):
        remat.apply(model, Plan({"0": "keep", "1": "keep", "2": "keep"}))


def test_a_memory_poor_group_of_blocks_that_turn_grad_back_on_is_exact() -> None:
    """Megatron-Core's layers run bias-dropout-add under torch.enable_grad(): the group's re-runs that rebuild a
    block's input must still store nothing (Note [2]), or torch finds other saved tensors in the recomputation."""

    class GradOnInside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16, bias=False)
            self.bias, self.scale = nn.Parameter(torch.randn(16)), nn.Parameter(torch.randn(16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            with torch.enable_grad():  # the parameters make these ops save tensors even on a rebuilt input
                return x + torch.tanh(h + self.bias) * self.scale

    def grads(plan: dict[str, str] | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(*[GradOnInside() for _ in range(4)])
        handle = remat.apply(model, remat.Plan(plan)) if plan else None
        model(torch.randn(8, 16, generator=torch.Generator().manual_seed(1))).square().sum().backward()
        if handle is not None:
            handle.remove()
        return [p.grad for p in model.parameters()]

    expected = grads(None)
    got = grads({"0": "memory_poor:0", "1": "memory_poor:0", "2": "memory_poor:0", "3": "keep"})
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
