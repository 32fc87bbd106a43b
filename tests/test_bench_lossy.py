"""The lossy strategies in ``remat bench``: ``compress``, ``optimal_lossy`` and ``pgac_q`` run beside exact ones
on the residual MLP (MNIST), are labelled lossy in the report, get claims rows (memory at fixed step time,
convergence gap), and resume like every other strategy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from remat.bench.records import read_jsonl
from remat.bench.runner import main
from remat.core import CostTable

LOSSY = ["compress", "optimal_lossy", "pgac_q"]
ARGS = [
    "--model", "mlp", "--steps", "4", "--warmup", "1", "--seeds", "2",
    "--strategies", ",".join(["none", "optimal", *LOSSY]), "--budget", "0.5", "--eval-batches", "2",
    "--threads", "1", "--profile-repeats", "1", "--no-progress",
]  # fmt: skip


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench_lossy")
    assert main([*ARGS, "--out", str(out)]) == 0
    return out


def test_lossy_strategies_run_compressed_and_are_labelled(bench: Path) -> None:
    runs = {(r["strategy"], r["seed"]): r for r in read_jsonl(bench / "runs.jsonl")}
    assert all(r["status"] == "ok" for r in runs.values()) and len(runs) == 10
    costs = CostTable.from_json((bench / "costs" / "seed0.json").read_text())
    assert all("compress:int8" in row.grad_error for row in costs.blocks)  # profiled for the lossy strategies
    assert set(runs["compress", 0]["plan"].values()) == {"compress:int8"}
    assert not any(a.startswith("compress:") for a in runs["optimal", 0]["plan"].values())  # exact stays exact
    steps = read_jsonl(bench / "steps.jsonl")
    assert any(s.get("compressed_blocks") for s in steps if s["strategy"] == "pgac_q" and s["step"] > 0)
    report = (bench / "report.md").read_text()
    for name in LOSSY:
        assert f"| {name} (lossy) |" in report
        assert f"Memory at fixed step time: `{name}` (lossy)" in report
        assert f"Convergence gap: `{name}` (lossy) vs exact training" in report
    summary = json.loads((bench / "summary.json").read_text())
    exactness = summary["exactness"]
    assert exactness["optimal"]["max_abs_diff"] == 0.0
    assert exactness["compress"]["verdict"] == "differs (lossy: compressed activations)"
    assert not exactness["compress"]["exact_strategy"]


def test_resume_reruns_only_the_missing_lossy_run(bench: Path, tmp_path: Path) -> None:
    out = tmp_path / "resumed"
    shutil.copytree(bench, out)
    runs = read_jsonl(out / "runs.jsonl")
    kept = [r for r in runs if (r["strategy"], r["seed"]) != ("pgac_q", 1)]
    (out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    steps = read_jsonl(out / "steps.jsonl")
    (out / "steps.jsonl").write_text(
        "".join(json.dumps(s) + "\n" for s in steps if (s["strategy"], s["seed"]) != ("pgac_q", 1))
    )
    costs_before = (out / "costs" / "seed1.json").read_text()
    assert main([*ARGS, "--out", str(out), "--resume"]) == 0
    after = read_jsonl(out / "runs.jsonl")
    assert sorted((r["strategy"], r["seed"]) for r in after) == sorted((r["strategy"], r["seed"]) for r in runs)
    assert (out / "costs" / "seed1.json").read_text() == costs_before  # the lossy profile was reused


@pytest.mark.parametrize(
    ("strategies", "message"),
    [("none,compress:format=int4", "compress:format: unknown compression format 'int4'"),
     ("none,pgac_q:rank=loud", "pgac_q:rank must be 'score' or 'error'"),
     ("none,pgac_q:q=3", "pgac_q:q is the quantile")],
)  # fmt: skip
def test_bad_lossy_options_fail_before_training(
    strategies: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    args = list(ARGS)
    args[args.index("--strategies") + 1] = strategies
    assert main([*args, "--out", str(tmp_path / "bad")]) == 2
    assert message in capsys.readouterr().err
