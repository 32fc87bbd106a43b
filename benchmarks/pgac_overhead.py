"""What PGAC's controller costs: step time of PGAC against the same masks applied statically (scores off),
the controller's own time per step, and the measured peak memory of both. Optionally, a run of the learned
gamma schedule on real step times.

Two copies of a GPT-2 model (Hugging Face ``GPT2LMHeadModel``, dropout on) train on the same batches with the
same dropout seeds. Copy A runs PGAC attached to its optimizer (scoring every block in every backward, EMA,
threshold, budget fit and plan switch after every optimizer step). Copies B and C run ``remat.apply`` with, at
each step, exactly the plan PGAC chose for A at that step, and nothing else; C against B shows the noise floor
of the machine. Steps rotate A/B/C after a warm-up, so drifts in machine load hit all alike; medians of wall
and process CPU time are compared. PGAC's own work is also timed directly (its forward observer and gradient
hooks, and the update after the optimizer step).

    .venv/bin/python -m benchmarks.pgac_overhead [--layers 6] [--embd 256] [--seq 128] [--batch 4]
        [--steps 40] [--budget 0.5] [--learned-steps 0] [--threads 1] [--json PATH]

Target: PGAC / static step-time ratio at most 1.01, and PGAC's measured activation peak not above the
static run's.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Any

import torch

import remat
from remat.dynamic.pgac import LearnedGamma


def make_model(layers: int, embd: int, seq: int, seed: int = 0) -> torch.nn.Module:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=layers,
        n_embd=embd,
        n_head=max(1, embd // 64),
        n_positions=seq,
        vocab_size=512,
        attn_implementation="sdpa",
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).train()


def batch_at(step: int, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(step))


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, seed: int) -> tuple[float, float]:
    """Wall seconds and process CPU seconds of one training step (CPU time is less disturbed by other jobs)."""
    wall, cpu = time.perf_counter(), time.process_time()
    torch.manual_seed(seed)
    model(x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - wall, time.process_time() - cpu


def norm_microbench(shape: tuple[int, ...], blocks: int, repeats: int = 20) -> float:
    """Seconds per step of the scoring arithmetic alone: ``||delta * a||`` for every block."""
    a, d = torch.randn(shape), torch.randn(shape)
    start = time.perf_counter()
    for _ in range(repeats):
        for _ in range(blocks):
            torch.linalg.vector_norm(d * a).float()
    return (time.perf_counter() - start) / repeats


def instrument(pgac: Any) -> list[float]:
    """Accumulate the seconds spent in PGAC's forward observer and gradient hooks (the in-step scoring)."""
    spent = [0.0]
    scorer = pgac.scorer

    def timed(fn: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[0] += time.perf_counter() - start

        return wrapper

    scorer._remove()  # re-register the observer through the timer
    scorer._remove = pgac.handle.add_output_observer(timed(scorer._observe))
    scorer._on_grad = timed(scorer._on_grad)  # hooks look the method up at registration
    return spent


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    model_a = make_model(args.layers, args.embd, args.seq)
    model_b, model_c = copy.deepcopy(model_a), copy.deepcopy(model_a)
    sample = batch_at(0, args.batch, args.seq)
    # Profiled on a fourth copy, so that the three timed copies have the same history.
    costs = remat.profile(copy.deepcopy(model_a), {"input_ids": sample, "labels": sample})
    models = {"a": model_a, "b": model_b, "c": model_c}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    pgac = remat.PGAC(model_a, args.budget, alpha=0.9, costs=costs).attach(opts["a"])
    statics = {"b": remat.apply(model_b, pgac.plan), "c": remat.apply(model_c, pgac.plan)}
    in_step = instrument(pgac)
    times: dict[str, list[tuple[float, float]]] = {"a": [], "b": [], "c": []}
    plans, hook_times = [], []
    for step in range(args.warmup + args.steps):
        x = batch_at(step + 1, args.batch, args.seq)
        for handle in statics.values():
            handle.set_plan(pgac.plan)  # B and C run exactly the plan A runs in this step
        plans.append(tuple(pgac.plan.actions.values()))
        order = "abc"[step % 3 :] + "abc"[: step % 3]
        for k in order:
            in_step[0] = 0.0
            t = train_step(models[k], opts[k], x, seed=step)
            if step >= args.warmup:
                times[k].append(t)
                if k == "a":
                    hook_times.append(in_step[0])
    # Memory of one more step each, under the same plan.
    x = batch_at(10_000, args.batch, args.seq)
    statics["b"].set_plan(pgac.plan)
    with remat.measure() as mem_a:
        torch.manual_seed(0)
        model_a(x, labels=x).loss.backward()
    with remat.measure() as mem_b:
        torch.manual_seed(0)
        model_b(x, labels=x).loss.backward()
    updates = [r.update_s for r in list(pgac.history)[args.warmup :]]
    wall = {k: statistics.median(t for t, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    med_a, med_b = wall["a"], wall["b"]
    hidden = (args.batch, args.seq, args.embd)
    result = {
        "config": vars(args),
        "budget_bytes": pgac.budget_bytes,
        "distinct_plans": len(set(plans)),
        "stored_blocks_last": sum(pgac.mask.values()),
        "step_s_pgac_median": med_a,
        "step_s_static_median": med_b,
        "ratio_of_medians": med_a / med_b,
        "noise_ratio_static_c_over_b": wall["c"] / med_b,
        "cpu_s_pgac_median": cpu["a"],
        "cpu_s_static_median": cpu["b"],
        "cpu_ratio_of_medians": cpu["a"] / cpu["b"],
        "cpu_noise_ratio_static_c_over_b": cpu["c"] / cpu["b"],
        "controller_update_s_median": statistics.median(updates),
        "scoring_hooks_s_per_step": statistics.median(hook_times),
        "controller_s_per_step": statistics.median(hook_times) + statistics.median(updates),
        "scoring_arith_s_per_step": norm_microbench(hidden, args.layers),
        "activation_bytes_pgac": mem_a.activation_bytes,
        "activation_bytes_static": mem_b.activation_bytes,
        "peak_bytes_pgac": mem_a.peak_bytes,
        "peak_bytes_static": mem_b.peak_bytes,
        "predicted_peak_bytes": pgac.plan.predicted_peak_bytes,
    }
    pgac.remove()
    for handle in statics.values():
        handle.remove()
    return result


def learned_run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train with gamma="learned" on real step times; report per window of steps."""
    model = make_model(args.layers, args.embd, args.seq)
    sample = batch_at(0, args.batch, args.seq)
    costs = remat.profile(model, {"input_ids": sample, "labels": sample})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gamma = LearnedGamma(init=args.learned_init)
    pgac = remat.PGAC(
        model, args.learned_budget, alpha=0.9, costs=costs, gamma=gamma, total_steps=args.learned_steps
    ).attach(opt)
    pgac.clock = time.process_time  # the reward's step time in CPU seconds: steadier on a shared machine
    for step in range(args.learned_steps):
        train_step(model, opt, batch_at(step + 1, args.batch, args.seq), seed=step)
    records = list(pgac.history)
    window = max(1, args.learned_steps // 8)
    rows: list[dict[str, Any]] = []
    for start in range(0, len(records), window):
        chunk = records[start : start + window]
        times = [r.step_time_s for r in chunk if r.step_time_s is not None]
        middle = min(1.0, (start + len(chunk) / 2) / args.learned_steps)
        rows.append(
            {
                "steps": f"{start}-{start + len(chunk) - 1}",
                "net_gamma": pgac.schedule.mean(middle),
                "sampled_gamma_mean": statistics.mean(r.gamma for r in chunk),
                "stored_mean": statistics.mean(sum(a == "keep" for a in r.next_actions) for r in chunk),
                "step_s_median": statistics.median(times) if times else float("nan"),
            }
        )
    by_stored: dict[int, list[float]] = {}
    for r in records:
        if r.step_time_s is not None:
            by_stored.setdefault(sum(a == "keep" for a in r.actions), []).append(r.step_time_s)
    rows.append({"step_s_median_by_stored": {k: round(statistics.median(v), 4) for k, v in sorted(by_stored.items())}})
    rows.append({"budget_bytes": pgac.budget_bytes, "updates": pgac.schedule.updates})
    pgac.remove()
    return rows


def report(args: argparse.Namespace, o: dict[str, Any]) -> None:
    print(
        f"budget {remat.format_bytes(o['budget_bytes'])}; {o['distinct_plans']} distinct plans over the run; "
        f"{o['stored_blocks_last']}/{args.layers} blocks stored at the end"
    )
    print(
        f"step time  PGAC {o['step_s_pgac_median'] * 1e3:8.1f} ms   static {o['step_s_static_median'] * 1e3:8.1f} ms"
        f"   ratio {o['ratio_of_medians']:.4f}   (second static copy / static: {o['noise_ratio_static_c_over_b']:.4f})"
    )
    print(
        f"CPU time   PGAC {o['cpu_s_pgac_median'] * 1e3:8.1f} ms   static {o['cpu_s_static_median'] * 1e3:8.1f} ms"
        f"   ratio {o['cpu_ratio_of_medians']:.4f}   (second static copy / static: "
        f"{o['cpu_noise_ratio_static_c_over_b']:.4f})"
    )
    base = o["step_s_static_median"]
    print(
        f"PGAC's own work per step (medians): {o['controller_s_per_step'] * 1e3:.2f} ms = "
        f"{o['controller_s_per_step'] / base:.3%} of a static step "
        f"(scoring in forward/backward hooks {o['scoring_hooks_s_per_step'] * 1e3:.2f} ms, "
        f"update: EMA, threshold, budget fit, set_plan {o['controller_update_s_median'] * 1e3:.3f} ms; "
        f"the norm arithmetic alone {o['scoring_arith_s_per_step'] * 1e3:.2f} ms)"
    )
    print(
        f"activation peak  PGAC {o['activation_bytes_pgac']:,} B   static {o['activation_bytes_static']:,} B   "
        f"predicted {o['predicted_peak_bytes']:,} B"
    )
    print(f"total peak       PGAC {o['peak_bytes_pgac']:,} B   static {o['peak_bytes_static']:,} B")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40, help="timed steps (0: skip the overhead comparison)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.5, help="fraction of the no-checkpoint peak")
    parser.add_argument("--learned-steps", type=int, default=0, help="also run gamma='learned' this long")
    parser.add_argument("--learned-budget", type=float, default=0.7)
    parser.add_argument("--learned-init", type=float, default=1.6, help="the learned net's starting gamma")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier timings)")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    result: dict[str, Any] = {}
    if args.steps > 0:
        result["overhead"] = overhead(args)
        report(args, result["overhead"])
    if args.learned_steps:
        result["learned"] = learned_run(args)
        print(
            f"\nlearned gamma over {args.learned_steps} steps from gamma {args.learned_init} "
            f"(budget {args.learned_budget} of no-checkpoint; net gamma: the final net at each window's fraction):"
        )
        for row in result["learned"]:
            if "steps" in row:
                print(
                    f"  steps {row['steps']:>9}  net gamma {row['net_gamma']:.3f}"
                    f"  sampled {row['sampled_gamma_mean']:.3f}  stored next {row['stored_mean']:.2f}"
                    f"  step {row['step_s_median'] * 1e3:.1f} ms"
                )
            else:
                print(" ", row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
