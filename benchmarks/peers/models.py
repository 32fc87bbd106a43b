"""The models of the peers benchmark and the one training step every contender runs.

Two Hugging Face causal language models built from their config classes with random weights (nothing is
downloaded): GPT-2 (the library's default dropout, 0.1) and Llama (no dropout), each with its library-default
attention implementation. Four sizes: ``default`` for the committed table, ``tiny`` for quick checks and the
smoke test, ``gpu`` (GPT-2 small's shape at a 8192-token vocabulary, and a Llama of the same shape) for a GPU,
and ``1b`` (a Llama of 1.2B parameters) for a step bound by the GPU. The forward runs in fp32 or under bf16
autocast on the benchmark's device (:mod:`benchmarks.peers.device`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .device import precision_context

MODELS = ("gpt2", "llama")
DTYPES = ("fp32", "bf16")

# layers, hidden width, heads, vocabulary, batch, sequence length
SIZES: dict[str, dict[str, int]] = {
    "default": dict(layers=6, hidden=128, heads=4, vocab=256, batch=4, seq=128),
    "tiny": dict(layers=3, hidden=32, heads=2, vocab=128, batch=2, seq=32),
    # GPT-2 small's layers, width and context; a smaller vocabulary keeps the logits from dwarfing the blocks
    "gpu": dict(layers=12, hidden=768, heads=12, vocab=8192, batch=8, seq=1024),
    # a Llama of about 1.2B parameters (Llama 3.2 1B's layers, width and MLP; a 32000-token vocabulary): a step
    # bound by the device, not by Python (benchmarks.gpu_llama picks its batch)
    "1b": dict(layers=16, hidden=2048, heads=16, vocab=32000, batch=8, seq=2048),
}


@dataclass(frozen=True)
class ModelSetting:
    """Which model, at which size, in which precision."""

    model: str
    dtype: str
    size: str = "default"

    def describe(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "size": self.size, **SIZES[self.size]}


def check_setting(setting: ModelSetting) -> None:
    if setting.model not in MODELS:
        raise ValueError(f"unknown model {setting.model!r}; choose from {', '.join(MODELS)}")
    if setting.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {setting.dtype!r}; choose from {', '.join(DTYPES)}")
    if setting.size not in SIZES:
        raise ValueError(f"unknown size {setting.size!r}; choose from {', '.join(SIZES)}")


def build_model(setting: ModelSetting, seed: int = 0) -> nn.Module:
    """The model of ``setting`` with weights drawn from ``seed``, in training mode (the global RNG is kept)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    s = SIZES[setting.size]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if setting.model == "gpt2":
            config = GPT2Config(n_layer=s["layers"], n_embd=s["hidden"], n_head=s["heads"], vocab_size=s["vocab"],
                                n_positions=s["seq"], bos_token_id=0, eos_token_id=0, use_cache=False)
            model: nn.Module = GPT2LMHeadModel(config)
        else:
            config = LlamaConfig(num_hidden_layers=s["layers"], hidden_size=s["hidden"],
                                 num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
                                 intermediate_size=4 * s["hidden"], vocab_size=s["vocab"],
                                 max_position_embeddings=s["seq"], bos_token_id=0, eos_token_id=0,
                                 pad_token_id=0, use_cache=False)
            model = LlamaForCausalLM(config)
    return model.train()


def block_list(model: nn.Module) -> list[nn.Module]:
    """The repeated layers, where a user finds them: ``transformer.h`` (GPT-2), ``model.layers`` (Llama)."""
    container = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    return list(container)


def make_batch(setting: ModelSetting, seed: int = 0, device: str = "cpu",
               batch: int | None = None) -> dict[str, torch.Tensor]:
    """Random token ids (drawn on the CPU, the same on every device), used as inputs and labels; ``batch``
    sequences (default: the size's)."""
    s = SIZES[setting.size]
    rows = batch or s["batch"]
    ids = torch.randint(0, s["vocab"], (rows, s["seq"]), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(device)
    return {"input_ids": ids, "labels": ids}


def forward_backward(forward: Callable[..., Any], batch: dict[str, torch.Tensor], dtype: str,
                     device: str = "cpu") -> torch.Tensor:
    """One training step without the optimizer: the forward in the step's precision, then the backward."""
    with precision_context(dtype, device):
        loss = forward(**batch).loss
    loss.backward()
    return loss.detach()
