"""The per-block policy menu on a GPT-2 block: what each action keeps and what it costs, and what the menu buys
the optimal planner.

Part 1, one block (the first of the model, on its real inputs): per action (keep, checkpoint, ``selective:<policy>`` for
every policy of ``remat.policies.MENU``, and the knapsack policies of ``remat.checkpointing.knapsack`` at ``--knapsack``
shares of the block's keep bytes) the bytes it keeps after forward (from ``remat.profile``), its recomputation in
backward (ms) and its forward overhead over a plain forward (ms). Timings are medians of ``--repeats`` rounds, the
actions interleaved in each round (order reversed every other round); the overhead is taken per round against that
round's plain forward.

Part 2, the whole model profiled with ``policies="menu"``: the optimal plan at 25%, 50% and 75% of the
no-checkpoint activation memory, without the menu (keep, checkpoint, ``selective:dots_saveable``, segments and
memory-poor groups: what a profile with the default policies offers), with it, and with it and the knapsack
policies: the predicted peak and recompute, the measured peak and recompute of applied steps (median of three),
and how many blocks take each action.

    python -m benchmarks.policy_menu [--layers 8] [--hidden 256] [--batch 8] [--seq 128] [--dropout 0.1]
        [--attention sdpa] [--knapsack 0.25,0.5,0.75] [--repeats 15] [--threads 0] [--json PATH]

Timing on CPU: run with ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184
MALLOC_TOP_PAD_=268435456`` (the script restarts itself with them when they are missing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import remat
from remat.bench import default_threads, environment
from remat.chains import (
    detached_from_step,
    main_input_slot,
    main_tensor,
    replace_slot,
    run_step,
    slot_value,
    without_caches,
)
from remat.core import CHECKPOINT, KEEP, SELECTIVE, Action
from remat.planning import no_checkpoint_peak
from remat.profiling import TimedCalls, clear_grads, run_action

TIMING_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "33554432",
    "MALLOC_TRIM_THRESHOLD_": "17179869184",
    "MALLOC_TOP_PAD_": "268435456",
}
MENU_ACTIONS = [Action.selective(p).text for p in remat.policies.MENU]
WITHOUT_MENU = [KEEP, CHECKPOINT, "selective:dots_saveable", "segment", "memory_poor"]


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    config = GPT2Config(
        n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, n_positions=args.seq, vocab_size=args.vocab,
        resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout, use_cache=False, bos_token_id=0,
        eos_token_id=0,
        attn_implementation=args.attention,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


def first_block_call(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[tuple, dict, torch.Tensor]:
    """The first block's arguments in a real forward, detached, the main input a leaf needing grad."""
    seen: list[tuple[tuple, dict]] = []
    block = model.transformer.h[0]
    hook = block.register_forward_pre_hook(lambda m, a, k: seen.append((a, k)) if not seen else None, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        hook.remove()
    args, kwargs = seen[0]
    slot = main_input_slot(args, kwargs)
    main = slot_value(args, kwargs, slot).detach().requires_grad_(True)
    return (*detached_from_step(*without_caches(*replace_slot(args, kwargs, slot, main))), main)


def time_block(
    block: torch.nn.Module, call: tuple[tuple, dict, torch.Tensor], actions: list[str], repeats: int
) -> dict:
    """Per action: median forward, recompute and forward-overhead seconds over interleaved rounds."""
    args, kwargs, main = call
    rounds: list[dict[str, tuple[float, float]]] = []
    for r in range(repeats + 1):
        order = actions if r % 2 == 0 else actions[::-1]
        got: dict[str, tuple[float, float]] = {}
        for action in order:
            timed = TimedCalls(block, torch.device("cpu"))
            t0 = time.perf_counter()
            out = main_tensor(run_action(timed, action, args, kwargs))
            t1 = time.perf_counter()
            torch.autograd.backward(out, torch.ones_like(out))
            del out
            main.grad = None
            clear_grads(block)
            got[action] = (t1 - t0, sum(timed.seconds[1:]))
        if r:  # the first round warms up
            rounds.append(got)
    return {
        a: {
            "fwd_s": statistics.median(g[a][0] for g in rounds),
            "recompute_s": statistics.median(g[a][1] for g in rounds),
            "fwd_overhead_s": statistics.median(g[a][0] - g[KEEP][0] for g in rounds),
        }
        for a in actions
    }


def applied_step(model: torch.nn.Module, batch: dict, plan: remat.Plan, steps: int = 3) -> dict[str, float]:
    handle = remat.apply(model, plan)
    try:
        model.zero_grad(set_to_none=True)
        with remat.measure() as mem:
            run_step(model, batch)
        recompute = []
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            handle.stats.reset()
            run_step(model, batch)
            recompute.append(handle.stats.total_seconds)
        return {"measured_peak": mem.activation_bytes, "measured_recompute_s": statistics.median(recompute)}
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)


def action_counts(plan: remat.Plan) -> str:
    parsed = [Action.parse(a) for a in plan.actions.values()]
    counts = Counter(a.policy if a.kind == SELECTIVE else a.kind for a in parsed)
    return ", ".join(f"{n}x {a}" for a, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--knapsack", default="0.25,0.5,0.75", help="shares of a block's keep bytes ('' for none)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: half the cores)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if any(os.environ.get(k) != v for k, v in TIMING_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **TIMING_ENV})
    torch.set_num_threads(args.threads or default_threads())

    model, batch = build(args)
    shares = [float(x) for x in args.knapsack.split(",") if x]
    t0 = time.perf_counter()
    knapsack_names = remat.checkpointing.knapsack.register_for(model, batch, shares=shares) if shares else []
    knapsack_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    costs = remat.profile(model, batch, policies=["menu", *knapsack_names], repeats=3)
    profile_s = time.perf_counter() - t0
    knapsack_actions = [Action.selective(n).text for n in knapsack_names]
    actions = [KEEP, CHECKPOINT, *MENU_ACTIONS, *knapsack_actions]
    block_times = time_block(model.transformer.h[0], first_block_call(model, batch), actions, args.repeats)
    row = costs.blocks[0]
    print(f"GPT-2 block, CPU, batch {args.batch}x{args.seq}, hidden {args.hidden}, {args.heads} heads, dropout "
          f"{args.dropout}, {args.attention} attention, {torch.get_num_threads()} threads; medians of "
          f"{args.repeats} interleaved rounds; knapsack op profile {knapsack_s:.1f} s, profile of {args.layers} "
          f"blocks with the menu and knapsacks: {profile_s:.1f} s")  # fmt: skip
    print(f"{'action':<38}{'saved':>12}{'recompute ms':>14}{'fwd overhead ms':>17}{'fwd ms':>9}")
    block_rows = []
    for action in actions:
        t = block_times[action]
        block_rows.append({"action": action, "saved_bytes": row.saved_bytes[action], **t})
        print(f"{action:<38}{remat.format_bytes(row.saved_bytes[action]):>12}{t['recompute_s'] * 1e3:>14.2f}"
              f"{t['fwd_overhead_s'] * 1e3:>17.2f}{t['fwd_s'] * 1e3:>9.2f}")  # fmt: skip

    reference = no_checkpoint_peak(costs)
    print(f"\nOptimal plans on {args.layers} blocks (no-checkpoint peak {remat.format_bytes(reference)}):")
    print(f"{'budget':>7} {'menu':>5}{'pred peak':>12}{'pred recomp ms':>16}{'meas peak':>12}{'meas recomp ms':>16}"
          "  actions")  # fmt: skip
    plan_rows = []
    for fraction in (0.25, 0.5, 0.75):
        for menu, allowed in (("no", WITHOUT_MENU), ("yes", WITHOUT_MENU + MENU_ACTIONS), ("+knap", None)):
            options = {"actions": allowed} if allowed is not None else {}
            try:
                plan = remat.plan(costs, "optimal", budget=fraction, **options)
            except remat.planning.strategies.BudgetError as error:
                print(f"{fraction:>7.0%} {menu:>5}  no plan fits: {error}")
                continue
            measured = applied_step(model, batch, plan)
            plan_rows.append({"budget": fraction, "menu": menu, "actions": plan.actions,
                              "predicted_peak": plan.predicted_peak_bytes,
                              "predicted_recompute_s": plan.predicted_recompute_s, **measured})  # fmt: skip
            print(f"{fraction:>7.0%} {menu:>5}{remat.format_bytes(plan.predicted_peak_bytes):>12}"
                  f"{plan.predicted_recompute_s * 1e3:>16.2f}{remat.format_bytes(measured['measured_peak']):>12}"
                  f"{measured['measured_recompute_s'] * 1e3:>16.2f}  {action_counts(plan)}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": environment("cpu"), "profile_s": profile_s,
                       "block": block_rows, "plans": plan_rows}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
