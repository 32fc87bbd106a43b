"""remat's module-registration hook (``remat.chains.model_state``, Note [1]) stays out of compiled graphs' guards: a
forward that registers modules (Hugging Face slices its ModuleList of layers in every forward) compiled with remat
imported is guarded on nothing of remat's buffer-slot cache, so remat caching another tree (profiles,
measurements and recomputations do) cannot fail its guards and recompile it (it did: in
``benchmarks/compiled_partitions.py`` a Llama compiled whole recompiled between timed rounds, its guard on the
size of remat's cache failing)."""

from __future__ import annotations

import torch
from torch import nn

import remat  # noqa: F401  (installs the registration hooks)


class SlicingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:2]:  # a new ModuleList: torch's registration hooks run inside the trace
            x = layer(x)
        return x


def test_a_forward_that_registers_modules_is_not_guarded_on_remats_cache() -> None:
    explained = torch._dynamo.explain(SlicingNet())(torch.randn(2, 8))
    guarded = [g.name for g in explained.out_guards]
    assert guarded  # the explanation did trace the forward
    assert not [name for name in guarded if "_TREES_HOLDING" in name or "_SLOTS" in name]
