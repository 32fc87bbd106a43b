"""remat next to what a user would otherwise run at the same byte budget: one command, one table.

At fractions of the no-checkpoint activation memory (default 25%, 50%, 75%), on a GPT-2 and a Llama built
from their Hugging Face configs with random weights, in fp32 and under bf16 autocast, the contenders are:
no checkpointing (twice: an A/A pair), hand-written ``torch.utils.checkpoint`` on the first k blocks, the same
with torch's selective checkpointing and a matmul-saving policy, ``torch.compile`` with and without
``activation_memory_budget`` (at the fraction, and fitted to the bytes by remat), remat's static strategies,
``optimal`` (profiled with the per-operator policies of ``--policies``, default ``remat.policies.MENU``), PGAC
and DTR, remat's optimal plan on compiled blocks and ``fit_compiled`` (whichever compiled route measures faster),
and the PyPI planner ``ckptplan`` where it installs and runs. What each measures and how:
:mod:`benchmarks.peers.child` (one process per model and precision) and :mod:`benchmarks.peers.table` (the table).

    python -m benchmarks.peers                      # the full table (about 16 minutes on a shared 2-core CPU)
    python -m benchmarks.peers --quick              # one model, fp32, 50%: a check in 1-2 minutes
    python -m benchmarks.peers --out peers.jsonl --resume   # go on with an interrupted run
    python -m benchmarks.peers --markdown docs/results/peers-cpu.md
    python -m benchmarks.peers --device cuda --size gpu --markdown docs/results/peers-cuda.md
    python -m benchmarks.peers --device cuda --no-compiled   # eager contenders only: a minute on an H200

On ``--device cuda`` the models and batches live on the GPU, bf16 is ``torch.autocast("cuda")``, the peak
of a step is the CUDA allocator's (``max_memory_allocated`` above what was allocated before it) and step
times are wall-clock with the device synchronised around each step (:mod:`benchmarks.peers.device`).

Records are appended to ``--out`` (JSON lines) as they arrive; ``--resume`` keeps the models and precisions already
finished there and runs the rest. A unit whose no-checkpointing prediction is off by more than ``--steady-within`` (5%)
ran while the machine's speed changed (:mod:`benchmarks.peers.attempts`): it is run again, up to ``--retries`` (2)
times, and the table lists the attempts it discarded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from remat.bench import child_env, parse
from remat.meters import CHILD_ENV

from . import attempts, ckptplan, table
from . import device as pd
from . import models as pm

REPOSITORY = Path(__file__).resolve().parents[2]  # the child runs as benchmarks.peers.child from here
# Options that must match for --resume to continue a file.
SAME_FOR_RESUME = ("device", "size", "budgets", "rounds", "duel_rounds", "duel_max_rounds", "choice_rounds", "warmup",
                   "threads", "backend", "seed", "policies", "compiled")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama", help="comma-separated: gpt2, llama")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16 (autocast)")
    parser.add_argument("--budgets", default="0.25,0.5,0.75", help="fractions of the no-checkpoint activations")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds over all contenders")
    parser.add_argument("--duel-rounds", type=int, default=20,
                        help="then rounds of remat optimal, the eager peers and remat optimal again, per budget")
    parser.add_argument("--duel-max-rounds", type=int, default=60,
                        help="head-to-head rounds go on, 8 at a time, up to this many while the 95%% interval of "
                             "remat's ratio to a fitting peer still holds 1.02")
    parser.add_argument("--choice-rounds", type=int, default=5,
                        help="fit_compiled's and remat fit's own head-to-head rounds per budget (0: no "
                             "'remat.fit(compile=True)' rows, and one round for remat fit)")
    parser.add_argument("--policies", default="menu",
                        help="per-operator policies remat's eager profile measures as selective actions: 'menu' "
                             "(remat.policies.MENU) or comma-separated names, like dots_saveable")
    parser.add_argument("--no-compiled", action="store_true",
                        help="eager contenders only: no torch.compile budgets or compiled remat rows (on a GPU, "
                             "torch.compile under a budget can take minutes per graph)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps before measuring each contender")
    parser.add_argument("--device", default="cpu", choices=pd.DEVICES, help="where the models and steps run")
    parser.add_argument("--size", default=None, choices=sorted(pm.SIZES),
                        help="model and batch size (default: 'default' on cpu, 'gpu', GPT-2 small's shape, on cuda)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled contenders")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: steadiest on a shared CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="gpt2, fp32, budget 0.5, 3 rounds (3 head to head)")
    parser.add_argument("--out", default="results/peers/peers.jsonl", help="JSON lines, written as it goes")
    parser.add_argument("--resume", action="store_true", help="keep the finished units of --out, run the rest")
    parser.add_argument("--markdown", default=None, help="also write the table with the command and machine here")
    parser.add_argument("--ckptplan-path", default=ckptplan.DEFAULT_PATH,
                        help="folder holding ckptplan (pip install --target FOLDER ckptplan)")
    parser.add_argument("--unit-timeout", type=float, default=1800, help="seconds one model and precision may take")
    parser.add_argument("--compile-seconds", type=float, default=None,
                        help="build no more compiled contenders once a unit's compiled part has run this long "
                             "(those not built are listed as refused)")
    parser.add_argument("--retries", type=int, default=2,
                        help="times a unit is run again when the machine's speed changed under it (peers_attempts)")
    parser.add_argument("--steady-within", type=float, default=0.05,
                        help="how far no checkpointing's predicted step may be from its measured one")
    args = parser.parse_args(argv)
    if args.size is None:
        args.size = "gpu" if args.device == "cuda" else "default"
    if args.quick:
        args.models, args.dtypes, args.budgets, args.rounds, args.duel_rounds = "gpt2", "fp32", "0.5", 3, 3
        args.duel_max_rounds = 3
        args.choice_rounds = min(args.choice_rounds, 2)
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    args.dtype_list = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    args.budget_list = [float(b) for b in args.budgets.split(",") if b.strip()]
    for model in args.model_list:
        for dtype in args.dtype_list:
            pm.check_setting(pm.ModelSetting(model, dtype, args.size))
    try:
        pd.check_device(args.device)
    except ValueError as err:
        parser.error(str(err))
    bad = [b for b in args.budget_list if not 0.0 < b < 1.0]
    if bad or not args.budget_list:
        parser.error(f"--budgets takes fractions strictly between 0 and 1, got {args.budgets!r}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.duel_rounds < 0 or args.choice_rounds < 0:
        parser.error("--duel-rounds and --choice-rounds must be 0 or more")
    args.duel_max_rounds = max(args.duel_max_rounds, args.duel_rounds)
    if args.retries < 0 or not args.steady_within > 0:
        parser.error("--retries must be 0 or more and --steady-within above 0")
    return args


def machine(device: str = "cpu") -> dict[str, Any]:
    import torch

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpu": pd.device_name("cpu"), "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "load_average_1min": load, "device": device,
            "device_name": pd.device_name(device), "cuda": torch.version.cuda if device == "cuda" else None}


def options(args: argparse.Namespace) -> dict[str, Any]:
    return {"device": args.device, "size": args.size, "budgets": args.budget_list, "rounds": args.rounds,
            "duel_rounds": args.duel_rounds, "duel_max_rounds": args.duel_max_rounds,
            "choice_rounds": args.choice_rounds, "warmup": args.warmup,
            "threads": args.threads, "backend": args.backend, "seed": args.seed, "policies": args.policies,
            "compiled": not args.no_compiled, "compile_seconds": args.compile_seconds}


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut off by an interruption
    return records


def resume_records(path: Path, opts: dict[str, Any]) -> list[dict[str, Any]]:
    """The records of the units finished in ``path`` (discarded attempts left out); raises if it was written with
    other options."""
    records = attempts.without_discarded(read_records(path))
    header = next((r for r in records if r.get("record") == "run"), None)
    if header is not None:
        old = {k: header["options"].get(k, True if k == "compiled" else None) for k in SAME_FOR_RESUME}
        new = {k: opts[k] for k in SAME_FOR_RESUME}
        if old != new:
            raise SystemExit(f"{path} was written with {old}, not {new}: resume with the same options, "
                             "or give another --out")
    done = {(r["model"], r["dtype"]) for r in records if r.get("record") == "unit_done"}
    return [r for r in records if r.get("record") == "run" or (r.get("model"), r.get("dtype")) in done]


def run_unit(job: dict[str, Any], out: Any, timeout: float, attempt: int = 1) -> list[dict[str, Any]]:
    """One model and precision in a child process; its records, marked with ``attempt``, are written to ``out``
    as they come."""
    env = child_env(**(CHILD_ENV if job.get("device", "cpu") == "cpu" else {}))  # glibc's settings: CPU only
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.peers.child", json.dumps(job)], cwd=REPOSITORY,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    records: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        record = parse(line)
        if record is None:
            continue
        record["attempt"] = attempt
        records.append(record)
        out.write(json.dumps(record) + "\n")
        out.flush()
        if record.get("record") == "memory":
            print(f"  {job['model']}/{job['dtype']} memory: {record['key']}", file=sys.stderr, flush=True)
        if time.monotonic() > deadline:
            proc.kill()
            break
    try:
        stderr = proc.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        stderr = proc.communicate()[1]
    if not any(r.get("record") == "unit_done" for r in records):
        tail = " | ".join((stderr or "").strip().splitlines()[-8:])
        failed = {"record": "unit_failed", "model": job["model"], "dtype": job["dtype"], "attempt": attempt,
                  "error": f"the child exited with code {proc.returncode}: {tail}"}
        records.append(failed)
        out.write(json.dumps(failed) + "\n")
        out.flush()
    return records


def run_steady_unit(job: dict[str, Any], out: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``run_unit``, again (up to ``--retries`` times) while the unit's no-checkpointing prediction says the
    machine's speed changed under it; returns the records of the attempt kept and the discard records."""
    discards: list[dict[str, Any]] = []
    for attempt in range(1, args.retries + 2):
        t0 = time.perf_counter()
        records = run_unit(job, out, args.unit_timeout, attempt)
        ratio = attempts.steadiness(records)
        print(f"{job['model']}/{job['dtype']}: {time.perf_counter() - t0:.0f} s (attempt {attempt}, no checkpointing "
              f"predicted {ratio if ratio is None else f'{ratio:.2f}x'})", file=sys.stderr, flush=True)
        if attempt > args.retries or not attempts.unsteady(ratio, args.steady_within):
            return discards + records
        assert ratio is not None
        discards.append(attempts.discard_record(job, attempt, ratio, args.steady_within))
        out.write(json.dumps(discards[-1]) + "\n")
        out.flush()
    return discards


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    opts = options(args)
    kept = resume_records(out_path, opts) if args.resume else []
    started = time.time()
    command = "python -m benchmarks.peers" + (" " + shlex.join(sys.argv[1:]) if argv is None else "")
    header = next((r for r in kept if r.get("record") == "run"), None) or {
        "record": "run", "command": command, "options": opts, "machine": machine(args.device),
        "started": started}
    done = {(r["model"], r["dtype"]) for r in kept if r.get("record") == "unit_done"}
    with out_path.open("w") as out:
        for record in [header, *[r for r in kept if r.get("record") != "run"]]:
            out.write(json.dumps(record) + "\n")
        out.flush()
        for model in args.model_list:
            for dtype in args.dtype_list:
                if (model, dtype) in done:
                    print(f"{model}/{dtype}: kept from {out_path}", file=sys.stderr)
                    continue
                print(f"{model}/{dtype}: running", file=sys.stderr, flush=True)
                job = {"model": model, "dtype": dtype, **opts, "ckptplan_path": args.ckptplan_path}
                kept.extend(run_steady_unit(job, out, args))
    records = [header, *[r for r in kept if r.get("record") != "run"]]
    wanted = {(m, d) for m in args.model_list for d in args.dtype_list}
    records = [r for r in records if r.get("record") == "run" or (r.get("model"), r.get("dtype")) in wanted]
    body = table.render(records, device=args.device)
    discarded = attempts.discarded_text(records)
    body += "\n\n" + discarded if discarded else ""
    print(body)
    if args.markdown:
        write_markdown(Path(args.markdown), header, body, time.time() - started)
    return 0


def write_markdown(path: Path, header: dict[str, Any], body: str, wall_s: float) -> None:
    m, o = header["machine"], header["options"]
    device = o.get("device", "cpu")
    if device == "cuda":
        title = f"# remat next to its peers (CUDA: {m.get('device_name')})"
        where = (f"Machine: {m.get('device_name')} (CUDA {m.get('cuda')}), host {m['cpu']}, {m['cores']} cores, "
                 f"torch {m['torch']}, Python {m['python']}; peaks from the CUDA allocator, wall-clock step times; ")
    else:
        title = "# remat next to its peers (CPU)"
        where = (f"Machine: {m['cpu']}, {m['cores']} cores (shared; 1-minute load average "
                 f"{m['load_average_1min']:.1f} at the start), torch {m['torch']}, Python {m['python']}; "
                 f"{o['threads']} intra-op thread(s), ")
    intro = [
        title,
        "",
        f"Command: `{header['command']}`  ",
        where + f"compile backend `{o['backend']}`, {o['rounds']} timing rounds (then {o.get('duel_rounds', 0)} "
        f"head to head{_more_rounds(o)}), models of size `{o['size']}` "
        f"({pm.SIZES[o['size']]}).  ",
        f"Wall time of this invocation: {wall_s / 60:.1f} min.",
        "",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(intro) + body + "\n")


def _more_rounds(o: dict[str, Any]) -> str:
    most, first = o.get("duel_max_rounds", 0), o.get("duel_rounds", 0)
    return f", up to {most} while remat's ratio to a fitting peer was unresolved from 1.02" if most > first else ""

