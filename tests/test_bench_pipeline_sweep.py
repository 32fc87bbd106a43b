"""``remat bench --sweep stage_sync=local,global``: the bench's model as a two-stage pipeline under torchrun with
a PGAC per stage, local thresholds against one threshold for the whole chain.

The default suite checks the pieces without torchrun: the bench's models cut into stages compute the model's
own loss, the sweep string and the model check, the report's rows and comparison from known records, and
``--resume`` keeping finished modes. The end-to-end run (two torchrun launches of two processes) is slow on a
CPU and runs with REMAT_SLOW_TESTS=1.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from remat.bench.checks import all_specs, validate
from remat.bench.config import BenchConfig, BenchError
from remat.bench.distributed_sections import pipeline_section
from remat.bench.pipeline_stages import bench_stages, stage_inputs, stage_loss
from remat.bench.pipeline_summary import compare_modes, keep_finished, mode_rows
from remat.bench.pipeline_sweep import micro_batches, run_stage_sync_sweep
from remat.bench.records import JsonlWriter, read_jsonl
from remat.bench.runner import main
from remat.bench.strategies import StrategyError, parse_strategies, parse_sweep


def _job(model: str) -> dict:
    return dict(
        model=model,
        preset="tiny",
        layers=4,
        dropout=None,
        tokenizer="bytes",
        dataset=None,
        max_bytes=100_000,
        seq_len=32,
        batch_size=4,
        seed=0,
        device="cpu",
    )


@pytest.mark.parametrize("model", ["gpt2", "mlp"])
def test_stages_of_a_bench_model_compute_its_own_loss_and_gradients(model: str) -> None:
    from remat.bench.train import build, load_data

    job = _job(model)
    data = load_data(job)
    spec = build(job, data)
    spec.module.eval()  # no dropout: the two computations draw no random numbers
    batch = data.batch_kwargs(next(data.train_batches()))
    reference = spec.loss_fn(spec.module(**batch))
    reference.backward()
    ref_grads = {n: p.grad.clone() for n, p in spec.module.named_parameters()}
    spec.module.zero_grad()

    stages = bench_stages(spec, 2)
    assert [len(s.blocks) for s in stages] == [2, 2]
    x, labels = stage_inputs(spec, batch)
    for stage in stages:
        x = stage(x)
    loss = stage_loss(spec)(x, labels)
    loss.backward()
    # A GPT-2 block alone attends to every position; a wrong causal mask changes the loss far more than this.
    assert abs(loss.item() - reference.item()) < 1e-5
    for name, p in spec.module.named_parameters():
        assert torch.allclose(p.grad, ref_grads[name], atol=1e-5), name


def test_stage_sync_sweep_string_and_model_checks(tmp_path: Path) -> None:
    assert parse_sweep("stage_sync=local,global") == ("stage_sync", ["local", "global"])
    with pytest.raises(StrategyError, match="stage_sync takes 'local' or 'global'"):
        parse_sweep("stage_sync=local,everywhere")
    config = BenchConfig(
        model="bert", strategies=parse_strategies("none,pgac"), sweeps=[("stage_sync", ["local", "global"])]
    )
    assert [s.label for s in all_specs(config)] == ["none", "pgac"]  # no PGAC variant for the torchrun sweep
    with pytest.raises(BenchError, match="cuts only gpt2, mlp into pipeline stages.*use --model gpt2"):
        validate(config)
    assert [micro_batches(b) for b in (8, 6, 3)] == [4, 2, 1]


def _step(mode: str, step: int, actions: list[list[str]], taus: list[float], loss: float, peaks: list[int]) -> dict:
    stages = [
        {
            "stage": p,
            "step_time_s": 0.1,
            "peak_bytes": peaks[p],
            "budget_bytes": 1000,
            "actions": a,
            "recompute_fraction": sum(x != "keep" for x in a) / len(a),
            "recompute_time_s": 0.01,
            "scores": [1.0, 2.0],
            "tau": taus[p],
        }
        for p, a in enumerate(actions)
    ]
    record = {"record": "step", "stage_sync": mode, "step": step, "warmup": step == 0, "loss": loss}
    return {**record, "step_time_s": 0.1 + 0.1 * step, "stages": stages}


K, C = "keep", "checkpoint"


def _records() -> list[dict]:
    local = [
        _step("local", 0, [[C, C], [C, K]], [1.0, 2.0], 5.0, [900, 800]),
        _step("local", 1, [[C, K], [C, K]], [1.5, 2.5], 4.0, [950, 800]),
        _step("local", 2, [[C, K], [K, C]], [1.5, 2.5], 3.0, [950, 700]),
    ]
    glob = [
        _step("global", 0, [[C, C], [C, K]], [1.7, 1.7], 5.0, [900, 800]),
        _step("global", 1, [[C, C], [C, K]], [1.7, 1.7], 4.0, [900, 1100]),
        _step("global", 2, [[C, C], [K, C]], [1.7, 1.7], 3.5, [900, 700]),
    ]
    summary = {"record": "summary", "status": "ok", "schedule": "1f1b", "micro_batches": 4, "in_flight": [2, 1]}
    return [*local, {**summary, "stage_sync": "local"}, *glob, {**summary, "stage_sync": "global"}]


def test_report_rows_and_comparison_of_the_two_modes() -> None:
    records = _records()
    rows = {(r["stage_sync"], r["stage"]): r for r in mode_rows(records)}
    assert rows["local", 0]["mask_changes"] == 1 and rows["local", 1]["mask_changes"] == 1
    assert rows["global", 0]["mask_changes"] == 0
    assert rows["global", 1]["max_peak_bytes"] == 1100 and rows["global", 1]["within_budget"] is False
    assert rows["local", 0]["within_budget"] is True and rows["local", 0]["in_flight"] == 2
    assert rows["local", 0]["recompute_fraction"] == pytest.approx((1 + 0.5 + 0.5) / 3)
    assert rows["local", 0]["final_loss"] == 3.0 and rows["global", 0]["final_loss"] == 3.5
    assert rows["local", 1]["step_ms"] == pytest.approx(250.0)  # steps 1 and 2: step 0 is warm-up
    cmp = compare_modes(records)
    assert cmp["mask_agreement_per_stage"] == pytest.approx([1 / 3, 1.0])
    assert cmp["mask_agreement"] == pytest.approx(4 / 6)
    assert cmp["loss_step0"] == [5.0, 5.0] and cmp["max_loss_diff"] == pytest.approx(0.5)
    assert cmp["steps_tau_differs"] == 3 and cmp["first_step_tau_differs"] == 0
    text = "\n".join(pipeline_section(SimpleNamespace(pipeline=records)))
    assert "stage_sync=local against stage_sync=global" in text
    assert "| global | 1 | 2 | 1 | 1000 B | 1.07 KiB | no | 700 B |" in text
    assert "same mask on 67% of (step, stage) pairs (stage 0 33%, stage 1 100%)" in text
    assert "differed on some stage after 3 of them; largest loss difference 0.5, step 0 loss 5 (local)" in text
    assert pipeline_section(SimpleNamespace(pipeline=[])) == []


def test_resume_keeps_finished_modes_and_runs_only_the_others(tmp_path: Path) -> None:
    records = _records()
    unfinished = [r for r in records if r["stage_sync"] == "global" and r["record"] == "step"]
    kept = keep_finished([r for r in records if r["stage_sync"] == "local"] + unfinished)
    assert {r["stage_sync"] for r in kept} == {"local"} and len(kept) == 4
    path = tmp_path / "pipeline.jsonl"
    writer = JsonlWriter(path)
    for r in kept:
        writer.write(r)
    writer.close()
    config = BenchConfig(model="gpt2", strategies=parse_strategies("none"))
    budget = {"fraction": 0.5, "bytes": 1}
    # "local" is finished: nothing is launched (a launch here would fail: no torchrun job can start from it)
    assert run_stage_sync_sweep(config, 4, budget, ["local"], path, tmp_path) == []
    assert read_jsonl(path) == kept


SLOW = pytest.mark.skipif(
    not os.environ.get("REMAT_SLOW_TESTS"),
    reason="two torchrun launches of two processes: about a minute on a CPU; set REMAT_SLOW_TESTS=1 to run",
)
ARGS = ["--model", "gpt2", "--steps", "5", "--warmup", "1", "--seeds", "1", "--strategies", "none"]
ARGS += ["--max-bytes", "200000", "--seq-len", "32", "--batch-size", "8", "--budget", "0.6", "--threads", "1"]
ARGS += ["--profile-repeats", "1", "--eval-batches", "1", "--no-progress", "--sweep", "stage_sync=local,global"]


@pytest.mark.slow
@SLOW
def test_stage_sync_sweep_runs_a_two_stage_pipeline_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "pipe"
    assert main([*ARGS, "--out", str(out)]) == 0
    records = read_jsonl(out / "pipeline.jsonl")
    summaries = {r["stage_sync"]: r for r in records if r["record"] == "summary"}
    assert set(summaries) == {"local", "global"}
    assert all(s["status"] == "ok" and s["stages"] == 2 and s["in_flight"] == [2, 1] for s in summaries.values())
    steps = {m: [r for r in records if r["record"] == "step" and r["stage_sync"] == m] for m in summaries}
    for mode, rows in steps.items():
        assert [r["step"] for r in rows] == list(range(5))
        for r in rows:
            for s in r["stages"]:
                assert 0 < s["peak_bytes"] <= s["budget_bytes"], (mode, r["step"], s)
                assert 0.0 <= s["recompute_fraction"] <= 1.0 and len(s["actions"]) == 3
    assert steps["local"][0]["loss"] == steps["global"][0]["loss"]  # same weights, batch and dropout
    assert all(r["stages"][0]["tau"] == r["stages"][1]["tau"] for r in steps["global"])  # one chain threshold
    assert any(r["stages"][0]["tau"] != r["stages"][1]["tau"] for r in steps["local"])  # each stage's own
    assert "stage_sync=local against stage_sync=global" in (out / "report.md").read_text()

    # --resume keeps both finished modes: nothing runs again
    assert main([*ARGS, "--out", str(out), "--resume"]) == 0
    assert read_jsonl(out / "pipeline.jsonl") == records
