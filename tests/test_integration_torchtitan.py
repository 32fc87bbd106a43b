"""torchtitan's ``RematAC`` mode: the plan estimated on the ``meta`` model torchtitan builds, read from a saved plan or
cost table, installed by torchtitan's own ``parallelize_llama`` before ``fully_shard`` (eager) or inside the blocks
torchtitan compiles; gradients bitwise those of no checkpointing over two SGD steps, the activation peak within the
budget and within 5% of the prediction, next to torchtitan's ``FullAC`` and ``SelectiveAC``.

The runs through ``parallelize_llama`` happen in a child process (``python -m benchmarks.torchtitan --check``): a
gloo group, torchtitan's device mesh put on the CPU (it names ``"cuda"`` when it finds no accelerator), and
torchtitan's import-time changes to ``torch.compile``'s settings stay out of this process. Skipped, with the reason,
where torchtitan does not install or import (it needs ``triton``, ``tyro`` and ``spmd_types``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import remat

try:
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    from benchmarks.torchtitan import llama3_debug
    from remat.integrations.torchtitan import COSTS_FILE, PLAN_FILE, RematAC, remat_ac
except Exception as err:  # ImportError, or its own errors where a dependency is missing
    pytest.skip(f"torchtitan cannot be imported here ({type(err).__name__}: {err})", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]


def check(*options: str) -> dict[str, Any]:
    """One ``benchmarks.torchtitan --check`` run in a child process: its JSON record."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.torchtitan", "--check", *options], cwd=ROOT,
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def rows(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["contender"]: row for row in record["rows"]}


def meta_model() -> torch.nn.Module:
    with torch.device("meta"):
        return llama3_debug().build()


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_rematac_through_torchtitan_is_exact_within_the_budget_and_the_prediction(precision: str) -> None:
    record = check("--precision", precision)
    by_name = rows(record)
    assert all(row["bitwise"] for row in record["rows"]), record["rows"]  # FullAC and SelectiveAC too
    mine = by_name["remat RematAC"]
    assert mine["peak_bytes"] <= record["budget_bytes"] * 1.02
    assert abs(record["predicted_peak_bytes"] - mine["peak_bytes"]) <= 0.05 * mine["peak_bytes"]
    # The budget is half the estimate's no-checkpoint activations: the estimate of those within 5% as well.
    assert abs(2 * record["budget_bytes"] - record["plain_peak_bytes"]) <= 0.05 * record["plain_peak_bytes"]
    assert set(record["plan"]) == {f"layers.{i}" for i in range(6)}
    assert mine["peak_bytes"] < by_name["no checkpointing"]["peak_bytes"]


def test_rematac_runs_inside_the_blocks_torchtitan_compiles() -> None:
    record = check("--compile", "--backend", "aot_eager")
    by_name = rows(record)
    assert all(row["bitwise"] for row in record["rows"]), record["rows"]
    plain, mine = by_name["no checkpointing"]["peak_bytes"], by_name["remat RematAC"]["peak_bytes"]
    assert mine <= record["budget_bytes"]  # what the compiled graphs save, within the eager plan's budget
    assert mine < 0.6 * plain
    assert by_name["torchtitan FullAC"]["peak_bytes"] < mine  # checkpoint regions recompute inside the graphs


def test_rematac_under_fully_shard_over_two_ranks_is_exact() -> None:
    record = check("--ranks", "2")
    by_name = rows(record)
    assert all(row["bitwise"] for row in record["rows"]), record["rows"]  # full gradients, two SGD steps
    mine = by_name["remat RematAC"]
    assert mine["peak_bytes"] < 0.6 * by_name["no checkpointing"]["peak_bytes"]
    # The estimate counts activations; fully_shard's all-gathered parameters come on top, at most one block's
    # whole parameters at a time (the debug model's blocks hold 851,968 float32 parameters).
    assert mine["predicted_peak_bytes"] <= mine["peak_bytes"] <= mine["predicted_peak_bytes"] + 851_968 * 4


def test_remat_ac_reads_the_trainer_config() -> None:
    trainer = types.SimpleNamespace(
        training=TrainingConfig(local_batch_size=6, seq_len=512, mixed_precision_param="bfloat16"),
        parallelism=ParallelismConfig(),
        compile=CompileConfig(),
    )
    mode = remat_ac(trainer, 0.4, strategy="optimal")
    assert (mode.activations, mode.batch_size, mode.seq_len, mode.dtype, mode.compiled) == (
        "0.4", 6, 512, "bfloat16", False)  # fmt: skip
    trainer.compile = CompileConfig(enable=True, components=["model", "loss"])
    trainer.parallelism = ParallelismConfig(pipeline_parallel_degree=2, pipeline_parallel_microbatch_size=2)
    mode = remat_ac(trainer, "3GiB")
    assert (mode.activations, mode.batch_size, mode.compiled) == ("3GiB", 2, True)


def test_the_estimate_writes_its_plan_and_table_and_they_are_applied_again(tmp_path: Path) -> None:
    config = RematAC.Config(activations="0.5", batch_size=2, seq_len=64, dtype="float32")
    first = config.build(dump_folder=str(tmp_path))
    first.apply(meta_model())
    plan = remat.Plan.from_json((tmp_path / PLAN_FILE).read_text())
    assert plan.fits and plan.actions == first.handle.plan.actions
    assert first.costs.info["attention"] == "fused"

    again = RematAC.Config(plan=str(tmp_path / PLAN_FILE)).build()
    model = meta_model()
    again.apply(model)
    assert model._remat_handle.plan.actions == plan.actions

    from_table = RematAC.Config(costs=str(tmp_path / COSTS_FILE), activations="0.5").build()
    from_table.apply(meta_model())
    assert from_table.handle.plan.actions == plan.actions
    assert from_table.handle.plan.budget_bytes == plan.budget_bytes


def test_flex_attention_models_are_estimated_and_keep_their_attention() -> None:
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.llama3 import model_registry

    with torch.device("meta"):
        model = model_registry("debugmodel").model.build()  # flex attention, as torchtitan trains it
    mode = RematAC.Config(activations="0.5", batch_size=2, seq_len=128).build()
    mode.apply(model)
    assert mode.handle.plan.fits and mode.costs.info["attention"] == "fused"
    assert all(isinstance(block.attention.inner_attention, FlexAttention) for block in model.layers.children())
    # flex's estimate is SDPA's fused kernel: the same bytes as the SDPA model's
    sdpa = RematAC.Config(activations="0.5", batch_size=2, seq_len=128).build()
    sdpa.apply(meta_model())
    assert [b.saved_bytes for b in mode.costs.blocks] == [b.saved_bytes for b in sdpa.costs.blocks]


def test_the_estimate_needs_the_batch_and_a_meta_model() -> None:
    with pytest.raises(ValueError, match="give batch_size and seq_len"):
        RematAC.Config(activations="0.5").build().apply(meta_model())
    real = llama3_debug().build()
    with pytest.raises(ValueError, match="this model has real weights: measure it with remat.profile"):
        RematAC.Config(batch_size=2, seq_len=64).build().apply(real)


def test_compiled_blocks_take_whole_block_actions_only(tmp_path: Path) -> None:
    path = tmp_path / "offload.json"
    path.write_text(remat.Plan({f"layers.{i}": "offload" if i == 2 else "keep" for i in range(6)}).to_json())
    with pytest.raises(ValueError, match=r"layers.2: 'offload' cannot run inside torchtitan's compiled blocks"):
        RematAC.Config(plan=str(path), compiled=True).build().apply(meta_model())


def test_compiled_blocks_under_the_eager_route_say_what_to_set() -> None:
    model = meta_model()
    RematAC.Config(activations="0.5", batch_size=2, seq_len=32, dtype="float32").build().apply(model)
    for block in model.layers.children():  # what torchtitan's apply_compile does after the mode
        block.compile(backend="eager", fullgraph=True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    with pytest.raises(RuntimeError, match=r"give RematAC.Config\(compiled=True\)"):
        model(torch.randint(0, 2048, (2, 32)))


def test_layers_wrapped_by_torchtitans_own_mode_are_refused() -> None:
    from torchtitan.distributed.activation_checkpoint import FullAC

    model = meta_model()
    FullAC.Config().build().apply(model)
    with pytest.raises(RuntimeError, match=r"block 'layers.0' is recomputed already by .*checkpoint_wrapper"):
        RematAC.Config(activations="0.5", batch_size=2, seq_len=32, dtype="float32").build().apply(model)


def test_pipeline_stages_are_estimated_from_what_each_holds() -> None:
    from torchtitan.distributed.pipeline_parallel import _split_module  # how torchtitan cuts its stages

    whole = meta_model()
    stages = [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3"], ["layers.4", "layers.5", "norm",
              "lm_head"]]  # fmt: skip
    whole_costs = RematAC.Config(activations="1.0", batch_size=2, seq_len=64, dtype="float32").build()
    whole_costs.apply(meta_model())
    for names in stages:
        stage = _split_module(whole, names)
        mode = RematAC.Config(activations="0.8", batch_size=2, seq_len=64, dtype="float32").build()
        mode.apply(stage)  # the first stage takes tokens, the others hidden states; only the last has the head
        assert mode.handle.plan.fits
        assert set(mode.handle.plan.actions) == {name for name in names if name.startswith("layers.")}
        for block in mode.costs.blocks:  # each layer costs what it costs in the whole model
            assert block.saved_bytes == whole_costs.costs.blocks[whole_costs.costs.index(block.fqn)].saved_bytes
