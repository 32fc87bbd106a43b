"""The figures of a results folder (drawn by :mod:`remat.bench.plots`) and their captions: memory against step
time, loss curves, PGAC's mask over the steps, the bytes each block keeps, and where the step time goes."""

from __future__ import annotations

import json
from typing import Any

from ..core import CostTable
from .results import Results


def make_plots(res: Results, rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Draw every figure; returns (relative path, caption) pairs."""
    from . import plots  # matplotlib: imported only when figures are drawn

    out = res.out / "plots"
    footer = res.footer
    made: list[tuple[str, str]] = []
    points = [
        {
            "label": r["strategy"],
            "memory_bytes": r["peak_activation_bytes"],
            "step_ms": r["step_time_ms"],
            "ci_low": r["step_time_ms_ci_low"],
            "ci_high": r["step_time_ms_ci_high"],
        }
        for r in rows
        if r["memory_method"] == "tracker"
    ]
    if points:
        plots.pareto(points, res.budget, out / "pareto.png", footer)
        made.append(
            (
                "plots/pareto.png",
                "Peak activation memory (tracker, measured steps) against mean step time "
                "(timed steps, 95% CI); the red line is the budget.",
            )
        )
    curves: dict[str, tuple[list[int], list[float]]] = {}
    for label in res.labels:
        by_step: dict[int, list[float]] = {}
        for s in res.steps:
            if s["strategy"] == label:
                by_step.setdefault(s["step"], []).append(s["loss"])
        if by_step:
            steps = sorted(by_step)
            curves[label] = (steps, [sum(by_step[i]) / len(by_step[i]) for i in steps])
    if curves:
        plots.loss_curves(curves, int(res.settings["warmup"]), out / "loss.png", footer)
        made.append(
            (
                "plots/loss.png",
                "Training loss per step, mean over seeds. Exact strategies lie on the "
                "no-checkpoint curve (see the exactness table).",
            )
        )
    histories = {}
    for label in res.labels:
        if res.name_of[label] != "pgac":
            continue
        run = min(res.runs_of(label), key=lambda r: r["seed"])
        if run.get("artifact") and (res.out / run["artifact"]).exists():
            info = json.loads((res.out / run["artifact"]).read_text())
            if info.get("history"):
                histories[f"{label} (seed {run['seed']})"] = (info["fqns"], [h["stored"] for h in info["history"]])
    if histories:
        plots.mask_heatmap(dict(list(histories.items())[:6]), out / "pgac_mask.png", footer)
        made.append(
            (
                "plots/pgac_mask.png",
                "PGAC's mask over steps (from PGAC.history): which blocks kept their activations in each step.",
            )
        )
    costs_path = res.out / "costs" / "seed0.json"
    if costs_path.exists():
        costs = CostTable.from_json(costs_path.read_text())
        actions = costs.plannable_actions()
        saved = {a: [b.saved_bytes.get(a) for b in costs.blocks] for a in actions}
        plots.block_memory(costs.fqns, saved, out / "block_memory.png", footer)
        made.append(
            (
                "plots/block_memory.png",
                "Bytes each block keeps for backward under each action (profiled CostTable of seed 0).",
            )
        )
    timing = [
        {"label": r["strategy"], **{k: r[k] for k in ("forward_ms", "backward_net_ms", "recompute_ms", "optimizer_ms")}}
        for r in rows
        if r["forward_ms"] is not None
    ]
    if timing:
        plots.time_breakdown(timing, out / "time_breakdown.png", footer)
        made.append(
            (
                "plots/time_breakdown.png",
                "Mean step time split into forward, backward without "
                "recomputation, recomputation (measured per block) and optimizer.",
            )
        )
    return made
