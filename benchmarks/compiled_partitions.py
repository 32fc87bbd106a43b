"""remat on compiled blocks, with and without per-block partitions, against torch.compile's activation memory
budget, at the same byte budgets.

One model and precision of the peers benchmark (:mod:`benchmarks.peers.models`; GPT-2 has dropout 0.1, Llama none; under
inductor remat's partitions save the forward's seeds and stay exact with dropout, see
:mod:`remat.checkpointing.compiled_partitions`). Contenders, each on its own copy of the model:

* ``torch.compile`` of the whole model, twice (the reference and its A/A pair);
* ``block.compile()`` on each block, without remat: what compiling blocks instead of the whole model costs;
* ``torch.compile`` with ``torch._functorch.config.activation_memory_budget`` at each budget, compiled with
  remat's pass that saves the forward's random seeds (``contenders.budget_backend``; torch's partitioner
  alone may draw dropout anew in the backward, pytorch/pytorch#190758: its gradients are printed too);
* ``torch.compile`` with the ``activation_memory_budget`` that remat's ``fit_compile_budget`` finds fastest
  among those whose measured peak fits each byte budget (whole model, one graph);
* ``remat optimal`` on compiled blocks (``compile_blocks(..., partition_budgets=...)``), planned from
  ``remat.profile`` of the compiled blocks at each budget's share of torch.compile's measured peak: with the
  partitions (``partition:<b>`` actions among keep and checkpoint) and without them (keep, checkpoint and
  segments only, what remat planned on compiled blocks before partitions);
* ``fit_compiled`` at each byte budget, on a copy of its own: whichever of the two routes above (the whole
  model's fitted budget, the plan on compiled blocks) its own head-to-head rounds measure faster among those that
  fit (its whole-model grid holds the fit budgets and the byte budgets' fractions).

Peaks by ``remat.measure(allocations=True)`` (the allocator's events; they see compiled code), as ratios to
torch.compile's; steps in CPU seconds (one intra-op thread), every contender once per round, the order reversed
every other round, as ratios to torch.compile's step of the same round (median and 25th-75th percentiles).
Gradients of remat's plans (and of the blocks compiled without remat, and ``fit_compiled``'s where it chose the
blocks) are compared with keep-all on the same compiled blocks, those of torch.compile's budgets (and
``fit_compiled``'s where it chose the whole model) with torch.compile's own (every step from the same seed;
compiled code draws dropout its own way, so each is compared with its own reference).

    python -m benchmarks.compiled_partitions [--model llama] [--dtype fp32] [--rounds 10]
        [--budgets 0.25 0.5 0.75] [--partitions 0.1 0.25 0.5] [--fit-budgets 0 0.05 0.1 0.2 0.3 0.5 0.7]
        [--choice-rounds 5]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import remat
from benchmarks.peers.child import use_timing_allocator
from benchmarks.peers.contenders import PARTITION_BUDGETS, budget_backend
from benchmarks.peers.device import precision_context
from benchmarks.peers.models import ModelSetting, block_list, build_model, forward_backward, make_batch
from remat.fitting import DEFAULT_BUDGETS, compile_blocks, fit_compile_budget, fit_compiled

WITHOUT_PARTITIONS = ["keep", "checkpoint", "segment", "memory_poor"]


@dataclass
class Contender:
    name: str
    budget: float | None
    model: torch.nn.Module
    forward: Callable[..., Any]
    select: Callable[[], None] = lambda: None
    plan: remat.Plan | None = None
    detail: str = ""
    reference: Contender | None = None  # whose gradients this one's are compared with, where not the default
    peak: int = 0
    grads: list[torch.Tensor] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def step(c: Contender, batch: dict[str, torch.Tensor], dtype: str) -> float:
    c.model.zero_grad(set_to_none=True)
    c.select()
    torch.manual_seed(0)
    start = time.process_time()
    forward_backward(c.forward, batch, dtype)
    return time.process_time() - start


def compare_grads(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> str:
    """``bitwise``, or the largest absolute difference and its share of the reference's largest gradient."""
    if all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True)):
        return "bitwise"
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(grads, reference, strict=True))
    scale = max(float(b.float().abs().max()) for b in reference)
    return f"differ: max abs diff {diff:.1e} ({diff / scale:.0e} of max)"


def torch_alone(backend: str, budget: float) -> Callable[..., Any]:
    """``backend`` under ``activation_memory_budget = budget`` with nothing of remat's: torch's partitioner alone."""
    import torch._functorch.config as functorch_config
    from torch._dynamo import lookup_backend

    compiler = lookup_backend(backend)

    def budgeted(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        with functorch_config.patch(activation_memory_budget=budget):
            return compiler(graph, example_inputs)

    return budgeted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--partitions", type=float, nargs="+", default=list(PARTITION_BUDGETS))
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--fit-budgets", type=float, nargs="+", default=[0.0, *DEFAULT_BUDGETS],
                        help="the activation memory budgets fit_compile_budget tries on the whole model")
    parser.add_argument("--choice-rounds", type=int, default=5, help="fit_compiled's head-to-head rounds (0: skip it)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    use_timing_allocator()
    setting = ModelSetting(args.model, args.dtype)
    batch = make_batch(setting)
    base = build_model(setting)

    contenders = [Contender("torch.compile", None, m := copy.deepcopy(base), torch.compile(m, backend=args.backend))]
    contenders.append(
        Contender("torch.compile (A/A)", None, m := copy.deepcopy(base), torch.compile(m, backend=args.backend))
    )
    for b in args.budgets:
        contenders.append(
            Contender(
                "torch.compile + activation_memory_budget",
                b,
                m := copy.deepcopy(base),
                torch.compile(m, backend=budget_backend(args.backend, b)),
            )
        )
    plain_blocks = copy.deepcopy(base)
    for block in block_list(plain_blocks):  # what compiling blocks costs without remat: the floor of remat's plans
        block.compile(backend=args.backend)
    per_block = Contender("block.compile() on each block, no remat", None, plain_blocks, plain_blocks)
    blocks = copy.deepcopy(base)
    compile_blocks(blocks, backend=args.backend, partition_budgets=args.partitions)
    started = time.perf_counter()
    with precision_context(setting.dtype, "cpu"):
        costs = remat.profile(blocks, batch, clock=time.process_time, holds_output=False)
    profile_s = time.perf_counter() - started
    keep_plan = remat.plan(costs, "none")
    handle = remat.apply(blocks, keep_plan)
    keep_all = Contender(
        "remat keep-all on compiled blocks", None, blocks, blocks, select=lambda: handle.set_plan(keep_plan),
        plan=keep_plan,
    )  # fmt: skip

    def measure(c: Contender) -> None:
        for _ in range(2):
            step(c, batch, setting.dtype)
        with remat.measure("cpu", allocations=True) as meter:
            step(c, batch, setting.dtype)
        c.peak = meter.activation_bytes
        c.grads = [p.grad.clone() for p in c.model.parameters()]

    for c in contenders:
        measure(c)
    measure(per_block)
    measure(keep_all)
    reference = contenders[0].peak
    fitted_model = copy.deepcopy(base)
    autocast = torch.bfloat16 if setting.dtype == "bf16" else None
    trials = fit_compile_budget(  # every budget measured once; each byte budget chooses from the same trials
        fitted_model, batch, 1.0, budgets=args.fit_budgets, backend=args.backend, autocast=autocast,
        clock=time.process_time, holds_output=False,
    )  # fmt: skip
    for b in args.budgets:
        try:
            fit = trials.refit(int(b * reference))
        except remat.BudgetError as err:
            print(f"fit_compile_budget at {b:g}: {err}")
            continue
        print(f"fit_compile_budget at {b:g}:\n{fit.describe()}")
        c = Contender(
            "torch.compile, budget fitted by remat", b, fitted_model, fit.compile(fitted_model),
            detail=f"budget={fit.budget:g}",
        )  # fmt: skip
        measure(c)
        contenders.append(c)
    chosen: list[Contender] = []
    for b in args.budgets if args.choice_rounds else ():
        own = copy.deepcopy(base)
        try:
            choice = fit_compiled(
                own, batch, int(b * reference), budgets=sorted({*args.fit_budgets, *args.budgets}),
                partition_budgets=args.partitions, backend=args.backend, autocast=autocast, rounds=args.choice_rounds,
                clock=time.process_time, holds_output=False,
            )  # fmt: skip
        except remat.BudgetError as err:
            print(f"fit_compiled at {b:g}: {err}")
            continue
        print(f"fit_compiled at {b:g}:\n{choice.describe()}")
        c = Contender(
            "remat fit_compiled", b, own, choice.module, detail=f"{choice.route}: {choice.chosen.detail}",
            reference=keep_all if choice.handle is not None else contenders[0],
        )  # fmt: skip
        measure(c)
        contenders.append(c)
        chosen.append(c)
    for b in args.budgets:
        for name, actions in (
            ("remat optimal, partitions", None),
            ("remat optimal, no partitions", WITHOUT_PARTITIONS),
        ):
            try:
                plan = remat.plan(costs, "optimal", int(b * reference), actions=actions)
            except remat.BudgetError as err:
                print(f"{name} at {b:g}: {err}")
                continue
            c = Contender(name, b, blocks, blocks, select=lambda plan=plan: handle.set_plan(plan), plan=plan)
            measure(c)
            contenders.append(c)
    # What torch's partitioner gives on its own (without remat's seed-saving pass, which budget_backend adds):
    # one step at each budget, its gradients against torch.compile's
    alone: list[str] = []
    for b in args.budgets:
        m = copy.deepcopy(base)
        c = Contender("torch alone", b, m, torch.compile(m, backend=torch_alone(args.backend, b)))
        step(c, batch, setting.dtype)
        step(c, batch, setting.dtype)
        grads = [p.grad.clone() for p in c.model.parameters()]
        alone.append(f"{b:g}: {compare_grads(grads, contenders[0].grads)}")
    # remat at the peak torch.compile's budget measured: the comparison at the same measured peak
    same_peak: list[tuple[Contender, Contender]] = []
    for peer in [c for c in contenders if c.name.startswith("torch.compile +")]:
        try:
            plan = remat.plan(costs, "optimal", peer.peak)
        except remat.BudgetError:
            continue
        c = Contender(
            f"remat optimal, partitions, at the peak of torch's budget {peer.budget:g}",
            peer.peak / reference,
            blocks,
            blocks,
            select=lambda plan=plan: handle.set_plan(plan),
            plan=plan,
        )
        measure(c)
        contenders.append(c)
        same_peak.append((peer, c))
    timed = [*contenders, per_block, keep_all]
    for r in range(args.rounds):
        for c in timed if r % 2 == 0 else timed[::-1]:
            c.seconds.append(step(c, batch, setting.dtype))
    for r in range(args.rounds):
        for c in timed:
            c.ratios.append(c.seconds[r] / contenders[0].seconds[r])

    print(f"# remat on compiled blocks with partitions, against torch.compile's budget ({args.model} {args.dtype})\n")
    print(f"Command: `python -m benchmarks.compiled_partitions {' '.join(sys.argv[1:] if argv is None else argv)}`  ")
    print(
        f"torch {torch.__version__}, backend `{args.backend}`, 1 intra-op thread, {args.rounds} rounds; "
        f"partition budgets {args.partitions}; profile of the compiled blocks {profile_s:.1f} s wall; "
        f"torch.compile's peak {reference / 2**20:.2f} MiB, step {statistics.median(contenders[0].seconds) * 1e3:.1f} "
        "ms CPU\n"
    )
    print(
        "| contender | budget | plan | peak/ref | fits | step/ref median [q1-q3] | pred/meas step | pred/meas peak | "
        "gradients |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for c in timed:
        q = statistics.quantiles(c.ratios, n=4) if len(c.ratios) > 1 else [c.ratios[0]] * 3
        fits = "—" if c.budget is None else ("yes" if c.peak <= c.budget * reference * 1.02 else "no")
        plan = c.detail or "—"
        pred_step = pred_peak = grads = "—"
        if c.reference is not None:
            grads = compare_grads(c.grads, c.reference.grads)
        elif c.plan is not None:
            sim = remat.simulate(costs, c.plan.actions)
            plan = " ".join(a.replace("partition:", "P") for a in c.plan.actions.values())
            pred_step = f"{sim.step_s / statistics.median(c.seconds):.2f}"
            pred_peak = f"{sim.peak_bytes / c.peak:.2f}"
            grads = compare_grads(c.grads, keep_all.grads)
        elif c is per_block:
            grads = compare_grads(c.grads, keep_all.grads)
        elif c is not contenders[0]:
            grads = compare_grads(c.grads, contenders[0].grads)
        budget = "ref" if c.budget is None else f"{c.budget:.0%}"
        print(
            f"| {c.name} | {budget} | {plan} | {c.peak / reference:.2f} | {fits} | {q[1]:.2f} [{q[0]:.2f}-{q[2]:.2f}] "
            f"| {pred_step} | {pred_peak} | {grads} |"
        )
    print("\nAt the same measured peak (remat planned at the peak torch.compile's budget reached; paired per round):\n")
    print(
        "| torch.compile budget | its peak/ref | its step/ref | remat plan | remat peak/ref | remat step/ref | "
        "remat / torch.compile |"
    )
    print("|---|---|---|---|---|---|---|")
    for peer, c in same_peak:
        paired = statistics.median(a / b for a, b in zip(c.seconds, peer.seconds, strict=True))
        plan = " ".join(a.replace("partition:", "P") for a in c.plan.actions.values())
        print(
            f"| {peer.budget:g} | {peer.peak / reference:.2f} | {statistics.median(peer.ratios):.2f} | {plan} | "
            f"{c.peak / reference:.2f} | {statistics.median(c.ratios):.2f} | {paired:.3f} |"
        )
    print(
        "\ntorch.compile's budgets as torch compiles them alone, without the pass that saves the forward's seeds "
        "(the rows above have it), gradients against torch.compile's: " + "; ".join(alone)
    )
    print("\nfit_compiled against torch.compile's own budget at each byte budget (paired per round):\n")
    print("| byte budget | fit_compiled's route | its peak/ref | its step/ref | torch's budget at the fraction: "
          "peak/ref, step/ref | fit_compiled / it | torch.compile, budget fitted by remat: step/ref | "
          "fit_compiled / it |")
    print("|---|---|---|---|---|---|---|---|")
    for c in chosen:
        cells = []
        for name in ("torch.compile + activation_memory_budget", "torch.compile, budget fitted by remat"):
            peer = next((p for p in contenders if p.name == name and p.budget == c.budget), None)
            if peer is None:
                cells += ["no fit", "—"] if name.endswith("by remat") else ["—", "—"]
                continue
            paired = statistics.median(a / b for a, b in zip(c.seconds, peer.seconds, strict=True))
            over = "" if peer.peak <= c.budget * reference * 1.02 else " (over)"
            head = f"{peer.peak / reference:.2f}{over}, " if name.startswith("torch.compile +") else ""
            cells += [f"{head}{statistics.median(peer.ratios):.2f}", f"{paired:.3f}"]
        print(f"| {c.budget:.0%} | {c.detail} | {c.peak / reference:.2f} | {statistics.median(c.ratios):.2f} | "
              + " | ".join(cells) + " |")
    print("\nAt each byte budget, what fits, fastest first (step/ref median):\n")
    for b in args.budgets:
        fitting = [c for c in timed if c.budget == b and c.peak <= b * reference * 1.02]
        ranked = sorted(fitting, key=lambda c: statistics.median(c.ratios))
        listed = "; ".join(
            f"{c.name}{f' ({c.detail})' if c.detail else ''} {statistics.median(c.ratios):.2f}" for c in ranked
        )
        print(f"- {b:.0%}: {listed or 'nothing'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
