"""``remat.host_copies.saved_on_host``, the offload action's saved-tensor hooks: what a block saves comes back
for backward with the strides it was saved with, so a compiled block's backward (which asserts the strides of
what its forward saved) runs offloaded, with the gradients of a plain step."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from remat.host_copies import saved_on_host


class AttentionLike(nn.Module):
    """One projection split into query, key and value views of shape (batch, heads, tokens, width), as GPT-2
    does: the attention kernel saves the strided views for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q, k, v = (t.view(batch, tokens, 2, 16).transpose(1, 2) for t in self.proj(x).split(32, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).square().mean()


def _grads(block: nn.Module, x: torch.Tensor, offloaded: bool) -> list[torch.Tensor]:
    block.zero_grad(set_to_none=True)
    if offloaded:
        with saved_on_host():
            loss = block(x)
    else:
        loss = block(x)
    loss.backward()
    return [p.grad.clone() for p in block.parameters()]


def test_saved_views_come_back_with_their_strides() -> None:
    x = torch.randn(3, 8, 16, requires_grad=True)
    unpacked: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    saved: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    hooks = saved_on_host()
    pack, unpack = hooks.pack_hook, hooks.unpack_hook
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: (saved.append((tuple(t.shape), t.stride())), pack(t))[1],
        lambda p: (lambda t: (unpacked.append((tuple(t.shape), t.stride())), t)[1])(unpack(p)),
    ):
        q = (x * 2)[..., 4:12].transpose(1, 2)
        loss = (q * q).sum()
    loss.backward()
    assert any(stride != torch.empty(shape).stride() for shape, stride in saved)  # a strided view was saved
    assert unpacked == saved


def test_a_compiled_block_runs_offloaded_with_the_gradients_of_a_plain_step() -> None:
    torch.manual_seed(0)
    block = AttentionLike()
    x = torch.randn(2, 8, 32)
    reference = _grads(block, x, offloaded=False)
    compiled = torch.compile(block, backend="inductor")
    offloaded = _grads(compiled, x, offloaded=True)
    for got, want in zip(offloaded, reference, strict=True):
        torch.testing.assert_close(got, want)
