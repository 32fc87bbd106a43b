"""From a results folder to ``summary.csv``, ``summary.json``, ``report.md`` and the plots.

The report reads only the files the runner wrote (``config.json``, ``steps.jsonl``, ``runs.jsonl``,
``costs/``, ``runs/``, ``ddp.jsonl``), so it can be rebuilt at any time with
``python -m remat.bench.report RESULTS_DIR``. It holds:

* one row per strategy: plan prediction and whether it fits, measured peak activation memory against the
  budget, step / forward / backward / recompute time, recompute overhead, throughput, losses, validation
  metric, energy;
* paired t-tests of step time against static uniform checkpointing and against DTR (pairs are the same
  ``(seed, step)``: the same weights, batch and dropout stream), with a per-seed test beside them;
* the claims table (:mod:`remat.bench.claims`): each expected outcome of section 3.1 of the PGAC proposal
  with the measured value, the test and a verdict (confirmed / not confirmed / not measurable here);
* the exactness table: the largest ``|loss - loss_none|`` of every strategy over the same seeds and steps;
* the ablations (PGAC variants from ``--sweep``, the distributed ``sync`` sweep) and the figures.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path
from typing import Any

from ..sizes import format_bytes
from . import stats
from .claims import Claim, claims, context_notes, fmt_ms, fmt_p, fmt_pct, mean_of
from .records import read_jsonl


class Results:
    """The contents of a results folder, with the choices the report makes about them."""

    def __init__(self, out: Path) -> None:
        self.out = out
        config_path = out / "config.json"
        if not config_path.exists():
            raise FileNotFoundError(f"{out} has no config.json: it is not a `remat bench` results folder")
        self.config = json.loads(config_path.read_text())
        self.settings = self.config["settings"]
        self.runs_all = read_jsonl(out / "runs.jsonl")
        self.runs = [r for r in self.runs_all if r.get("status") == "ok"]
        ok = {(r["strategy"], r["seed"]) for r in self.runs}
        self.steps = [s for s in read_jsonl(out / "steps.jsonl") if (s["strategy"], s["seed"]) in ok]
        self.timed = [s for s in self.steps if s.get("timed")]
        order = self.config.get("all_strategies", [])
        present = {r["strategy"] for r in self.runs}
        self.labels = [label for label in order if label in present] + sorted(present - set(order))
        self.name_of = {r["strategy"]: r["strategy_name"] for r in self.runs}
        self.budget = self.config["budget"]["bytes"]
        self.env = self.config["environment"]
        self.command = self.config["commands"][-1] if self.config.get("commands") else ""
        self.ddp = read_jsonl(out / "ddp.jsonl")

    def first(self, name: str) -> str | None:
        """The first strategy label of ``name`` (unswept options first)."""
        plain = [label for label in self.labels if label == name]
        if plain:
            return plain[0]
        return next((label for label in self.labels if self.name_of.get(label) == name), None)

    @property
    def static_label(self) -> str | None:
        """Static uniform checkpointing: ``every_k`` if it ran, else ``full``."""
        return self.first("every_k") or self.first("full")

    @property
    def pgac_label(self) -> str | None:
        listed = [s for s in self.settings.get("strategies", []) if s.split("[")[0] == "pgac"]
        for label in listed:
            if label in self.labels:
                return label
        return self.first("pgac")

    @property
    def dtr_label(self) -> str | None:
        return self.first("dtr")

    def runs_of(self, label: str) -> list[dict[str, Any]]:
        return [r for r in self.runs if r["strategy"] == label]

    def values(self, label: str, key: str, rows: list[dict[str, Any]] | None = None) -> dict[tuple[int, int], float]:
        rows = self.timed if rows is None else rows
        return {(r["seed"], r["step"]): float(r[key])
                for r in rows if r["strategy"] == label and r.get(key) is not None}

    @property
    def footer(self) -> str:
        return f"machine: {self.env['machine']} | command: {self.command}"

    @property
    def is_text(self) -> bool:
        kind = self.config.get("facts", {}).get("kind")
        return kind in ("lm", "mlm") if kind else self.settings["model"] in ("gpt2", "bert")


# ------------------------------------------------------------------------------------------- computations


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
        rows.append({
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
            "forward_ms": _scale(mean_of(r.get("forward_s") for r in runs)),
            "backward_ms": _scale(backward),
            "backward_net_ms": _scale(None if backward is None else backward - (recompute or 0.0)),
            "recompute_ms": _scale(recompute),
            "optimizer_ms": _scale(mean_of(r.get("optimizer_s") for r in runs)),
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
        })
    return rows


def _scale(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _compare(res: Results, key: str, baseline: str | None, by: tuple[str, ...] = ("seed", "step")
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
        exact = res.name_of[label] != "compile_budget"
        if worst == 0.0:
            verdict = "identical (bitwise)"
        elif worst <= 1e-5 * scale:
            verdict = "equal within floating-point noise"
        else:
            verdict = "differs" + ("" if exact else " (compiled kernels round differently)")
        out[label] = {"max_abs_diff": worst, "pairs": len(keys), "seeds": len({k[0] for k in keys}),
                      "exact_strategy": exact, "verdict": verdict}
    return out


# ------------------------------------------------------------------------------------------------- plots


def make_plots(res: Results, rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Draw every figure; returns (relative path, caption) pairs."""
    from ..costs import CostTable
    from . import plots

    out = res.out / "plots"
    footer = res.footer
    made: list[tuple[str, str]] = []
    points = [{"label": r["strategy"], "memory_bytes": r["peak_activation_bytes"], "step_ms": r["step_time_ms"],
               "ci_low": r["step_time_ms_ci_low"], "ci_high": r["step_time_ms_ci_high"]}
              for r in rows if r["memory_method"] == "tracker"]
    if points:
        plots.pareto(points, res.budget, out / "pareto.png", footer)
        made.append(("plots/pareto.png", "Peak activation memory (tracker, measured steps) against mean step time "
                                          "(timed steps, 95% CI); the red line is the budget."))
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
        made.append(("plots/loss.png", "Training loss per step, mean over seeds. Exact strategies lie on the "
                                        "no-checkpoint curve (see the exactness table)."))
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
        made.append(("plots/pgac_mask.png", "PGAC's mask over steps (from PGAC.history): which blocks kept their "
                                             "activations in each step."))
    costs_path = res.out / "costs" / "seed0.json"
    if costs_path.exists():
        costs = CostTable.from_json(costs_path.read_text())
        actions = costs.common_actions()
        saved = {a: [b.saved_bytes[a] for b in costs.blocks] for a in actions}
        plots.block_memory(costs.fqns, saved, out / "block_memory.png", footer)
        made.append(("plots/block_memory.png", "Bytes each block keeps for backward under each action "
                                                "(profiled CostTable of seed 0)."))
    timing = [{"label": r["strategy"], **{k: r[k] for k in ("forward_ms", "backward_net_ms", "recompute_ms",
                                                             "optimizer_ms")}}
              for r in rows if r["forward_ms"] is not None]
    if timing:
        plots.time_breakdown(timing, out / "time_breakdown.png", footer)
        made.append(("plots/time_breakdown.png", "Mean step time split into forward, backward without "
                                                  "recomputation, recomputation (measured per block) and optimizer."))
    return made


# ------------------------------------------------------------------------------------------------ writing


CSV_FIELDS = [
    "strategy", "strategy_name", "runs", "budget_bytes", "predicted_peak_bytes", "plan_fits",
    "peak_activation_bytes", "memory_method", "within_budget", "step_time_ms", "step_time_ms_ci_low",
    "step_time_ms_ci_high", "timed_steps", "forward_ms", "backward_ms", "recompute_ms", "optimizer_ms",
    "recompute_overhead", "throughput", "unit", "final_loss", "val_loss", "val_perplexity", "val_accuracy",
    "energy_kwh", "energy_note", "vs_static_rel_step_time", "vs_static_p", "vs_dtr_rel_step_time", "vs_dtr_p",
    "max_abs_loss_diff_vs_none",
]


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in CSV_FIELDS})


def sweep_tables(res: Results) -> list[tuple[str, list[dict[str, Any]]]]:
    """For each swept PGAC option, one row per value."""
    tables = []
    for key, values in res.settings.get("sweeps", []):
        if key == "sync":
            continue
        rows = []
        for value in values:
            label = next((r["strategy"] for r in res.runs
                          if r["strategy_name"] == "pgac" and r.get("options", {}).get(key) == value), None)
            if label is None:
                continue
            runs = res.runs_of(label)
            peaks = [r["peak_activation_bytes"] for r in runs if r.get("peak_activation_bytes") is not None]
            rows.append({
                "value": value, "strategy": label,
                "recompute_ms": _scale(mean_of(r.get("recompute_time_s") for r in runs)),
                "step_ms": _scale(mean_of(r.get("step_time_s") for r in runs)),
                "peak": max(peaks) if peaks else None,
                "within": all(r.get("within_budget") for r in runs),
                "stored": mean_of(r.get("mean_stored_blocks") for r in runs),
                "val_loss": mean_of(r.get("val_loss") for r in runs),
            })
        tables.append((key, rows))
    return tables


def _cell(value: Any, kind: str = "") -> str:
    if value is None or value == "":
        return "n/a"
    if kind == "bytes":
        return format_bytes(value)
    if kind == "ms":
        return f"{value:.2f}"
    if kind == "pct":
        return f"{value:.1%}"
    if kind == "bool":
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _load(config: dict[str, Any]) -> str:
    loads = config.get("load_average", {})
    parts = [f"{loads[k][0]:.1f} at the {k}" for k in ("start", "end") if loads.get(k)]
    return ", ".join(parts) or "not recorded"


def render_markdown(res: Results, rows: list[dict[str, Any]], cmp: dict[str, Any], claim_list: list[Claim],
                    exact: dict[str, dict[str, Any]], figures: list[tuple[str, str]]) -> str:
    s, c = res.settings, res.config
    facts = c.get("facts", {})
    b = c["budget"]
    static = res.static_label
    static_note = ""
    if static is not None:
        opts = (res.runs_of(static) or [{}])[0].get("plan_options") or {}
        static_note = f"`{static}`" + (f" (k = {opts['k']})" if "k" in opts else "")
    lines = [
        f"# remat bench: {s['model']}-{s['preset']}",
        "",
        f"- **Machine:** {res.env['machine']}; {c.get('threads')} intra-op thread(s); {res.env['platform']}; "
        f"load average {_load(c)} (other processes share the cores: timings carry their noise)",
        "- **Command:** " + "; then ".join(f"`{cmd}`" for cmd in c.get("commands", [])),
        f"- **Model:** {s['model']}-{s['preset']}, {facts.get('model', {}).get('num_layers', '?')} blocks, "
        f"{facts.get('num_params', 0):,} parameters; data {json.dumps(facts.get('data', c.get('data', {})))}",
        f"- **Training:** {s['steps']} steps per run ({s['warmup']} warm-up steps left out of every statistic), "
        f"{s['seeds']} seed(s), AdamW lr {s['lr']}, batch {s['batch_size']}"
        + (f" x {s['seq_len']} tokens" if res.is_text else ""),
        f"- **Budget:** {format_bytes(b['bytes'])} ({b['fraction']:.0%} of the no-checkpoint activation peak "
        f"{format_bytes(b['no_checkpoint_predicted_bytes'])} predicted from seed 0's profile; the least any plan "
        f"reaches is {format_bytes(b['min_feasible_bytes'])}). Every strategy runs at this budget.",
        f"- **Static uniform baseline:** {static_note or 'none ran'}; **DTR baseline:** "
        f"{'`' + res.dtr_label + '`' if res.dtr_label else 'none ran'}; **PGAC:** "
        f"{'`' + res.pgac_label + '`' if res.pgac_label else 'none ran'}",
        "",
        "## How it was measured",
        "",
        f"- Peak activation memory is measured with the live-tensor tracker (`remat.measure`) on dedicated steps "
        f"only (steps {', '.join(map(str, c.get('measure_steps', [])))}: the first after warm-up and the last), "
        "because the tracker slows the step. Those steps are excluded from every time figure; all other steps "
        "after warm-up are timed without the tracker.",
        "- Recompute time is measured per block re-execution in backward (`handle.stats`) for the plans and PGAC, "
        "and by DTR's own counters for DTR. Backward time includes recomputation.",
        "- Paired tests pair the same (seed, step): same weights, batch and dropout stream. Steps of one run are "
        "not independent, so the per-seed test (step times averaged per seed) is shown beside it. Runs go seed by "
        "seed, the strategy order reversed on every other seed so that drifts of the machine's load favour no "
        "strategy.",
    ]
    if any(res.name_of.get(lab) == "compile_budget" for lab in res.labels):
        lines.append("- `compile_budget` (torch.compile with `activation_memory_budget`) is invisible to the "
                     "tracker; its memory is the whole-process high-water mark growth over the step (parameter "
                     "gradients included), measured in a child process started with MALLOC_MMAP_THRESHOLD_=65536 "
                     "MALLOC_TRIM_THRESHOLD_=0, shown next to one eager no-checkpoint step measured the same way. "
                     "It is not comparable byte for byte with the tracker figures.")
    else:
        lines.append("- `compile_budget` (the torch.compile reference) was not in this run: add it to --strategies "
                     "(compiling on a CPU takes minutes, which is why the default run leaves it out).")
    energy_notes = {r.get("energy_note") for r in res.runs if r.get("energy_note")}
    if any(r.get("energy_j") is not None for r in res.runs):
        lines.append("- Energy: hardware counters summed over the timed steps of each run.")
    else:
        lines.append("- Energy: not available on this machine (" + "; ".join(sorted(energy_notes)) + ").")
    lines += ["", "## Results per strategy", ""]
    unit = rows[0]["unit"] if rows else "items"
    metric = "val perplexity" if res.is_text else "val accuracy"
    lines.append(f"| strategy | plan fits (predicted peak) | measured peak | within budget | step ms (95% CI) "
                 f"| forward ms | backward ms | recompute ms | recompute / step | {unit}/s | final train loss "
                 f"| val loss | {metric} | energy kWh |")
    lines.append("|" + "---|" * 14)
    for r in rows:
        ci = (f" [{r['step_time_ms_ci_low']:.2f}, {r['step_time_ms_ci_high']:.2f}]"
              if r["step_time_ms_ci_low"] is not None else "")
        mark = "" if r["memory_method"] in ("tracker", None) else " †"
        pred = (f"{_cell(r['plan_fits'], 'bool')} ({_cell(r['predicted_peak_bytes'], 'bytes')})"
                if r["predicted_peak_bytes"] is not None else "n/a")
        val = r["val_perplexity"] if res.is_text else r["val_accuracy"]
        cells = [
            r["strategy"], pred, _cell(r["peak_activation_bytes"], "bytes") + mark, _cell(r["within_budget"], "bool"),
            _cell(r["step_time_ms"], "ms") + ci, _cell(r["forward_ms"], "ms"), _cell(r["backward_ms"], "ms"),
            _cell(r["recompute_ms"], "ms"), _cell(r["recompute_overhead"], "pct"),
            _cell(r["throughput"] and round(r["throughput"])), _cell(r["final_loss"]), _cell(r["val_loss"]),
            _cell(val), _cell(r["energy_kwh"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    for r in rows:
        if r["memory_method"] not in ("tracker", None):
            runs = res.runs_of(r["strategy"])
            ref = mean_of(x.get("reference_none_process_bytes") for x in runs)
            lines.append("")
            peak = r["peak_activation_bytes"]
            ratio = f" (ratio {peak / ref:.2f})" if ref and peak else ""
            note = runs[0].get("memory_note", "") if runs else ""
            lines.append(f"† {r['strategy']}: {r['memory_method']}; eager no-checkpoint step measured the same way: "
                         f"{_cell(ref, 'bytes')}{ratio}. {note}")
    lines += ["", "## Step time against the baselines (paired t-tests)", ""]
    for name, title in (("static", "static uniform"), ("dtr", "DTR")):
        base = cmp[name]["baseline"]
        if base is None:
            lines.append(f"No {title} run: no comparison against it.")
            lines.append("")
            continue
        lines.append(f"Against {title} (`{base}`); difference = strategy - baseline, negative is faster.")
        lines.append("")
        lines.append("| strategy | mean ms | baseline ms | difference | 95% CI (ms) | p (seed, step pairs) | n "
                     "| p (per seed) | seeds |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for label, d in cmp[name]["by_step"].items():
            seed = cmp[name]["by_seed"].get(label, {})
            ci = (f"[{d['ci_low'] * 1e3:.2f}, {d['ci_high'] * 1e3:.2f}]" if d["ci_low"] is not None else "n/a")
            seed_p = fmt_p(seed["p_value"]) if seed.get("p_value") is not None else (seed.get("reason") or "n/a")
            lines.append(
                f"| {label} | {fmt_ms(d['mean'])} | {fmt_ms(d['baseline_mean'])} | {fmt_pct(d['relative_diff'])} "
                f"| {ci} | {fmt_p(d['p_value'])} | {d['n']} | {seed_p} | {seed.get('n', 0)} |"
            )
        lines.append("")
    lines += ["## Claims of the PGAC proposal (section 3.1)", ""]
    lines.append("| expected outcome | expected | measured here | test | verdict |")
    lines.append("|---|---|---|---|---|")
    for cl in claim_list:
        lines.append(f"| {cl.claim} | {cl.expected} | {cl.measured} | {cl.test} | **{cl.verdict}** |")
    lines += ["", "Verdicts: *confirmed* when the measured effect reaches the low end of the expected range and the "
              "test is significant at p < 0.05 (memory: every measured step within the budget; fidelity: every seed "
              "within 0.5%); *not confirmed* otherwise. The numbers are from this machine and this model size "
              "only.", ""]
    notes = context_notes(res)
    if notes:
        lines += [f"- {n}" for n in notes] + [""]
    lines += ["## Exactness: training loss against no checkpointing", ""]
    if exact:
        lines.append("| strategy | max abs(loss - loss_none) | (seed, step) pairs | seeds | verdict |")
        lines.append("|---|---|---|---|---|")
        for label, e in exact.items():
            lines.append(f"| {label} | {e['max_abs_diff']:.3g} | {e['pairs']} | {e['seeds']} | {e['verdict']} |")
        lines.append("")
        lines.append("Every strategy but `compile_budget` runs the model's own kernels and only changes what is "
                     "stored, so its losses must equal the no-checkpoint run's for the same seed.")
    else:
        lines.append("No `none` run to compare against.")
    lines.append("")
    tables = sweep_tables(res)
    if tables:
        lines += ["## Ablations of PGAC", ""]
        for key, trows in tables:
            lines.append(f"**{key}**")
            lines.append("")
            lines.append("| value | strategy | recompute ms | step ms | measured peak | within budget | stored blocks "
                         "| val loss |")
            lines.append("|---|---|---|---|---|---|---|---|")
            for t in trows:
                cells = [str(t["value"]), t["strategy"], _cell(t["recompute_ms"], "ms"), _cell(t["step_ms"], "ms"),
                         _cell(t["peak"], "bytes"), _cell(t["within"], "bool"), _cell(t["stored"]),
                         _cell(t["val_loss"])]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
    summaries = [d for d in res.ddp if d.get("record") == "summary"]
    if summaries:
        lines += ["## Distributed thresholds: sync=local against sync=global", "",
                  "Two CPU ranks (torchrun, gloo, DistributedDataParallel), each on its own batches, PGAC planning "
                  "from seed 0's cost table at the same budget.", "",
                  "| sync | status | step ms | recompute ms | masks equal across ranks | mean stored blocks "
                  "| final loss |", "|---|---|---|---|---|---|---|"]
        for d in summaries:
            if d.get("status") != "ok":
                lines.append(f"| {d['sync']} | failed: {d.get('error', '')[:200]} | | | | | |")
                continue
            lines.append(f"| {d['sync']} | ok | {fmt_ms(d['step_time_s'])} | {fmt_ms(d['recompute_time_s'])} | "
                         f"{_cell(d['mask_agreement'], 'pct')} of steps | {_cell(d['mean_stored_blocks'])} | "
                         f"{_cell(d['final_loss'])} |")
        lines.append("")
    if figures:
        lines += ["## Figures", ""]
        for path, caption in figures:
            lines.append(f"![{caption}]({path})")
            lines.append("")
            lines.append(f"*{caption}* Machine: {res.env['machine']}. Command: `{res.command}`.")
            lines.append("")
    failed = [r for r in res.runs_all if r.get("status") != "ok"]
    if failed:
        lines += ["## Failed runs", ""]
        for r in failed:
            lines.append(f"- {r.get('strategy')} seed {r.get('seed')}: {r.get('error')}")
        lines.append("")
    return "\n".join(lines) + "\n"


def build_report(out: Path | str) -> dict[str, Any]:
    """Write summary.csv, summary.json, report.md and plots/ for the results folder ``out``."""
    res = Results(Path(out))
    rows = strategy_rows(res)
    cmp = comparisons(res)
    claim_list = claims(res)
    exact = loss_differences(res)
    figures = make_plots(res, rows)
    write_csv(res.out / "summary.csv", rows)
    (res.out / "report.md").write_text(render_markdown(res, rows, cmp, claim_list, exact, figures))
    summary = {
        "settings": res.settings, "environment": res.env, "budget": res.config["budget"],
        "commands": res.config.get("commands", []), "strategies": rows, "comparisons": cmp,
        "claims": [c.to_dict() for c in claim_list], "exactness": exact,
        "sweeps": [{"key": k, "rows": v} for k, v in sweep_tables(res)],
        "ddp": [d for d in res.ddp if d.get("record") == "summary"],
        "figures": [p for p, _ in figures],
        "failed_runs": [r for r in res.runs_all if r.get("status") != "ok"],
    }
    (res.out / "summary.json").write_text(json.dumps(summary, indent=2, default=_nan_safe))
    return summary


def _nan_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m remat.bench.report RESULTS_DIR", file=sys.stderr)
        return 2
    try:
        build_report(args[0])
    except FileNotFoundError as err:
        print(f"remat bench report: error: {err}", file=sys.stderr)
        return 2
    print(Path(args[0]) / "report.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["Claim", "Results", "build_report", "claims", "loss_differences", "strategy_rows"]
