"""Per-stage activation memory for pipeline, tensor and data parallel splits (``remat.profiling.estimate.parallel``) and
``remat plan`` / ``remat advise`` with ``--stages``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from toy_models import uniform_costs

from remat.cli.commands import main
from remat.planning import no_checkpoint_peak, simulate
from remat.profiling import LayerShape, estimate_stages, shard_costs, transformer_layer_activation_bytes


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tensor_and_sequence_parallel_layer_formulas(t):
    s, b, h, a = 2048, 2, 4096, 32
    sbh = s * b * h
    tp = transformer_layer_activation_bytes(s, b, h, a, tensor_parallel=t)
    assert tp == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    sp = transformer_layer_activation_bytes(s, b, h, a, tensor_parallel=t, sequence_parallel=True)
    assert sp == sbh * (34 / t + 5 * a * s / (h * t))
    with pytest.raises(ValueError, match="tensor_parallel must be a positive integer"):
        transformer_layer_activation_bytes(s, b, h, a, tensor_parallel=0)


def test_stage_bytes_count_micro_batches_in_flight():
    costs = uniform_costs([f"h.{i}" for i in range(8)])
    one = estimate_stages(costs, stages=4, schedule="1f1b", n_microbatches=8)
    assert [s.in_flight for s in one] == [4, 3, 2, 1]
    assert [(s.start, s.end) for s in one] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert all(s.stage_bytes == s.in_flight * s.micro_batch_bytes for s in one)
    gpipe = estimate_stages(costs, stages=4, schedule="gpipe", n_microbatches=8)
    assert [s.in_flight for s in gpipe] == [8] * 4
    assert gpipe[1].stage_bytes == 8 * one[1].micro_batch_bytes


def test_stage_plans_fit_their_share_and_a_small_budget_is_reported():
    costs = uniform_costs([f"h.{i}" for i in range(8)])
    stages = estimate_stages(costs, stages=2, schedule="1f1b", n_microbatches=4, budget=0.5)
    for s in stages:
        assert s.plan is not None and s.error is None
        assert s.planned_stage_bytes <= s.budget_bytes <= s.stage_bytes // 2 + 1
        assert any(a != "keep" for a in s.plan.actions.values())
    tiny = estimate_stages(costs, stages=2, schedule="1f1b", n_microbatches=4, budget=10)
    assert all(s.plan is None and "no plan fits" in s.error for s in tiny)


def test_shard_costs_scale_block_bytes_by_the_formula_ratio():
    costs = uniform_costs([f"h.{i}" for i in range(4)], keep=10_000, io=1000, temp=500)
    shape = LayerShape(seq=1024, micro_batch=1, hidden=1024, heads=16)
    sp = shard_costs(costs, shape, 4, sequence_parallel=True)
    assert sp.blocks[0].saved("keep") == 2500 and sp.blocks[0].input_bytes == 250 and sp.stem_bytes == 250
    tp = shard_costs(costs, shape, 4, sequence_parallel=False)
    ratio = shape.layer_bytes(4) / shape.layer_bytes(1)
    assert tp.blocks[0].saved("keep") == round(10_000 * ratio) and tp.blocks[0].input_bytes == 1000
    assert no_checkpoint_peak(sp) < no_checkpoint_peak(tp) < no_checkpoint_peak(costs)
    assert shard_costs(costs, shape, 1, sequence_parallel=False) is costs


def test_shard_costs_divide_every_block_second_overheads_included():
    costs = uniform_costs([f"h.{i}" for i in range(4)])
    costs.blocks = [replace(b, overhead_s={"checkpoint": 2e-3}) for b in costs.blocks]
    shape = LayerShape(seq=1024, micro_batch=1, hidden=1024, heads=16)
    actions = ["checkpoint", "keep", "checkpoint", "checkpoint"]
    whole, sharded = simulate(costs, actions), simulate(shard_costs(costs, shape, 4, sequence_parallel=False), actions)
    assert whole.overhead_s == pytest.approx(3 * 2e-3)
    assert sharded.time_cost_s == pytest.approx(whole.time_cost_s / 4)
    assert sharded.step_s == pytest.approx(whole.step_s / 4)


def test_cli_plan_prints_a_row_and_a_plan_per_stage_on_meta(tmp_path, capsys):
    out = tmp_path / "stages.json"
    args = ["plan", "--device", "meta", "--model", "gpt2", "--layers", "4", "--hidden", "64", "--heads", "4"]
    args += ["--seq-len", "32", "--stages", "2", "--micro-batch", "2", "--budget", "0.99", "--tp", "2"]
    assert main([*args, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 stages, 1f1b, 4 micro-batches of 2, tp 2" in text
    assert "stage 0 plan:" in text and "stage 1 plan:" in text
    stages = json.loads(out.read_text())["stages"]
    assert [s["in_flight"] for s in stages] == [2, 1]
    assert [s["blocks"] for s in stages] == [[0, 2], [2, 4]]
    for s in stages:
        assert s["stage_bytes"] == s["in_flight"] * s["micro_batch_bytes"]
        assert s["planned_stage_bytes"] <= s["budget_bytes"]


def test_cli_advise_per_stage_with_fsdp(capsys):
    args = ["advise", "--device", "meta", "--model", "gpt2", "--layers", "4", "--hidden", "64", "--heads", "4"]
    args += ["--seq-len", "32", "--stages", "2", "--schedule", "gpipe", "--dp", "4", "--fsdp"]
    assert main([*args, "--device-memory", "1GiB"]) == 0
    text = capsys.readouterr().out
    assert "stage 0: fits without checkpointing" in text and "dp 4" in text
    assert main([*args, "--device-memory", "2MiB"]) == 0
    assert "does not fit" in capsys.readouterr().out


def test_cli_tp_must_divide_heads(capsys):
    args = ["plan", "--device", "meta", "--model", "gpt2", "--layers", "2", "--hidden", "64", "--heads", "4"]
    assert main([*args, "--stages", "2", "--tp", "3", "--budget", "0.5"]) == 2
    assert "--tp 3 must divide the 4 attention heads" in capsys.readouterr().err
