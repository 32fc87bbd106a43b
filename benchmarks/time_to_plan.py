"""Time to the first planned step, and whether fresh profiles give the same plan.

For each model (Hugging Face's GPT-2 and Llama built from their configs, random weights, eager attention) at
each depth, the benchmark measures the plain training step (median of three after one warm-up), then takes
``--profiles`` fresh profiles (the profile cache off) and plans each at ``--budget`` of the no-checkpoint
activations with ``remat.plan(costs, "optimal", ...)``, as ``remat.fit`` does: ``remat.profile(...,
price_segments=False)``, then ``remat.profiling.price_segments`` and a second plan only where the first holds a
segment. It reports profile + plan seconds over the plain step (the target is at most 10), how many profiles
priced segments, and the number of distinct plans over the fresh profiles, with the optimal planner's noise
rules on the noise each profile recorded (``costs.info["time_noise_s"]``, the default) and without them
(``time_noise_s=0``): the target is one. What the rules cost is the plan's predicted step over the fastest plan
without them, on the same profile.

Each setting's row is appended to ``--out`` (JSON lines) as soon as it is measured; a rerun skips the settings
already there, so an interrupted run resumes.

    .venv/bin/python -m benchmarks.time_to_plan [--models gpt2,llama] [--layers 12,24] [--hidden 384]
        [--batch 2] [--seq 256] [--profiles 5] [--budget 0.5] [--out docs/results/time-to-plan.jsonl]
        [--tables DIR] [--predict docs/results/time-to-plan-prediction.jsonl]

With ``--predict FILE`` it instead takes one fresh profile per model and depth and sets plans' predicted steps
against their measured ones (:func:`prediction_rows`): what the profile's fewer steps read, checked on the step.
With ``--compile FILE`` it times ``remat.fit(..., compile=...)``'s first planned step next to ``torch.compile``'s
own first step (:func:`compile_rows`; ``--backend``, inductor by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

import remat
from remat.chains import run_step
from remat.profiling import price_segments

os.environ.setdefault("REMAT_CACHE_DIR", "off")  # every profile here is a fresh one


def build(name: str, layers: int, hidden: int, seq: int, vocab: int) -> nn.Module:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                                         n_positions=seq, use_cache=False, attn_implementation="eager")  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_attention_heads=heads,
        num_key_value_heads=heads, vocab_size=vocab, max_position_embeddings=seq, use_cache=False,
        attn_implementation="eager",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def plain_step_s(model: nn.Module, batch: dict[str, torch.Tensor]) -> float:
    times = []
    for _ in range(4):
        start = time.perf_counter()
        run_step(model, batch)
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def measure(name: str, layers: int, args: argparse.Namespace) -> dict[str, Any]:
    model = build(name, layers, args.hidden, args.seq, args.vocab)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    step = plain_step_s(model, batch)
    ratios, noise, with_rule, without_rule = [], [], Counter(), Counter()
    priced = 0
    rules_cost: list[float] = []  # per profile: the plan's predicted step over the fastest's without the rules, less 1
    for i in range(args.profiles):
        start = time.perf_counter()
        costs = remat.profile(model, batch, price_segments=False)
        plan = remat.plan(costs, "optimal", args.budget)
        if price_segments(model, batch, costs, plan=plan):
            priced += 1
            plan = remat.plan(costs, "optimal", args.budget)
        ratios.append((time.perf_counter() - start) / step)
        if args.tables is not None:
            args.tables.mkdir(parents=True, exist_ok=True)
            (args.tables / f"{name}-{layers}-{i}.json").write_text(costs.to_json())
        noise.append(costs.info.get("time_noise_s", 0.0))
        with_rule[json.dumps(plan.actions)] += 1
        fastest = remat.plan(costs, "optimal", args.budget, time_noise_s=0.0)
        without_rule[json.dumps(fastest.actions)] += 1
        rules_cost.append(plan.predicted_step_s / fastest.predicted_step_s - 1)
        print(f"  {name} {layers}: profile + plan {ratios[-1]:.1f} plain steps, {plan.action_counts()}", flush=True)
    return {
        "model": name,
        "layers": layers,
        "hidden": args.hidden,
        "batch": f"{args.batch}x{args.seq}",
        "threads": torch.get_num_threads(),
        "plain_step_s": step,
        "profile_and_plan_steps": ratios,
        "time_noise_ms": [n * 1e3 for n in noise],
        "segments_priced": priced,
        "rules_cost": rules_cost,
        "distinct_plans": len(with_rule),
        "distinct_plans_without_noise_rule": len(without_rule),
        "plans": [json.loads(p) for p in with_rule],
    }


def prediction_rows(name: str, layers: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One fresh profile (``remat.profile``, segments priced), then plans' predicted steps against their measured
    ones: keep-all twice (the A/A pair), every block checkpointed, every block ``dots_saveable``, the chain as one
    segment, ``optimal`` at 50% and 30%; six interleaved rounds through one handle, the median of the last five."""
    model = build(name, layers, args.hidden, args.seq, args.vocab)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    plain_step_s(model, batch)
    costs = remat.profile(model, batch)
    n = len(costs)
    plans = {
        "keep": remat.Plan.from_actions(costs, ["keep"] * n),
        "keep (A/A)": remat.Plan.from_actions(costs, ["keep"] * n),
        "checkpoint every block": remat.Plan.from_actions(costs, ["checkpoint"] * n),
        "dots_saveable every block": remat.Plan.from_actions(costs, ["selective:dots_saveable"] * n),
        "one segment": remat.Plan.from_actions(costs, ["segment:0"] * n),
        "optimal 50%": remat.plan(costs, "optimal", 0.5),
        "optimal 30%": remat.plan(costs, "optimal", 0.3),
    }
    handle = remat.apply(model, plans["keep"])
    seconds: dict[str, list[float]] = {label: [] for label in plans}
    try:
        for r in range(6):
            for label in list(plans) if r % 2 == 0 else list(plans)[::-1]:
                handle.set_plan(plans[label])
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                run_step(model, batch)
                seconds[label].append(time.perf_counter() - start)
    finally:
        handle.remove()
    rows = []
    for label, plan in plans.items():
        measured = statistics.median(seconds[label][1:])
        rows.append({"model": name, "layers": layers, "plan": label, "actions": plan.action_counts(),
                     "predicted_s": plan.predicted_step_s, "measured_s": measured})  # fmt: skip
        print(f"  {name} {layers} {label}: predicted/measured {plan.predicted_step_s / measured:.3f}", flush=True)
    return rows


def compile_rows(name: str, layers: int, args: argparse.Namespace) -> dict[str, Any]:
    """Time to the first planned step with ``remat.fit(..., compile=...)`` next to ``torch.compile``'s own first step.

    The memory is what is resident (parameters) plus ``--budget`` of the plain step's own peak (activations and
    gradients). ``torch.compile(model)`` (no budget) is timed from the call to the end of its first step, then its
    steps (median of three); ``remat.fit`` from the call to the end of the first training step after it (the
    fit compiles and measures every route first), then its steps. Both in plain eager steps."""
    from remat.meters import measure as measure_memory

    def fresh() -> nn.Module:
        return build(name, layers, args.hidden, args.seq, args.vocab)

    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    model = fresh()
    step = plain_step_s(model, batch)
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    with measure_memory() as meter:
        run_step(model, batch)
    memory = int(resident + args.budget * meter.peak_bytes)

    def steps(module: nn.Module) -> float:
        return plain_step_s(module, batch)

    backend = {"backend": args.backend}
    compiled = torch.compile(fresh(), **backend)
    start = time.perf_counter()
    run_step(compiled, batch)
    compile_first = time.perf_counter() - start
    compiled_step = steps(compiled)
    torch._dynamo.reset()
    model = fresh()
    start = time.perf_counter()
    handle = remat.fit(model, memory, batch=batch, compile=dict(backend, rounds=3))
    run_step(model, batch)
    fit_first = time.perf_counter() - start
    fit_step = steps(model)
    row = {
        "model": name, "layers": layers, "batch": f"{args.batch}x{args.seq}", "backend": args.backend,
        "plain_step_s": step, "memory": memory, "torch_compile_first_s": compile_first,
        "torch_compile_step_s": compiled_step, "fit_first_s": fit_first, "fit_step_s": fit_step,
        "route": handle.route, "plan": handle.plan.action_counts() if handle.plan is not None else None,
        "seconds": handle.fitted.seconds,
    }  # fmt: skip
    handle.remove()
    torch._dynamo.reset()
    print(
        f"  {name} {layers}: torch.compile first step {compile_first / step:.1f} plain steps, then "
        f"{compiled_step / step:.2f}x; remat.fit(compile) first step {fit_first / step:.1f} plain steps "
        f"({handle.route}), then {fit_step / step:.2f}x",
        flush=True,
    )
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | blocks | plain step | profile + plan, in plain steps (median [min-max]) | segments priced | "
        "distinct plans / profiles (noise rules) | without them | what the rules cost (predicted, max) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        steps = r["profile_and_plan_steps"]
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['plain_step_s']:.2f} s | {statistics.median(steps):.1f} "
            f"[{min(steps):.1f}-{max(steps):.1f}] | {r.get('segments_priced', 0)} / {len(steps)} | "
            f"{r['distinct_plans']} / {len(steps)} | "
            f"{r['distinct_plans_without_noise_rule']} / {len(steps)} | "
            + (f"{max(r['rules_cost']) * 100:.2f}% |" if r.get("rules_cost") else "|")
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--layers", default="12,24")
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--profiles", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("docs/results/time-to-plan.jsonl"))
    parser.add_argument("--tables", type=Path, default=None, help="keep each profile's cost table here (JSON)")
    parser.add_argument(
        "--predict", type=Path, default=None, help="instead: plans' predicted against measured steps, to this file"
    )
    parser.add_argument(
        "--compile", type=Path, default=None,
        help="instead: remat.fit(compile=...)'s first step next to torch.compile's, rows appended to this file",
    )  # fmt: skip
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend for --compile")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.compile is not None:
        args.compile.parent.mkdir(parents=True, exist_ok=True)
        for name in args.models.split(","):
            for layers in [int(n) for n in args.layers.split(",")]:
                with args.compile.open("a") as f:
                    f.write(json.dumps(compile_rows(name, layers, args)) + "\n")
        return
    if args.predict is not None:
        rows = [row for name in args.models.split(",") for layers in [int(n) for n in args.layers.split(",")]
                for row in prediction_rows(name, layers, args)]  # fmt: skip
        args.predict.parent.mkdir(parents=True, exist_ok=True)
        args.predict.write_text("".join(json.dumps(row) + "\n" for row in rows))
        for r in rows:
            print(f"| {r['model']} {r['layers']} | {r['plan']} | {r['actions']} | {r['predicted_s'] * 1e3:.0f} | "
                  f"{r['measured_s'] * 1e3:.0f} | {r['predicted_s'] / r['measured_s']:.3f} |")  # fmt: skip
        return
    done = [json.loads(line) for line in args.out.read_text().splitlines()] if args.out.exists() else []
    for name in args.models.split(","):
        for layers in [int(n) for n in args.layers.split(",")]:
            if any(r["model"] == name and r["layers"] == layers for r in done):
                continue
            row = measure(name, layers, args)
            done.append(row)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    print(table(done))


if __name__ == "__main__":
    main()
