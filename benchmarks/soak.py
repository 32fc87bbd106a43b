"""Long runs: does anything grow? 1,000 training steps each with no remat, an optimal plan, PGAC and DTR on a
small GPT-2, printing the growth of the resident set (RSS) and of the number of live Python objects between
the end of the warm-up and the end of the run, and the memory PGAC's history takes.

Each strategy runs in a process of its own (one model, one optimizer, the same batches), so one run's
allocations do not mix with another's. The figure to read is growth against ``none``: the allocator and
Python's caches grow a little in any long run.

    python -m benchmarks.soak [--steps 1000] [--warmup 50] [--layers 4] [--hidden 128] [--json PATH]

``--budget-runs clip:pgac,t5:pgac,clip:fit,t5:fit`` runs, instead, models of several chains (the harness's tiny
CLIP and T5, built from their configs) through PGAC (``remat.PGAC(model, 0.5, blocks=remat.find_chains(model))``,
its first step profiled) or the front door (``remat.fit(model, activations=0.5, batch=..., optimizer=...)``) for
``--steps`` steps with AdamW, each step's activation peak measured by ``remat.measure()`` and compared with the
plan's budget: the steps over it (by more than 2%), the worst ratio, and the growth of the resident set after the
first 50 steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

STRATEGIES = ("none", "optimal", "pgac", "dtr")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_one(strategy: str, args: argparse.Namespace) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import remat

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=4, vocab_size=512, n_positions=64,
                        use_cache=False)
    model = GPT2LMHeadModel(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 512, (4, 64), generator=gen) for _ in range(8)]
    first = {"input_ids": batches[0], "labels": batches[0]}
    cleanup = None
    pgac = None
    if strategy == "optimal":
        plan = remat.plan(remat.profile(model, first), "optimal", budget=0.5)
        cleanup = remat.apply(model, plan).remove
    elif strategy == "pgac":
        pgac = remat.PGAC(model, 0.5, total_steps=args.steps).attach(optimizer)
        cleanup = pgac.remove
    elif strategy == "dtr":
        dtr = remat.DTR(model, 0.5)
        cleanup = dtr.detach

    def train(steps: int, offset: int) -> None:
        for s in range(steps):
            ids = batches[(offset + s) % len(batches)]
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    train(args.warmup, 0)
    gc.collect()
    rss0, objects0, start = rss_bytes(), len(gc.get_objects()), time.perf_counter()
    train(args.steps, args.warmup)
    gc.collect()
    result = {
        "strategy": strategy,
        "steps": args.steps,
        "seconds": time.perf_counter() - start,
        "rss_growth_bytes": rss_bytes() - rss0,
        "object_growth": len(gc.get_objects()) - objects0,
    }
    if pgac is not None:
        result["pgac_history_records"] = len(pgac.history)
        result["pgac_history_bytes"] = sum(sys.getsizeof(r) for r in pgac.history)
    if cleanup is not None:
        cleanup()
    return result


def budget_run(model_name: str, door: str, steps: int) -> dict:
    """``steps`` steps of ``model_name`` through ``door`` (pgac or fit), every step's peak against its budget."""
    import torch

    import remat
    from remat.bench import architectures

    torch.set_num_threads(1)
    arch = next(a for a in architectures() if a.name == model_name)
    model = arch.build()
    batch = arch.batch()
    loss_of = arch.loss or (lambda out: out.loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if door == "pgac":
        controller = remat.PGAC(model, 0.5, blocks=remat.find_chains(model), total_steps=steps).attach(optimizer)
        budget_of, remove = (lambda: controller.budget_bytes), controller.remove
    else:
        session = remat.fit(model, activations=0.5, batch=batch, optimizer=optimizer)
        budget_of, remove = (lambda: session.plan.budget_bytes), session.remove
    over, worst, measured_steps = 0, 0.0, 0
    warmup = min(50, steps // 2)  # RSS growth is read from here on: the first steps allocate AdamW's state
    rss0, start = rss_bytes(), time.perf_counter()
    for step in range(steps):
        if step == warmup:
            gc.collect()
            rss0 = rss_bytes()
        torch.manual_seed(step)
        with remat.measure() as measured:
            loss_of(model(**batch)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        budget = budget_of()
        if budget is None or (door == "pgac" and step == 0):  # PGAC's first step is its profile
            continue
        ratio = measured.activation_bytes / budget
        measured_steps += 1
        worst = max(worst, ratio)
        over += ratio > 1.02
    result = {"model": model_name, "door": door, "steps": steps, "measured_steps": measured_steps,
              "over_budget": over, "worst_peak_over_budget": round(worst, 4), "budget_bytes": budget_of(),
              "seconds": round(time.perf_counter() - start, 1), "rss_growth_bytes": rss_bytes() - rss0}
    remove()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--budget-runs", default=None,
                        help="model:door pairs (clip, t5; pgac, fit): every step's peak against its budget")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        if ":" in args.child:
            print("SOAK " + json.dumps(budget_run(*args.child.split(":"), args.steps)), flush=True)
        else:
            print("SOAK " + json.dumps(run_one(args.child, args)), flush=True)
        return 0
    if args.budget_runs:
        rows = []
        for pair in args.budget_runs.split(","):
            cmd = [sys.executable, __file__, "--child", pair, "--steps", str(args.steps)]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SOAK ")]
            if proc.returncode != 0 or not lines:
                print(f"{pair}: failed\n{proc.stderr[-2000:]}")
                return 1
            r = json.loads(lines[-1][5:])
            rows.append(r)
            print(f"{r['model']:5s} {r['door']:5s} {r['steps']} steps in {r['seconds']:6.1f} s  over budget "
                  f"{r['over_budget']} of {r['measured_steps']} (worst {r['worst_peak_over_budget']}x of "
                  f"{r['budget_bytes'] / 2**10:.1f} KiB)  RSS {r['rss_growth_bytes'] / 2**20:+.1f} MiB", flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return 0
    rows = []
    for strategy in args.strategies.split(","):
        cmd = [sys.executable, __file__, "--child", strategy, "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--layers", str(args.layers), "--hidden", str(args.hidden)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SOAK ")]
        if proc.returncode != 0 or not lines:
            print(f"{strategy}: failed\n{proc.stderr[-2000:]}")
            return 1
        rows.append(json.loads(lines[-1][5:]))
        r = rows[-1]
        extra = ""
        if "pgac_history_records" in r:
            extra = f"  PGAC history: {r['pgac_history_records']} records, {r['pgac_history_bytes'] / 2**10:.1f} KiB"
        rss = r["rss_growth_bytes"] / 2**20
        print(f"{strategy:8s} {r['steps']} steps in {r['seconds']:6.1f} s  RSS {rss:+6.1f} MiB"
              f"  objects {r['object_growth']:+d}{extra}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
