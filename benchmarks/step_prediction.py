"""How well remat predicts a plan's step time: predicted against measured, whole step and split into forward
and backward, on HF GPT-2 (dropout 0.1) and Llama (no dropout) built from config (the peers' ``default`` size).

One thread, CPU seconds (``time.process_time``) for the profile and for the steps alike. After ``remat.profile`` the
plans keep-all (twice: the A/A pair), ``full``, ``memory_poor``, all-selective (``dots_saveable`` in every block),
one block checkpointed, one block selective, and ``optimal`` at 50% and 75% run through one ``remat.apply`` handle,
interleaved round by round; each figure is the median over rounds. Per plan the table shows the predicted and
measured step and their ratio, and the measured forward (model call and loss) and backward next to the blocks'
predicted ones: what the plan adds to keep-all's forward and backward, predicted (``fwd_s_by_action`` and
``bwd_s_by_action`` less keep's) and measured (the plan's step less keep-all's).

    .venv/bin/python -m benchmarks.step_prediction [--models gpt2 llama] [--rounds 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import remat
from benchmarks.peers.models import ModelSetting, block_list, build_model, make_batch

SELECTIVE = "selective:dots_saveable"


def plans_for(costs: remat.CostTable) -> dict[str, remat.Plan]:
    n = len(costs)
    one = n // 2
    plans = {
        "keep": remat.plan(costs, "none"),
        "keep (A/A)": remat.plan(costs, "none"),
        "full": remat.plan(costs, "full"),
        "memory_poor": remat.plan(costs, "memory_poor"),
        "all selective": remat.Plan.from_actions(costs, [SELECTIVE] * n, "selective"),
        "one checkpoint": remat.Plan.from_actions(costs, ["keep"] * one + ["checkpoint"] + ["keep"] * (n - one - 1)),
        "one selective": remat.Plan.from_actions(costs, ["keep"] * one + [SELECTIVE] + ["keep"] * (n - one - 1)),
    }
    for budget in (0.5, 0.75):
        try:
            plans[f"optimal {budget:.0%}"] = remat.plan(costs, "optimal", budget)
        except remat.BudgetError as err:
            print(f"optimal {budget:.0%}: {err}")
    return plans


def short(plan: remat.Plan) -> str:
    letters = {"keep": "K", "checkpoint": "C", SELECTIVE: "S", "segment": "G", "memory_poor": "M"}
    return "".join(letters.get(a.split(":")[0] if a.startswith(("segment", "memory")) else a, "?")
                   for a in plan.actions.values())


def predicted_split(costs: remat.CostTable, plan: remat.Plan) -> tuple[float, float]:
    """Blocks' forward and backward seconds under ``plan`` (single-block actions), from the table."""
    fwd = bwd = 0.0
    for row, action in zip(costs.blocks, plan.actions.values(), strict=True):
        fwd += row.fwd_s_by_action.get(action, row.fwd_s)
        bwd += row.bwd_s_by_action.get(action, row.bwd_s)
    return fwd, bwd


class BlockClock:
    """CPU seconds spent inside the blocks' calls (remat's hooks included): in the forward, and in the backward
    (recomputations)."""

    def __init__(self, blocks: list[torch.nn.Module]) -> None:
        self.seconds = {"fwd": 0.0, "bwd": 0.0}
        self.phase = "fwd"
        self.depth = 0
        self.start = 0.0
        self.hooks = []
        for block in blocks:
            self.hooks.append(block.register_forward_pre_hook(self.pre, prepend=True))
            self.hooks.append(block.register_forward_hook(self.post, always_call=True))

    def pre(self, *_: Any) -> None:
        if self.depth == 0:
            self.start = time.process_time()
        self.depth += 1

    def post(self, *_: Any) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.seconds[self.phase] += time.process_time() - self.start

    def reset(self) -> None:
        self.seconds = {"fwd": 0.0, "bwd": 0.0}


def timed_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], clock: BlockClock | None = None) -> tuple:
    model.zero_grad(set_to_none=True)
    if clock is not None:
        clock.reset()
        clock.phase = "fwd"
    t0 = time.process_time()
    loss = model(**batch).loss
    t1 = time.process_time()
    if clock is not None:
        clock.phase = "bwd"
    loss.backward()
    t2 = time.process_time()
    if clock is None:
        return t1 - t0, t2 - t1
    return t1 - t0, t2 - t1, clock.seconds["fwd"], clock.seconds["bwd"]


def run_model(name: str, rounds: int, repeats: int) -> list[dict[str, Any]]:
    setting = ModelSetting(name, "fp32")
    model = build_model(setting)
    batch = make_batch(setting)
    for _ in range(2):  # warm the allocator and the kernels before the profile
        timed_step(model, batch)
    costs = remat.profile(model, batch, clock=time.process_time, repeats=repeats)
    plans = plans_for(costs)
    handle = remat.apply(model, plans["keep"])
    clock = BlockClock(block_list(model))
    times: dict[str, list[tuple[float, ...]]] = {label: [] for label in plans}
    for round_ in range(rounds + 2):
        order = list(plans) if round_ % 2 == 0 else list(reversed(plans))
        for label in order:
            handle.set_plan(plans[label])
            measured = timed_step(model, batch, clock)
            if round_ >= 2:  # two warm-up rounds
                times[label].append(measured)
    handle.remove()
    keep_fwd = statistics.median(t[0] for t in times["keep"])
    keep_bwd = statistics.median(t[1] for t in times["keep"])
    keep_pf, keep_pb = predicted_split(costs, plans["keep"])
    rows = []
    for label, plan in plans.items():
        fwd = statistics.median(t[0] for t in times[label])
        bwd = statistics.median(t[1] for t in times[label])
        step = statistics.median(t[0] + t[1] for t in times[label])
        pf, pb = predicted_split(costs, plan)
        blocks_fwd = statistics.median(t[2] for t in times[label])
        recompute = statistics.median(t[3] for t in times[label])
        sim = remat.simulate(costs, plan.actions)
        rows.append(
            dict(model=name, plan=label, actions=short(plan), pred=plan.predicted_step_s, meas=step, fwd=fwd,
                 bwd=bwd, d_pf=pf - keep_pf, d_mf=fwd - keep_fwd, d_pb=pb - keep_pb, d_mb=bwd - keep_bwd,
                 p_bf=pf, m_bf=blocks_fwd, p_rec=sim.recompute_s, m_rec=recompute)
        )
    outside = costs.outside_s or 0.0
    print(f"{name}: outside_s {outside * 1e3:.2f} ms, blocks fwd {keep_pf * 1e3:.2f} ms, bwd {keep_pb * 1e3:.2f} ms; "
          f"profile {costs.info.get('profile_s', 0):.1f} s wall")
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | plan | actions | pred ms | meas ms | pred/meas | meas fwd ms | meas bwd ms "
        "| Δfwd pred | Δfwd meas | Δbwd pred | Δbwd meas | blocks fwd pred | blocks fwd meas | recompute pred "
        "| recompute meas |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['plan']} | {r['actions']} | {r['pred'] * 1e3:.1f} | {r['meas'] * 1e3:.1f} "
            f"| {r['pred'] / r['meas']:.2f} | {r['fwd'] * 1e3:.1f} | {r['bwd'] * 1e3:.1f} "
            f"| {r['d_pf'] * 1e3:+.1f} | {r['d_mf'] * 1e3:+.1f} | {r['d_pb'] * 1e3:+.1f} | {r['d_mb'] * 1e3:+.1f} "
            f"| {r['p_bf'] * 1e3:.1f} | {r['m_bf'] * 1e3:.1f} | {r['p_rec'] * 1e3:.1f} | {r['m_rec'] * 1e3:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="the profile's timed repeats per action")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    for name in args.models:
        rows += run_model(name, args.rounds, args.repeats)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
