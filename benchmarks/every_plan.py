"""Every plan of a small model, predicted and measured: the simulator's peak against the step's.

For each architecture of the matrix (``remat.bench.architectures``, tiny models built from their configs), one
profile of all its chains, then every plan of ``keep`` and ``checkpoint`` per block and of segment and memory-poor
groups of two or more blocks within a chain (a group may not span two chains), each applied and one training step
measured (CPU, live-tensor tracker, the step's output counted as the simulator counts it). Each row is written to
``--out`` as it is measured; the summary per architecture (how many plans, how many predicted below the measured
peak and by how much, the most above) goes to ``--markdown``.

    python -m benchmarks.every_plan [--models t5,bart,clip,gpt2,llama,bert]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import remat
from remat.bench import architectures, plan_peak

SINGLES = ("keep", "checkpoint")
GROUPS = ("segment", "memory_poor")


def chain_plans(length: int, chain: int) -> Iterator[list[str]]:
    """Every plan of one chain of ``length`` blocks: a single action per block or a group of 2+ blocks, group ids
    unique to the chain."""

    def from_block(i: int, group: int) -> Iterator[list[str]]:
        if i == length:
            yield []
            return
        for action in SINGLES:
            for rest in from_block(i + 1, group):
                yield [action, *rest]
        for size in range(2, length - i + 1):
            for kind in GROUPS:
                for rest in from_block(i + size, group + 1):
                    yield [f"{kind}:{chain}.{group}"] * size + rest

    yield from from_block(0, 0)


def run(name: str, emit: Any) -> dict[str, Any]:
    arch = next(a for a in architectures() if a.name == name)
    model, batch = arch.build(), arch.batch()
    loss = arch.loss or (lambda out: out.loss)
    chains = remat.find_chains(model)
    costs = remat.profile(model, batch, blocks=chains, loss_fn=loss, repeats=1)
    lengths = costs.chain_lengths or [len(costs)]
    started = time.perf_counter()
    rows = []
    for parts in itertools.product(*(list(chain_plans(n, k)) for k, n in enumerate(lengths))):
        actions = [a for part in parts for a in part]
        plan = remat.Plan.from_actions(costs, actions)
        peak = plan_peak(arch, model, batch, plan, chains)
        row = {"model": name, "actions": actions, "predicted": plan.predicted_peak_bytes, "measured": peak}
        emit(row)
        rows.append(row)
    below = [r for r in rows if r["predicted"] < r["measured"]]
    ratios = [r["predicted"] / r["measured"] for r in rows]
    return {"model": name, "chains": lengths, "plans": len(rows), "below": len(below),
            "most_below_bytes": max((r["measured"] - r["predicted"] for r in below), default=0),
            "least_ratio": min(ratios), "most_ratio": max(ratios),
            "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="t5,bart,clip,gpt2,llama,bert")
    parser.add_argument("--out", default="docs/results/every-plan.jsonl")
    parser.add_argument("--markdown", default="docs/results/every-plan.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")

    def emit(record: dict[str, Any]) -> None:
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")

    summaries = []
    for name in args.models.split(","):
        summary = run(name, emit)
        emit({"summary": summary})
        print(json.dumps(summary), flush=True)
        summaries.append(summary)
    lines = [
        "# Every plan of the matrix's small models: predicted over measured peak",
        "",
        f"Command: `python -m benchmarks.every_plan --models {args.models}` (CPU, live-tensor tracker)",
        "",
        "| model | chains | plans | predicted below measured | most below | predicted / measured, least-most |",
        "|---|---|---|---|---|---|",
    ]
    for s in summaries:
        lines.append(f"| {s['model']} | {s['chains']} | {s['plans']} | {s['below']} | {s['most_below_bytes']} B | "
                     f"{s['least_ratio']:.4f}-{s['most_ratio']:.4f} |")  # fmt: skip
    Path(args.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
