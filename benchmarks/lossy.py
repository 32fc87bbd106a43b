"""Lossy storage against exact plans on a small GPT-2 trained on Shakespeare: memory, step time, final
validation loss.

    .venv/bin/python -m benchmarks.lossy                   # 4 layers x 64, 300 training steps per plan
    .venv/bin/python -m benchmarks.lossy --steps 100 --formats int8

The model is profiled once with ``lossy=formats``. Budgets: 25% and 50% of the no-checkpoint activation memory
(predicted), 90% of the least peak any exact plan reaches, and half-way between the least lossy and the least
exact peak (``--budgets`` picks some). At each budget: the best exact plan (``remat.plan(costs, "optimal",
budget)``), every block under ``compress:<format>`` and every block under ``checkpoint+compress:<first format>``
(whatever the budget), the optimal lossy plan (``allow_lossy=True``), and PGAC-Q (``remat.PGACQ``, compressing
with the first format, re-planning every step from its gradient scores). For each plan: the measured peak
activation bytes of one step (``remat.measure().activation_bytes``), the median CPU time of a step (one thread)
over ``--time-steps`` steps relative to a step with no checkpointing, and the validation loss after ``--steps``
AdamW steps (same initial weights, same batches, dropout 0.1) relative to exact training, averaged over
``--seeds`` dropout seeds (paired: exact training runs with the same seeds). Exact plans give bit-identical
gradients to no checkpointing, so their loss is the exact one and is not trained again. PGAC-Q's peak and time are
measured after 5 steps of re-planning (its mask changes with training; the column ``K/Q/R`` counts kept,
compressed and recomputed blocks over its training steps).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch
from torch import nn

import remat
from remat.bench import load_dataset
from remat.core import Action
from remat.planning import plan_error


def build(args: argparse.Namespace) -> tuple[nn.Module, Any, Any]:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    train = load_dataset("gpt2", seq_len=args.seq, batch_size=args.batch, tokenizer="bytes", seed=0)
    val = load_dataset("gpt2", seq_len=args.seq, batch_size=args.batch, tokenizer="bytes", split="val")
    config = transformers.GPT2Config(
        n_layer=args.layers, n_embd=args.embd, n_head=4, n_positions=args.seq, bos_token_id=0, eos_token_id=0,
        use_cache=False, attn_implementation="eager", **train.model_overrides(),
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train(), train, val


def run_plan(model: nn.Module, actions: list[str] | None, costs: Any, step: Any, timed: int) -> tuple[int, float]:
    """Measured peak activation bytes of one step and median step seconds under ``actions``."""
    handle = remat.apply(model, remat.Plan.from_actions(costs, actions)) if actions else None
    try:
        step()  # warm-up
        with remat.measure() as measured:
            step()
        seconds = []
        for _ in range(timed):
            start = time.process_time()
            step()
            seconds.append(time.process_time() - start)
    finally:
        if handle is not None:
            handle.remove()
    return measured.activation_bytes, statistics.median(seconds)


def run_pgacq(model: nn.Module, costs: Any, budget: int, fmt: str, step: Any, timed: int) -> tuple[int, float]:
    """Measured peak activation bytes and median step seconds of PGAC-Q after 5 steps of re-planning."""
    pgacq = remat.PGACQ(model, budget, compress=fmt, costs=costs, measure=0)
    try:
        for _ in range(5):
            step()
            pgacq.step()
        with remat.measure() as measured:
            step()
        pgacq.step()
        seconds = []
        for _ in range(timed):
            start = time.process_time()
            step()
            pgacq.step()
            seconds.append(time.process_time() - start)
    finally:
        pgacq.remove()
    return measured.activation_bytes, statistics.median(seconds)


def train_loss(
    model0: nn.Module, actions: list[str] | None, costs: Any, train: Any, val: Any, args: Any, seed: int = 0,
    pgacq: dict[str, Any] | None = None,
) -> float:  # fmt: skip
    """Validation loss after ``args.steps`` AdamW steps from ``model0``'s weights under ``actions`` (or under
    PGAC-Q with ``pgacq``'s arguments; its states per step are counted into ``pgacq["states"]``)."""
    model = copy.deepcopy(model0)
    handle = remat.apply(model, remat.Plan.from_actions(costs, actions)) if actions else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    controller = None
    if pgacq is not None:
        controller = remat.PGACQ(model, pgacq["budget"], compress=pgacq["fmt"], costs=costs, measure=0)
        controller.attach(optimizer)
    torch.manual_seed(1 + seed)
    batches = train.train_batches()
    for _ in range(args.steps):
        loss = model(**train.batch_kwargs(next(batches))).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if controller is not None:
            for state in controller.states.values():
                pgacq["states"][state] = pgacq["states"].get(state, 0) + 1
    if handle is not None:
        handle.remove()
    if controller is not None:
        controller.remove()
    model.eval()
    with torch.no_grad():
        losses = [model(**val.batch_kwargs(b)).loss.item() for b in val.val_batches(args.val_batches)]
    return statistics.fmean(losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300, help="training steps per plan")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--val-batches", type=int, default=16)
    parser.add_argument("--time-steps", type=int, default=9)
    parser.add_argument("--formats", default="int8,fp8")
    parser.add_argument("--seeds", type=int, default=1, help="dropout seeds per trained plan (paired with exact)")
    parser.add_argument(
        "--budgets", default="25,50,90,below", help="which budgets: 25, 50 (%% of no checkpointing), 90 (%% of the "
        "least exact peak), below (half-way between the least lossy and the least exact peak)"
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread and CPU time: other load on the machine blurs wall time
    formats = [f for f in args.formats.split(",") if f]
    model, train, val = build(args)
    sample = train.batch_kwargs(next(train.train_batches()))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(**sample).loss.backward()

    costs = remat.profile(model, sample, repeats=2, lossy=formats)
    model.zero_grad(set_to_none=True)
    n = len(costs)
    none_peak = remat.plan(costs, "none").predicted_peak_bytes
    try:
        remat.plan(costs, "optimal", 1)  # exact actions only: the refusal names the least exact peak
    except remat.BudgetError as error:
        exact_min = error.floor
    print(
        f"GPT-2 {args.layers} layers x {args.embd}, batch {args.batch} x {args.seq} byte tokens, Shakespeare; "
        f"{args.steps} AdamW steps (lr {args.lr}) per trained plan and seed, {args.seeds} seed(s), validation on "
        f"{args.val_batches} batches"
    )
    for row in costs.blocks:
        print(f"  {row.fqn}: " + ", ".join(
            f"{a} keeps {row.saved_bytes[a] / row.saved_bytes['keep']:.2f} of keep, grad error {row.grad_error[a]:.4f}"
            f" (cos {row.grad_cosine[a]:.6f})" for a in row.grad_error))  # fmt: skip
    print(f"no checkpointing: predicted {remat.format_bytes(none_peak)}; least exact plan "
          f"{remat.format_bytes(exact_min)} ({exact_min / none_peak:.0%})")  # fmt: skip
    base_peak, base_s = run_plan(model, None, costs, step, args.time_steps)
    seeds = range(args.seeds)
    exact_losses = [train_loss(model, None, costs, train, val, args, s) for s in seeds]
    exact_loss = statistics.fmean(exact_losses)
    print(f"none: measured {remat.format_bytes(base_peak)}, {base_s * 1e3:.1f} ms CPU/step, val loss {exact_loss:.4f}")
    print(f"{'budget':>16}  {'plan':<14} {'measured':>10} {'fits':>4} {'time/none':>9} {'val loss/exact':>14}  "
          f"{'grad err':>8}  actions")  # fmt: skip
    losses: dict[tuple[str, ...], float] = {}
    try:
        remat.plan(costs, "optimal", 1, allow_lossy=True)
    except remat.BudgetError as error:
        lossy_min = error.floor
    print(f"least lossy plan: {remat.format_bytes(lossy_min)} ({lossy_min / exact_min:.1%} of the least exact)")
    budgets = {
        "25": ("25%", none_peak // 4),
        "50": ("50%", none_peak // 2),
        "90": ("90% exact min", exact_min * 9 // 10),
        "below": ("below exact min", (lossy_min + exact_min) // 2),
    }
    for label, budget in (budgets[key] for key in args.budgets.split(",") if key):
        rows: list[tuple[str, list[str] | None, str]] = []
        try:
            rows.append(("best exact", list(remat.plan(costs, "optimal", budget).actions.values()), ""))
        except remat.BudgetError as error:
            rows.append(("best exact", None, f"no plan: floor {remat.format_bytes(error.floor)}"))
        for fmt in formats:
            rows.append((f"all {fmt}", [f"compress:{fmt}"] * n, ""))
        if formats:
            rows.append((f"all C+{formats[0]}", [f"checkpoint+compress:{formats[0]}"] * n, ""))
            rows.append((f"all R+{formats[0]}", [f"recompute+compress:{formats[0]}"] * n, ""))
        try:
            rows.append(
                ("optimal lossy", list(remat.plan(costs, "optimal", budget, allow_lossy=True).actions.values()), "")
            )
        except remat.BudgetError as error:
            rows.append(("optimal lossy", None, f"no plan: floor {remat.format_bytes(error.floor)}"))
        if formats:
            rows.append(("PGAC-Q " + formats[0], ["pgacq"], ""))
        for name, actions, note in rows:
            if actions == ["pgacq"]:
                try:
                    peak, seconds = run_pgacq(model, costs, budget, formats[0], step, args.time_steps)
                except remat.BudgetError as error:
                    print(f"{label + ' ' + remat.format_bytes(budget):>16}  {name:<14} no plan: floor "
                          f"{remat.format_bytes(error.floor)}")  # fmt: skip
                    continue
                states: dict[str, int] = {}
                spec = {"budget": budget, "fmt": formats[0], "states": states}
                ratio = _ratio([train_loss(model, None, costs, train, val, args, s, spec) for s in seeds], exact_losses)
                total = max(1, sum(states.values()))
                mix = "/".join(f"{states.get(k, 0) / total:.0%}" for k in ("keep", "compress", "recompute"))
                print(f"{label + ' ' + remat.format_bytes(budget):>16}  {name:<14} {remat.format_bytes(peak):>10} "
                      f"{'yes' if peak <= budget else 'NO':>4} {seconds / base_s:>9.2f} {ratio:>14.4f}  "
                      f"{'':>8}  K/Q/R {mix} of block-steps")  # fmt: skip
                continue
            if actions is None:
                print(f"{label + ' ' + remat.format_bytes(budget):>16}  {name:<14} {note}")
                continue
            peak, seconds = run_plan(model, actions, costs, step, args.time_steps)
            lossy = any(Action.parse(a).is_lossy for a in actions)
            key = tuple(actions)
            if key not in losses:
                losses[key] = (
                    _ratio([train_loss(model, actions, costs, train, val, args, s) for s in seeds], exact_losses)
                    if lossy
                    else 1.0
                )
            plan = remat.Plan.from_actions(costs, actions)
            print(f"{label + ' ' + remat.format_bytes(budget):>16}  {name:<14} {remat.format_bytes(peak):>10} "
                  f"{'yes' if peak <= budget else 'NO':>4} {seconds / base_s:>9.2f} {losses[key]:>14.4f}  "
                  f"{plan_error(costs, plan):>8.4f}  {' '.join(_short(a) for a in actions)}")  # fmt: skip


def _ratio(losses: list[float], exact: list[float]) -> float:
    """Mean over seeds of the validation loss relative to exact training with the same seed."""
    return statistics.fmean(a / b for a, b in zip(losses, exact, strict=True))


def _short(action: str) -> str:
    return {"keep": "K", "checkpoint": "C", "selective:dots_saveable": "S", "offload": "O"}.get(
        action,
        action.replace("checkpoint+compress:", "C+").replace("recompute+compress:", "R+").replace("compress:", "Q:"),
    )


if __name__ == "__main__":
    main()
