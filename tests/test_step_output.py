"""Whether the training loop holds the model's output through the backward decides the head's share of the
peak: ``out = model(**batch); out.loss.backward()`` keeps the logits alive through the chain's backward,
``model(**batch).loss.backward()`` (Hugging Face's Trainer) frees them first. ``remat.profile`` measures the
loop it is told of (``holds_output``), and the prediction for a plan that recomputes is the measured peak of
that loop, never below it (a Llama whose logits are large beside its blocks was predicted 5% high when the
profile held the output and the loop did not)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import remat

transformers = pytest.importorskip("transformers")

PLANS = ("CCK", "CCC", "MMK", "KKK", "GGG", "CKK")
ACTIONS = {"C": "checkpoint", "K": "keep", "M": "memory_poor:0", "G": "segment:0"}


def _llama() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = transformers.LlamaConfig(
        num_hidden_layers=3, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=128,
        vocab_size=512, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        use_cache=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


def _drops_output(model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    model(**batch).loss.backward()


def _holds_output(model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    out = model(**batch)
    out.loss.backward()
    del out


def _predicted_and_measured(
    holds_output: bool, loop: Callable[[nn.Module, dict[str, torch.Tensor]], None]
) -> list[tuple[str, int, int]]:
    model, batch = _llama()
    costs = remat.profile(model, batch, holds_output=holds_output, repeats=1)
    assert costs.info["holds_output"] is holds_output
    rows = []
    for code in PLANS:
        plan = remat.Plan.from_actions(costs, [ACTIONS[c] for c in code])
        handle = remat.apply(model, plan)
        try:
            loop(model, batch)  # gradients exist before the measured step, as in training
            with remat.measure() as mem:
                loop(model, batch)
        finally:
            handle.remove()
        rows.append((code, plan.predicted_peak_bytes, mem.activation_bytes))
    return rows


def test_a_loop_dropping_the_output_is_predicted_within_one_percent_never_below() -> None:
    rows = _predicted_and_measured(False, _drops_output)
    for code, predicted, measured in rows:
        assert measured <= predicted <= 1.01 * measured, (code, predicted, measured)


def test_a_loop_holding_the_output_is_predicted_within_one_percent_never_below() -> None:
    rows = _predicted_and_measured(True, _holds_output)
    for code, predicted, measured in rows:
        assert measured <= predicted <= 1.01 * measured, (code, predicted, measured)


def test_the_default_profile_is_on_the_safe_side_of_a_loop_dropping_the_output() -> None:
    dropping = {code: measured for code, _, measured in _predicted_and_measured(False, _drops_output)}
    for code, predicted, _ in _predicted_and_measured(True, _drops_output):
        assert predicted > 1.05 * dropping[code] or code in ("KKK", "CKK"), (code, predicted, dropping[code])
        assert predicted >= dropping[code]
