"""What is alive at a training step's activation peak, next to what remat's simulator predicted for that plan.

A dispatch mode records every tensor an operator makes in the step (operator, phase, shape, dtype) and drops it
when its storage is freed; at the step's highest live total it keeps a snapshot. The snapshot is printed grouped
by operator, phase (forward or backward), shape and dtype, largest first, under the plan's predicted and
measured peaks: where a prediction misses, this says which tensors make up the difference.

    python benchmarks/peak_composition.py                         # GPT-2 (peers' default size), bf16, full
    python benchmarks/peak_composition.py --dtype fp32 --strategy optimal --budget 0.5
"""

from __future__ import annotations

import argparse
import collections
import sys
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers_models as pm  # noqa: E402

import remat  # noqa: E402

Entry = tuple[str, str, tuple[int, ...], str, int]  # operator, phase, shape, dtype, bytes


class PeakSnapshot(TorchDispatchMode):
    """Live tensors made inside, by storage; ``snapshot`` holds them at the highest live total."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, Entry] = {}
        self.total = self.peak = 0
        self.snapshot: dict[int, Entry] = {}
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
                  if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.live or key in inputs or storage.nbytes() == 0:
                continue  # a view or an in-place result: no new memory
            self.live[key] = (str(func), self.phase, tuple(t.shape), str(t.dtype), storage.nbytes())
            self.total += storage.nbytes()
            weakref.finalize(storage, self._free, key)
            if self.total > self.peak:
                self.peak, self.snapshot = self.total, dict(self.live)
        return out

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.total -= entry[4]


def grouped(snapshot: dict[int, Entry]) -> list[tuple[int, int, tuple[str, str, tuple[int, ...], str]]]:
    """(bytes, count, (operator, phase, shape, dtype)) per group, largest first."""
    size: collections.Counter[Any] = collections.Counter()
    count: collections.Counter[Any] = collections.Counter()
    for op, phase, shape, dtype, nbytes in snapshot.values():
        size[(op, phase, shape, dtype)] += nbytes
        count[(op, phase, shape, dtype)] += 1
    return sorted(((b, count[k], k) for k, b in size.items()), key=lambda row: -row[0])


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
        for _ in range(2):  # the first step allocates what outlives a step (gradients)
            probe = PeakSnapshot()
            with probe:
                with pm.precision_context(args.dtype):
                    loss = model(**batch).loss  # the logits are freed here, as in the peers' step
                probe.phase = "backward"
                loss.backward()
                del loss
    finally:
        handle.remove()
    print(f"{args.model} {args.dtype} {args.strategy}: {' '.join(plan.actions.values())}")
    print(f"predicted peak {plan.predicted_peak_bytes:,} B, measured {probe.peak:,} B "
          f"(predicted - measured {plan.predicted_peak_bytes - probe.peak:+,} B); profile: stem "
          f"{costs.stem_bytes:,}, head {costs.head_bytes:,}, head retained {costs.head_retained_bytes:,}, held "
          f"arguments {costs.held_args_bytes:,} B")
    print(f"{'bytes':>12} {'count':>5}  operator, phase, shape, dtype")
    for nbytes, count, (op, phase, shape, dtype) in grouped(probe.snapshot):
        print(f"{nbytes:12,} {count:5d}  {op}, {phase}, {shape}, {dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
