"""How long the optimal planner takes on long heterogeneous chains (target: under a second for 1,000 blocks).

Run: ``python -m benchmarks.plan_speed``. Each chain has blocks of five different sizes with their own
keep / checkpoint / selective costs; budgets are fractions of the no-checkpoint activation memory. Prints the
best wall time of three runs, the predicted recompute time next to full checkpointing's, and whether the
search was exact or thinned its fronts.
"""

from __future__ import annotations

import random
import time

from remat.core import BlockCost, CostTable, format_bytes
from remat.planning import STRATEGIES, minimum_peak_bytes, no_checkpoint_peak, optimal

SELECTIVE = "selective:dots_saveable"


def heterogeneous_chain(n: int, seed: int = 0) -> CostTable:
    """Blocks of 0.5x to 4x a base size (8 MB outputs, 1 ms forward), each with its own proportions."""
    rng = random.Random(seed)
    blocks = []
    for i in range(n):
        scale = rng.choice([0.5, 1, 1, 2, 4]) * rng.uniform(0.8, 1.25)
        out = int(8e6 * scale)
        fwd = 1e-3 * scale * rng.uniform(0.8, 1.2)
        saved = {
            "keep": int(out * rng.uniform(10, 20)),
            "checkpoint": out + 64,
            SELECTIVE: int(out * rng.uniform(3, 8)),
        }
        recompute = {"keep": 0.0, "checkpoint": fwd, SELECTIVE: fwd * rng.uniform(0.1, 0.3)}
        blocks.append(BlockCost(f"h.{i}", fwd, 2 * fwd, out, out, saved, recompute, 2 * out, 3 * out))
    return CostTable(blocks, stem_bytes=int(8e6), head_bytes=int(100e6))


def best_of(runs: int, fn):  # noqa: ANN001, ANN201
    """Least wall and CPU seconds of ``runs`` calls (CPU time is what a busy machine does not inflate)."""
    wall = cpu = float("inf")
    result = None
    for _ in range(runs):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    return wall, cpu, result


def main() -> None:
    header = ("blocks", "budget", "wall s", "cpu s", "recompute ms", "full ckpt ms", "exact")
    print("{:>6} {:>7} {:>7} {:>7} {:>13} {:>13} {:>6}  peak / budget".format(*header))
    for n in (100, 300, 1000):
        costs = heterogeneous_chain(n)
        reference = no_checkpoint_peak(costs)
        full_ms = STRATEGIES["full"](costs).predicted_recompute_s * 1e3
        for fraction in (0.1, 0.3, 0.6):
            budget = max(minimum_peak_bytes(costs), int(fraction * reference))
            wall, cpu, plan = best_of(3, lambda costs=costs, budget=budget: optimal(costs, budget))
            print(
                f"{n:>6} {fraction:>7.0%} {wall:>7.3f} {cpu:>7.3f} {plan.predicted_recompute_s * 1e3:>13.1f} "
                f"{full_ms:>13.1f} {plan.options['exact']!s:>6}  "
                f"{format_bytes(plan.predicted_peak_bytes)} / {format_bytes(budget)}"
            )


if __name__ == "__main__":
    main()
