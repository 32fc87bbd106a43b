"""remat against hand-written and torch checkpointing on a step bound by the device: a Llama of 1.2B parameters.

    python -m benchmarks.gpu_llama --device cuda --out results/gpu-llama          # on a GPU (a few minutes)
    python -m benchmarks.gpu_llama --device cpu --size tiny --out /tmp/gpu-llama   # the same run, tiny, on a CPU

The model is :mod:`benchmarks.peers.models`' ``1b`` Llama (16 layers, width 2048, MLP 8192, sequence 2048, fp32
weights) under bf16 autocast. On CUDA the batch is the largest of ``--batches`` whose step without checkpointing
runs and peaks under 90% of the device's memory. Every contender runs on the one model (same weights), switched
between steps; no optimizer runs, so the gradients every exact contender must reproduce stay the same.

Budgets are activation bytes: ``--budgets`` fractions of the measured peak of the step without checkpointing, and
``full``, the measured peak of checkpointing every block. Contenders:

* no checkpointing, twice (an A/A pair: the noise of the timings);
* ``torch.utils.checkpoint`` on every block (hand full), and on the first ``k`` blocks with ``k`` the smallest that
  fits each budget by measurement (hand first-k);
* torch's selective checkpointing on every block with a policy saving matmul and attention outputs (torch SAC);
* ``remat optimal``: ``remat.profile`` once, ``remat.plan(costs, "optimal", budget)``, ``remat.apply``;
* ``remat fit``: ``remat.fitting.fit`` at the budget (its two ``optimal`` candidates, head to head where the profile
  cannot tell them apart); its plan is then run on the shared model.

Memory: one step per contender under the allocator's peak (``max_memory_allocated`` above what was allocated before
it; on the CPU ``remat.measure()``), compared with the budget and, for remat, with the plan's predicted peak.
Gradients: the measured step's, against no checkpointing's, bitwise and by the largest difference. Timings: rounds
over every contender, the order reversed every other round, the device synchronised around each step; the table
gives the median, the spread (min-max) and the ratio to no checkpointing and to hand full. ``--compile-budget F``
adds ``torch.compile`` of the whole model under ``activation_memory_budget=F`` last, in its own time.
Each record is written to ``OUT/gpu-llama.jsonl`` as it is measured; the table to ``OUT/gpu-llama.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import remat
from remat.fitting import fit as measured_fit

from .peers.contenders import HandCheckpointed
from .peers.device import AllocatorPeak, check_device, device_name, synchronize
from .peers.models import SIZES, ModelSetting, block_list, build_model, forward_backward, make_batch

GiB = 2**30


@dataclass
class Contender:
    key: str
    name: str
    budget: str  # the budget's label ("0.5", "full") or "" for a reference row
    select: Callable[[], None]
    plan: remat.Plan | None = None
    predicted_peak: int | None = None
    predicted_step_s: float | None = None
    peak: int | None = None
    grad_max_diff: float | None = None
    bitwise: bool | None = None
    times: list[float] = field(default_factory=list)
    detail: str = ""


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = args.device
        self.setting = ModelSetting("llama", "bf16", args.size)
        self.model = build_model(self.setting).to(self.device)
        self.blocks = block_list(self.model)
        self.hand = HandCheckpointed(self.model, self.blocks)
        self.handle: Any = None
        self.batch: dict[str, torch.Tensor] = {}
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.records = self.out / "gpu-llama.jsonl"
        self.records.write_text("")

    # ----- records -----
    def emit(self, kind: str, **fields: Any) -> None:
        record = {"kind": kind, "t": round(time.time(), 3), **fields}
        with self.records.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)

    # ----- one step -----
    def step(self) -> torch.Tensor:
        return forward_backward(self.model, self.batch, "bf16", self.device)

    def zero_grads(self) -> None:
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.zero_()

    def measured_peak(self) -> int:
        self.zero_grads()
        if self.device == "cuda":
            with AllocatorPeak("cuda") as meter:
                self.step()
            return int(meter.bytes or 0)
        with remat.measure() as meter:
            self.step()
        return int(meter.peak_bytes)

    def timed_step(self) -> float:
        self.zero_grads()
        synchronize(self.device)
        start = time.perf_counter()
        self.step()
        synchronize(self.device)
        return time.perf_counter() - start

    def grads(self) -> list[torch.Tensor]:
        torch.manual_seed(0)
        self.zero_grads()
        self.step()
        return [p.grad.detach().clone() for p in self.model.parameters()]

    # ----- contenders -----
    def use_plain(self) -> None:
        self.hand.use("plain", 0)
        self.handle.set_plan(self.keep_plan)

    def use_hand(self, mode: str, k: int) -> None:
        self.handle.set_plan(self.keep_plan)
        self.hand.use(mode, k)

    def use_plan(self, plan: remat.Plan) -> None:
        self.hand.use("plain", 0)
        self.handle.set_plan(plan)

    def choose_batch(self) -> int:
        size = SIZES[self.setting.size]
        if self.device != "cuda":
            return size["batch"]
        total = torch.cuda.get_device_properties(0).total_memory
        for rows in self.args.batches:
            self.batch = make_batch(self.setting, device=self.device, batch=rows)
            try:
                self.zero_grads()
                self.step()
                with AllocatorPeak("cuda") as meter:
                    self.zero_grads()
                    self.step()
                if torch.cuda.max_memory_allocated() < 0.9 * total:
                    self.emit("batch", rows=rows, peak_gib=round(meter.bytes / GiB, 2))
                    return rows
                self.emit("batch_refused", rows=rows, why="peak over 90% of the device")
            except torch.OutOfMemoryError:
                self.emit("batch_refused", rows=rows, why="out of memory")
            self.model.zero_grad(set_to_none=True)
            self.batch = {}
            torch.cuda.empty_cache()
        raise SystemExit(f"no batch of {self.args.batches} fits without checkpointing on this device")

    def run(self) -> None:
        args = self.args
        started = time.perf_counter()
        rows = self.choose_batch()
        self.batch = make_batch(self.setting, device=self.device, batch=rows)
        self.emit("setting", **{**self.setting.describe(), "batch": rows}, device=device_name(self.device),
                  torch=torch.__version__, params=sum(p.numel() for p in self.model.parameters()))
        self.zero_grads()
        self.step()  # warm-up (and gradients allocated before any measured step)
        costs = remat.profile(self.model, self.batch, autocast="bf16", holds_output=False)
        self.emit("profile", seconds=round(costs.info["profile_s"], 2), blocks=len(costs),
                  actions=costs.blocks[0].actions, copy_bytes_per_s=costs.copy_bytes_per_s,
                  block_fwd_bwd_ms=round((costs.blocks[0].fwd_s + costs.blocks[0].bwd_s) * 1e3, 2),
                  action_cost_ms={a: round(costs.blocks[0].time_cost(a) * 1e3, 3) for a in costs.blocks[0].actions})
        self.keep_plan = remat.plan(costs, "none")
        self.handle = remat.apply(self.model, self.keep_plan)
        n = len(self.blocks)

        # references and the budgets they define
        none = Contender("none", "no checkpointing", "", self.use_plain)
        none_b = Contender("none-b", "no checkpointing (A/A)", "", self.use_plain)
        full = Contender("hand-full", "torch checkpoint, every block", "", lambda: self.use_hand("plain", n))
        sac = Contender("torch-sac", "torch selective (matmuls saved), every block", "",
                        lambda: self.use_hand("selective", n))
        contenders = [none, none_b, full, sac]
        reference_grads = None
        for c in contenders:
            c.select()
            c.peak = self.measured_peak()
            grads = self.grads()
            if reference_grads is None:
                reference_grads = grads
            self.compare(c, grads, reference_grads)
            self.emit("reference", key=c.key, peak_gib=c.peak / GiB, bitwise=c.bitwise, grad_max_diff=c.grad_max_diff)
        assert none.peak and full.peak
        budgets: dict[str, int] = {f"{b:g}": int(b * none.peak) for b in args.budgets}
        if args.full_peak:
            budgets["full"] = full.peak

        for label, budget in budgets.items():
            fraction = budget / none.peak
            self.hand_k(budget, none.peak, full.peak, n, reference_grads, contenders, label)
            try:
                plan = remat.plan(costs, "optimal", budget=fraction)
                sim = remat.simulate(costs, plan.actions)
                c = Contender(f"optimal-{label}", "remat optimal", label, lambda p=plan: self.use_plan(p), plan=plan,
                              predicted_peak=sim.peak_bytes, predicted_step_s=sim.step_s, detail=_short(plan))
                contenders.append(self.measure(c, reference_grads))
            except remat.BudgetError as err:
                self.emit("refused", key=f"optimal-{label}", why=str(err))
            self.handle.remove()  # the fit applies its own plans to the model while it chooses
            try:
                chosen = measured_fit(self.model, self.batch, fraction, costs=costs, autocast="bf16",
                                      holds_output=False, rounds=args.fit_rounds)
                chosen.handle.remove()
            except remat.BudgetError as err:
                chosen = None
                self.emit("refused", key=f"fit-{label}", why=str(err))
            finally:
                self.handle = remat.apply(self.model, self.keep_plan)
            if chosen is not None:
                plan = chosen.plan
                sim = remat.simulate(costs, plan.actions)
                c = Contender(f"fit-{label}", "remat fit", label, lambda p=plan: self.use_plan(p), plan=plan,
                              predicted_peak=sim.peak_bytes, predicted_step_s=sim.step_s, detail=_short(plan))
                contenders.append(self.measure(c, reference_grads))

        self.time_rounds(contenders)
        self.write_table(contenders, budgets, none, full, rows, time.perf_counter() - started)
        self.handle.remove()
        if args.compile_budget:
            self.compiled(args.compile_budget, none)

    def hand_k(self, budget: int, none_peak: int, full_peak: int, n: int, reference: list[torch.Tensor],
               contenders: list[Contender], label: str) -> None:
        """Adds the hand-written contender of the smallest k whose measured peak fits ``budget``: a first guess on
        the line from no checkpointing to full, then one block more or fewer while measurement says so."""
        guess = max(0, min(n, -(-(none_peak - budget) * n // max(1, none_peak - full_peak))))
        peaks: dict[int, int] = {}

        def peak_at(k: int) -> int:
            if k not in peaks:
                self.use_hand("plain", k)
                peaks[k] = self.measured_peak()
            return peaks[k]

        k = guess
        while k < n and peak_at(k) > budget:
            k += 1
        while k > 0 and peak_at(k - 1) <= budget:
            k -= 1
        if peak_at(k) > budget:
            self.emit("refused", key=f"hand-k-{label}", why="no k fits")
            return
        existing = next((c for c in contenders if c.key == f"hand-k{k}"), None)
        if existing is None:
            c = Contender(f"hand-k{k}", "torch checkpoint, first k blocks", label,
                          lambda k=k: self.use_hand("plain", k), detail=f"k={k}/{n}")
            contenders.append(self.measure(c, reference))
        else:
            existing.budget += f",{label}"

    def measure(self, c: Contender, reference: list[torch.Tensor]) -> Contender:
        c.select()
        c.peak = self.measured_peak()
        self.compare(c, self.grads(), reference)
        self.emit("contender", key=c.key, budget=c.budget, peak_gib=c.peak / GiB,
                  predicted_gib=c.predicted_peak / GiB if c.predicted_peak else None, bitwise=c.bitwise,
                  grad_max_diff=c.grad_max_diff, detail=c.detail)
        return c

    def compare(self, c: Contender, grads: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
        c.bitwise = all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))
        c.grad_max_diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(grads, reference,
                                                                                       strict=True))

    def time_rounds(self, contenders: list[Contender]) -> None:
        for r in range(self.args.rounds):
            order = contenders if r % 2 == 0 else list(reversed(contenders))
            for c in order:
                c.select()
                if r == 0:
                    self.timed_step()  # one untimed step after switching, first round only
                c.times.append(self.timed_step())
            self.emit("round", round=r, ms={c.key: round(c.times[-1] * 1e3, 2) for c in contenders})

    def write_table(self, contenders: list[Contender], budgets: dict[str, int], none: Contender, full: Contender,
                    rows: int, seconds: float) -> None:
        base = statistics.median(none.times)
        full_s = statistics.median(full.times)
        lines = [
            f"# remat on a Llama of {sum(p.numel() for p in self.model.parameters()) / 1e9:.2f}B parameters",
            "",
            f"{device_name(self.device)}, torch {torch.__version__}, bf16 autocast, batch {rows}x"
            f"{SIZES[self.setting.size]['seq']}, {len(self.blocks)} blocks; {self.args.rounds} rounds; "
            f"{seconds:.0f} s. Command: `python -m benchmarks.gpu_llama {' '.join(sys.argv[1:])}`",
            "",
            "Budgets (activation bytes): " + ", ".join(f"{k}: {v / GiB:.2f} GiB" for k, v in budgets.items()),
            "",
            "| contender | budget | peak GiB | fits | predicted GiB | step ms (min-max) | x none | x hand full | "
            "predicted step | gradients |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in contenders:
            median = statistics.median(c.times)
            fits = ""
            if c.budget:
                fits = "yes" if all(c.peak <= budgets[b] for b in c.budget.split(",")) else "**no**"
            predicted = f"{c.predicted_peak / GiB:.2f}" if c.predicted_peak else ""
            pred_step = ""
            if c.predicted_step_s and c.plan is not None:
                pred_step = f"{c.predicted_step_s / median:.2f}x measured"
            grads = "bitwise" if c.bitwise else f"max diff {c.grad_max_diff:.1e}"
            name = c.name + (f" ({c.detail})" if c.detail else "")
            lines.append(
                f"| {name} | {c.budget or '-'} | {c.peak / GiB:.2f} | {fits} | {predicted} | {median * 1e3:.1f} "
                f"({min(c.times) * 1e3:.1f}-{max(c.times) * 1e3:.1f}) | {median / base:.3f} | {median / full_s:.3f} | "
                f"{pred_step} | {grads} |"
            )
        (self.out / "gpu-llama.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))

    def compiled(self, fraction: float, none: Contender) -> None:
        """``torch.compile`` of the whole model under ``activation_memory_budget=fraction``: its compile time, its
        peak and its step against eager no checkpointing's."""
        import torch._functorch.config as functorch_config

        self.hand.use("plain", 0)
        started = time.perf_counter()
        with _functorch_budget(functorch_config, fraction):
            compiled = torch.compile(self.model)
            self.zero_grads()
            forward_backward(compiled, self.batch, "bf16", self.device)
            compile_s = time.perf_counter() - started
            self.emit("compiled", phase="compiled", budget=fraction, compile_s=round(compile_s, 1))
            self.zero_grads()
            if self.device == "cuda":
                with AllocatorPeak("cuda") as meter:
                    forward_backward(compiled, self.batch, "bf16", self.device)
                peak = meter.bytes
            else:
                peak = None
            times = []
            for _ in range(self.args.rounds):
                self.zero_grads()
                synchronize(self.device)
                t0 = time.perf_counter()
                forward_backward(compiled, self.batch, "bf16", self.device)
                synchronize(self.device)
                times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        self.emit("compiled", budget=fraction, compile_s=round(compile_s, 1), peak_gib=peak / GiB if peak else None,
                  peak_x_none=peak / none.peak if peak and none.peak else None, step_ms=round(median * 1e3, 2),
                  x_none=median / statistics.median(none.times))
        with (self.out / "gpu-llama.md").open("a") as f:
            f.write(f"\ntorch.compile (whole model, activation_memory_budget={fraction:g}): compiled in "
                    f"{compile_s:.0f} s; peak {peak / GiB if peak else float('nan'):.2f} GiB; step "
                    f"{median * 1e3:.1f} ms, {median / statistics.median(none.times):.3f}x eager no checkpointing\n")


@contextlib.contextmanager
def _functorch_budget(config: Any, fraction: float) -> Iterator[None]:
    before = config.activation_memory_budget
    config.activation_memory_budget = fraction
    try:
        yield
    finally:
        config.activation_memory_budget = before


def _short(plan: remat.Plan) -> str:
    codes = {"keep": "K", "checkpoint": "C", "offload": "O"}
    return "".join(codes.get(a, "S" if a.startswith("selective") else "G") for a in plan.actions.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--size", default="1b", choices=sorted(SIZES))
    parser.add_argument("--batches", default="16,12,8,4,2", help="batch sizes tried on CUDA, largest first")
    parser.add_argument("--budgets", default="0.25,0.5,0.75", help="fractions of no checkpointing's measured peak")
    parser.add_argument("--no-full-peak", dest="full_peak", action="store_false",
                        help="leave out the budget of full checkpointing's measured peak")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--fit-rounds", type=int, default=2, help="timed steps per candidate in remat fit")
    parser.add_argument("--compile-budget", type=float, default=None,
                        help="also torch.compile the whole model under this activation_memory_budget, last")
    parser.add_argument("--out", default="results/gpu-llama")
    args = parser.parse_args(argv)
    check_device(args.device)
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    args.budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    torch.manual_seed(0)
    Bench(args).run()


if __name__ == "__main__":
    main()
