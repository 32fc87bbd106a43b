"""The numbers of the report, computed from a results folder: one row per strategy (``summary.csv``), the paired
step-time tests against static uniform checkpointing and DTR, the exactness of every strategy's losses against
no checkpointing, and one table per swept PGAC option."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from . import stats
from .formatting import mean_of, to_ms
from .results import Results
from .strategies import DISTRIBUTED_SWEEPS, LOSSY

CSV_FIELDS = [
    "strategy",
    "strategy_name",
    "runs",
    "budget_bytes",
    "predicted_peak_bytes",
    "plan_fits",
    "peak_activation_bytes",
    "memory_method",
    "within_budget",
    "step_time_ms",
    "step_time_ms_ci_low",
    "step_time_ms_ci_high",
    "timed_steps",
    "forward_ms",
    "backward_ms",
    "predicted_step_ms",
    "measured_fwd_bwd_ms",
    "step_clock",
    "predicted_step_ratio",
    "recompute_ms",
    "optimizer_ms",
    "recompute_overhead",
    "throughput",
    "unit",
    "final_loss",
    "val_loss",
    "val_perplexity",
    "val_accuracy",
    "energy_kwh",
    "energy_note",
    "vs_static_rel_step_time",
    "vs_static_p",
    "vs_dtr_rel_step_time",
    "vs_dtr_p",
    "max_abs_loss_diff_vs_none",
]


def _measured_fwd_bwd(run: dict[str, Any]) -> float | None:
    """A run's forward + backward seconds on the clock its profile read; runs written before that was
    recorded: wall-clock (None without both)."""
    if "measured_fwd_bwd_s" in run:
        return run["measured_fwd_bwd_s"]
    forward, backward = run.get("forward_s"), run.get("backward_s")
    return None if forward is None or backward is None else forward + backward


def strategy_rows(res: Results) -> list[dict[str, Any]]:
    """One summary row per strategy (means over seeds; timing over the timed (seed, step) pairs)."""
    static, dtr = res.static_label, res.dtr_label
    vs_static = _compare(res, "step_time_s", static)
    vs_dtr = _compare(res, "step_time_s", dtr)
    exact = loss_differences(res)
    rows = []
    for label in res.labels:
        runs = res.runs_of(label)
        times = stats.summarize(res.values(label, "step_time_s").values())
        peaks = [r["peak_activation_bytes"] for r in runs if r.get("peak_activation_bytes") is not None]
        recompute = mean_of(r.get("recompute_time_s") for r in runs)
        backward = mean_of(r.get("backward_s") for r in runs)
        s_cmp, d_cmp = vs_static.get(label), vs_dtr.get(label)
        fits = [r.get("plan_fits") for r in runs if r.get("plan_fits") is not None]
        within = [r.get("within_budget") for r in runs if r.get("within_budget") is not None]
        energy = [r.get("energy_kwh") for r in runs if r.get("energy_kwh") is not None]
        predicted = [r["predicted_peak_bytes"] for r in runs if r.get("predicted_peak_bytes") is not None]
        forward = mean_of(r.get("forward_s") for r in runs)
        predicted_step = mean_of(r.get("predicted_step_s") for r in runs)
        measured_step = mean_of(_measured_fwd_bwd(r) for r in runs)
        rows.append(
            {
                "strategy": label,
                "strategy_name": res.name_of[label],
                "runs": len(runs),
                "budget_bytes": res.budget,
                # the largest over seeds (each seed plans on its own profile), like the measured peak beside it
                "predicted_peak_bytes": max(predicted) if predicted else None,
                "plan_fits": all(fits) if fits else None,
                "peak_activation_bytes": max(peaks) if peaks else None,
                "memory_method": runs[0].get("memory_method"),
                "within_budget": all(within) if within else None,
                "step_time_ms": None if times.mean is None else times.mean * 1e3,
                "step_time_ms_ci_low": None if times.ci_low is None else times.ci_low * 1e3,
                "step_time_ms_ci_high": None if times.ci_high is None else times.ci_high * 1e3,
                "timed_steps": times.n,
                "forward_ms": to_ms(forward),
                "backward_ms": to_ms(backward),
                # the simulator's step (forward and backward, no optimizer) against the measured one
                "predicted_step_ms": to_ms(predicted_step),
                # forward + backward on the profile's clock (CPU seconds on a one-thread CPU), what it predicts
                "measured_fwd_bwd_ms": to_ms(measured_step),
                "step_clock": runs[0].get("step_clock", "wall"),
                "predicted_step_ratio": predicted_step / measured_step
                if predicted_step is not None and measured_step
                else None,
                "backward_net_ms": to_ms(None if backward is None else backward - (recompute or 0.0)),
                "recompute_ms": to_ms(recompute),
                "optimizer_ms": to_ms(mean_of(r.get("optimizer_s") for r in runs)),
                "recompute_overhead": mean_of(r.get("recompute_overhead") for r in runs),
                "throughput": mean_of(r.get("throughput") for r in runs),
                "unit": runs[0].get("unit"),
                "final_loss": mean_of(r.get("final_loss") for r in runs),
                "val_loss": mean_of(r.get("val_loss") for r in runs),
                "val_perplexity": mean_of(r.get("val_perplexity") for r in runs),
                "val_accuracy": mean_of(r.get("val_accuracy") for r in runs),
                "energy_kwh": mean_of(energy) if energy else None,
                "energy_note": "" if energy else (runs[0].get("energy_note") or "not measured"),
                "vs_static_rel_step_time": s_cmp.relative_diff if s_cmp else None,
                "vs_static_p": s_cmp.p_value if s_cmp else None,
                "vs_dtr_rel_step_time": d_cmp.relative_diff if d_cmp else None,
                "vs_dtr_p": d_cmp.p_value if d_cmp else None,
                "max_abs_loss_diff_vs_none": exact.get(label, {}).get("max_abs_diff"),
            }
        )
    return rows


def _compare(
    res: Results, key: str, baseline: str | None, by: tuple[str, ...] = ("seed", "step")
) -> dict[str, stats.Comparison]:
    if baseline is None:
        return {}
    rows = [r for r in res.timed if r.get(key) is not None]
    if not any(r["strategy"] == baseline for r in rows):
        return {}
    return stats.compare(rows, value=key, baseline=baseline, by=by)


def comparisons(res: Results) -> dict[str, Any]:
    """Paired step-time tests against static uniform and DTR, by (seed, step) and by seed."""
    out: dict[str, Any] = {}
    for name, baseline in (("static", res.static_label), ("dtr", res.dtr_label)):
        out[name] = {
            "baseline": baseline,
            "by_step": {k: v.to_dict() for k, v in _compare(res, "step_time_s", baseline).items()},
            "by_seed": {k: v.to_dict() for k, v in _compare(res, "step_time_s", baseline, ("seed",)).items()},
        }
    return out


def loss_differences(res: Results) -> dict[str, dict[str, Any]]:
    """Per strategy, the largest |loss - loss_none| over every (seed, step) both ran (warm-up included)."""
    reference = res.values("none", "loss", res.steps) if "none" in res.labels else {}
    out: dict[str, dict[str, Any]] = {}
    if not reference:
        return out
    for label in res.labels:
        if label == "none":
            continue
        mine = res.values(label, "loss", res.steps)
        keys = [k for k in mine if k in reference]
        if not keys:
            continue
        diffs = [abs(mine[k] - reference[k]) for k in keys]
        worst = max(diffs)
        scale = max(abs(reference[k]) for k in keys)
        name = res.name_of[label]
        exact = name not in ("compile_budget", *LOSSY)
        if worst == 0.0:
            verdict = "identical (bitwise)"
        elif worst <= 1e-5 * scale:
            verdict = "equal within floating-point noise"
        elif name in LOSSY:
            verdict = "differs (lossy: compressed activations)"
        else:
            verdict = "differs" + ("" if exact else " (compiled kernels round differently)")
        out[label] = {
            "max_abs_diff": worst,
            "pairs": len(keys),
            "seeds": len({k[0] for k in keys}),
            "exact_strategy": exact,
            "verdict": verdict,
        }
    return out


def sweep_tables(res: Results) -> list[tuple[str, list[dict[str, Any]]]]:
    """For each swept PGAC option, one row per value."""
    tables = []
    for key, values in res.settings.get("sweeps", []):
        if key in DISTRIBUTED_SWEEPS:
            continue
        rows = []
        for value in values:
            label = next(
                (
                    r["strategy"]
                    for r in res.runs
                    if r["strategy_name"] == "pgac" and r.get("options", {}).get(key) == value
                ),
                None,
            )
            if label is None:
                continue
            runs = res.runs_of(label)
            peaks = [r["peak_activation_bytes"] for r in runs if r.get("peak_activation_bytes") is not None]
            rows.append(
                {
                    "value": value,
                    "strategy": label,
                    "recompute_ms": to_ms(mean_of(r.get("recompute_time_s") for r in runs)),
                    "step_ms": to_ms(mean_of(r.get("step_time_s") for r in runs)),
                    "peak": max(peaks) if peaks else None,
                    "within": all(r.get("within_budget") for r in runs),
                    "stored": mean_of(r.get("mean_stored_blocks") for r in runs),
                    "val_loss": mean_of(r.get("val_loss") for r in runs),
                }
            )
        tables.append((key, rows))
    return tables


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in CSV_FIELDS})
