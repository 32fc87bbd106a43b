"""The residual MLP chain of the ``mlp`` model family: an image classifier of identical blocks, small enough for
quick checks and exact enough to test every strategy on."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class ResidualMLPBlock(nn.Module):
    """``x + Dropout(W2 GELU(W1 LayerNorm(x)))``: one repeated layer of :class:`MLPChain`."""

    def __init__(self, hidden_size: int, intermediate_size: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden_size)
        self.fc1 = nn.Linear(hidden_size, intermediate_size)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(intermediate_size, hidden_size)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(self.act(self.fc1(self.norm(x)))))


@dataclass
class MLPOutput:
    """What :class:`MLPChain` returns, shaped like a Hugging Face output."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class MLPChain(nn.Module):
    """An image classifier: flatten, project, ``blocks`` (an ``nn.Sequential`` of identical residual MLP
    blocks), then a normalised linear head with a cross-entropy loss when labels are given."""

    def __init__(
        self,
        *,
        input_size: int,
        hidden_size: int,
        intermediate_size: int,
        num_layers: int,
        num_labels: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.stem = nn.Linear(input_size, hidden_size)
        self.blocks = nn.Sequential(
            *[ResidualMLPBlock(hidden_size, intermediate_size, dropout) for _ in range(num_layers)]
        )
        self.head_norm = nn.LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, num_labels)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> MLPOutput:
        hidden = self.blocks(self.stem(pixel_values.flatten(1)))
        logits = self.head(self.head_norm(hidden))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return MLPOutput(logits=logits, loss=loss)
