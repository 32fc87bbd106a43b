"""Models for the experiments: GPT-2, BERT and ViT built from Hugging Face config classes with random weights
(nothing is downloaded), and a residual MLP chain for quick checks.

``build_model(name, preset)`` returns a :class:`ModelSpec`: the module plus what the harness needs to train
and report on it (loss function, task kind, throughput unit, a JSON-safe summary of the configuration and
the parameter count). ``model_config`` gives the same summary without allocating any weights, which is how
the large presets are inspected on a small machine.

Presets: ``tiny`` trains a step in well under a second on a CPU (with GPT-2's 50,257-token vocabulary the
output layer dominates: about 0.3 s for 4 x 64 tokens on one core; with byte tokens, tens of milliseconds),
``small`` has a few million parameters in its layers, and the standard sizes (``gpt2``: medium, large, xl;
``bert``: base, large; ``vit``: base, large) are those of the published models, GPT-2 Medium, BERT-Base and
ViT-Base being the ones of the PGAC experiment plan. A preset may also be written with its model prefix
(``"gpt2-medium"``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core import StepSpec
from .mlp_chain import MLPChain

# Presets use family-neutral keys; _FIELDS maps them onto each Hugging Face config class.
_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "gpt2": {
        "tiny": dict(num_layers=2, hidden_size=64, num_heads=4, max_positions=256),
        "mini": dict(num_layers=6, hidden_size=256, num_heads=8, max_positions=512),  # not GPT-2 small (12x768)
        "medium": dict(num_layers=24, hidden_size=1024, num_heads=16, max_positions=1024),
        "large": dict(num_layers=36, hidden_size=1280, num_heads=20, max_positions=1024),
        "xl": dict(num_layers=48, hidden_size=1600, num_heads=25, max_positions=1024),
    },
    "bert": {
        "tiny": dict(num_layers=2, hidden_size=64, num_heads=4, intermediate_size=256, max_positions=256),
        "mini": dict(num_layers=4, hidden_size=256, num_heads=4, intermediate_size=1024, max_positions=512),
        "base": dict(num_layers=12, hidden_size=768, num_heads=12, intermediate_size=3072, max_positions=512),
        "large": dict(num_layers=24, hidden_size=1024, num_heads=16, intermediate_size=4096, max_positions=512),
    },
    # The image presets classify into 10 classes (the digit and Fashion-MNIST data sets). The small ones
    # take 28x28 grey images as they are; base and large keep ViT's 224x224 RGB, 16x16-patch geometry
    # (197 tokens), and the data module resizes the digits to match (see ``data.load_dataset``).
    "vit": {
        "tiny": dict(
            num_layers=2,
            hidden_size=64,
            num_heads=4,
            intermediate_size=256,
            image_size=28,
            patch_size=7,
            num_channels=1,
            num_labels=10,
        ),
        "mini": dict(
            num_layers=6,
            hidden_size=256,
            num_heads=8,
            intermediate_size=1024,
            image_size=28,
            patch_size=4,
            num_channels=1,
            num_labels=10,
        ),
        "base": dict(
            num_layers=12,
            hidden_size=768,
            num_heads=12,
            intermediate_size=3072,
            image_size=224,
            patch_size=16,
            num_channels=3,
            num_labels=10,
        ),
        "large": dict(
            num_layers=24,
            hidden_size=1024,
            num_heads=16,
            intermediate_size=4096,
            image_size=224,
            patch_size=16,
            num_channels=3,
            num_labels=10,
        ),
    },
    "mlp": {
        "tiny": dict(num_layers=4, hidden_size=64, intermediate_size=256, image_size=28, num_channels=1, num_labels=10),
        "mini": dict(
            num_layers=8, hidden_size=512, intermediate_size=2048, image_size=28, num_channels=1, num_labels=10
        ),
        "base": dict(
            num_layers=16, hidden_size=2048, intermediate_size=8192, image_size=28, num_channels=1, num_labels=10
        ),
    },
}

# Family-neutral key -> field of the Hugging Face config class (keys not listed have the same name).
_FIELDS: dict[str, dict[str, str]] = {
    "gpt2": {
        "num_layers": "n_layer",
        "hidden_size": "n_embd",
        "num_heads": "n_head",
        "intermediate_size": "n_inner",
        "max_positions": "n_positions",
    },
    "bert": {
        "num_layers": "num_hidden_layers",
        "num_heads": "num_attention_heads",
        "max_positions": "max_position_embeddings",
    },
    "vit": {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads"},
    "mlp": {},
}
_DROPOUT_FIELDS: dict[str, tuple[str, ...]] = {
    "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "vit": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "mlp": ("dropout",),
}
_KIND = {"gpt2": "lm", "bert": "mlm", "vit": "image", "mlp": "image"}
_UNIT = {"lm": "tokens", "mlm": "tokens", "image": "images"}
_MLP_DEFAULTS: dict[str, Any] = {"dropout": 0.0}


@dataclass
class ModelSpec:
    """A model ready for the harness.

    ``loss_fn(output)`` turns the model's output into the scalar to differentiate; ``kind`` is the task
    (``"lm"`` causal language modelling, ``"mlm"`` masked language modelling, ``"image"`` classification)
    and ``unit`` what throughput counts (``"tokens"`` or ``"images"``). ``config`` is a JSON-safe summary
    with family-neutral keys; ``block_container`` is the dotted name of the repeated layers.
    """

    module: nn.Module
    name: str
    preset: str
    kind: str
    unit: str
    loss_fn: Callable[[Any], torch.Tensor]
    config: dict[str, Any]
    num_params: int
    block_container: str
    seed: int

    @property
    def step(self) -> StepSpec:
        """The model's training step as remat's entry points take it: its loss and its repeated layers."""
        return StepSpec(loss_fn=self.loss_fn, blocks=self.blocks())

    def blocks(self) -> list[tuple[str, nn.Module]]:
        """The repeated layers as ``(fully qualified name, module)`` pairs, in execution order."""
        container = self.module.get_submodule(self.block_container)
        return [(f"{self.block_container}.{i}", block) for i, block in enumerate(container)]

    def count_items(self, batch_kwargs: Mapping[str, Any]) -> int:
        """Tokens or images in one batch (the numerator of throughput)."""
        key = "input_ids" if self.unit == "tokens" else "pixel_values"
        if key not in batch_kwargs:
            raise ValueError(f"a {self.name} batch needs {key!r}; got keys {sorted(batch_kwargs)}")
        value = batch_kwargs[key]
        return int(value.numel()) if self.unit == "tokens" else int(value.shape[0])


def list_models() -> list[str]:
    """Names accepted by :func:`build_model`."""
    return list(_PRESETS)


def list_presets(name: str) -> list[str]:
    """Presets of model ``name``, smallest first."""
    return list(_PRESETS[_check_name(name)])


def parse_model_id(model_id: str) -> tuple[str, str]:
    """Split ``"gpt2-medium"`` into ``("gpt2", "medium")``; a bare name gets the ``tiny`` preset."""
    name, sep, preset = model_id.partition("-")
    _check_name(name)
    return name, _check_preset(name, preset) if sep else "tiny"


def model_config(
    name: str,
    preset: str = "tiny",
    *,
    dropout: float | None = None,
    attn_implementation: str = "eager",
    vocab_size: int | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """The JSON-safe configuration summary :func:`build_model` would produce, without building weights."""
    name = _check_name(name)
    preset = _check_preset(name, preset)
    cfg = _make_config(name, preset, dropout, attn_implementation, vocab_size, overrides)
    return _summary(name, preset, cfg)


def build_model(
    name: str,
    preset: str = "tiny",
    *,
    seed: int = 0,
    dropout: float | None = None,
    attn_implementation: str = "eager",
    vocab_size: int | None = None,
    device: str | torch.device | None = None,
    **overrides: Any,
) -> ModelSpec:
    """Build model ``name`` at ``preset`` with random weights drawn from ``seed``.

    ``dropout`` sets every dropout probability of the model (``None`` keeps the preset's, which for the
    Hugging Face models is their library default). ``vocab_size`` makes a text model agree with the data's
    tokenizer. Further keyword arguments override configuration fields, by family-neutral name
    (``num_layers``, ``hidden_size``, ``num_heads``, ``intermediate_size``, ``max_positions``,
    ``image_size``, ``patch_size``, ``num_channels``, ``num_labels``) or by the config class's own field
    name. ``device="meta"`` builds the structure without memory (parameter counts, planning); other devices
    get the weights initialised on the CPU, so one seed gives the same model everywhere. The global RNG
    state is left as it was.
    """
    name = _check_name(name)
    preset = _check_preset(name, preset)
    cfg = _make_config(name, preset, dropout, attn_implementation, vocab_size, overrides)
    on_meta = device is not None and torch.device(device).type == "meta"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if on_meta:
            with torch.device("meta"):
                module = _instantiate(name, cfg)
        else:
            module = _instantiate(name, cfg)
    if device is not None and not on_meta:
        module = module.to(device)
    module.train()
    return ModelSpec(
        module=module,
        name=name,
        preset=preset,
        kind=_KIND[name],
        unit=_UNIT[_KIND[name]],
        loss_fn=output_loss,
        config=_summary(name, preset, cfg),
        num_params=sum(p.numel() for p in module.parameters()),
        block_container=_block_container(
            module, cfg["num_layers"] if name == "mlp" else getattr(cfg, _FIELDS[name]["num_layers"])
        ),
        seed=seed,
    )


def output_loss(output: Any) -> torch.Tensor:
    """The loss a model computed from the labels in its batch (``output.loss``)."""
    loss = getattr(output, "loss", None)
    if loss is None:
        raise ValueError("the model returned no loss: pass labels in the batch (data.batch_kwargs does)")
    return loss


def _check_name(name: str) -> str:
    if name not in _PRESETS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(_PRESETS)}")
    return name


def _check_preset(name: str, preset: str) -> str:
    if preset.startswith(name + "-"):
        preset = preset[len(name) + 1 :]
    if preset not in _PRESETS[name]:
        raise ValueError(f"unknown preset {preset!r} for model {name!r}; known presets: {', '.join(_PRESETS[name])}")
    return preset


def _config_class(name: str) -> type:
    import transformers

    return {"gpt2": transformers.GPT2Config, "bert": transformers.BertConfig, "vit": transformers.ViTConfig}[name]


def _make_config(
    name: str,
    preset: str,
    dropout: float | None,
    attn_implementation: str,
    vocab_size: int | None,
    overrides: Mapping[str, Any],
) -> Any:
    """The Hugging Face config object (a plain dict for the MLP) of ``name`` at ``preset``."""
    values = dict(_PRESETS[name][preset])
    if vocab_size is not None:
        if _KIND[name] not in ("lm", "mlm"):
            raise ValueError(f"vocab_size applies to text models; {name!r} classifies images")
        overrides = {**overrides, "vocab_size": vocab_size}
    if dropout is not None:
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1); got {dropout}")
        for field in _DROPOUT_FIELDS[name]:
            values[field] = dropout
    fields = _FIELDS[name]
    if name == "mlp":
        values = {**_MLP_DEFAULTS, **values}
        known = set(values)
    else:
        known = set(fields) | set(values) | set(_config_class(name)().to_dict())
    for key, value in overrides.items():
        if key not in known:
            raise ValueError(
                f"unknown configuration field {key!r} for model {name!r}; use a family-neutral name "
                f"({', '.join(sorted(set(_PRESETS[name][preset]) | set(fields)))}) or a field of its config"
            )
        values[key] = value
    if name == "mlp":
        return values
    if name == "gpt2":
        # Training never reuses keys/values; a cache would keep them alive in the output and inflate memory.
        values.setdefault("use_cache", False)
    if vocab_size is not None:
        # Special-token ids of the default vocabulary may not exist in a smaller one; the harness never
        # generates text, so such ids are dropped rather than left pointing outside the embedding.
        defaults = _config_class(name)().to_dict()
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if key not in values and isinstance(defaults.get(key), int) and defaults[key] >= vocab_size:
                values[key] = None
    kwargs = {fields.get(key, key): value for key, value in values.items()}
    return _config_class(name)(**kwargs, attn_implementation=attn_implementation)


def _instantiate(name: str, cfg: Any) -> nn.Module:
    if name == "mlp":
        return MLPChain(
            input_size=cfg["num_channels"] * cfg["image_size"] ** 2,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_layers"],
            num_labels=cfg["num_labels"],
            dropout=cfg["dropout"],
        )
    import transformers

    cls = {
        "gpt2": transformers.GPT2LMHeadModel,
        "bert": transformers.BertForMaskedLM,
        "vit": transformers.ViTForImageClassification,
    }[name]
    module = cls(cfg)
    if name == "gpt2":
        # The class name does not tell transformers which loss it computes; say it (silences a warning).
        module.loss_type = "ForCausalLM"
    return module


def _block_container(module: nn.Module, num_layers: int) -> str:
    """Dotted name of the first ``ModuleList``/``Sequential`` holding ``num_layers`` modules of one class.

    Searched rather than hard-coded because transformers moves these between major versions
    (ViT's ``vit.encoder.layer`` became ``vit.layers``).
    """
    for fqn, child in module.named_modules():
        is_chain = isinstance(child, (nn.ModuleList, nn.Sequential)) and len(child) == num_layers > 0
        if is_chain and len({type(block) for block in child}) == 1:
            return fqn
    raise RuntimeError(f"no container of {num_layers} identical layers in {type(module).__name__}")


def _summary(name: str, preset: str, cfg: Any) -> dict[str, Any]:
    """Family-neutral, JSON-safe summary of a configuration."""
    if name == "mlp":
        return {"model_type": "mlp", "preset": preset, **cfg, "num_heads": None, "attn_implementation": None}
    fields = _FIELDS[name]
    raw = cfg.to_dict()

    def get(key: str) -> Any:
        return raw.get(fields.get(key, key))

    summary: dict[str, Any] = {
        "model_type": raw.get("model_type", name),
        "preset": preset,
        "num_layers": get("num_layers"),
        "hidden_size": get("hidden_size"),
        "num_heads": get("num_heads"),
        "intermediate_size": get("intermediate_size") or 4 * get("hidden_size"),
        "dropout": raw.get(_DROPOUT_FIELDS[name][0]),
        "attn_implementation": getattr(cfg, "_attn_implementation", None),
    }
    if _KIND[name] == "image":
        summary.update({k: get(k) for k in ("image_size", "patch_size", "num_channels")})
        summary["num_labels"] = cfg.num_labels
    else:
        summary["vocab_size"] = get("vocab_size")
        summary["max_positions"] = get("max_positions")
    return summary
