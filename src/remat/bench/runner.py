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
4. run the distributed ``sync`` ablation if asked (``torchrun`` subprocess, :mod:`remat.bench.ddp_sweep`);
5. write ``summary.csv``, ``report.md`` and the plots (:mod:`remat.bench.report`).

Memory is measured with the live-tensor tracker (``remat.measure``) on dedicated steps only -- the first step
after warm-up and the last step (plus every ``--measure-every`` steps) -- because the tracker slows the step;
those steps are left out of every timing figure. ``compile_budget`` runs in a child process and is measured
by the whole-process high-water mark (:mod:`remat.bench.procmem`).

``--resume`` keeps finished (strategy, seed) runs, drops the steps of unfinished ones and runs them again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..costs import CostTable
from ..simulator import no_checkpoint_peak
from ..sizes import format_bytes, normalize_budget
from .strategies import (
    DEFAULT_STRATEGIES,
    StrategyError,
    StrategySpec,
    budget_fraction,
    check_available,
    make_controller,
    make_spec,
    parse_strategies,
    parse_sweep,
)
from .train import execute_run, profile_costs

# Settings that must match for --resume to continue a results folder.
RESUME_KEYS = (
    "model", "preset", "layers", "steps", "warmup", "budget", "batch_size", "seq_len", "lr", "tokenizer",
    "dropout", "eval_batches", "measure_every", "device", "dataset", "max_bytes",
)
MIN_LAYERS = 6


class BenchError(Exception):
    """A problem with the bench's input or output folder, found before training; the message says what to do."""


@dataclass
class BenchConfig:
    """Everything one ``remat bench`` invocation does. Field names match the command-line options."""

    model: str = "gpt2"
    preset: str = "tiny"
    layers: int | None = None  # None: the preset's depth raised to MIN_LAYERS
    steps: int = 24  # the default run (`make demo`) must finish in under 5 minutes on a 2-core CPU
    warmup: int = 4
    seeds: int = 2
    strategies: list[StrategySpec] = field(default_factory=lambda: parse_strategies(DEFAULT_STRATEGIES))
    budget: str = "0.5"
    out: Path = Path("results/bench")
    resume: bool = False
    sweeps: list[tuple[str, list[Any]]] = field(default_factory=list)
    json_path: Path | None = None
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 1e-3
    tokenizer: str = "bytes"
    dataset: str | None = None
    max_bytes: int | None = None
    dropout: float | None = None
    eval_batches: int = 8
    measure_every: int = 0
    threads: int = 0  # 0: half the cores
    device: str = "cpu"
    profile_repeats: int = 2
    progress: bool = True
    fail_fast: bool = False
    report: bool = True
    command: str = ""

    def settings(self) -> dict[str, Any]:
        """JSON-safe settings (what config.json records and --resume compares)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("strategies", "sweeps", "out", "json_path")}
        out["strategies"] = [s.label for s in self.strategies]
        out["sweeps"] = [[k, list(v)] for k, v in self.sweeps]
        out["out"] = str(self.out)
        return out


# ------------------------------------------------------------------------------------------------ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``remat bench`` (also ``python -m remat.bench``)."""
    d = BenchConfig()
    parser.add_argument("--model", default=d.model, help="gpt2, bert, vit or mlp (default: %(default)s)")
    parser.add_argument("--preset", default=d.preset, help="tiny, small, base, medium... (default: %(default)s)")
    parser.add_argument("--layers", default=None,
                        help=f"repeated blocks: a number, or 'preset' for the preset's own depth (default: the "
                             f"preset's depth, raised to at least {MIN_LAYERS} so the plans have a chain to "
                             "choose over)")
    parser.add_argument("--steps", type=int, default=d.steps, help="training steps per run (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=d.warmup,
                        help="first steps left out of every statistic (default: %(default)s)")
    parser.add_argument("--seeds", type=int, default=d.seeds, help="repeats with seeds 0..N-1 (default: %(default)s)")
    parser.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                        help="comma-separated; options as pgac:q=0.3,alpha=0.8,gamma=linear. Known: none, full, "
                             "every_k, sqrt, memory_poor, random, optimal, pgac, dtr, compile_budget "
                             "(default: %(default)s)")
    parser.add_argument("--budget", default=d.budget,
                        help="activation memory budget: a fraction in (0, 1] of the no-checkpoint peak or a "
                             "size like 2GiB (default: %(default)s)")
    parser.add_argument("--out", default=str(d.out), help="results folder (default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="keep finished runs in --out and run the rest")
    parser.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                        help="PGAC ablation: q=..., alpha=..., gamma=constant,linear,learned or sync=local,global "
                             "(repeatable)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the summary as JSON here")
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per example (text models)")
    parser.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate")
    parser.add_argument("--tokenizer", default=d.tokenizer, choices=["bytes", "bpe", "auto"],
                        help="text tokens (default: %(default)s: with tiny models GPT-2's 50k-token vocabulary "
                             "makes the logits, not the blocks, dominate activation memory)")
    parser.add_argument("--dataset", default=None, help="image data: mnist (default) or fashion-mnist")
    parser.add_argument("--max-bytes", type=int, default=None, help="read only this much of the text corpus")
    parser.add_argument("--dropout", type=float, default=None, help="dropout of every layer (default: the model's)")
    parser.add_argument("--eval-batches", type=int, default=d.eval_batches, help="validation batches per run")
    parser.add_argument("--measure-every", type=int, default=d.measure_every,
                        help="also measure memory every N steps after warm-up (default: only the first step "
                             "after warm-up and the last step)")
    parser.add_argument("--threads", type=int, default=d.threads, help="intra-op threads (default: half the cores)")
    parser.add_argument("--device", default=d.device, help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--profile-repeats", type=int, default=d.profile_repeats, help="timed repeats per block")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-report", action="store_true", help="write the result files but no report/plots")
    parser.add_argument("--fail-fast", action="store_true", help="stop at the first failed run")


def config_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> BenchConfig:
    """A :class:`BenchConfig` from parsed options; raises :class:`BenchError` on malformed values."""
    try:
        strategies = parse_strategies(args.strategies)
        sweeps = [parse_sweep(s) for s in args.sweep]
    except StrategyError as err:
        raise BenchError(str(err)) from err
    layers: int | None
    if args.layers in (None, "auto"):
        layers = None
    elif str(args.layers) == "preset":
        layers = -1
    else:
        try:
            layers = int(args.layers)
        except ValueError:
            raise BenchError(f"--layers must be a number or 'preset', got {args.layers!r}") from None
    return BenchConfig(
        model=args.model, preset=args.preset, layers=layers, steps=args.steps, warmup=args.warmup,
        seeds=args.seeds, strategies=strategies, budget=str(args.budget), out=Path(args.out), resume=args.resume,
        sweeps=sweeps, json_path=Path(args.json) if args.json else None, batch_size=args.batch_size,
        seq_len=args.seq_len, lr=args.lr, tokenizer=args.tokenizer, dataset=args.dataset,
        max_bytes=args.max_bytes, dropout=args.dropout, eval_batches=args.eval_batches,
        measure_every=args.measure_every, threads=args.threads, device=args.device,
        profile_repeats=args.profile_repeats, progress=not args.no_progress, fail_fast=args.fail_fast,
        report=not args.no_report, command=_command_line(argv),
    )


def _command_line(argv: list[str] | None) -> str:
    """The command as typed: ``remat bench ...`` or ``python -m remat.bench ...``."""
    if argv is not None:
        return shlex.join(["remat", "bench", *argv])
    prog = Path(sys.argv[0]).name
    if prog == "__main__.py":
        return shlex.join(["python", "-m", "remat.bench", *sys.argv[1:]])
    return shlex.join([prog, *sys.argv[1:]])


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


# ------------------------------------------------------------------------------------------- checking


def parse_budget(text: str) -> float | int:
    """``"0.5"`` or ``"50%"`` -> 0.5 (a fraction of the no-checkpoint peak); ``"2GiB"`` or ``"1000000"`` -> bytes."""
    try:
        return normalize_budget(str(text))  # type: ignore[return-value]  # never None for a string
    except (ValueError, TypeError) as err:
        raise BenchError(f"--budget {text!r}: {err}") from None


def default_threads() -> int:
    return max(1, (os.cpu_count() or 2) // 2)


def resolve_layers(config: BenchConfig) -> int | None:
    """The number of repeated blocks to build (None: the preset's own)."""
    from .models import model_config

    if config.layers == -1:
        return None
    if config.layers is not None:
        if config.layers < 1:
            raise BenchError(f"--layers must be at least 1, got {config.layers}")
        return config.layers
    depth = model_config(config.model, config.preset)["num_layers"]
    return max(depth, MIN_LAYERS) if depth < MIN_LAYERS else None


def validate(config: BenchConfig) -> dict[str, Any]:
    """Check everything that needs no training; returns what the data check found. Raises BenchError."""
    from .data import DataUnavailableError, check_data_available
    from .models import list_models, model_config

    if config.model not in list_models():
        raise BenchError(f"unknown model {config.model!r}; known models: {', '.join(list_models())}")
    try:
        model_config(config.model, config.preset)
    except ValueError as err:
        raise BenchError(str(err)) from None
    for name, value, low in (("--steps", config.steps, 1), ("--seeds", config.seeds, 1),
                             ("--batch-size", config.batch_size, 1), ("--eval-batches", config.eval_batches, 0),
                             ("--warmup", config.warmup, 0), ("--measure-every", config.measure_every, 0),
                             ("--profile-repeats", config.profile_repeats, 1)):
        if value < low:
            raise BenchError(f"{name} must be at least {low}, got {value}")
    if config.warmup >= config.steps:
        raise BenchError(
            f"--warmup {config.warmup} leaves no measured steps out of --steps {config.steps}; use more steps"
        )
    if config.threads < 0:
        raise BenchError(f"--threads must be positive (0: half the cores), got {config.threads}")
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise BenchError("--device cuda: torch sees no CUDA device; use --device cpu")
    parse_budget(config.budget)
    specs = all_specs(config)
    try:
        check_available(specs)
    except (StrategyError, ValueError) as err:
        raise BenchError(str(err)) from None
    if any(s.name == "compile_budget" for s in specs) and config.warmup < 1:
        raise BenchError("compile_budget compiles during its first step: use --warmup 1 or more")
    if any(k == "sync" for k, _ in config.sweeps) and importlib_missing("torch.distributed.run"):
        raise BenchError("the sync sweep needs torch.distributed (torchrun); this torch build has none")
    try:
        return check_data_available(config.model, tokenizer=config.tokenizer, dataset=config.dataset)
    except DataUnavailableError as err:
        raise BenchError(str(err)) from None
    except ValueError as err:
        raise BenchError(str(err)) from None


def importlib_missing(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def all_specs(config: BenchConfig) -> list[StrategySpec]:
    """The strategies to run: the listed ones, then the PGAC variants of the sweeps (sync excepted)."""
    specs = list(config.strategies)
    base = next((s for s in specs if s.name == "pgac"), make_spec("pgac"))
    for key, values in config.sweeps:
        if key == "sync":
            continue
        for value in values:
            variant = base.with_option(key, value)
            if variant.label not in {s.label for s in specs}:
                specs.append(variant)
    return specs


# ------------------------------------------------------------------------------------------ environment


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


# ------------------------------------------------------------------------------------------ result files


def safe_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON line of ``path`` (a line cut short by a kill is skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class JsonlWriter:
    """Appends JSON lines and flushes each one, so a killed run leaves every finished line on disk."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, default=_json_default) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def check_out(config: BenchConfig) -> bool:
    """Check the results folder without changing it; True when ``--resume`` continues results there."""
    out = config.out
    if out.exists() and not out.is_dir():
        raise BenchError(f"--out {out} exists and is not a folder; choose another path")
    config_path = out / "config.json"
    if not (config.resume and config_path.exists()):
        return False
    old = json.loads(config_path.read_text())["settings"]
    new = config.settings()
    changed = [k for k in RESUME_KEYS if old.get(k) != new.get(k)]
    if changed:
        detail = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
        raise BenchError(
            f"--resume: {out} holds results made with other settings ({detail}); rerun with the same settings "
            "or use a new --out"
        )
    return True


def prepare_out(config: BenchConfig, resuming: bool) -> set[tuple[str, int]]:
    """Create or reopen the results folder; returns the (strategy, seed) runs already finished.

    Resuming keeps the finished runs and their steps and drops everything of unfinished runs (they run again
    from their first step); otherwise earlier results in the folder are removed."""
    out = config.out
    out.mkdir(parents=True, exist_ok=True)
    finished: set[tuple[str, int]] = set()
    if resuming:
        runs = [r for r in read_jsonl(out / "runs.jsonl") if r.get("status") == "ok"]
        finished = {(r["strategy"], int(r["seed"])) for r in runs}
        steps = [s for s in read_jsonl(out / "steps.jsonl") if (s.get("strategy"), s.get("seed")) in finished]
        _rewrite(out / "runs.jsonl", runs)
        _rewrite(out / "steps.jsonl", steps)
        (out / "ddp.jsonl").unlink(missing_ok=True)  # the distributed sweep is short: it runs again
    else:
        for name in ("steps.jsonl", "runs.jsonl", "ddp.jsonl", "summary.csv", "report.md", "summary.json"):
            (out / name).unlink(missing_ok=True)
        for sub in ("runs", "costs", "plots"):
            shutil.rmtree(out / sub, ignore_errors=True)
    for sub in ("runs", "costs", "plots"):
        (out / sub).mkdir(exist_ok=True)
    return finished


def _rewrite(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


# ------------------------------------------------------------------------------------------- one run


def job_for(config: BenchConfig, spec: StrategySpec, seed: int, layers: int | None, budget: dict[str, Any]
            ) -> dict[str, Any]:
    """Everything one run needs, JSON-safe (the compile child receives it on its command line)."""
    return {
        "model": config.model, "preset": config.preset, "layers": layers, "dropout": config.dropout,
        "tokenizer": config.tokenizer, "dataset": config.dataset, "max_bytes": config.max_bytes,
        "seq_len": config.seq_len, "batch_size": config.batch_size, "lr": config.lr, "seed": seed,
        "steps": config.steps, "warmup": config.warmup, "measure_steps": measure_steps(config),
        "eval_batches": config.eval_batches, "threads": config.threads or default_threads(),
        "device": config.device, "strategy": spec.name, "options": [list(o) for o in spec.options],
        "label": spec.label, "budget_bytes": budget["bytes"], "budget_fraction": budget["fraction"],
    }


def measure_steps(config: BenchConfig) -> list[int]:
    """Steps whose memory is measured (and whose time is therefore not used)."""
    steps = {config.warmup, config.steps - 1}
    if config.measure_every:
        steps |= set(range(config.warmup, config.steps, config.measure_every))
    return sorted(steps)


# ---------------------------------------------------------------------------------------------- the bench


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
    log = _Log(config.progress)
    if data_info.get("tokenizer_note"):
        log.note(data_info["tokenizer_note"])

    # Profiles first (one per seed): the budget and its feasibility are settled before any training, and
    # before anything in the results folder changes.
    costs_by_seed: dict[int, CostTable] = {}
    facts: dict[str, Any] = {}
    probe = job_for(config, specs[0], 0, layers, {"bytes": 0, "fraction": 0.0})
    for seed in range(config.seeds):
        path = out / "costs" / f"seed{seed}.json"
        if resuming and path.exists():
            costs_by_seed[seed] = CostTable.from_json(path.read_text())
            continue
        log.note(f"profiling {config.model}-{config.preset} seed {seed} ...")
        started = time.perf_counter()
        costs, found = profile_costs({**probe, "seed": seed}, config.profile_repeats)
        costs.info["profile_s"] = time.perf_counter() - started
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
        "settings": config.settings(), "threads": threads, "layers_built": layers, "environment": env,
        "commands": commands, "budget": budget, "data": data_info,
        "facts": facts or old_config.get("facts", {}), "all_strategies": [s.label for s in specs],
        "measure_steps": measure_steps(config),
        "load_average": {"start": _loadavg(), "end": None},
    }
    (out / "config.json").write_text(json.dumps(record, indent=2, default=_json_default))

    # The order alternates between seeds, so a slow drift of the machine's load favours no position.
    pending = [(spec, seed) for seed in range(config.seeds) for spec in (specs if seed % 2 == 0 else specs[::-1])
               if (spec.label, seed) not in finished]
    if finished:
        log.note(f"resuming: {len(finished)} finished run(s) kept, {len(pending)} to run")
    steps_writer = JsonlWriter(out / "steps.jsonl")
    runs_writer = JsonlWriter(out / "runs.jsonl")
    bar = log.bar(total=len(pending) * config.steps)
    try:
        for spec, seed in pending:
            job = job_for(config, spec, seed, layers, budget)
            bar.set_description(f"{spec.label} seed {seed}")
            run = _run_one(job, spec, costs_by_seed[seed], steps_writer, bar, out, config)
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
        from .ddp_sweep import run_sync_sweep

        log.note("sync ablation: torchrun --nproc_per_node 2 (gloo) ...")
        run_sync_sweep(config, layers, budget, sync_sweep[0], out / "ddp.jsonl", out / "costs" / "seed0.json")

    record["load_average"]["end"] = _loadavg()
    (out / "config.json").write_text(json.dumps(record, indent=2, default=_json_default))
    summary: dict[str, Any] = {"runs": read_jsonl(out / "runs.jsonl")}
    if config.report:
        from .report import build_report

        summary = build_report(out)
        summary["runs"] = read_jsonl(out / "runs.jsonl")
        log.note(f"report: {out / 'report.md'}")
    if config.json_path is not None:
        config.json_path.parent.mkdir(parents=True, exist_ok=True)
        config.json_path.write_text(json.dumps(summary, indent=2, default=_json_default))
    return summary


def _loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def resolve_bench_budget(spec: float | int, costs_by_seed: dict[int, CostTable]) -> dict[str, Any]:
    """The budget in bytes (a fraction is of seed 0's predicted no-checkpoint peak); raises BenchError when
    no plan reaches it on some seed's model and batch."""
    from ..planners import minimum_peak_bytes

    reference = no_checkpoint_peak(costs_by_seed[0])
    budget_bytes = int(spec * reference) if isinstance(spec, float) else int(spec)
    floors = {seed: minimum_peak_bytes(costs) for seed, costs in costs_by_seed.items()}
    worst = max(floors.values())
    if budget_bytes < worst:
        raise BenchError(
            f"budget {format_bytes(budget_bytes)} is below the least activation memory any plan reaches on this "
            f"model and batch ({format_bytes(worst)}, {worst / reference:.0%} of the no-checkpoint "
            f"{format_bytes(reference)}); use --budget {math.ceil(100 * worst / reference) / 100:.2f} or more, a "
            "smaller --batch-size/--seq-len, or more --layers"
        )
    return {
        "spec": spec, "bytes": budget_bytes, "fraction": budget_fraction(costs_by_seed[0], budget_bytes),
        "no_checkpoint_predicted_bytes": reference, "min_feasible_bytes": worst,
    }


def _run_one(job: dict[str, Any], spec: StrategySpec, costs: CostTable, steps_writer: JsonlWriter, bar: Any,
             out: Path, config: BenchConfig) -> dict[str, Any]:
    def on_step(record: dict[str, Any]) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)

    def emit(record: dict[str, Any]) -> None:
        steps_writer.write(record)
        on_step(record)

    started = time.perf_counter()
    try:
        if spec.name == "compile_budget":
            from .procmem import run_child

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
        artifact.write_text(json.dumps(info, default=_json_default))
        run["artifact"] = str(artifact.relative_to(out))
    return run


class _Log:
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
        return _NoBar()


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, text: str) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass
