"""Tiny architectures for the architecture matrix: Hugging Face models built from their config classes with
tiny sizes (random weights, nothing downloaded), a LoRA fine-tune of a Llama, and plain PyTorch user models.

Each :class:`Architecture` builds a fresh model in train mode (dropout on wherever the architecture has it)
and a batch for it, and says which stacks of blocks the model has (``stacks``: the module names of the
containers :func:`remat.find_chains` must find). ``outputs`` are the extra outputs a training step asks for
(``output_hidden_states``, router logits), which remat must leave as a plain step does. :class:`UserNet` is the
plain PyTorch model of the matrix (no Hugging Face; heterogeneous blocks of one class).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

VOCAB, SEQ, BATCH, IMAGE, LAYERS = 64, 16, 2, 16, 3


@dataclass(frozen=True)
class Architecture:
    """A named tiny model and its batch. ``build()`` returns a new model (same weights for the same seed)."""

    name: str
    make: Callable[[], nn.Module]
    batch: Callable[[], dict[str, Any]]
    stacks: tuple[str, ...]
    needs: str = "transformers"
    notes: str = ""
    loss: Callable[[Any], torch.Tensor] | None = None
    extras: tuple[str, ...] = field(default=())

    def build(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return self.make().train()


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _lm_batch() -> dict[str, Any]:
    ids = _ids()
    return {"input_ids": ids, "labels": ids, "output_hidden_states": True}


def _masked_lm_batch() -> dict[str, Any]:
    ids = _ids()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids, "output_hidden_states": True}


def _seq2seq_batch() -> dict[str, Any]:
    ids = _ids()
    labels = _ids(1)
    return {"input_ids": ids, "labels": labels, "output_hidden_states": True}


def _image_batch(channels: int = 3) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        g = torch.Generator().manual_seed(0)
        pixels = torch.randn(BATCH, channels, IMAGE, IMAGE, generator=g)
        return {"pixel_values": pixels, "labels": torch.tensor([0, 2]), "output_hidden_states": True}

    return make


def _decoder(config_name: str, model_name: str, **overrides: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import transformers

        sizes: dict[str, Any] = {
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2 * SEQ,
            "attention_dropout": 0.1,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
        sizes.update(overrides)
        config = getattr(transformers, config_name)(**sizes)
        config._attn_implementation = "eager"
        return getattr(transformers, model_name)(config)

    return make


def _from_config(config_name: str, model_name: str, **sizes: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import transformers

        config = getattr(transformers, config_name)(**sizes)
        config._attn_implementation = "eager"
        return getattr(transformers, model_name)(config)

    return make


def _clip() -> nn.Module:
    import transformers

    text = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "max_position_embeddings": 2 * SEQ,
        "dropout": 0.1,
        "attention_dropout": 0.1,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "image_size": IMAGE,
        "patch_size": 4,
        "dropout": 0.1,
        "attention_dropout": 0.1,
    }
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    config._attn_implementation = "eager"
    return transformers.CLIPModel(config)


def _clip_batch() -> dict[str, Any]:
    pixels = _image_batch()()["pixel_values"]
    return {"input_ids": _ids(), "pixel_values": pixels, "return_loss": True, "output_hidden_states": True}


def _lora_llama() -> nn.Module:
    import peft

    base = _decoder("LlamaConfig", "LlamaForCausalLM")()
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)  # peft asks transformers a deprecated question
        return peft.get_peft_model(base, config)


_T5 = {
    "vocab_size": VOCAB,
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": LAYERS,
    "num_heads": 4,
    "dropout_rate": 0.1,
    "decoder_start_token_id": 0,
    "pad_token_id": 0,
}
_BART = {
    "vocab_size": VOCAB,
    "d_model": 32,
    "encoder_layers": LAYERS,
    "decoder_layers": LAYERS,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "max_position_embeddings": 2 * SEQ,
    "dropout": 0.1,
    "attention_dropout": 0.1,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "decoder_start_token_id": 2,
}
_BERT = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 2 * SEQ + 2,
}
_VIT = {
    "hidden_size": 32,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "image_size": IMAGE,
    "patch_size": 4,
    "num_labels": 3,
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
}


def architectures() -> list[Architecture]:
    """The matrix's architectures, decoder LMs first."""
    return [
        Architecture(
            "gpt2",
            _from_config(
                "GPT2Config",
                "GPT2LMHeadModel",
                n_layer=LAYERS,
                n_embd=32,
                n_head=4,
                vocab_size=VOCAB,
                n_positions=2 * SEQ,
                bos_token_id=0,
                eos_token_id=0,
            ),
            _lm_batch,
            ("transformer.h",),
        ),
        Architecture("llama", _decoder("LlamaConfig", "LlamaForCausalLM"), _lm_batch, ("model.layers",)),
        Architecture(
            "mistral", _decoder("MistralConfig", "MistralForCausalLM", sliding_window=8), _lm_batch, ("model.layers",)
        ),
        Architecture("qwen2", _decoder("Qwen2Config", "Qwen2ForCausalLM"), _lm_batch, ("model.layers",)),
        Architecture(
            "qwen3",  # its default head_dim (128): attention wider than the hidden state, as in Qwen3's own sizes
            _decoder("Qwen3Config", "Qwen3ForCausalLM"),
            _lm_batch,
            ("model.layers",),
        ),
        Architecture(
            "gemma2",
            _decoder("Gemma2Config", "Gemma2ForCausalLM", head_dim=8, sliding_window=8, query_pre_attn_scalar=8),
            _lm_batch,
            ("model.layers",),
        ),
        Architecture(
            "phi3",
            _decoder("Phi3Config", "Phi3ForCausalLM", resid_pdrop=0.1, embd_pdrop=0.1, num_key_value_heads=4),
            _lm_batch,
            ("model.layers",),
        ),
        Architecture(
            "mixtral",
            _decoder(
                "MixtralConfig",
                "MixtralForCausalLM",
                num_local_experts=4,
                num_experts_per_tok=2,
                output_router_logits=True,
                router_aux_loss_coef=0.02,
            ),
            _lm_batch,
            ("model.layers",),
            extras=("router_logits",),
        ),
        Architecture(
            "deepseek_v3",  # a dense first layer, then mixture-of-experts layers: blocks of one class that differ
            _decoder(
                "DeepseekV3Config",
                "DeepseekV3ForCausalLM",
                num_key_value_heads=4,
                moe_intermediate_size=32,
                n_routed_experts=4,
                num_experts_per_tok=2,
                n_group=1,
                topk_group=1,
                first_k_dense_replace=1,
                q_lora_rank=16,
                kv_lora_rank=16,
                qk_rope_head_dim=4,
                qk_nope_head_dim=4,
                v_head_dim=8,
            ),
            _lm_batch,
            ("model.layers",),
        ),
        Architecture(
            "gpt_neox",
            _from_config(
                "GPTNeoXConfig",
                "GPTNeoXForCausalLM",
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=LAYERS,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=2 * SEQ,
                hidden_dropout=0.1,
                attention_dropout=0.1,
            ),
            _lm_batch,
            ("gpt_neox.layers",),
        ),
        Architecture(
            "opt",
            _from_config(
                "OPTConfig",
                "OPTForCausalLM",
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=LAYERS,
                ffn_dim=64,
                num_attention_heads=4,
                word_embed_proj_dim=32,
                max_position_embeddings=2 * SEQ,
                dropout=0.1,
                attention_dropout=0.1,
            ),
            _lm_batch,
            ("model.decoder.layers",),
        ),
        Architecture(
            "bert", _from_config("BertConfig", "BertForMaskedLM", **_BERT), _masked_lm_batch, ("bert.encoder.layer",)
        ),
        Architecture(
            "roberta",
            _from_config("RobertaConfig", "RobertaForMaskedLM", **_BERT, pad_token_id=1),
            _masked_lm_batch,
            ("roberta.encoder.layer",),
        ),
        Architecture(
            "distilbert",
            _from_config(
                "DistilBertConfig",
                "DistilBertForMaskedLM",
                vocab_size=VOCAB,
                dim=32,
                hidden_dim=64,
                n_layers=LAYERS,
                n_heads=4,
                max_position_embeddings=2 * SEQ,
            ),
            _masked_lm_batch,
            ("distilbert.transformer.layer",),
        ),
        Architecture(
            "t5",
            _from_config("T5Config", "T5ForConditionalGeneration", **_T5),
            _seq2seq_batch,
            ("encoder.block", "decoder.block"),
        ),
        Architecture(
            "bart",
            _from_config("BartConfig", "BartForConditionalGeneration", **_BART),
            _seq2seq_batch,
            ("model.encoder.layers", "model.decoder.layers"),
        ),
        Architecture(
            "vit", _from_config("ViTConfig", "ViTForImageClassification", **_VIT), _image_batch(), ("vit.layers",)
        ),
        Architecture("clip", _clip, _clip_batch, ("text_model.encoder.layers", "vision_model.encoder.layers")),
        Architecture(
            "resnet",
            _from_config(
                "ResNetConfig",
                "ResNetForImageClassification",
                embedding_size=8,
                hidden_sizes=[8, 16],
                depths=[2, 2],
                layer_type="basic",
                num_labels=3,
            ),
            _image_batch(),
            ("resnet.encoder.stages",),
        ),
        Architecture(
            "convnext",
            _from_config(
                "ConvNextConfig",
                "ConvNextForImageClassification",
                hidden_sizes=[8, 16],
                depths=[2, 2],
                num_stages=2,
                num_labels=3,
                drop_path_rate=0.1,
                image_size=IMAGE,
            ),
            _image_batch(),
            ("convnext.encoder.stages",),
        ),
        Architecture("llama_lora", _lora_llama, _lm_batch, ("base_model.model.model.layers",), needs="peft"),
        Architecture("user_net", UserNet, lambda: user_batch(BATCH * SEQ), ("blocks",), needs=""),
    ]


def by_name(name: str) -> Architecture:
    for arch in architectures():
        if arch.name == name:
            return arch
    raise KeyError(f"no architecture {name!r}; known: {[a.name for a in architectures()]}")


# ----------------------------------------------------------------------------------------------------
# A plain PyTorch model for the architecture matrix: no Hugging Face, heterogeneous blocks of one class (widths
# change along the stack; some carry a BatchNorm with running statistics, some a LayerNorm; all dropout).


class UserBlock(nn.Module):
    """One block class, many shapes: a linear map with an optional norm (batch or layer), GELU and dropout,
    residual when the widths match."""

    def __init__(self, d_in: int, d_out: int, norm: str | None = None, dropout: float = 0.1) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.norm: nn.Module = {"batch": nn.BatchNorm1d(d_out), "layer": nn.LayerNorm(d_out)}.get(
            norm or "", nn.Identity()
        )
        self.drop = nn.Dropout(dropout)
        self.residual = d_in == d_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(torch.nn.functional.gelu(self.norm(self.fc(x))))
        return x + y if self.residual else y


class UserNet(nn.Module):
    """A plain PyTorch model with heterogeneous blocks: widths change along the stack, some blocks carry a
    BatchNorm (running statistics), some a LayerNorm, all dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(
            [
                UserBlock(16, 32, norm="batch"),
                UserBlock(32, 32, norm="layer"),
                UserBlock(32, 64, norm="batch"),
                UserBlock(64, 64),
            ]
        )
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).square().mean()


def user_batch(rows: int = 32) -> dict[str, Any]:
    """A batch for :class:`UserNet`: ``rows`` random inputs of width 8 (seeded)."""
    return {"x": torch.randn(rows, 8, generator=torch.Generator().manual_seed(0))}
