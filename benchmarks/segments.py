"""Segments against the same blocks checkpointed one by one: what the cost model prices alike, timed in steps.

A segment of blocks ``s..e`` re-runs them all before the backward of any, where checkpointing them one by one
re-runs each right before its own backward. Both re-run the same blocks once and save the same bytes at
their boundaries but fewer in the segment; :mod:`remat.unit_terms` charges a segment the sum of its blocks'
checkpoint costs, so where both fit, ``optimal`` may choose either. This benchmark times them side by side:
the first four of six blocks checkpointed (``CCCCKK``), as two segments of two (``GGGGKK``) and as one segment
of four (``G4KK``), on the peers benchmark's models (:mod:`peers_models`: HF GPT-2 with dropout 0.1 and Llama,
built from config), through one ``remat.apply`` handle, every plan once per round, the order reversed every
other round, CPU seconds (``time.process_time``, one intra-op thread). An A/A pair (``CCCCKK`` twice) shows the
noise floor. Per plan it prints the predicted and the measured step (medians) and the median per-round ratio to
``CCCCKK`` with the 25th-75th percentiles.

    python benchmarks/segments.py [--models llama gpt2] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers_models import ModelSetting, build_model, make_batch  # noqa: E402
from runtime_overhead import fmt, quantiles  # noqa: E402
from step_prediction import timed_step  # noqa: E402

import remat  # noqa: E402

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
    }[name]


def run_model(name: str, rounds: int) -> None:
    setting = ModelSetting(name, "fp32")
    model, batch = build_model(setting), make_batch(setting)
    for _ in range(2):
        timed_step(model, batch)
    costs = remat.profile(model, batch, clock=time.process_time, holds_output=False)
    n = len(costs.fqns)
    names = ["keep", BASE, f"{BASE} (A/A)", "GGGGKK", "G4KK"]
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
    print(f"{name}: {n} blocks, {rounds} rounds")
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
