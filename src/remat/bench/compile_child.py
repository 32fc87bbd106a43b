"""The ``compile_budget`` run, in a child process of its own so that the whole-process meter of
:mod:`remat.meters.process` can measure it (the live-tensor tracker does not see allocations made inside
``torch.compile``d code).

Parent side, :func:`run_child`: start ``python -m remat.bench.compile_child JOB_JSON`` with the allocator
settings the meter needs and collect its records. Child side, :func:`execute_child_job`: one training run (see
:func:`remat.bench.train.execute_run`) measured with the whole-process meter, then one eager no-checkpoint step
measured the same way as the reference; it prints one ``REMAT {json}`` line per step and one for the run.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..meters import CHILD_ENV, ProcessPeakMeter, process_meter_problem
from .childproc import child_env, emit, parse
from .controllers import CompileController
from .strategies import StrategySpec
from .train import Emit, build, execute_run, load_data


def run_child(
    job: dict[str, Any], on_record: Callable[[dict[str, Any]], None], timeout_s: float | None = None
) -> dict[str, Any]:
    """Run ``job`` in a child process with the allocator settings the meter needs (``remat.meters.CHILD_ENV``); every
    step record goes to ``on_record`` as it arrives; returns the run record (``status`` "failed" with the reason
    if it failed)."""
    env = child_env(**CHILD_ENV)
    cmd = [sys.executable, "-m", "remat.bench.compile_child", json.dumps(job)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    run: dict[str, Any] | None = None
    assert proc.stdout is not None
    for line in proc.stdout:
        record = parse(line)
        if record is None:
            continue
        if record.get("record") == "run":
            run = record
        else:
            on_record(record)
    try:
        stderr = proc.communicate(timeout=timeout_s)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        stderr = proc.communicate()[1]
    if run is None:
        tail = "\n".join((stderr or "").strip().splitlines()[-15:])
        run = {"status": "failed", "error": f"the compile child exited with code {proc.returncode}: {tail}"}
    return run


def execute_child_job(job: dict[str, Any], emit: Emit) -> dict[str, Any]:
    """The compile child's run: the run, then one eager no-checkpoint step
    measured the same way as the reference for the whole-process figures."""
    spec = StrategySpec(job["strategy"], tuple(tuple(o) for o in job["options"]))
    problem = process_meter_problem()
    meter_factory: Callable[[], Any]
    if problem is None:
        meter_factory, method = ProcessPeakMeter, ProcessPeakMeter.method
    else:
        meter_factory, method = _NullMeter, f"not measured: {problem}"
    try:
        run = execute_run(
            job,
            CompileController(spec, job["budget_fraction"]),
            emit,
            meter_factory=meter_factory,
            memory_method=method,
        )
    except Exception as err:  # reported to the parent as a failed run
        return {
            "strategy": job["label"],
            "strategy_name": job["strategy"],
            "seed": job["seed"],
            "status": "failed",
            "error": f"{type(err).__name__}: {err}",
        }
    run.pop("_info", None)
    # Whole-process bytes are not the tracker's activation bytes: no verdict against the budget from them.
    run["within_budget"] = None
    if problem is None:
        reference = _eager_reference(job)
        run["reference_none_process_bytes"] = reference
        peak = run.get("peak_activation_bytes")
        run["process_ratio_to_none"] = peak / reference if peak is not None and reference else None
    else:
        run["peak_activation_bytes"] = None
    run["memory_note"] = (
        "whole-process VmHWM growth over the step (parameter gradients included); compare with "
        "reference_none_process_bytes, one eager no-checkpoint step measured the same way"
        if problem is None
        else method
    )
    return run


class _NullMeter:
    activation_bytes = 0
    peak_bytes = 0

    def __enter__(self) -> _NullMeter:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def _eager_reference(job: dict[str, Any]) -> int:
    """Whole-process peak growth of one eager no-checkpoint step (after one unmeasured step)."""
    data = load_data(job)
    spec = build(job, data)
    optimizer = torch.optim.AdamW(spec.module.parameters(), lr=job["lr"])
    batches = data.train_batches()
    result = 0
    for i in range(2):
        batch = data.batch_kwargs(next(batches), job["device"])
        meter = ProcessPeakMeter() if i else contextlib.nullcontext()
        with meter:
            spec.loss_fn(spec.module(**batch)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i:
            result = meter.activation_bytes
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m remat.bench.compile_child JOB_JSON (started by remat bench)", file=sys.stderr)
        return 2
    job = json.loads(args[0])
    run = execute_child_job(job, emit)
    run["record"] = "run"
    emit(run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
