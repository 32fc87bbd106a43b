"""The batch streams every bench data set shares: an endless training stream reshuffled every epoch and the same
for the same seed, and a fixed list of validation batches, the same for every seed."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch

Batch = tuple[torch.Tensor, torch.Tensor]

_VAL_SEED = 1234  # fixes the masking of validation batches, so every run is scored on the same batches


class BenchData:
    """Batches of one task from both splits. ``train_batches()`` is an endless, reshuffled-every-epoch
    stream that is identical for identical seeds; ``val_batches(n)`` is a fixed list, the same for every
    seed. ``batches()`` streams the split chosen at load time."""

    kind: str
    dataset: str

    def __init__(self, *, batch_size: int, seed: int, split: str) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}")
        if split not in ("train", "val", "validation"):
            raise ValueError(f"split must be 'train' or 'validation'; got {split!r}")
        self.batch_size = batch_size
        self.seed = seed
        self.split = "val" if split == "validation" else split

    # Subclasses provide the number of examples of a split and how to build a batch from indices.
    def _count(self, split: str) -> int:
        raise NotImplementedError

    def _batch(self, split: str, index: torch.Tensor, generator: torch.Generator) -> Batch:
        raise NotImplementedError

    def batch_kwargs(self, batch: Batch, device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def num_batches(self, split: str = "train") -> int:
        """Whole batches in one pass over ``split`` (``"train"`` or ``"val"``)."""
        return self._count("val" if split == "validation" else split) // self.batch_size

    def train_batches(self) -> Iterator[Batch]:
        per_epoch = self.num_batches("train")
        if per_epoch == 0:
            raise ValueError(f"the training split has fewer than batch_size={self.batch_size} examples")
        generator = torch.Generator().manual_seed(self.seed)
        size = self.batch_size
        while True:
            order = torch.randperm(self._count("train"), generator=generator)
            for b in range(per_epoch):
                yield self._batch("train", order[b * size : (b + 1) * size], generator)

    def val_batches(self, n: int | None = None) -> list[Batch]:
        available = self.num_batches("val")
        n = available if n is None else n
        if not 0 <= n <= available:
            raise ValueError(
                f"asked for {n} validation batches; the split has {available} of "
                f"batch_size={self.batch_size} (use fewer or smaller batches)"
            )
        generator = torch.Generator().manual_seed(_VAL_SEED)
        size = self.batch_size
        return [self._batch("val", torch.arange(b * size, (b + 1) * size), generator) for b in range(n)]

    def batches(self) -> Iterator[Batch]:
        return self.train_batches() if self.split == "train" else itertools.cycle(self.val_batches())

    def model_overrides(self) -> dict[str, Any]:
        """Keyword arguments for ``models.build_model`` that make the model agree with this data."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """A JSON-safe description for reports."""
        raise NotImplementedError
