"""Finding the chain of repeated blocks: Hugging Face GPT-2, BERT and ViT built from tiny configs (nothing is
downloaded), ``nn.Sequential`` and ``nn.ModuleList`` chains, explicit names, and the errors."""

from __future__ import annotations

import pytest
from torch import nn
from toy_models import MLPBlock, MLPChain

import remat


def _names_and_modules(model: nn.Module, prefix: str, count: int) -> list[tuple[str, nn.Module]]:
    modules = dict(model.named_modules())
    return [(f"{prefix}.{i}", modules[f"{prefix}.{i}"]) for i in range(count)]


def test_gpt2(make_gpt2) -> None:
    model = make_gpt2(n_layer=3)
    blocks = remat.find_blocks(model)
    assert blocks == _names_and_modules(model, "transformer.h", 3)
    assert all(module is model.transformer.h[i] for i, (_, module) in enumerate(blocks))


def test_bert() -> None:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64
    )
    model = BertForMaskedLM(config)
    assert remat.find_blocks(model) == _names_and_modules(model, "bert.encoder.layer", 3)


def test_vit() -> None:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
        num_channels=1,
        num_labels=3,
    )
    model = ViTForImageClassification(config)
    # transformers 4 keeps ViT's layers in ``vit.encoder.layer``; transformers 5 moved them to ``vit.layers``.
    prefix = "vit.encoder.layer" if hasattr(model.vit, "encoder") else "vit.layers"
    assert remat.find_blocks(model) == _names_and_modules(model, prefix, 3)


def test_sequential_at_the_top_and_inside_a_model() -> None:
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    assert remat.find_blocks(seq) == [("0", seq[0]), ("1", seq[1]), ("2", seq[2])]
    model = MLPChain([8] * 5)
    assert [name for name, _ in remat.find_blocks(model)] == [f"blocks.{i}" for i in range(4)]


def test_the_longest_chain_wins_and_parameterless_lists_are_skipped() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.short = nn.ModuleList([MLPBlock(4) for _ in range(2)])
            self.activations = nn.Sequential(*[nn.ReLU() for _ in range(9)])
            self.long = nn.ModuleList([MLPBlock(4) for _ in range(5)])

    model = Model()
    assert [name for name, _ in remat.find_blocks(model)] == [f"long.{i}" for i in range(5)]
    model.long = nn.ModuleList([MLPBlock(4) for _ in range(2)])  # a tie: the first in module order
    assert [name for name, _ in remat.find_blocks(model)] == ["short.0", "short.1"]


def test_mixed_class_lists_are_not_chains() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
            self.pair = nn.ModuleList([MLPBlock(4), MLPBlock(4)])

    assert [name for name, _ in remat.find_blocks(Model())] == ["pair.0", "pair.1"]


def test_explicit_names_in_the_order_given() -> None:
    model = MLPChain([8] * 5)
    blocks = remat.find_blocks(model, names=["blocks.2", "inp", "head"])
    assert blocks == [("blocks.2", model.blocks[2]), ("inp", model.inp), ("head", model.head)]


def test_a_name_not_in_the_model() -> None:
    model = MLPChain([8] * 3)
    with pytest.raises(ValueError, match=r"no module named \['blocks\.7'\].*blocks\.0"):
        remat.find_blocks(model, names=["blocks.0", "blocks.7"])
    with pytest.raises(ValueError, match="names is empty"):
        remat.find_blocks(model, names=[])


def test_a_model_without_a_chain_says_how_to_name_blocks() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match="no chain of repeated blocks found in Sequential") as info:
        remat.find_blocks(model)
    assert "names=[" in str(info.value) and "blocks=[" in str(info.value)
    # The advice works: naming the blocks gives a chain.
    assert [n for n, _ in remat.find_blocks(model, names=["0", "2"])] == ["0", "2"]
