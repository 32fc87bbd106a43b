"""``remat.checkpointing.host_copies.saved_on_host``, the offload action's saved-tensor hooks: what a block saves comes
back for backward with the strides it was saved with (a dense host copy of a device tensor included), so a compiled
block's backward (which asserts the strides of what its forward saved) runs offloaded, with the gradients of a plain
step; a CPU tensor is not copied."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from remat.checkpointing import saved_on_host


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


def test_a_dense_host_copy_comes_back_with_the_saved_strides() -> None:
    hooks = saved_on_host()
    view = torch.randn(3, 8, 48)[..., 16:32].transpose(1, 2)  # strided, with gaps: as a split's view
    dense = view.contiguous()  # what the pack makes in host memory for a device tensor
    back = hooks.unpack_hook((dense, view.device, view.size(), view.stride()))
    assert back.stride() == view.stride() and dense.stride() != view.stride()
    assert torch.equal(back, view)


def test_a_cpu_tensor_is_saved_as_itself() -> None:
    hooks = saved_on_host()
    view = torch.randn(3, 8, 48)[..., 16:32]
    packed = hooks.pack_hook(view)
    assert packed[0] is view and hooks.unpack_hook(packed) is view  # no copy where it already is in host memory


def test_a_compiled_block_runs_offloaded_with_the_gradients_of_a_plain_step() -> None:
    torch.manual_seed(0)
    block = AttentionLike()
    x = torch.randn(2, 8, 32)
    reference = _grads(block, x, offloaded=False)
    compiled = torch.compile(block, backend="inductor")
    offloaded = _grads(compiled, x, offloaded=True)
    for got, want in zip(offloaded, reference, strict=True):
        torch.testing.assert_close(got, want)
