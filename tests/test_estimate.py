"""Estimation without running the model: the transformer formula against known values and a measured GPT-2
layer, meta-device cost tables against bytes saved on a real CPU run, the FLOPs time model, and planning a
10B-parameter model that could never be materialised here."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from toy_models import tiny_gpt2_config

import remat
from remat.meters import LiveTensorTracker
from remat.profiling import meta_cost_table, transformer_layer_activation_bytes
from remat.profiling.estimate import DEVICE_PRESETS, count_flops, flops_time_model

transformers = pytest.importorskip("transformers")

GPT3 = {"s": 2048, "b": 1, "h": 12288, "a": 96}


def test_formula_is_34sbh_plus_5as2b_for_16_bit_with_dropout() -> None:
    s, b, h, a = GPT3.values()
    assert transformer_layer_activation_bytes(s, b, h, a) == 34 * s * b * h + 5 * a * s * s * b
    assert transformer_layer_activation_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert transformer_layer_activation_bytes(s, b, h, a) == 2_868_903_936  # 2.67 GiB per GPT-3 layer


@pytest.mark.parametrize(
    ("options", "per_sbh", "per_as2b", "per_asb"),
    [
        ({"dropout": False}, 32, 2, 0),
        ({"flash_attention": True}, 34, 0, 4),
        ({"activation": "relu"}, 26, 5, 0),
        ({"bytes_per_element": 4}, 66, 9, 0),
        ({"mask_bytes": 2}, 36, 6, 0),
        ({"full_recompute": True}, 2, 0, 0),
    ],
)
def test_formula_variants(options: dict, per_sbh: int, per_as2b: int, per_asb: int) -> None:
    s, b, h, a = 512, 4, 1024, 16
    expected = per_sbh * s * b * h + per_as2b * a * s * s * b + per_asb * a * s * b
    assert transformer_layer_activation_bytes(s, b, h, a, **options) == expected


def test_formula_rejects_what_it_does_not_model() -> None:
    with pytest.raises(ValueError, match="activation"):
        transformer_layer_activation_bytes(8, 1, 8, 1, activation="swish-gated")
    with pytest.raises(ValueError, match="positive"):
        transformer_layer_activation_bytes(0, 1, 8, 1)


def gpt2_config(**overrides):
    """Eager attention (the s x s scores exist, as the formula assumes) and dropout 0.1 everywhere."""
    options = {
        "n_embd": 256,
        "n_layer": 2,
        "n_positions": 256,
        "vocab": 128,
        "use_cache": True,
        "activation_function": "gelu_pytorch_tanh",  # one GELU kernel that keeps only its input
    }
    options.update(overrides)
    return tiny_gpt2_config(**options)


def bytes_saved_by_autograd(block: nn.Module, *args: torch.Tensor, count_input: bool) -> int:
    """Bytes of the distinct storages autograd saves for backward when ``block`` runs (weights excluded)."""
    weights = {t.untyped_storage().data_ptr() for t in [*block.parameters(), *block.buffers()]}
    inputs = {a.untyped_storage().data_ptr() for a in args}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(*args)
    out = out[0] if isinstance(out, tuple) else out
    excluded = weights | (set() if count_input else inputs)
    saved = sum(n for ptr, n in seen.items() if ptr not in excluded)
    if not count_input:  # a CostTable row: what the block adds, its output included
        saved += 0 if out.untyped_storage().data_ptr() in seen else out.untyped_storage().nbytes()
    return saved


def test_formula_matches_a_measured_gpt2_layer_in_bf16_with_dropout() -> None:
    # GPT-2 layer, h=256, 4 heads, s=256, b=2, bfloat16, dropout 0.1, eager attention, GELU (tanh form).
    # On CPU, eager dropout keeps its mask in the activation dtype (2 bytes); GPUs keep 1-byte masks.
    s, b, h, a = 256, 2, 256, 4
    torch.manual_seed(0)
    model = transformers.GPT2Model(gpt2_config(n_layer=1)).to(torch.bfloat16).train()
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    measured = bytes_saved_by_autograd(model.h[0], x, count_input=True)
    predicted = transformer_layer_activation_bytes(s, b, h, a, mask_bytes=2)
    assert abs(predicted - measured) / measured < 0.10, (predicted, measured)


def test_meta_table_equals_bytes_saved_on_a_real_cpu_run() -> None:
    config = gpt2_config(n_embd=64, n_head=4, n_layer=3, n_positions=32, activation_function="gelu_new")
    batch = {"input_ids": torch.zeros(2, 32, dtype=torch.long), "attention_mask": torch.ones(2, 32, dtype=torch.long)}
    table = meta_cost_table(lambda: transformers.GPT2LMHeadModel(config), batch)
    assert table.source == "meta" and table.info["time_source"] == "flops-estimate"
    assert len(table) == 3

    torch.manual_seed(0)
    real = transformers.GPT2LMHeadModel(config).train()
    block = real.transformer.h[1]
    x = torch.randn(2, 32, 64, requires_grad=True)
    on_cpu = bytes_saved_by_autograd(block, x, count_input=False)
    for row in table.blocks:
        assert abs(row.saved_bytes["keep"] - on_cpu) <= 0.05 * on_cpu, (row.saved_bytes, on_cpu)
        assert row.saved_bytes["checkpoint"] == row.output_bytes == x.numel() * x.element_size()

    # What the selective policy keeps, measured by the live-tensor tracker on CPU.
    tracker = LiveTensorTracker("cpu")
    with tracker:
        out = remat.checkpoint(block, x, policy="dots_saveable")[0]
        tracker.mark("fwd_end")
    tracker.close()
    selective = tracker.bytes_at("fwd_end", exclude_survivors=False)
    assert abs(table.blocks[0].saved_bytes["selective:dots_saveable"] - selective) <= 0.05 * selective
    del out


def test_meta_table_byte_terms_equal_remat_profile_on_cpu() -> None:
    config = gpt2_config(n_embd=64, n_head=4, n_layer=3, n_positions=32, activation_function="gelu_new")
    batch = {"input_ids": torch.zeros(2, 32, dtype=torch.long), "attention_mask": torch.ones(2, 32, dtype=torch.long)}
    meta = meta_cost_table(lambda: transformers.GPT2LMHeadModel(config), batch)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    model.config.use_cache = False
    measured = remat.profile(model, batch, repeats=1)
    for estimated, real in zip(meta.blocks, measured.blocks, strict=True):
        assert estimated.saved_bytes == real.saved_bytes
        assert estimated.bwd_extra_bytes == real.bwd_extra_bytes
        assert (estimated.fwd_temp_bytes, estimated.bwd_temp_bytes) == (real.fwd_temp_bytes, real.bwd_temp_bytes)
    assert meta.held_args_bytes == measured.held_args_bytes > 0
    assert meta.held_args_rows == measured.held_args_rows == [measured.held_args_bytes] * 3  # the mask: every row
    assert (meta.stem_bytes, meta.head_bytes, meta.head_retained_bytes) == (
        measured.stem_bytes,
        measured.head_bytes,
        measured.head_retained_bytes,
    )


class Mlp(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def test_meta_table_of_any_chain_and_its_plan() -> None:
    def model() -> nn.Module:
        return nn.Sequential(*[Mlp(32) for _ in range(6)])

    table = meta_cost_table(model, torch.zeros(8, 32), device_flops="cpu")
    real = model()
    x = torch.randn(8, 32, requires_grad=True)
    assert table.blocks[0].saved_bytes["keep"] == bytes_saved_by_autograd(real[0], x, count_input=False)
    assert table.blocks[0].fwd_s > 0 and table.blocks[0].recompute_s["checkpoint"] == table.blocks[0].fwd_s
    plan = remat.plan(table, "optimal", budget=0.5)
    assert plan.predicted_peak_bytes <= 0.5 * remat.plan(table, "none").predicted_peak_bytes


def test_meta_table_refuses_a_materialised_model() -> None:
    with pytest.raises(ValueError, match="factory"):
        meta_cost_table(nn.Sequential(Mlp(4), Mlp(4)), torch.zeros(2, 4))


def test_a_10b_parameter_transformer_plans_at_20_gib_on_meta() -> None:
    config = transformers.LlamaConfig(
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=32,
        num_attention_heads=40,
        num_key_value_heads=40,
        vocab_size=32000,
        max_position_embeddings=2048,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) > 10e9
    ids = torch.zeros(1, 2048, dtype=torch.long)
    table = meta_cost_table(model, {"input_ids": ids, "labels": ids}, device_flops="h100-bf16")
    assert len(table) == 32
    keep_all = remat.plan(table, "none")
    assert keep_all.predicted_peak_bytes > 20 * 2**30  # so the plan has work to do
    plan = remat.plan(table, "optimal", budget="20GiB")
    assert plan.predicted_peak_bytes <= 20 * 2**30
    assert 0 < plan.predicted_recompute_s < remat.plan(table, "full").predicted_recompute_s


def test_flops_time_model() -> None:
    a = torch.empty(64, 128, device="meta")
    b = torch.empty(128, 32, device="meta")
    _, flops = count_flops(torch.mm, a, b)
    assert flops == 2 * 64 * 128 * 32
    h100 = DEVICE_PRESETS["h100-bf16"]
    assert flops_time_model(1e12, device_flops="h100-bf16") == pytest.approx(1e12 / h100.flops)
    assert flops_time_model(1e12, 1e9, device_flops="h100-bf16") == pytest.approx(
        1e12 / h100.flops + 1e9 / h100.bandwidth
    )
    assert flops_time_model(2e12, 1e9, device_flops=1e12) == pytest.approx(2.0)  # a number: FLOPs only
    with pytest.raises(ValueError, match="h100-bf16"):
        flops_time_model(1.0, device_flops="tpu-v9")


class CausalAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(attended.transpose(1, 2).reshape(b, s, w))


@pytest.mark.parametrize("holds_output", [True, False])
def test_fused_attention_on_meta_equals_the_cpu_kernel_and_the_step_is_the_one_given(holds_output: bool) -> None:
    def model() -> nn.Module:
        return nn.Sequential(*[CausalAttention(32, 4) for _ in range(3)], nn.Linear(32, 64))

    step = remat.StepSpec(blocks=["0", "1", "2"], holds_output=holds_output)
    batch = torch.zeros(2, 64, 32)
    fused = meta_cost_table(model, batch, step=step, fused_attention=True)
    scores = meta_cost_table(model, batch, step=step)
    torch.manual_seed(0)
    measured = remat.profile(model().train(), torch.randn(2, 64, 32), step=step, repeats=1)
    for estimated, real, math in zip(fused.blocks, measured.blocks, scores.blocks, strict=True):
        assert estimated.saved_bytes[remat.core.KEEP] == real.saved_bytes[remat.core.KEEP]
        scores_bytes = 2 * 4 * 64 * 64 * 4  # the math form keeps the s x s scores of every head
        assert math.saved_bytes[remat.core.KEEP] > real.saved_bytes[remat.core.KEEP] + scores_bytes // 2
    assert fused.info["attention"] == "fused" and scores.info["attention"] != "fused"
    assert (fused.head_bytes, fused.head_retained_bytes) == (measured.head_bytes, measured.head_retained_bytes)
