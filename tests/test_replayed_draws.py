"""CPU dropout draws in selective-checkpoint regions: kept from forward at one byte per element and replayed in
recompute. Checked by the draws backward makes (none), the bytes the region keeps (one per masked element),
gradients bit for bit equal to no checkpointing (fp32 and bf16, with random ops after the dropout that must
see the forward's random stream), and a clear error when recompute takes another path."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from toy_models import tiny_gpt2_config
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import remat
from remat.checkpointing import replayed_draws
from remat.meters import LiveTensorTracker

aten = torch.ops.aten
POLICIES = (
    "nothing_saveable",
    "dots_saveable",
    "everything_saveable",
    "all_but_pointwise_saveable",
    "attention_saveable",
    "dots_every_other_saveable",
)


class DrawCounter(TorchDispatchMode):
    """Counts the random ops that reach the kernels while active."""

    def __init__(self) -> None:
        super().__init__()
        self.draws = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.draws += 1
        return func(*args, **(kwargs or {}))


class NoisyBlock(nn.Module):
    """Two dropouts, then fresh random noise (``randn_like``, redrawn in recompute) and a third dropout: the
    noise is right only if the generator is where forward left it after the replayed draws."""

    def __init__(self, width: int = 32, p: float = 0.3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.fc1(x)))
        h = h + 0.1 * torch.randn_like(h)
        y = self.drop(self.fc2(self.drop(h)))
        return x + y


def run(block: nn.Module, x: torch.Tensor, policy: str | None, seed: int = 5) -> tuple[torch.Tensor, list]:
    block.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(seed)
    out = block(x) if policy is None else remat.checkpoint(block, x, policy=policy)
    out.float().square().sum().backward()
    return out.detach(), [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("policy", POLICIES)
def test_gradients_equal_no_checkpoint_with_noise_after_the_draws(policy: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    block = NoisyBlock().to(dtype)
    x = torch.randn(16, 32, dtype=dtype, requires_grad=True)
    out_ref, ref = run(block, x, None)
    out, got = run(block, x, policy)
    assert torch.equal(out_ref, out)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    # and the generator ends where it ends without checkpointing
    torch.manual_seed(5)
    block(x)
    after_plain = torch.get_rng_state()
    run(block, x, policy)
    assert torch.equal(after_plain, torch.get_rng_state())


def test_recompute_draws_only_what_no_policy_may_keep() -> None:
    torch.manual_seed(0)
    block = NoisyBlock()
    x = torch.randn(16, 32, requires_grad=True)
    counts = {}
    for policy in (None, "dots_saveable"):
        torch.manual_seed(5)
        out = block(x) if policy is None else remat.checkpoint(block, x, policy=policy)
        counter = DrawCounter()
        with counter:
            out.sum().backward()
        counts[policy] = counter.draws
    assert counts[None] == 0
    assert counts["dots_saveable"] == 1  # randn_like runs again; the three bernoulli_ draws are replayed


def test_gpt2_block_under_dots_saveable_draws_nothing_in_backward() -> None:
    torch.manual_seed(0)
    config = tiny_gpt2_config(n_layer=1, n_embd=64, n_positions=32)  # eager attention, dropout 0.1
    block = GPT2Block(config)
    x = torch.randn(2, 32, 64, requires_grad=True)

    def first(out: Any) -> torch.Tensor:
        return out[0] if isinstance(out, tuple) else out

    torch.manual_seed(1)
    ref_out = first(block(x))
    ref_out.sum().backward()
    ref = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = first(remat.checkpoint(block, x, policy="dots_saveable"))
    counter = DrawCounter()
    with counter:
        out.sum().backward()
    assert counter.draws == 0
    assert torch.equal(ref_out, out)
    assert all(torch.equal(a, p.grad) for a, p in zip(ref, block.parameters(), strict=True))


def _kept_bytes(p: float) -> int:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Dropout(p), nn.Linear(256, 64))
    x = torch.randn(32, 64, requires_grad=True)
    tracker = LiveTensorTracker()
    with tracker:
        out = remat.checkpoint(block, x, policy="dots_saveable")
        tracker.mark("forward_end")
        out.sum().backward()
    tracker.close()
    return tracker.bytes_at("forward_end", exclude_survivors=False)


def test_a_kept_draw_costs_one_byte_per_element() -> None:
    # (the generator state kept with each draw, 5 KB, is made outside dispatch and not tracked)
    assert _kept_bytes(0.2) - _kept_bytes(0.0) == 32 * 256


def test_a_replay_on_another_path_is_an_error() -> None:
    # torch's selective checkpoint usually notices a changed path first; the replay checks on its own too.
    record, replay = replayed_draws.contexts()
    with record:
        torch.empty(4, 8).bernoulli_(0.5)
    with replay, pytest.raises(RuntimeError, match=r"drew a \(8, 8\) tensor in recompute where forward drew \(4, 8\)"):
        torch.empty(8, 8).bernoulli_(0.5)
    with replay:
        torch.empty(4, 8).bernoulli_(0.5)  # each recompute starts from the first draw
        with pytest.raises(RuntimeError, match="drew more random numbers in recompute than in forward"):
            torch.empty(4, 8).bernoulli_(0.5)


def test_nested_selective_regions_give_the_gradients_of_no_checkpoint() -> None:
    torch.manual_seed(0)
    inner, outer = NoisyBlock(), NoisyBlock()
    x = torch.randn(16, 32, requires_grad=True)

    def forward(checkpointed: bool) -> list[torch.Tensor]:
        for p in [*inner.parameters(), *outer.parameters()]:
            p.grad = None
        x.grad = None
        torch.manual_seed(9)
        if checkpointed:
            out = remat.checkpoint(
                lambda h: outer(remat.checkpoint(inner, h, policy="everything_saveable")), x, policy="dots_saveable"
            )
        else:
            out = outer(inner(x))
        out.square().sum().backward()
        return [p.grad.clone() for p in [*inner.parameters(), *outer.parameters()]] + [x.grad.clone()]

    reference = forward(False)
    assert all(torch.equal(a, b) for a, b in zip(reference, forward(True), strict=True))


def test_recompute_without_rng_preservation_leaves_the_stream_alone() -> None:
    torch.manual_seed(0)
    block = NoisyBlock()
    x = torch.randn(16, 32, requires_grad=True)
    out = remat.checkpoint(block, x, policy="dots_saveable", preserve_rng_state=False)
    torch.manual_seed(123)
    untouched = torch.get_rng_state()
    out.sum().backward()  # the recompute replays the draws, moving the generator, then puts it back
    assert torch.equal(torch.get_rng_state(), untouched)
