"""The experiment models: every kind builds at ``tiny`` and trains a step; presets have their documented
shapes; seeds, overrides and errors behave."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat.bench.mlp_chain import MLPChain, ResidualMLPBlock
from remat.bench.models import (
    build_model,
    list_models,
    list_presets,
    model_config,
    parse_model_id,
)


def _batch(spec, batch_size: int = 4, seq_len: int = 32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    cfg = spec.config
    if spec.kind == "image":
        shape = (batch_size, cfg["num_channels"], cfg["image_size"], cfg["image_size"])
        return {
            "pixel_values": torch.randn(shape, generator=gen),
            "labels": torch.randint(cfg["num_labels"], (batch_size,), generator=gen),
        }
    ids = torch.randint(cfg["vocab_size"], (batch_size, seq_len), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def test_lists():
    assert list_models() == ["gpt2", "bert", "vit", "mlp"]
    assert list_presets("gpt2")[:3] == ["tiny", "mini", "medium"]
    assert "base" in list_presets("bert") and "base" in list_presets("vit")


@pytest.mark.parametrize("name", ["gpt2", "bert", "vit", "mlp"])
def test_tiny_model_trains_a_step(name):
    spec = build_model(name, "tiny", seed=0)
    assert spec.name == name and spec.preset == "tiny"
    assert spec.kind == {"gpt2": "lm", "bert": "mlm", "vit": "image", "mlp": "image"}[name]
    assert spec.unit == ("images" if spec.kind == "image" else "tokens")
    assert spec.num_params == sum(p.numel() for p in spec.module.parameters()) > 0
    assert spec.module.training
    blocks = spec.blocks()
    assert len(blocks) == spec.config["num_layers"]
    assert len({type(b) for _, b in blocks}) == 1
    assert all(spec.module.get_submodule(fqn) is block for fqn, block in blocks)

    batch = _batch(spec)
    loss = spec.loss_fn(spec.module(**batch))
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    for fqn, block in blocks:
        grads = [p.grad for p in block.parameters()]
        assert all(g is not None for g in grads), fqn
        assert any(bool(g.abs().sum() > 0) for g in grads), fqn
    assert spec.count_items(batch) == (4 if spec.kind == "image" else 4 * 32)


def test_loss_fn_needs_labels():
    spec = build_model("mlp")
    out = spec.module(pixel_values=torch.randn(2, 1, 28, 28))
    with pytest.raises(ValueError, match="labels"):
        spec.loss_fn(out)


def test_large_presets_have_the_published_shapes():
    gpt2 = model_config("gpt2", "medium")
    assert (gpt2["num_layers"], gpt2["hidden_size"], gpt2["num_heads"]) == (24, 1024, 16)
    assert gpt2["vocab_size"] == 50257 and gpt2["max_positions"] == 1024
    bert = model_config("bert", "base")
    assert (bert["num_layers"], bert["hidden_size"], bert["num_heads"], bert["intermediate_size"]) == (
        12,
        768,
        12,
        3072,
    )
    vit = model_config("vit", "base")
    assert (vit["num_layers"], vit["hidden_size"], vit["num_heads"]) == (12, 768, 12)
    assert (vit["image_size"], vit["patch_size"], vit["num_channels"]) == (224, 16, 3)
    assert model_config("gpt2", "gpt2-medium") == gpt2
    assert parse_model_id("gpt2-medium") == ("gpt2", "medium")
    assert parse_model_id("vit") == ("vit", "tiny")


def test_tiny_presets_are_small_and_eager():
    for name in list_models():
        cfg = model_config(name, "tiny")
        assert cfg["num_layers"] <= 4 and cfg["hidden_size"] <= 64
        if name != "mlp":
            assert cfg["attn_implementation"] == "eager"


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="known models: gpt2, bert, vit, mlp"):
        build_model("resnet")
    with pytest.raises(ValueError, match="known presets: tiny, mini, base, large"):
        build_model("bert", "medium")
    with pytest.raises(ValueError, match="unknown configuration field 'n_wings'"):
        build_model("gpt2", n_wings=2)
    with pytest.raises(ValueError, match="text models"):
        build_model("vit", vocab_size=100)
    with pytest.raises(ValueError, match="dropout"):
        build_model("mlp", dropout=1.5)


def test_seed_fixes_weights_and_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b, c = build_model("vit", seed=1), build_model("vit", seed=1), build_model("vit", seed=2)
    assert torch.equal(torch.random.get_rng_state(), state)
    pa, pb, pc = (list(s.module.parameters()) for s in (a, b, c))
    assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(pa, pc, strict=True))


def test_overrides_reach_the_module():
    spec = build_model("gpt2", vocab_size=258, num_layers=3, dropout=0.0, max_positions=64)
    cfg = spec.module.config
    assert (cfg.vocab_size, cfg.n_layer, cfg.n_positions) == (258, 3, 64)
    assert spec.module.transformer.wte.num_embeddings == 258
    assert all(m.p == 0.0 for m in spec.module.modules() if isinstance(m, nn.Dropout))
    assert cfg.eos_token_id is None  # 50256 does not exist in a 258-id vocabulary
    assert spec.config["vocab_size"] == 258 and spec.config["num_layers"] == 3

    bert = build_model("bert", vocab_size=258, pad_token_id=None, dropout=0.2)
    assert bert.module.bert.embeddings.word_embeddings.padding_idx is None
    assert bert.config["dropout"] == 0.2

    vit = build_model("vit", image_size=28, patch_size=4, num_labels=7)
    assert vit.module.classifier.out_features == 7
    out = vit.module(pixel_values=torch.randn(2, 1, 28, 28))
    assert out.logits.shape == (2, 7)


def test_attention_implementations_agree():
    eager = build_model("gpt2", dropout=0.0, attn_implementation="eager", seed=3)
    sdpa = build_model("gpt2", dropout=0.0, attn_implementation="sdpa", seed=3)
    assert sdpa.module.config._attn_implementation == "sdpa"
    batch = _batch(eager)
    assert torch.allclose(eager.loss_fn(eager.module(**batch)), sdpa.loss_fn(sdpa.module(**batch)), atol=1e-5)


def test_meta_device_counts_parameters_without_memory():
    meta = build_model("bert", "tiny", device="meta")
    assert all(p.is_meta for p in meta.module.parameters())
    assert meta.num_params == build_model("bert", "tiny").num_params


def test_mlp_chain_is_a_sequential_of_identical_residual_blocks():
    spec = build_model("mlp", "tiny", dropout=0.0)
    model = spec.module
    assert isinstance(model, MLPChain) and spec.block_container == "blocks"
    assert isinstance(model.blocks, nn.Sequential)
    assert all(isinstance(b, ResidualMLPBlock) for b in model.blocks)
    block = model.blocks[0]
    x = torch.randn(3, spec.config["hidden_size"])
    with torch.no_grad():
        block.fc2.weight.zero_()
        block.fc2.bias.zero_()
        assert torch.equal(block(x), x)  # residual: a zero branch is the identity
