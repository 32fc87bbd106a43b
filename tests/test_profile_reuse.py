"""Profiling reuses the row of a block that costs the same as one already measured: the table it gives has the
same bytes as one timing every block, blocks that differ are measured, and ``info`` says what was done."""

from __future__ import annotations

import io

import torch
from torch import nn
from toy_models import MLPBlock

import remat
from remat.core import CostTable


def _bytes(costs: CostTable) -> list[tuple]:
    """Every byte figure of the table: the chain-wide ones, then each row's."""
    table = (costs.stem_bytes, costs.head_bytes, costs.head_retained_bytes, costs.held_args_bytes)
    return [table] + [
        (b.fqn, b.input_bytes, b.output_bytes, b.saved_bytes, b.fwd_temp_bytes, b.bwd_temp_bytes, b.bwd_extra_bytes)
        for b in costs.blocks
    ]


def test_gpt2_table_with_reuse_has_the_bytes_of_one_timing_every_block(make_gpt2) -> None:
    model = make_gpt2(n_layer=12, n_embd=32, dropout=0.1, seed=0)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    reused = remat.profile(model, batch, repeats=1)
    full = remat.profile(model, batch, repeats=1, reuse_identical=False)
    assert _bytes(reused) == _bytes(full)
    assert reused.fqns == full.fqns
    assert reused.info["blocks_measured"] == 1 and reused.info["blocks_reused"] == 11
    assert full.info["blocks_measured"] == 12 and full.info["blocks_reused"] == 0
    assert reused.info["profile_s"] > 0 and full.info["profile_s"] > 0
    # reused rows are copies: editing one leaves the measured one alone
    reused.blocks[1].saved_bytes["keep"] += 1
    assert reused.blocks[0].saved_bytes["keep"] == full.blocks[0].saved_bytes["keep"]
    for field in ("overhead_s", "recompute_s", "fwd_s_by_action", "bwd_s_by_action"):
        assert getattr(reused.blocks[1], field) is not getattr(reused.blocks[0], field), field
    # info holds plain types only
    buf = io.BytesIO()
    torch.save(full.to_dict(), buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["info"] == full.info


class _Chain(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x).square().mean()


def test_blocks_of_two_widths_are_not_merged() -> None:
    torch.manual_seed(0)
    model = _Chain([MLPBlock(16, hidden=32 if i % 2 == 0 else 96, dropout=0.1) for i in range(6)])
    x = torch.randn(8, 16)
    reused = remat.profile(model, x, repeats=1)
    full = remat.profile(model, x, repeats=1, reuse_identical=False)
    assert _bytes(reused) == _bytes(full)
    assert reused.info["blocks_measured"] == 2 and reused.info["blocks_reused"] == 4
    narrow, wide = reused.blocks[0].saved_bytes["keep"], reused.blocks[1].saved_bytes["keep"]
    assert wide > narrow
    assert [b.saved_bytes["keep"] for b in reused.blocks] == [narrow, wide] * 3


class _Gated(nn.Module):
    """A block whose forward depends on a plain attribute its signature does not see."""

    def __init__(self, width: int, gated: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.gated = gated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.gated:
            y = y * torch.sigmoid(y)  # keeps y and sigmoid(y) for backward
        return x + y


def test_a_block_whose_check_fails_is_measured() -> None:
    torch.manual_seed(0)
    model = _Chain([_Gated(16, gated=i == 2) for i in range(4)])
    x = torch.randn(8, 16)
    reused = remat.profile(model, x, repeats=1)
    full = remat.profile(model, x, repeats=1, reuse_identical=False)
    assert reused.info["blocks_measured"] == 2 and reused.info["blocks_reused"] == 2
    assert _bytes(reused) == _bytes(full)
    saved = [b.saved_bytes["keep"] for b in reused.blocks]
    assert saved[2] > saved[0] and saved[0] == saved[1] == saved[3]
