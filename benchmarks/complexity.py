"""The complexity table of seed 001 measured: peak activation memory and block re-executions against chain length.

For a chain of L equal residual MLP blocks (L = 4, 16, 64 by default) and each strategy (``none``, ``full``,
``sqrt``, ``memory_poor``) it runs one training step with the plan applied and prints

* the measured peak activation memory (``remat.measure().activation_bytes``) and its log-log slope against L
  (seed 001 expects about 1 for none, 0.5 for sqrt and 0 for memory-poor; ``full`` is O(L) with a small
  constant: one stored input per block);
* the block re-executions counted by the runtime (``handle.stats.total_calls``: 0, L, L and L(L-1)/2);
* the simulator's prediction from a profiled CostTable next to the measurement, and their ratio.

The blocks are wide (hidden 4x the width) and the chain's input narrow, so the chain's memory dominates the
fixed costs before and after it. A second table does the prediction check on a GPT-2 chain (Hugging Face
``GPT2LMHeadModel`` built from a small config, dropout on).

    .venv/bin/python -m benchmarks.complexity [--lengths 4 16 64] [--width 256] [--batch 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import torch
from torch import nn

import remat

STRATEGIES = ["none", "full", "sqrt", "memory_poor"]


class Block(nn.Module):
    """``x + fc2(gelu(fc1(x)))``: saves two hidden tensors of 4x the width when kept."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


class Chain(nn.Module):
    def __init__(self, length: int, width: int, d_in: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(length)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x))).square().mean()


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) against log(x)."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)


def measure_plans(
    model: nn.Module, step: Any, costs: remat.CostTable, plans: list[tuple[str, dict[str, Any]]]
) -> list[dict[str, Any]]:
    """Run one step per plan; return measured and predicted peaks, re-executions and step seconds."""
    rows = []
    handle = remat.apply(model, remat.plan(costs, "none"))
    try:
        for strategy, options in plans:
            plan = remat.plan(costs, strategy, **options)
            handle.set_plan(plan)
            model.zero_grad(set_to_none=True)
            handle.stats.reset()
            start = time.perf_counter()
            with remat.measure() as measured:
                step()
            seconds = time.perf_counter() - start
            rows.append(
                {
                    "strategy": strategy + (f"(k={options['k']})" if "k" in options else ""),
                    "measured_bytes": measured.activation_bytes,
                    "predicted_bytes": plan.predicted_peak_bytes,
                    "ratio": plan.predicted_peak_bytes / measured.activation_bytes,
                    "reexecutions": handle.stats.total_calls,
                    "predicted_reexecutions": sum(remat.simulate(costs, plan.actions).reexecutions),
                    "step_s": seconds,
                }
            )
    finally:
        handle.remove()
    return rows


def chain_table(lengths: list[int], width: int, batch: int) -> dict[str, Any]:
    results: dict[int, list[dict[str, Any]]] = {}
    for length in lengths:
        torch.manual_seed(0)
        model = Chain(length, width)
        x = torch.randn(batch, 16)
        costs = remat.profile(model, x, policies=(), repeats=1)
        results[length] = measure_plans(model, lambda m=model, x=x: m(x).backward(), costs,
                                        [(s, {}) for s in STRATEGIES])

    print(f"\nChain of L residual MLP blocks (width {width}, hidden {4 * width}, batch {batch}, float32)")
    header = f"{'strategy':<12}" + "".join(f"{'L=' + str(n):>24}" for n in lengths) + f"{'slope':>8}"
    print("measured peak activation memory (and block re-executions in backward)")
    print(header)
    summary: dict[str, Any] = {}
    for i, strategy in enumerate(STRATEGIES):
        cells, peaks = "", []
        for n in lengths:
            row = results[n][i]
            peaks.append(row["measured_bytes"])
            cells += f"{remat.format_bytes(row['measured_bytes']):>14} ({row['reexecutions']:>5})  "
        s = slope([float(n) for n in lengths], [float(p) for p in peaks])
        summary[strategy] = {"slope": s, "by_length": {n: results[n][i] for n in lengths}}
        print(f"{strategy:<12}{cells}{s:>8.2f}")
    expected = {"none": "0", "full": "L", "sqrt": "L", "memory_poor": "L(L-1)/2"}
    checks = []
    for n in lengths:
        want = {"none": 0, "full": n, "sqrt": n, "memory_poor": n * (n - 1) // 2}
        got = {r["strategy"]: r["reexecutions"] for r in results[n]}
        checks.append(all(got[s] == want[s] for s in STRATEGIES))
    print("re-executions expected: " + ", ".join(f"{s} {e}" for s, e in expected.items())
          + ("  -> all match" if all(checks) else "  -> MISMATCH"))

    print("\npredicted (simulator, from remat.profile) vs measured peak activation memory")
    print(f"{'L':>4} {'strategy':<12} {'predicted':>12} {'measured':>12} {'ratio':>7} {'step s':>8}")
    for n in lengths:
        for row in results[n]:
            print(f"{n:>4} {row['strategy']:<12} {remat.format_bytes(row['predicted_bytes']):>12} "
                  f"{remat.format_bytes(row['measured_bytes']):>12} {row['ratio']:>7.3f} {row['step_s']:>8.2f}")
    return summary


def gpt2_table(n_layer: int, n_embd: int, batch: int, seq: int) -> list[dict[str, Any]]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, n_positions=max(128, seq), vocab_size=512,
                        bos_token_id=0, eos_token_id=0, use_cache=False, attn_implementation="eager")
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(0))
    batch_kwargs = {"input_ids": ids, "labels": ids}
    costs = remat.profile(model, batch_kwargs, repeats=1)
    plans = [("none", {}), ("full", {}), ("every_k", {"k": 2}), ("every_k", {"k": 3}), ("sqrt", {}),
             ("memory_poor", {}), ("random", {"fraction": 0.5, "seed": 0})]

    def step() -> None:
        # The loop holds the model output (the logits) through backward, as remat.profile's step does and the
        # simulator assumes; a loop that drops it first peaks lower by the logits.
        torch.manual_seed(1)
        output = model(**batch_kwargs)
        output.loss.backward()
        del output

    rows = measure_plans(model, step, costs, plans)
    print(f"\nGPT-2 chain: {n_layer} layers, width {n_embd}, batch {batch}x{seq} tokens, dropout 0.1, eager "
          "attention")
    print(f"{'strategy':<14} {'predicted':>12} {'measured':>12} {'ratio':>7} {'re-exec':>8} {'predicted':>9}")
    for row in rows:
        print(f"{row['strategy']:<14} {remat.format_bytes(row['predicted_bytes']):>12} "
              f"{remat.format_bytes(row['measured_bytes']):>12} {row['ratio']:>7.3f} {row['reexecutions']:>8} "
              f"{row['predicted_reexecutions']:>9}")
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(f"largest prediction error: {worst:.1%} (target: within 10%)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--gpt2-layers", type=int, default=12)
    parser.add_argument("--gpt2-width", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    chain = chain_table(args.lengths, args.width, args.batch)
    gpt2 = gpt2_table(args.gpt2_layers, args.gpt2_width, batch=4, seq=128)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"chain": chain, "gpt2": gpt2, "torch": torch.__version__}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
