"""What is alive at a training step's activation peak, next to what remat's simulator predicted for that plan.

remat's live-tensor tracker (the meter of ``remat.measure``) runs the step and notes, for every storage an
operator makes, the operator, the phase (forward or backward), shape and dtype; the storages alive at its peak
(survivors such as parameter gradients left out, as ``remat.measure`` leaves them) are printed grouped by those,
largest first, under the plan's predicted and measured peaks: where a prediction misses, this says which tensors
make up the difference.

    python -m benchmarks.peak_composition                         # GPT-2 (peers' default size), bf16, full
    python -m benchmarks.peak_composition --dtype fp32 --strategy optimal --budget 0.5
"""

from __future__ import annotations

import argparse
import collections
from typing import Any

import torch

import remat
from benchmarks.peers import models as pm
from remat.meters import LiveTensorTracker

Label = tuple[str, str, tuple[int, ...], str]  # operator, phase, shape, dtype


class DescribingTracker(LiveTensorTracker):
    """The live-tensor tracker, noting what made each storage it tracks (:meth:`described`)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self._func = ""
        self._labels: dict[int, tuple[Label, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self._func = str(func)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def allocated(self, event_id: int, t: torch.Tensor) -> None:
        label = (self._func, self.phase, tuple(t.shape), str(t.dtype))
        self._labels[event_id] = (label, t.untyped_storage().nbytes())

    def described(self, event_ids: set[int]) -> list[tuple[int, int, Label]]:
        """(bytes, count, label) of ``event_ids`` grouped by label, largest first."""
        size: collections.Counter[Label] = collections.Counter()
        count: collections.Counter[Label] = collections.Counter()
        for event_id in event_ids:
            label, nbytes = self._labels[event_id]
            size[label] += nbytes
            count[label] += 1
        return sorted(((b, count[k], k) for k, b in size.items()), key=lambda row: -row[0])


def tracked_step(model: Any, batch: dict[str, torch.Tensor], dtype: str) -> DescribingTracker:
    """One forward and backward (the logits freed before the backward, as in the peers' step), tracked."""
    tracker = DescribingTracker()
    with tracker:
        with pm.precision_context(dtype):
            loss = model(**batch).loss
        tracker.phase = "backward"
        loss.backward()
        del loss
    tracker.close()
    return tracker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2", choices=pm.MODELS)
    parser.add_argument("--dtype", default="bf16", choices=pm.DTYPES)
    parser.add_argument("--size", default="default", choices=sorted(pm.SIZES))
    parser.add_argument("--strategy", default="full", help="a remat strategy: none, full, optimal, ...")
    parser.add_argument("--budget", type=float, default=None, help="fraction of the no-checkpoint peak (optimal)")
    args = parser.parse_args(argv)
    setting = pm.ModelSetting(args.model, args.dtype, args.size)
    model = pm.build_model(setting)
    batch = pm.make_batch(setting)
    with pm.precision_context(args.dtype):
        costs = remat.profile(model, batch, holds_output=False)
    plan = remat.plan(costs, args.strategy, budget=args.budget)
    handle = remat.apply(model, plan)
    try:
        pm.forward_backward(model, batch, args.dtype)  # allocates what outlives a step (parameter gradients)
        tracker = tracked_step(model, batch, args.dtype)
    finally:
        handle.remove()
    measured = tracker.peak()
    print(f"{args.model} {args.dtype} {args.strategy}: {' '.join(plan.actions.values())}")
    print(
        f"predicted peak {plan.predicted_peak_bytes:,} B, measured {measured:,} B "
        f"(predicted - measured {plan.predicted_peak_bytes - measured:+,} B); profile: stem "
        f"{costs.stem_bytes:,}, head {costs.head_bytes:,}, head retained {costs.head_retained_bytes:,}, held "
        f"arguments {costs.held_args_bytes:,} B"
    )
    print(f"{'bytes':>12} {'count':>5}  operator, phase, shape, dtype")
    for nbytes, count, (op, phase, shape, dtype) in tracker.described(tracker.alive_at_peak()):
        print(f"{nbytes:12,} {count:5d}  {op}, {phase}, {shape}, {dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
