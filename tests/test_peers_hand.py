"""The peers benchmark's hand-written contenders (``benchmarks/peers/contenders.py``): the blocks chosen, by ``k``
or by a planner's per-block choice (ckptplan's plans), run under ``torch.utils.checkpoint``, the others plainly;
the gradients stay those of no checkpointing and the peak falls with each block checkpointed."""

from __future__ import annotations

import importlib

import pytest
import torch

import remat

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def modules():
    return importlib.import_module("benchmarks.peers.models"), importlib.import_module("benchmarks.peers.contenders")


def step(pm, model, batch):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same dropout draws in every step
    with remat.measure() as meter:
        pm.forward_backward(model, batch, "fp32")
    return meter.activation_bytes, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_chosen_blocks_are_checkpointed_and_the_gradients_stay_exact(modules, monkeypatch):
    pm, pc = modules
    setting = pm.ModelSetting("gpt2", "fp32", "tiny")
    model, batch = pm.build_model(setting), pm.make_batch(setting)
    hand = pc.HandCheckpointed(model, pm.block_list(model))
    calls: list[object] = []
    real = pc.checkpoint
    monkeypatch.setattr(pc, "checkpoint", lambda fn, *a, **k: calls.append(fn) or real(fn, *a, **k))
    peaks, grads = {}, {}
    for choice in ("KKK", "CKC", "CCC"):
        checkpointed = [c == "C" for c in choice]
        contender = pc.ckptplan_contender(hand, checkpointed)
        assert contender.detail == "".join("C" if c else "K" for c in checkpointed)
        contender.select()
        calls.clear()
        peaks[choice], grads[choice] = step(pm, model, batch)
        assert len(calls) == sum(checkpointed)
    assert peaks["CCC"] < peaks["CKC"] < peaks["KKK"]
    for choice in ("CKC", "CCC"):
        assert all(torch.equal(grads[choice][n], g) for n, g in grads["KKK"].items())
    hand.use("plain", 1)
    assert hand.chosen == {0}
    with pytest.raises(ValueError, match=f"{hand.n + 1} choices for {hand.n} blocks"):
        hand.use_blocks("plain", [True] * (hand.n + 1))
