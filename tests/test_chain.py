"""Finding the chain of repeated blocks: Hugging Face GPT-2, BERT and ViT built from tiny configs (nothing is
downloaded), ``nn.Sequential`` and ``nn.ModuleList`` chains, explicit names, and the errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from toy_models import MLPBlock, MLPChain, assert_same_step

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
            # a list of mixed classes says nothing of how they are called (a speech model's feature extractor)
            self.convs = nn.ModuleList([nn.Conv1d(4, 4, 3), *[MLPBlock(4) for _ in range(3)]])
            self.pair = nn.ModuleList([MLPBlock(4), MLPBlock(4)])

    assert [[name for name, _ in chain] for chain in remat.find_chains(Model())] == [["pair.0", "pair.1"]]



def test_a_list_of_lists_is_no_chain_but_the_lists_inside_are() -> None:
    class Stages(nn.Module):  # Funnel keeps its layers so: a list of stages, each a list of layers
        def __init__(self) -> None:
            super().__init__()
            self.stages = nn.ModuleList([nn.ModuleList([MLPBlock(8, dropout=0.1) for _ in range(3)]) for _ in range(2)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for stage in self.stages:
                for layer in stage:
                    x = layer(x)
                x = x * 0.5  # between the stages, as Funnel pools
            return x

    torch.manual_seed(0)
    model = Stages()
    reference = copy.deepcopy(model)
    chains = remat.find_chains(model)
    expected = [[f"stages.{s}.{i}" for i in range(3)] for s in range(2)]
    assert [[name for name, _ in chain] for chain in chains] == expected
    x = torch.randn(3, 8)
    costs = remat.profile(model, x, loss_fn=lambda y: y.square().mean())
    handle = remat.apply(model, remat.plan(costs, "full"))
    assert_same_step(_step(model, x), _step(reference, x))
    assert handle.stats.total_calls == 6

def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """toy_models.step for a model whose output is not its loss: the loss is the output's mean square."""
    torch.manual_seed(1)
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("strategy", ["full", "sqrt", "memory_poor"])
def test_a_sequential_gives_the_run_of_repeated_blocks_between_its_stem_and_head(strategy: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), *[MLPBlock(8, dropout=0.1) for _ in range(4)], nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    assert [n for n, _ in remat.find_blocks(model)] == ["1", "2", "3", "4"]
    x = torch.randn(3, 4)
    handle = remat.apply(model, remat.plan(remat.profile(model, x, loss_fn=lambda y: y.square().mean()), strategy))
    got = _step(model, x)
    assert handle.stats.total_calls >= 4
    assert_same_step(got, _step(reference, x))


def test_a_module_dict_of_layers_is_a_chain_in_its_order() -> None:
    class Model(nn.Module):  # torchtitan keeps its layers in a ModuleDict keyed by layer number
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleDict({str(i): MLPBlock(8, dropout=0.1) for i in range(3)})
            self.head = nn.ModuleDict({"norm": nn.LayerNorm(8), "out": nn.Linear(8, 8)})  # mixed: not a chain

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers.values():
                x = layer(x)
            return self.head["out"](self.head["norm"](x))

    torch.manual_seed(0)
    model = Model()
    reference = copy.deepcopy(model)
    assert [n for n, _ in remat.find_blocks(model)] == ["layers.0", "layers.1", "layers.2"]
    x = torch.randn(3, 8)
    plan = remat.Plan({"layers.0": "checkpoint", "layers.1": "segment:a", "layers.2": "segment:a"})
    handle = remat.apply(model, plan)
    assert_same_step(_step(model, x), _step(reference, x))
    assert handle.stats.calls == {"layers.0": 1, "layers.1": 1, "layers.2": 1}


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


def test_a_model_with_one_shared_layer_is_told_to_name_it() -> None:
    class Shared(nn.Module):  # ALBERT's shape: one layer, called once per depth
        def __init__(self) -> None:
            super().__init__()
            self.groups = nn.ModuleList([MLPBlock(8)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(3):
                x = self.groups[0](x)
            return x.square().mean()

    model = Shared()
    with pytest.raises(ValueError, match=r"calls several times .*blocks=\['groups\.0'\]"):
        remat.find_blocks(model)
    # The advice works: each call is a block of the plan.
    costs = remat.profile(model, torch.randn(2, 8), loss_fn=lambda y: y, blocks=["groups.0"])
    assert costs.fqns == ["groups.0", "groups.0@2", "groups.0@3"]


def test_blocks_given_as_one_string_say_to_give_a_list() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"blocks='layers' is one string; give a list of block names"):
        remat.apply(model, remat.Plan({"0": "keep"}), blocks="layers")
