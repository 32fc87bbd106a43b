"""The ``remat`` command checks its arguments before building a model: a bad value exits with code 2 and a
message naming the argument and what to give instead, never a traceback, and nothing is computed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from remat.cli.commands import main
from remat.profiling import transformer_layer_activation_bytes

SRC = str(Path(__file__).resolve().parents[1] / "src")


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["plan", "--model", "mlp", "--dtype", "foo"], "argument --dtype: invalid choice: 'foo'"),
        (["plan", "--model", "mlp", "--dtype", "int64"], "argument --dtype: invalid choice: 'int64'"),
        (["profile", "--model", "mlp", "--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
        (["profile", "--model", "gpt2", "--seq-len", "0"], "argument --seq-len: must be at least 1, got 0"),
        (["profile", "--model", "gpt2", "--layers", "0"], "argument --layers: must be at least 1, got 0"),
        (["profile", "--model", "gpt2", "--layers", "-1"], "argument --layers: must be at least 1, got -1"),
        (["profile", "--model", "gpt2", "--layers", "two"], "argument --layers: expected a whole number"),
        (["profile", "--model", "gpt2", "--heads", "0"], "argument --heads: must be at least 1"),
        (["estimate", "--layers", "0"], "argument --layers: must be at least 1, got 0"),
        (["estimate", "--seq-len", "-4"], "argument --seq-len: must be at least 1"),
        (["estimate", "--dtype", "int8"], "argument --dtype: invalid choice"),
        (["estimate", "--hidden", "30", "--heads", "4"], "--hidden 30 is not divisible by --heads 4"),
        (["plan", "--model", "mlp", "--budget", "1.5"], "argument --budget: budget '1.5' is neither bytes nor"),
        (["plan", "--model", "mlp", "--budget", "nan"], "argument --budget: budget 'nan' is not a finite number"),
        (["plan", "--model", "mlp", "--budget", "inf"], "argument --budget: budget 'inf' is not a finite number"),
        (["plan", "--model", "mlp", "--budget", "0"], "argument --budget: a budget of '0' leaves no room"),
        (["plan", "--model", "mlp", "--budget", "150%"], "argument --budget: budget '150%'"),
        (["plan", "--model", "mlp"], "strategy 'optimal' needs --budget"),
        (["plan", "--model", "mlp", "--strategy", "every_k", "-k", "0"], "argument -k: must be at least 1"),
        (["plan", "--model", "mlp", "--strategy", "random", "--fraction", "2"], "argument --fraction: must be in"),
        (["plan", "--model", "resnet", "--budget", "0.5"], "unknown model 'resnet'"),
        (["plan", "--model", "mlp", "--preset", "huge", "--budget", "0.5"], "unknown preset 'huge'"),
        (["plan", "--model", "mlp", "--device", "tpu"], "argument --device: unknown device 'tpu'"),
        (["advise", "--model", "mlp", "--device-memory", "0.5"], "argument --device-memory: '0.5' is zero bytes"),
        (["advise", "--model", "mlp", "--device-memory", "lots"], "argument --device-memory: cannot read 'lots'"),
    ],
)
def test_bad_arguments_exit_2_with_the_cause_before_any_work(argv, words, capsys):
    code, out, err = run(argv, capsys)
    assert code == 2
    assert words in err, err
    assert "Traceback" not in err and out == ""  # nothing was built, profiled or printed


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused_early(capsys):
    code, out, err = run(["profile", "--model", "mlp", "--device", "cuda"], capsys)
    assert code == 2 and "no CUDA device is available on this machine" in err and "--device cpu" in err


@pytest.mark.parametrize(("dtype", "size"), [("float64", 8), ("float32", 4), ("bfloat16", 2), ("float16", 2)])
def test_estimate_counts_the_bytes_of_its_dtype(dtype, size, tmp_path, capsys):
    out = tmp_path / "e.json"
    args = ["estimate", "--seq-len", "64", "--batch-size", "2", "--hidden", "128", "--heads", "4", "--layers", "3"]
    assert main([*args, "--dtype", dtype, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["per_layer_bytes"] == transformer_layer_activation_bytes(64, 2, 128, 4, bytes_per_element=size)
    assert data["total_bytes"] == 3 * data["per_layer_bytes"]


def test_an_unwritable_json_path_fails_before_profiling(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, out, err = run(["profile", "--model", "mlp", "--json", str(blocker / "costs.json")], capsys)
    assert code == 2 and f"{blocker} is a file, not a folder" in err and out == ""
    code, out, err = run(["estimate", "--json", str(tmp_path)], capsys)
    assert code == 2 and "is a folder; give a file path" in err and out == ""
    assert blocker.read_text() == "not a folder"


def test_a_json_path_in_new_folders_is_accepted_and_nothing_is_left_on_failure(tmp_path, capsys):
    target = tmp_path / "new" / "deeper" / "plan.json"
    code, _, err = run(["plan", "--model", "mlp", "--budget", "nan", "--json", str(target)], capsys)
    assert code == 2 and not (tmp_path / "new").exists()
    assert main(["estimate", "--json", str(target)]) == 0 and json.loads(target.read_text())["layers"] == 24


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_a_read_only_folder_is_refused(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code, _, err = run(["estimate", "--json", str(locked / "e.json")], capsys)
    finally:
        locked.chmod(0o700)
    assert code == 2 and "cannot write in" in err


def test_bench_out_is_checked_before_any_training(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, out, err = run(["bench", "--model", "mlp", "--steps", "2", "--out", str(blocker / "results")], capsys)
    assert code == 2 and "is a file, not a folder" in err and out == ""
    code, out, err = run(["bench", "--model", "mlp", "--steps", "2", "--out", str(blocker)], capsys)
    assert code == 2 and "exists and is not a folder" in err


def test_help_exits_0(capsys):
    code, out, _ = run(["plan", "--help"], capsys)
    assert code == 0 and "--budget" in out and "50%" in out


def test_the_installed_command_prints_no_traceback():
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run(
        [sys.executable, "-m", "remat.cli.commands", "plan", "--model", "mlp", "--budget", "nan"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "not a finite number" in done.stderr and "Traceback" not in done.stderr
