"""What the report says about ``pipeline.jsonl`` (the ``stage_sync`` sweep, :mod:`remat.bench.pipeline_sweep`):
the finished threshold modes (kept by ``--resume``), one row per mode and stage, and the comparison of the
two modes step by step (losses, masks, thresholds)."""

from __future__ import annotations

from typing import Any


def finished_modes(records: list[dict[str, Any]]) -> set[str]:
    """The modes whose run ended with an ok summary."""
    return {r["stage_sync"] for r in records if r.get("record") == "summary" and r.get("status") == "ok"}


def keep_finished(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of finished modes only (``--resume`` runs the others again from their first step)."""
    done = finished_modes(records)
    return [r for r in records if r.get("stage_sync") in done]


def steps_of(records: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """The step records of ``mode``, in step order (the last record of a step wins)."""
    by_step = {r["step"]: r for r in records if r.get("record") == "step" and r.get("stage_sync") == mode}
    return [by_step[k] for k in sorted(by_step)]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def mask_changes(steps: list[dict[str, Any]], stage: int) -> int:
    """Steps whose mask on ``stage`` differs from the step before."""
    masks = [s["stages"][stage]["actions"] for s in steps]
    return sum(1 for a, b in zip(masks, masks[1:], strict=False) if a != b)


def mode_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (mode, stage): budget, largest and last measured peak, blocks recomputed, recompute time,
    mask changes, final threshold; with the mode's step time (after warm-up) and final loss."""
    rows = []
    summaries = [r for r in records if r.get("record") == "summary"]
    for summary in summaries:
        mode = summary["stage_sync"]
        steps = steps_of(records, mode)
        if summary.get("status") != "ok" or not steps:
            rows.append({"stage_sync": mode, "status": "failed", "error": summary.get("error", "no steps")})
            continue
        timed = [s for s in steps if not s["warmup"]] or steps
        for p in range(len(steps[0]["stages"])):
            per = [s["stages"][p] for s in steps]
            budget = per[0]["budget_bytes"]
            peak = max(r["peak_bytes"] for r in per)
            rows.append(
                {
                    "stage_sync": mode,
                    "status": "ok",
                    "stage": p,
                    "blocks": len(per[0]["actions"]),
                    "in_flight": (summary.get("in_flight") or [None] * (p + 1))[p],
                    "budget_bytes": budget,
                    "max_peak_bytes": peak,
                    "within_budget": peak <= budget,
                    "last_peak_bytes": per[-1]["peak_bytes"],
                    "recompute_fraction": _mean([r["recompute_fraction"] for r in per]),
                    "recompute_ms": 1e3 * (_mean([s["stages"][p]["recompute_time_s"] for s in timed]) or 0.0),
                    "mask_changes": mask_changes(steps, p),
                    "final_tau": per[-1]["tau"],
                    "step_ms": 1e3 * (_mean([s["step_time_s"] for s in timed]) or 0.0),
                    "final_loss": steps[-1]["loss"],
                    "steps": len(steps),
                }
            )
    return rows


def compare_modes(records: list[dict[str, Any]], a: str = "local", b: str = "global") -> dict[str, Any] | None:
    """Step by step, mode ``a`` against mode ``b`` over the steps both ran: the largest loss difference, the
    loss at step 0 in each, the share of (step, stage) pairs that ran the same mask, per stage too, and the
    steps where the thresholds differ. None unless both modes have steps."""
    sa, sb = {s["step"]: s for s in steps_of(records, a)}, {s["step"]: s for s in steps_of(records, b)}
    common = sorted(set(sa) & set(sb))
    if not common:
        return None
    stages = len(sa[common[0]]["stages"])
    same = [[sa[t]["stages"][p]["actions"] == sb[t]["stages"][p]["actions"] for t in common] for p in range(stages)]
    losses = [(sa[t]["loss"], sb[t]["loss"]) for t in common if sa[t]["loss"] is not None and sb[t]["loss"] is not None]
    tau_differs = [
        t for t in common if any(sa[t]["stages"][p]["tau"] != sb[t]["stages"][p]["tau"] for p in range(stages))
    ]
    return {
        "modes": [a, b],
        "steps": len(common),
        "loss_step0": [sa[common[0]]["loss"], sb[common[0]]["loss"]] if common[0] == 0 else None,
        "max_loss_diff": max((abs(x - y) for x, y in losses), default=None),
        "mask_agreement": sum(map(sum, same)) / (stages * len(common)),
        "mask_agreement_per_stage": [sum(s) / len(common) for s in same],
        "steps_tau_differs": len(tau_differs),
        "first_step_tau_differs": tau_differs[0] if tau_differs else None,
    }
