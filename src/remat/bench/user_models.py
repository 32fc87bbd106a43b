"""A plain PyTorch model for the architecture matrix: no Hugging Face, heterogeneous blocks of one class (widths
change along the stack; some carry a BatchNorm with running statistics, some a LayerNorm; all dropout)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class UserBlock(nn.Module):
    """One block class, many shapes: a linear map with an optional norm (batch or layer), GELU and dropout,
    residual when the widths match."""

    def __init__(self, d_in: int, d_out: int, norm: str | None = None, dropout: float = 0.1) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.norm: nn.Module = {"batch": nn.BatchNorm1d(d_out), "layer": nn.LayerNorm(d_out)}.get(
            norm or "", nn.Identity()
        )
        self.drop = nn.Dropout(dropout)
        self.residual = d_in == d_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(torch.nn.functional.gelu(self.norm(self.fc(x))))
        return x + y if self.residual else y


class UserNet(nn.Module):
    """A plain PyTorch model with heterogeneous blocks: widths change along the stack, some blocks carry a
    BatchNorm (running statistics), some a LayerNorm, all dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(
            [
                UserBlock(16, 32, norm="batch"),
                UserBlock(32, 32, norm="layer"),
                UserBlock(32, 64, norm="batch"),
                UserBlock(64, 64),
            ]
        )
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).square().mean()


def user_batch(rows: int = 32) -> dict[str, Any]:
    """A batch for :class:`UserNet`: ``rows`` random inputs of width 8 (seeded)."""
    return {"x": torch.randn(rows, 8, generator=torch.Generator().manual_seed(0))}
