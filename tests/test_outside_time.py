"""remat.profiling.outside_time: the step less its blocks' time, read within the same plain steps."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from remat.chains import block_ios
from remat.profiling.outside_time import plain_steps


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_outside_counts_clock_reads_outside_the_blocks_and_removes_its_hooks() -> None:
    model = Model()
    blocks = list(model.blocks)
    ios = block_ios([(f"blocks.{i}", b) for i, b in enumerate(blocks)])
    counter = itertools.count()
    # A clock that advances one tick per read: the step reads it once at each end, each block's forward
    # twice (pre-hook, post-hook) and each block's backward twice (output and input gradient hooks), so the
    # blocks span at least one tick each way and the step's two ends lie outside them.
    plain = plain_steps(model, torch.randn(4, 8), None, blocks, ios, steps=1, clock=lambda: next(counter))
    whole, outside = plain.step_s, plain.outside_s
    assert outside is not None
    assert whole == 1 + 4 * len(blocks)
    assert 2 * len(blocks) <= whole - outside < whole
    assert all(not b._forward_hooks and not b._forward_pre_hooks for b in blocks)


def test_blocks_whose_input_needs_no_gradient_give_no_outside_time() -> None:
    model = Model()
    model.stem.requires_grad_(False)
    blocks = list(model.blocks)
    ios = block_ios([(f"blocks.{i}", b) for i, b in enumerate(blocks)])
    plain = plain_steps(model, torch.randn(4, 8), None, blocks, ios, steps=1)
    assert plain.outside_s is None and plain.step_s > 0
    assert plain.block_fwd_s is None and plain.block_bwd_s is None
