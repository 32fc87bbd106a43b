"""The per-block menu of :mod:`remat.policies`: ``all_but_pointwise_saveable``, ``attention_saveable`` and
``dots_every_other_saveable`` give the gradients of no checkpointing bit for bit on a GPT-2 block with dropout
(eager and SDPA attention, fp32 and bf16), each keeps what it says (checked by the ops backward runs again and
the bytes alive after forward), the every-other count starts afresh in each region and is the same in
recompute, and ``policies="menu"`` names every policy of ``MENU``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext
from toy_models import ScaledInPlace, tiny_gpt2_config
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import remat
from remat import policies
from remat.meters import LiveTensorTracker

aten = torch.ops.aten
NEW = ("all_but_pointwise_saveable", "attention_saveable", "dots_every_other_saveable")


class OpLog(TorchDispatchMode):
    """Counts the calls of each overload packet that reach the kernels while active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[Any, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.counts[func.overloadpacket] = self.counts.get(func.overloadpacket, 0) + 1
        return func(*args, **(kwargs or {}))


def first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def run(block: nn.Module, x: torch.Tensor, policy: str | None) -> list[torch.Tensor]:
    block.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(3)
    out = first(block(x) if policy is None else remat.checkpoint(block, x, policy=policy))
    out.float().square().sum().backward()
    return [out.detach(), x.grad.clone(), *(p.grad.clone() for p in block.parameters())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("attention", ["eager", "sdpa", "sdpa-kernel"])
@pytest.mark.parametrize("policy", policies.MENU)
def test_gpt2_block_with_dropout_gives_the_gradients_of_no_checkpoint(
    policy: str, attention: str, dtype: torch.dtype
) -> None:
    # "sdpa-kernel": no attention dropout (residual dropout stays), so CPU runs SDPA's flash kernel, not its
    # math form, and the policies that save attention outputs save them.
    config = tiny_gpt2_config(n_layer=1, attn_implementation=attention.split("-")[0], dropout=0.1)
    if attention == "sdpa-kernel":
        config.attn_pdrop = 0.0
    torch.manual_seed(0)
    block = GPT2Block(config).to(dtype).train()
    x = torch.randn(2, 32, 64, dtype=dtype, requires_grad=True)
    reference = run(block, x, None)
    got = run(block, x, policy)
    assert all(torch.equal(a, b) for a, b in zip(reference, got, strict=True))
    torch.manual_seed(3)
    block(x)
    after_plain = torch.get_rng_state()
    run(block, x, policy)
    assert torch.equal(after_plain, torch.get_rng_state())  # the generator ends where it does without checkpoint


class Tower(nn.Module):
    """Four linear layers of distinct widths, each followed by tanh: which matmul outputs a policy keeps shows
    in the bytes alive after forward."""

    WIDTHS = (32, 64, 48, 80, 16)

    def __init__(self, widths: tuple[int, ...] = WIDTHS) -> None:
        super().__init__()
        w = widths
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(w, w[1:], strict=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def saved_and_rerun(module: nn.Module, x: torch.Tensor, policy: Any) -> tuple[int, OpLog]:
    """Bytes alive after one checkpointed forward, and the ops its backward runs."""
    x = x.detach().requires_grad_(True)
    tracker = LiveTensorTracker()
    backward = OpLog()
    with tracker:
        out = remat.checkpoint(module, x, policy=policy)
        tracker.mark("forward_end")
        with backward:
            out.sum().backward()
    tracker.close()
    return tracker.bytes_at("forward_end", exclude_survivors=False), backward


def test_every_other_matmul_keeps_the_first_and_third_and_recomputes_the_second_and_fourth() -> None:
    torch.manual_seed(0)
    tower, x = Tower(), torch.randn(8, 32)
    plain, plain_ops = saved_and_rerun(tower, x, "nothing_saveable")
    dots, dots_ops = saved_and_rerun(tower, x, "dots_saveable")
    every_other, ops = saved_and_rerun(tower, x, "dots_every_other_saveable")
    widths = Tower.WIDTHS
    assert every_other - plain == 8 * (widths[1] + widths[3]) * 4  # the 1st and 3rd addmm outputs, float32
    assert dots - plain == 8 * sum(widths[1:]) * 4  # all four
    assert plain_ops.counts[aten.addmm] == 4 and dots_ops.counts.get(aten.addmm, 0) == 0
    assert ops.counts[aten.addmm] == 2  # the 2nd and 4th, run again


def test_every_other_count_starts_afresh_in_each_region() -> None:
    torch.manual_seed(0)
    tower, x = Tower((32, 64, 48, 32)), torch.randn(8, 32)  # three matmuls: a count carried over would shift
    once, _ = saved_and_rerun(tower, x, "dots_every_other_saveable")
    assert once - saved_and_rerun(tower, x, "nothing_saveable")[0] == 8 * (64 + 32) * 4  # the 1st and 3rd
    tracker = LiveTensorTracker()
    xs = [x.detach().requires_grad_(True) for _ in range(3)]
    with tracker:
        outs = [remat.checkpoint(tower, xi, policy="dots_every_other_saveable") for xi in xs]
        tracker.mark("forward_end")
        sum(o.sum() for o in outs).backward()
    tracker.close()
    assert tracker.bytes_at("forward_end", exclude_survivors=False) == 3 * once


def test_every_other_decisions_are_the_same_when_recompute_asks_again() -> None:
    # torch < 2.6 asks the policy again in recompute (ctx.is_recompute=True); the count there is its own and
    # restarts with each recompute, so it gives the forward's decisions.
    decide = policies.dots_every_other_saveable.for_region().save
    ops = [aten.addmm.default, aten.tanh.default, aten.mm.default, aten.bmm.default, aten.addmm.default]
    forward = [decide(SelectiveCheckpointContext(is_recompute=False), op) for op in ops]
    assert forward == [True, False, False, True, False]
    for _ in range(2):
        decide.recompute_started()
        assert [decide(SelectiveCheckpointContext(is_recompute=True), op) for op in ops] == forward
    assert policies.dots_every_other_saveable.for_region().save is not decide  # a fresh count per region


def test_all_but_pointwise_recomputes_pointwise_ops_and_keeps_the_rest() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    x = torch.randn(16, 32)
    dots, _ = saved_and_rerun(block, x, "dots_saveable")
    everything, _ = saved_and_rerun(block, x, "everything_saveable")
    kept, ops = saved_and_rerun(block, x, "all_but_pointwise_saveable")
    # the layer norm's output, mean and rstd on top of the matmuls; not the GELU output
    assert kept == dots + 16 * 32 * 4 + 2 * 16 * 4
    assert kept == everything - 16 * 128 * 4
    assert ops.counts.get(aten.gelu, 0) == 1  # recomputed
    assert ops.counts.get(aten.native_layer_norm, 0) == 0 and ops.counts.get(aten.addmm, 0) == 0


def test_attention_saveable_keeps_the_attention_kernel_output_only() -> None:
    torch.manual_seed(0)
    # No attention dropout: CPU SDPA runs its flash kernel (with dropout it takes the math form).
    block = GPT2Block(tiny_gpt2_config(n_layer=1, attn_implementation="sdpa", dropout=0.0)).train()
    x = torch.randn(2, 32, 64)
    plain, plain_ops = saved_and_rerun(block, x, "nothing_saveable")
    kept, ops = saved_and_rerun(block, x, "attention_saveable")
    flash = aten._scaled_dot_product_flash_attention_for_cpu
    assert plain_ops.counts[flash] == 1 and ops.counts.get(flash, 0) == 0
    assert ops.counts[aten.addmm] == plain_ops.counts[aten.addmm]  # the projections are recomputed
    # the attention output (2 x 32 tokens x 64) and its log-sum-exp (2 x 4 heads x 32), float32
    assert kept - plain == (2 * 32 * 64 + 2 * 4 * 32) * 4


def test_menu_names_every_menu_policy() -> None:
    assert policies.expand("menu") == list(policies.MENU)
    assert policies.expand(["dots_saveable", "menu"]) == list(policies.MENU)
    assert policies.expand("nothing_saveable,menu") == ["nothing_saveable", *policies.MENU]
    assert policies.expand([policies.attention_saveable]) == ["attention_saveable"]
    assert set(NEW) <= set(policies.MENU) <= set(policies.names())
    with pytest.raises(ValueError, match="unknown policy 'dots_every_other'.*dots_every_other_saveable"):
        policies.expand("dots_every_other")


def test_an_attention_kernel_is_saved_only_when_it_draws_nothing() -> None:
    # The kernels are tagged random for their dropout; with dropout_p > 0 they move the generator, and a saved
    # one would leave recompute's later draws out of step.
    flash = aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.randn(1, 2, 4, 8)
    ctx = SelectiveCheckpointContext(is_recompute=False)
    for name in ("attention_saveable", "dots_saveable"):
        policy = policies.get(name)
        assert policy(ctx, flash, q, q, q) == CheckpointPolicy.MUST_SAVE
        assert policy(ctx, flash, q, q, q, 0.0, True) == CheckpointPolicy.MUST_SAVE
        assert policy(ctx, flash, q, q, q, dropout_p=0.1) == CheckpointPolicy.PREFER_RECOMPUTE
        assert policy(ctx, flash, q, q, q, 0.1) == CheckpointPolicy.PREFER_RECOMPUTE
    assert policies.attention_saveable(ctx, aten.addmm.default, q, q, q) == CheckpointPolicy.PREFER_RECOMPUTE


def test_a_policy_that_cannot_run_on_a_block_is_left_out_of_its_costs_and_plans() -> None:
    model = nn.Sequential(*(ScaledInPlace() for _ in range(3)))
    x = torch.randn(4, 16, requires_grad=True)
    refused = r"selective:dots_saveable cannot run on ScaledInPlace blocks.*changes in place"
    with pytest.warns(UserWarning, match=refused):
        costs = remat.profile(model, x, policies=("dots_saveable", "attention_saveable"), repeats=1)
    for row in costs.blocks:
        assert "selective:dots_saveable" not in row.actions and "selective:attention_saveable" in row.actions
        assert "changes in place" in row.unavailable["selective:dots_saveable"]
    assert remat.CostTable.from_json(costs.to_json()).blocks[1].unavailable == costs.blocks[1].unavailable
    with pytest.raises(ValueError, match=r"'selective:dots_saveable' cannot run on any block of the .*\(.*in place"):
        remat.plan(costs, "optimal", budget=0.8, actions=["keep", "selective:dots_saveable"])
    with pytest.raises(KeyError, match=r"cannot run on this block: .*in place.*Choose another"):
        remat.Plan.from_actions(costs, ["selective:dots_saveable"] * 3)
    plan = remat.plan(costs, "optimal", budget=0.8)
    assert "selective:dots_saveable" not in plan.actions.values() and set(plan.actions.values()) != {"keep"}
    with pytest.raises(RuntimeError, match=r"'dots_saveable' saved an operator's output that the region then") as info:
        remat.checkpoint(model[0], x, policy="dots_saveable").sum().backward()
    assert "has been mutated" in str(info.value.__cause__)  # torch's own refusal, as the profile saw it
    reference = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
    handle = remat.apply(model, plan)
    try:
        assert all(
            torch.equal(a, b)
            for a, b in zip(torch.autograd.grad(model(x).sum(), [x, *model.parameters()]), reference, strict=True)
        )
    finally:
        handle.remove()


def test_the_meta_estimate_leaves_out_a_policy_that_cannot_run_too() -> None:
    from remat.profiling import meta_cost_table

    model = lambda: nn.Sequential(*(ScaledInPlace() for _ in range(3)))  # noqa: E731
    with pytest.warns(UserWarning, match=r"selective:dots_saveable cannot run on ScaledInPlace blocks"):
        costs = meta_cost_table(model, torch.empty(4, 16), policies=("dots_saveable", "attention_saveable"))
    assert all("selective:dots_saveable" not in row.actions for row in costs.blocks)
    assert all("selective:attention_saveable" in row.recompute_s for row in costs.blocks)
    assert "changes in place" in costs.blocks[2].unavailable["selective:dots_saveable"]
