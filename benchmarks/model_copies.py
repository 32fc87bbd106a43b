"""Whether two copies of one model step at the same speed: the peers benchmark runs every contender on a copy of
its own, so a difference between copies would read as a difference between contenders.

Per model and precision (:mod:`peers_models`: HF GPT-2 with dropout 0.1 and Llama, built from config), the same
plain step (no checkpointing, gradients zeroed in place as ``peers.py`` does) runs on ``copy.deepcopy`` copies of
one model, on copies that share its parameters and buffers (``deepcopy`` with them in its memo), and on the first
copy twice (an A/A pair), once per round, the order reversed every other round, CPU seconds with one intra-op
thread. It prints each one's median per-round ratio to the first copy, with the 25th-75th percentiles.

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/model_copies.py [--models llama gpt2] [--dtypes bf16] [--rounds 40]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers_models import ModelSetting, build_model, forward_backward, make_batch  # noqa: E402
from runtime_overhead import fmt, quantiles  # noqa: E402


def sharing_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules that holds ``model``'s own parameters and buffers."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def run_setting(setting: ModelSetting, rounds: int, copies: int) -> None:
    base = build_model(setting)
    batch = make_batch(setting)
    first = copy.deepcopy(base)
    models = {"copy 0": first, "copy 0 (A/A)": first}
    models.update({f"copy {i}": copy.deepcopy(base) for i in range(1, copies)})
    models.update({f"sharing {i}": sharing_copy(base) for i in range(1, 3)})

    def step(model: nn.Module) -> float:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        torch.manual_seed(1)
        start = time.process_time()
        forward_backward(model, batch, setting.dtype)
        return time.process_time() - start

    for model in models.values():
        for _ in range(3):
            step(model)
    names = list(models)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            seconds[name].append(step(models[name]))
    reference = seconds["copy 0"]
    print(f"{setting.model} {setting.dtype}: copy 0 {sorted(reference)[len(reference) // 2] * 1e3:.1f} ms a step")
    for name in names[1:]:
        ratios = [a / b for a, b in zip(seconds[name], reference, strict=True)]
        print(f"  {name:<14} {fmt(quantiles(ratios))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama", "gpt2"])
    parser.add_argument("--dtypes", nargs="+", default=["bf16"])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--copies", type=int, default=4, help="deep copies, the first among them")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 intra-op thread, CPU seconds, {args.rounds} interleaved rounds; "
          "ratio to copy 0, median [q1-q3]")
    for model in args.models:
        for dtype in args.dtypes:
            run_setting(ModelSetting(model, dtype), args.rounds, args.copies)


if __name__ == "__main__":
    main()
