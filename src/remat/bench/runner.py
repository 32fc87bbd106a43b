"""``remat bench``: train one model under every strategy at the same memory budget and record what happened.

The loop, in order:

1. check everything that can be checked without training (model, strategies, sweeps, data packages, budget
   syntax, output folder) and fail with a message that says what to do;
2. per seed, build the model and ``remat.profile`` it once on that seed's first training batch (saved in
   ``costs/``); resolve the budget (a fraction is of the no-checkpoint activation peak predicted from seed 0's
   profile) and fail if no plan can reach it -- all before any training step;
3. per seed, per strategy: build the model from the seed, train ``--steps`` steps with AdamW on the same
   batches and dropout stream, one JSON line per step to ``steps.jsonl`` (flushed as it goes), evaluate on a
   fixed validation set, and append one line to ``runs.jsonl``;
4. run the distributed ``sync`` ablation and the pipeline ``stage_sync`` ablation if asked (``torchrun``
   subprocesses, :mod:`remat.bench.ddp_sweep`, :mod:`remat.bench.pipeline_sweep`);
5. write ``summary.csv``, ``report.md`` and the plots (:mod:`remat.bench.report`).

Memory is measured with the live-tensor tracker (``remat.measure``) on dedicated steps only -- the first step
after warm-up and the last step (plus every ``--measure-every`` steps) -- because the tracker slows the step;
those steps are left out of every timing figure. ``compile_budget`` runs in a child process and is measured
by the whole-process high-water mark (:mod:`remat.meters.process`, :mod:`remat.bench.compile_child`).

``--resume`` keeps finished (strategy, seed) runs, drops the steps of unfinished ones and runs them again (the
same for the modes of the pipeline sweep; the DDP sweep runs again whole). The runner describes the machine
for every figure (:func:`environment`) and tells the person watching what runs (:class:`ProgressLog`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..core import COMPRESS, Action, CostTable, profile_summary
from .budget import parse_budget, resolve_bench_budget
from .checks import all_specs, resolve_layers, validate
from .compile_child import run_child
from .config import BenchConfig, BenchError, add_arguments, config_from_args
from .controllers import make_controller
from .ddp_sweep import run_sync_sweep
from .output_folder import check_out, prepare_out
from .pipeline_sweep import run_stage_sync_sweep
from .records import JsonlWriter, json_default, read_jsonl, safe_name
from .report import build_report
from .strategies import StrategySpec, lossy_formats
from .train import execute_run, profile_clock, profile_costs

# The `remat` command builds `remat bench` from these two: add_arguments, then run_from_args.
# ----------------------------------------------------------------------------------------------------
# The machine a bench runs on: described in words for every figure and report, its load average, and the default
# number of intra-op threads.


def default_threads() -> int:
    """Intra-op threads when ``--threads`` is 0: half the cores."""
    return max(1, (os.cpu_count() or 2) // 2)


def environment(device: str) -> dict[str, Any]:
    """The machine, in words, for every figure and report."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    env: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    with contextlib.suppress(ImportError):
        import transformers

        env["transformers"] = transformers.__version__
    gpu = f"{env['gpu']}, " if "gpu" in env else ""
    env["machine"] = f"{gpu}{cpu} ({env['cores']} cores), torch {torch.__version__}"
    return env


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, or None where the system has none."""
    try:
        return list(os.getloadavg())
    except OSError:
        return None


# ----------------------------------------------------------------------------------------------------
# What ``remat bench`` tells the person watching it: notes on stderr and a tqdm progress bar over the training
# steps, or nothing at all with ``--no-progress``.


class ProgressLog:
    """Notes to stderr and the tqdm progress bar (a silent stand-in with --no-progress)."""

    def __init__(self, progress: bool) -> None:
        self.progress = progress

    def note(self, text: str) -> None:
        if self.progress:
            print(f"remat bench: {text}", file=sys.stderr, flush=True)

    def bar(self, total: int) -> Any:
        if self.progress:
            from tqdm import tqdm

            return tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True)
        return SilentBar()


class SilentBar:
    """The progress bar's interface, doing nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, text: str) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


__all__ = ["add_arguments", "main", "run_bench", "run_from_args"]


def run_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Entry point of ``remat bench`` (the ``remat`` CLI parses, this runs). Returns the exit code.
    ``argv``, when given, is the command line recorded in the report."""
    try:
        config = config_from_args(args, argv)
        result = run_bench(config)
    except BenchError as err:
        print(f"remat bench: error: {err}", file=sys.stderr)
        return 2
    failed = [r for r in result["runs"] if r.get("status") != "ok"]
    return 1 if failed and config.fail_fast else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m remat.bench [options]``."""
    parser = argparse.ArgumentParser(prog="remat bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_from_args(args, None if argv is None else list(argv))


def job_for(
    config: BenchConfig, spec: StrategySpec, seed: int, layers: int | None, budget: dict[str, Any]
) -> dict[str, Any]:
    """Everything one run needs, JSON-safe (the compile child receives it on its command line)."""
    return {
        **config.run_fields(layers, seed),
        "measure_steps": measure_steps(config),
        "eval_batches": config.eval_batches,
        "threads": config.threads or default_threads(),
        "device": config.device,
        "strategy": spec.name,
        "options": [list(o) for o in spec.options],
        "label": spec.label,
        "budget_bytes": budget["bytes"],
        "budget_fraction": budget["fraction"],
    }


def measure_steps(config: BenchConfig) -> list[int]:
    """Steps whose memory is measured (and whose time is therefore not used); with dynamic padding, every step."""
    if config.dynamic_padding:
        return list(range(config.steps))
    steps = {config.warmup, config.steps - 1}
    if config.measure_every:
        steps |= set(range(config.warmup, config.steps, config.measure_every))
    return sorted(steps)


def run_bench(config: BenchConfig) -> dict[str, Any]:
    """Run the whole experiment; returns the summary (also written to the results folder)."""
    data_info = validate(config)
    budget_spec = parse_budget(config.budget)
    layers = resolve_layers(config)
    specs = all_specs(config)
    resuming = check_out(config)
    out = config.out
    env = environment(config.device)
    threads = config.threads or default_threads()
    torch.set_num_threads(threads)
    log = ProgressLog(config.progress)
    if data_info.get("tokenizer_note"):
        log.note(data_info["tokenizer_note"])

    # Profiles first (one per seed): the budget and its feasibility are settled before any training, and
    # before anything in the results folder changes.
    costs_by_seed: dict[int, CostTable] = {}
    facts: dict[str, Any] = {}
    probe = job_for(config, specs[0], 0, layers, {"bytes": 0, "fraction": 0.0})
    lossy = lossy_formats(specs)
    for seed in range(config.seeds):
        path = out / "costs" / f"seed{seed}.json"
        if resuming and path.exists():
            saved = CostTable.from_json(path.read_text())
            clock = profile_clock(probe).__name__
            profiled = all(Action(COMPRESS, f).text in saved.common_actions() for f in lossy)
            if profiled and saved.info.get("clock") == clock:
                costs_by_seed[seed] = saved
                continue
            log.note(
                f"the saved profile of seed {seed} lacks the compression formats {lossy} or was read on "
                f"another clock than {clock}: profiling again"
            )
        log.note(f"profiling {config.model}-{config.preset} seed {seed} ...")
        started = time.perf_counter()
        costs, found = profile_costs({**probe, "seed": seed}, config.profile_repeats, lossy)
        costs.info["profile_job_s"] = time.perf_counter() - started  # model and data built, then profiled
        log.note(f"profiled in {profile_summary(costs)}")
        costs_by_seed[seed] = costs
        facts = facts or found
    budget = resolve_bench_budget(budget_spec, costs_by_seed)
    finished = prepare_out(config, resuming)
    for seed, costs in costs_by_seed.items():
        (out / "costs" / f"seed{seed}.json").write_text(costs.to_json())

    config_path = out / "config.json"
    old_config = json.loads(config_path.read_text()) if config.resume and config_path.exists() else {}
    commands = old_config.get("commands", []) + [config.command]
    record = {
        "settings": config.settings(),
        "threads": threads,
        "layers_built": layers,
        "environment": env,
        "commands": commands,
        "budget": budget,
        "data": data_info,
        "facts": facts or old_config.get("facts", {}),
        "all_strategies": [s.label for s in specs],
        "measure_steps": measure_steps(config),
        "load_average": {"start": loadavg(), "end": None},
    }
    (out / "config.json").write_text(json.dumps(record, indent=2, default=json_default))

    # The order alternates between seeds, so a slow drift of the machine's load favours no position.
    pending = [
        (spec, seed)
        for seed in range(config.seeds)
        for spec in (specs if seed % 2 == 0 else specs[::-1])
        if (spec.label, seed) not in finished
    ]
    if finished:
        log.note(f"resuming: {len(finished)} finished run(s) kept, {len(pending)} to run")
    steps_writer = JsonlWriter(out / "steps.jsonl")
    runs_writer = JsonlWriter(out / "runs.jsonl")
    bar = log.bar(total=len(pending) * config.steps)
    try:
        for spec, seed in pending:
            job = job_for(config, spec, seed, layers, budget)
            bar.set_postfix(loss="-", refresh=False)  # not the previous run's loss on this run's first step
            bar.set_description(f"{spec.label} seed {seed}")
            run = run_one(job, spec, costs_by_seed[seed], steps_writer, bar, out, config)
            runs_writer.write(run)
            if run["status"] != "ok":
                log.note(f"run {spec.label} seed {seed} failed: {run.get('error')}")
                if config.fail_fast:
                    break
    finally:
        bar.close()
        steps_writer.close()
        runs_writer.close()

    sync_sweep = [values for key, values in config.sweeps if key == "sync"]
    if sync_sweep:
        log.note("sync ablation: torchrun --nproc_per_node 2 (gloo) ...")
        run_sync_sweep(config, layers, budget, sync_sweep[0], out / "ddp.jsonl", out / "costs" / "seed0.json")
    stage_sweep = [values for key, values in config.sweeps if key == "stage_sync"]
    if stage_sweep:
        log.note("pipeline threshold ablation: torchrun --nproc_per_node 2 (gloo), two stages, 1F1B ...")
        run_stage_sync_sweep(config, layers, budget, stage_sweep[0], out / "pipeline.jsonl", out / "costs")

    record["load_average"]["end"] = loadavg()
    (out / "config.json").write_text(json.dumps(record, indent=2, default=json_default))
    summary: dict[str, Any] = {"runs": read_jsonl(out / "runs.jsonl")}
    if config.report:
        summary = build_report(out)
        summary["runs"] = read_jsonl(out / "runs.jsonl")
        log.note(f"report: {out / 'report.md'}")
    if config.json_path is not None:
        config.json_path.parent.mkdir(parents=True, exist_ok=True)
        config.json_path.write_text(json.dumps(summary, indent=2, default=json_default))
    return summary


def run_one(
    job: dict[str, Any],
    spec: StrategySpec,
    costs: CostTable,
    steps_writer: JsonlWriter,
    bar: Any,
    out: Path,
    config: BenchConfig,
) -> dict[str, Any]:
    """Train one (strategy, seed) run, in this process or in the compile child; returns its runs.jsonl line
    (status "failed" with the reason, unless --fail-fast) and writes its details to ``runs/``."""

    def on_step(record: dict[str, Any]) -> None:
        bar.update(1)
        if "loss" in record:  # a batch refused before its forward has none
            bar.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)

    def emit(record: dict[str, Any]) -> None:
        steps_writer.write(record)
        on_step(record)

    started = time.perf_counter()
    try:
        if spec.name == "compile_budget":
            run = run_child(job, emit)
        else:
            controller = make_controller(spec, costs, job["budget_bytes"], job["seed"], job["steps"])
            run = execute_run(job, controller, steps_writer.write, on_step=on_step)
    except Exception as err:
        if config.fail_fast:
            raise
        run = {"status": "failed", "error": f"{type(err).__name__}: {err}"}
    run.setdefault("strategy", spec.label)
    run.setdefault("strategy_name", spec.name)
    run.setdefault("seed", job["seed"])
    run.setdefault("wall_s", time.perf_counter() - started)
    info = run.pop("_info", None)
    if info:
        artifact = out / "runs" / f"{safe_name(spec.label)}_seed{job['seed']}.json"
        artifact.write_text(json.dumps(info, default=json_default))
        run["artifact"] = str(artifact.relative_to(out))
    return run
