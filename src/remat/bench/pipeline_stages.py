"""The bench's models cut into pipeline stages (:func:`remat.integrations.pipeline.split_chain`): what each
stage holds, what it receives and the loss the last stage computes, for the ``stage_sync`` sweep.

* ``gpt2`` (Hugging Face ``GPT2LMHeadModel``): the stem is the token and position embeddings and the
  embedding dropout, each block is a ``GPT2Block`` given the causal mask (a block alone attends to every
  position), the head is the final layer norm and the LM head; the loss is the shifted cross-entropy the model
  computes from its labels. GPT-2 ties its LM head to the token embedding; across stages the two are separate
  parameters (the stem's on the first stage, the head's on the last), each updated by its own stage.
* ``mlp`` (:class:`~remat.bench.mlp_chain.MLPChain`): flatten and project, the residual blocks, the normalised
  linear head; cross-entropy on the labels.

The stages share the model's modules: with the model's weights and dropout off, running the stages one after
the other gives the model's own loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..integrations import Stage, split_chain

PIPELINE_MODELS = ("gpt2", "mlp")


class GPT2Stem(nn.Module):
    """Token plus position embeddings, then the embedding dropout (as ``GPT2Model.forward`` does)."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.drop(self.wte(input_ids) + self.wpe(positions)[None])


class CausalBlock(nn.Module):
    """A ``GPT2Block`` with the additive causal mask that ``GPT2Model`` would have given it."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[1]
        mask = torch.full((t, t), float("-inf"), dtype=hidden.dtype, device=hidden.device).triu(1)
        out = self.block(hidden, attention_mask=mask[None, None])
        return out[0] if isinstance(out, tuple) else out


class Flatten(nn.Module):
    """``module(x.flatten(1))``: the MLP chain's stem."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x.flatten(1))


def check_pipeline_model(name: str) -> None:
    if name not in PIPELINE_MODELS:
        raise ValueError(
            f"the stage_sync sweep cuts only {', '.join(PIPELINE_MODELS)} into pipeline stages, not {name!r}; "
            "use --model gpt2 or --model mlp"
        )


def bench_stages(spec: Any, num_stages: int) -> list[Stage]:
    """``spec.module`` (a :class:`~remat.bench.models.ModelSpec`'s model) cut into ``num_stages`` stages."""
    check_pipeline_model(spec.name)
    model = spec.module
    if spec.name == "gpt2":
        body = model.transformer
        blocks = [CausalBlock(block) for block in body.h]
        stem: nn.Module = GPT2Stem(body.wte, body.wpe, body.drop)
        head: nn.Module = nn.Sequential(body.ln_f, model.lm_head)
    else:
        blocks = list(model.blocks)
        stem, head = Flatten(model.stem), nn.Sequential(model.head_norm, model.head)
    return split_chain(blocks, num_stages, stem=stem, head=head)


def stage_loss(spec: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss(output of the last stage, labels)``: the loss ``spec.module`` computes from its labels."""
    check_pipeline_model(spec.name)
    if spec.name == "gpt2":

        def shifted(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            flat = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
            return F.cross_entropy(flat, labels[:, 1:].reshape(-1), ignore_index=-100)

        return shifted
    return lambda logits, labels: F.cross_entropy(logits, labels)


def stage_inputs(spec: Any, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the first stage receives, the labels the last stage's loss takes) of one batch."""
    check_pipeline_model(spec.name)
    key = "input_ids" if spec.name == "gpt2" else "pixel_values"
    return batch[key], batch["labels"]


def stage_sample(spec: Any, stage_index: int, first_input: torch.Tensor) -> torch.Tensor:
    """One micro-batch of what stage ``stage_index`` receives: ``first_input`` on the first stage, random
    hidden states of the model's width after it (for profiling and for the stage's shapes)."""
    if stage_index == 0:
        return first_input
    hidden = spec.config["hidden_size"]
    shape = (*first_input.shape[:2], hidden) if spec.name == "gpt2" else (first_input.shape[0], hidden)
    return torch.randn(shape, generator=torch.Generator().manual_seed(stage_index))
