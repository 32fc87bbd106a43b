"""The optimal plan against the static strategies at 25%, 50% and 75% of the no-checkpoint activation memory.

For each budget: every strategy's predicted and measured peak activation memory, its predicted and measured
step time (forward and backward; strategies timed interleaved, medians over rounds) and their ratio, its
measured recompute seconds, and whether it fits. Checks printed at the end: the optimal plan's measured peak
is within the budget (+5%), its step time is no worse than any static strategy that also fits (at 50%: than
``full``), and every strategy's predicted step is within 10% of its measured one.

    python -m benchmarks.optimal_budgets [--layers 8] [--hidden 256] [--vocab 2048] [--batch 8] [--seq 128]
        [--threads N] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import remat
from remat.chains import run_step
from remat.core import format_bytes
from remat.planning import no_checkpoint_peak

STATIC = [("none", {}), ("full", {}), ("every_k", {"k": 2}), ("every_k", {"k": 3}), ("sqrt", {}),
          ("memory_poor", {}), ("random", {"fraction": 0.5, "seed": 0})]


def measure(model, batch, plans: dict[str, remat.Plan], steps: int) -> dict[str, dict]:  # noqa: ANN001
    """Each plan's peak (one step alone), then its step time and recompute seconds: medians of ``steps``
    rounds after a warm-up round, every round running each plan once (switched with ``set_plan``), so that
    drift on a busy machine touches every plan alike."""
    results: dict[str, dict] = {}
    handle = remat.apply(model, next(iter(plans.values())))
    try:
        times: dict[str, list[float]] = {label: [] for label in plans}
        recompute: dict[str, list[float]] = {label: [] for label in plans}
        for label, plan in plans.items():
            handle.set_plan(plan)
            model.zero_grad(set_to_none=True)
            with remat.measure() as mem:
                run_step(model, batch)
            results[label] = {"measured_peak": mem.activation_bytes}
        for round_ in range(steps + 1):
            for label, plan in plans.items():
                handle.set_plan(plan)
                model.zero_grad(set_to_none=True)
                handle.stats.reset()
                t0 = time.perf_counter()
                run_step(model, batch)
                if round_:
                    times[label].append(time.perf_counter() - t0)
                    recompute[label].append(handle.stats.total_seconds)
        for label in plans:
            results[label].update(step_s=statistics.median(times[label]),
                                  recompute_s=statistics.median(recompute[label]))
        return results
    finally:
        handle.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per block and action in the profile")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab,
                        n_positions=args.seq, use_cache=False)
    model = GPT2LMHeadModel(config)
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    batch = {"input_ids": ids, "labels": ids}
    started = time.perf_counter()
    costs = remat.profile(model, batch, repeats=args.repeats)
    profile_s = time.perf_counter() - started
    rich = no_checkpoint_peak(costs)
    print(f"GPT-2 style: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
          f"batch {args.batch}x{args.seq}, dropout 0.1, CPU, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"no-checkpoint activation memory (predicted): {format_bytes(rich)}")
    blocks_ms = sum(b.fwd_s + b.bwd_s for b in costs.blocks) * 1e3
    print(f"profile: {profile_s:.1f} s ({args.repeats} repeats); blocks kept {blocks_ms:.1f} ms, step outside "
          f"them {(costs.outside_s or 0.0) * 1e3:.1f} ms")
    rows, checks = [], []
    for fraction in (0.25, 0.5, 0.75):
        budget = int(fraction * rich)
        print(f"\nbudget {fraction:.0%} = {format_bytes(budget)}")
        print(f"{'strategy':<14}{'predicted':>12}{'measured':>12}{'fits':>6}{'pred step':>10}{'step ms':>10}"
              f"{'pred/meas':>10}{'recompute ms':>14}")
        plans = {}
        for name, opts in [(name, opts) for name, opts in STATIC] + [("optimal", {})]:
            try:
                plan = remat.plan(costs, name, budget, strict=False, **opts)
            except remat.BudgetError as err:
                print(f"{name:<14} {err}")
                continue
            plans[name + (f"(k={opts['k']})" if "k" in opts else "")] = plan
        results = {}
        for label, result in measure(model, batch, plans, args.steps).items():
            plan = plans[label]
            fits = result["measured_peak"] <= budget * 1.05
            step_ratio = plan.predicted_step_s / result["step_s"]
            results[label] = {**result, "predicted_peak": plan.predicted_peak_bytes, "fits": fits,
                              "predicted_recompute_s": plan.predicted_recompute_s,
                              "predicted_step_s": plan.predicted_step_s, "step_ratio": step_ratio}
            print(f"{label:<14}{format_bytes(plan.predicted_peak_bytes):>12}"
                  f"{format_bytes(result['measured_peak']):>12}{'yes' if fits else 'no':>6}"
                  f"{plan.predicted_step_s * 1e3:>10.1f}{result['step_s'] * 1e3:>10.1f}{step_ratio:>10.3f}"
                  f"{result['recompute_s'] * 1e3:>14.1f}")
            rows.append({"fraction": fraction, "strategy": label, **results[label]})
        ratios = {label: r["step_ratio"] for label, r in results.items()}
        worst = max(ratios, key=lambda label: abs(ratios[label] - 1))
        checks.append((f"{fraction:.0%}: predicted / measured step within 10% for every strategy (worst: {worst} "
                       f"{ratios[worst]:.3f})", all(0.9 <= r <= 1.1 for r in ratios.values())))
        if "none" in ratios:
            # Against none's ratio: what the cost model gets wrong between plans, apart from the machine
            # running faster or slower as a whole than while it was profiled.
            relative = {label: r / ratios["none"] for label, r in ratios.items()}
            worst = max(relative, key=lambda label: abs(relative[label] - 1))
            checks.append((f"{fraction:.0%}: (predicted / measured) / none's within 10% for every strategy (worst: "
                           f"{worst} {relative[worst]:.3f})", all(0.9 <= r <= 1.1 for r in relative.values())))
        opt = results.get("optimal")
        if opt is None:
            continue
        static_fit = {k: v for k, v in results.items() if k != "optimal" and v["fits"]}
        best_static = min(static_fit.items(), key=lambda kv: kv[1]["step_s"]) if static_fit else None
        checks.append((f"{fraction:.0%}: optimal measured peak within budget+5%", opt["fits"]))
        if best_static:
            ratio = opt["step_s"] / best_static[1]["step_s"]
            checks.append((f"{fraction:.0%}: optimal step / best fitting static ({best_static[0]}) = {ratio:.3f}",
                           ratio <= 1.03))
        if fraction == 0.5 and "full" in results:
            ratio = opt["recompute_s"] / max(results["full"]["recompute_s"], 1e-9)
            checks.append((f"50%: optimal recompute / full recompute = {ratio:.3f} (target <= 0.5)", ratio <= 0.5))
            if results["full"]["fits"]:
                ratio = opt["step_s"] / results["full"]["step_s"]
                checks.append((f"50%: optimal step / full step = {ratio:.3f} (full fits)", ratio <= 1.03))
    print("\nchecks (step times within 3% count as no worse: CPU timing noise)")
    for text, ok in checks:
        print(f"  [{'ok' if ok else 'MISS'}] {text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "checks": checks}, f, indent=2)


if __name__ == "__main__":
    main()
