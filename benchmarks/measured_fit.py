"""How often ``optimal`` under a fresh profile picks a per-operator policy where checkpointing measures faster,
and what ``remat.fitting.measured_fit.fit`` keeps instead, on the peers benchmark's models.

Per model and precision (:mod:`benchmarks.peers.models`: HF GPT-2 with dropout 0.1 and Llama, built from config), it
takes ``--profiles`` profiles as ``benchmarks/peers`` takes them (the policy menu, the loss alone held, CPU seconds with
one intra-op thread) and, per profile and budget, runs ``fit`` on a fresh copy of the model: where the plans with and
without per-operator policies differ it prints both, their measured peaks and the measured step of the one left over the
one kept. ``--disturb F`` first prices every policy at ``F`` times checkpointing's cost on each block, as a disturbed
profile may read it, so that ``optimal`` puts policies in its plan: the rows show what measuring them on the step does
with such a plan.

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_TOP_PAD_=268435456 \\
        python -m benchmarks.measured_fit [--models llama gpt2] [--dtypes fp32] [--profiles 4] [--disturb 0.9]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time

import torch

import remat
from benchmarks.peers.contenders import short_actions
from benchmarks.peers.device import precision_context
from benchmarks.peers.models import ModelSetting, build_model, make_batch
from remat.core import SELECTIVE, Action
from remat.fitting import fit


def disturbed(costs: remat.CostTable, factor: float) -> remat.CostTable:
    """``costs`` with every per-operator policy priced at ``factor`` times checkpointing's cost on its block."""
    blocks = []
    for b in costs.blocks:
        target = factor * b.time_cost("checkpoint")
        recompute, overhead = dict(b.recompute_s), dict(b.overhead_s)
        for action in b.actions:
            if Action.parse(action).kind == SELECTIVE:
                overhead[action] = target - recompute[action]
        blocks.append(dataclasses.replace(b, overhead_s=overhead))
    return dataclasses.replace(costs, blocks=blocks)


def run_setting(setting: ModelSetting, profiles: int, budgets: list[float], rounds: int, factor: float | None) -> None:
    base = build_model(setting)
    batch = make_batch(setting)
    for i in range(profiles):
        with precision_context(setting.dtype, "cpu"):
            costs = remat.profile(copy.deepcopy(base), batch, policies="menu", holds_output=False,
                                  clock=time.process_time)
        if factor is not None:
            costs = disturbed(costs, factor)
        for budget in budgets:
            model = copy.deepcopy(base)
            with precision_context(setting.dtype, "cpu"):
                result = fit(model, batch, budget, costs=costs, rounds=rounds, clock=time.process_time,
                             holds_output=False, set_to_none=False)
            kept, other = short_actions(result.plan), result.passed_over
            left = f"left {short_actions(other.plan)}: {result.passed_over_text()}" if other is not None else ""
            line = f"one plan {kept}" if other is None else f"kept {kept} ({result.chosen.name}), {left}"
            print(f"{setting.model:<6} {setting.dtype:<5} profile {i} budget {budget:.0%}: {line}", flush=True)
            result.handle.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama", "gpt2"])
    parser.add_argument("--dtypes", nargs="+", default=["fp32"])
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.25, 0.5, 0.75])
    parser.add_argument("--profiles", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5, help="fit's timed steps per plan, head to head")
    parser.add_argument("--disturb", type=float, default=None,
                        help="price every policy at this many times checkpointing's cost (0.9: a little cheaper)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 intra-op thread, CPU seconds; fit: {args.rounds} rounds head to head"
          + (f"; policies priced at {args.disturb}x checkpointing" if args.disturb is not None else ""))
    for model in args.models:
        for dtype in args.dtypes:
            run_setting(ModelSetting(model, dtype), args.profiles, args.budgets, args.rounds, args.disturb)


if __name__ == "__main__":
    main()
