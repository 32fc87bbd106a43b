"""Segments against the same blocks checkpointed one by one: what a segment's waiting blocks cost, predicted and
timed in steps.

A segment of blocks ``s..e`` re-runs them all before the backward of any, where checkpointing them one by one re-runs
each right before its own backward. Both re-run the same blocks once and save the same bytes at their boundaries but
fewer in the segment; :mod:`remat.planning.unit_terms` charges a segment the sum of its blocks' checkpoint costs plus,
for each block but its last, the profile's ``deferred_s_per_byte`` times the bytes it saves (its recomputed activations
wait while the later blocks re-run and run backward). This benchmark times them side by side: the first four of six
blocks checkpointed (``CCCCKK``), as two segments of two (``GGGGKK``), as one segment of four (``G4KK``) and the whole
chain of six as one segment (``G6``, the plan the profile reads the price from), on the peers benchmark's models
(:mod:`benchmarks.peers.models`: HF GPT-2 with dropout 0.1 and Llama, built from config), through one ``remat.apply``
handle, every plan once per round, the order reversed every other round, CPU seconds (``time.process_time``, one
intra-op thread). An A/A pair (``CCCCKK`` twice) shows the noise floor. Per plan it prints the predicted and the
measured step (medians) and the median per-round ratio to ``CCCCKK`` with the 25th-75th percentiles. The allocator's
settings change what waiting costs (glibc returning freed memory to the system makes higher peaks slower);
``benchmarks/peers`` times with ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184
MALLOC_TOP_PAD_=268435456``.

    python -m benchmarks.segments [--models llama gpt2] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from runtime_overhead import fmt, quantiles
from step_prediction import timed_step

import remat
from benchmarks.peers.models import ModelSetting, build_model, make_batch

BASE = "CCCCKK"


def actions_of(name: str, n: int) -> list[str]:
    """The plan's actions on ``n`` blocks (at least four)."""
    rest = ["keep"] * (n - 4)
    return {
        "keep": ["keep"] * n,
        BASE: ["checkpoint"] * 4 + rest,
        f"{BASE} (A/A)": ["checkpoint"] * 4 + rest,
        "GGGGKK": ["segment:0"] * 2 + ["segment:1"] * 2 + rest,
        "G4KK": ["segment:0"] * 4 + rest,
        "G6": ["segment:0"] * n,
    }[name]


def run_model(name: str, rounds: int) -> None:
    setting = ModelSetting(name, "fp32")
    model, batch = build_model(setting), make_batch(setting)
    for _ in range(2):
        timed_step(model, batch)
    costs = remat.profile(model, batch, clock=time.process_time, holds_output=False)
    n = len(costs.fqns)
    names = ["keep", BASE, f"{BASE} (A/A)", "GGGGKK", "G4KK", "G6"]
    plans = {label: remat.Plan.from_actions(costs, actions_of(label, n), label) for label in names}
    handle = remat.apply(model, plans["keep"])
    steps: dict[str, list[float]] = {label: [] for label in names}
    for round_ in range(rounds + 2):
        for label in names if round_ % 2 == 0 else reversed(names):
            handle.set_plan(plans[label])
            seconds = sum(timed_step(model, batch))  # forward and backward
            if round_ >= 2:  # two warm-up rounds
                steps[label].append(seconds)
    handle.remove()
    rate = costs.deferred_s_per_byte * 2**20 * 1e3
    print(f"{name}: {n} blocks, {rounds} rounds; a segment's waiting block priced at {rate:.3f} ms per MiB it saves")
    print(f"{'plan':<14}{'peak MiB':>10}{'pred ms':>10}{'meas ms':>10}   / {BASE} per round [q1-q3]")
    for label, plan in plans.items():
        ratio = fmt(quantiles([a / b for a, b in zip(steps[label], steps[BASE], strict=True)]))
        print(
            f"{label:<14}{plan.predicted_peak_bytes / 2**20:>10.2f}{plan.predicted_step_s * 1e3:>10.1f}"
            f"{statistics.median(steps[label]) * 1e3:>10.1f}   {ratio}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama", "gpt2"])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.models:
        run_model(name, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
