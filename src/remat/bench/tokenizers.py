"""Text tokens for the language models: UTF-8 bytes, or GPT-2's byte-pair encoding through ``tiktoken`` when its
vocabulary is installed (``auto`` picks BPE when it can and says why when it cannot)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

from .data_sources import DataUnavailableError, bpe_vocab_file

_GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


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
            name="gpt2",
            pat_str=_GPT2_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={"<|endoftext|>": self.eot_id},
        )
        self.n_vocab = self._encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self._encoding.encode_ordinary(text), dtype=np.int64)

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode(list(ids))


def pick_tokenizer(tokenizer: str) -> tuple[str, str]:
    """``(tokenizer name, note)``: ``auto`` is BPE when installed, else bytes, with the reason."""
    if tokenizer not in ("auto", "bpe", "bytes"):
        raise ValueError(f"tokenizer must be 'auto', 'bpe' or 'bytes'; got {tokenizer!r}")
    if tokenizer == "bytes":
        try:
            bpe_vocab_file()
        except DataUnavailableError:
            return "bytes", ""
        return "bytes", (
            "byte-level tokens as asked (GPT-2's vocabulary is installed: --tokenizer bpe uses it; with tiny models "
            "its 50k-token logits, not the blocks, dominate activation memory)"
        )
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
    chosen, _ = pick_tokenizer(name)
    return BPETokenizer(bpe_vocab_file()) if chosen == "bpe" else ByteTokenizer()
