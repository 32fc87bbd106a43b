"""``report.md``, one function per section: the header (machine, command, model, budget, baselines), how it was
measured, the results per strategy, the paired step-time tests, the claims of the PGAC proposal, exactness,
the PGAC ablations, the torchrun sweeps (:mod:`~remat.bench.distributed_sections`), the figures and the failed
runs. Each section is a list of lines ending with a blank one; :func:`render_markdown` joins them."""

from __future__ import annotations

import json
from typing import Any

from ..core import format_bytes
from .claims import Claim, context_notes
from .distributed_sections import distributed_section, pipeline_section
from .formatting import cell, fmt_ms, fmt_p, fmt_pct, mean_of
from .results import Results
from .strategies import LOSSY
from .summary import sweep_tables


def render_markdown(
    res: Results,
    rows: list[dict[str, Any]],
    cmp: dict[str, Any],
    claim_list: list[Claim],
    exact: dict[str, dict[str, Any]],
    figures: list[tuple[str, str]],
) -> str:
    """The whole report."""
    lines = [
        *header_section(res),
        *measurement_section(res),
        *results_section(res, rows),
        *shapes_section(res),
        *baselines_section(cmp),
        *claims_section(res, claim_list),
        *exactness_section(exact),
        *ablations_section(res),
        *distributed_section(res),
        *pipeline_section(res),
        *figures_section(res, figures),
        *failed_runs_section(res),
    ]
    return "\n".join(lines) + "\n"


def _load(config: dict[str, Any]) -> str:
    loads = config.get("load_average", {})
    parts = [f"{loads[k][0]:.1f} at the {k}" for k in ("start", "end") if loads.get(k)]
    return ", ".join(parts) or "not recorded"


def header_section(res: Results) -> list[str]:
    """Title, machine, command, model, training, budget and which runs are the baselines."""
    s, c = res.settings, res.config
    facts = c.get("facts", {})
    b = c["budget"]
    static = res.static_label
    static_note = ""
    if static is not None:
        opts = (res.runs_of(static) or [{}])[0].get("plan_options") or {}
        static_note = f"`{static}`" + (f" (k = {opts['k']})" if "k" in opts else "")
    return [
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
    ]


def measurement_section(res: Results) -> list[str]:
    """How memory, recompute time and the paired tests were measured; compile_budget and energy notes."""
    c = res.config
    if c.get("settings", {}).get("dynamic_padding"):
        memory = (
            "- Dynamic padding: every batch is padded to its longest paragraph, so shapes change from step to step. "
            "Peak activation memory is measured with the live-tensor tracker (`remat.measure`) on every step, each "
            "against the budget (section *Every step against the budget*), so the step times are read under the "
            "tracker, for every strategy alike. The profile is of the largest batch (the longest paragraphs), with "
            "three smaller shapes cut from it (`remat.profile_shapes`); `optimal` and PGAC plan each shape within "
            "the budget (`remat.ShapePlans`)."
        )
    else:
        memory = (
            f"- Peak activation memory is measured with the live-tensor tracker (`remat.measure`) on dedicated "
            f"steps only (steps {', '.join(map(str, c.get('measure_steps', [])))}: the first after warm-up and the "
            "last), because the tracker slows the step. Those steps are excluded from every time figure; all other "
            "steps after warm-up are timed without the tracker."
        )
    lines = [
        "## How it was measured",
        "",
        memory,
        "- Recompute time is measured per block re-execution in backward (`handle.stats`) for the plans and PGAC, "
        "and by DTR's own counters for DTR. Backward time includes recomputation.",
        _prediction_clock_note(res),
        "- Paired tests pair the same (seed, step): same weights, batch and dropout stream. Steps of one run are "
        "not independent, so the per-seed test (step times averaged per seed) is shown beside it. Runs go seed by "
        "seed, the strategy order reversed on every other seed so that drifts of the machine's load favour no "
        "strategy.",
    ]
    if any(res.name_of.get(lab) == "compile_budget" for lab in res.labels):
        lines.append(
            "- `compile_budget` (torch.compile with `activation_memory_budget`) is invisible to the "
            "tracker; its memory is the whole-process high-water mark growth over the step (parameter "
            "gradients included), measured in a child process started with MALLOC_MMAP_THRESHOLD_=65536 "
            "MALLOC_TRIM_THRESHOLD_=0 MALLOC_TOP_PAD_=131072, shown next to one eager no-checkpoint step measured "
            "the same way. "
            "It is not comparable byte for byte with the tracker figures."
        )
    else:
        lines.append(
            "- `compile_budget` (the torch.compile reference) was not in this run: add it to --strategies "
            "(compiling on a CPU takes minutes, which is why the default run leaves it out)."
        )
    energy_notes = {r.get("energy_note") for r in res.runs if r.get("energy_note")}
    if any(r.get("energy_j") is not None for r in res.runs):
        lines.append("- Energy: hardware counters summed over the timed steps of each run.")
    else:
        lines.append("- Energy: not available on this machine (" + "; ".join(sorted(energy_notes)) + ").")
    lines.append("")
    return lines


def shapes_section(res: Results) -> list[str]:
    """With dynamic padding: per run, every step's measured peak against the budget and the steps refused."""
    runs = [r for r in res.runs if r.get("steps_measured") is not None]
    if not runs:
        return []
    lines = [
        "## Every step against the budget",
        "",
        "| strategy | seed | steps measured | over the budget (+2%) | worst peak / budget | refused before the "
        "forward | sequence lengths (least, median, most) |",
        "|" + "---|" * 7,
    ]
    for r in runs:
        worst = r.get("worst_peak_over_budget")
        lengths = r.get("sequence_lengths") or []
        lines.append(
            f"| `{r['strategy']}` | {r['seed']} | {r['steps_measured']} | {r['steps_over_budget']} | "
            f"{'n/a' if worst is None else f'{worst:.3f}'} | {r['steps_refused']} | "
            f"{', '.join(map(str, lengths))} |"
        )
    lines += ["", "Every step's peak and budget are in `steps.jsonl` (`peak_activation_bytes`, `budget_bytes`, "
              "`shape`); a refused step holds the refusal.", ""]  # fmt: skip
    return lines


def _prediction_clock_note(res: Results) -> str:
    if any(r.get("step_clock") == "cpu" for r in res.runs):
        return (
            "- Predicted forward + backward: the simulator's step from the profile, which on a CPU with one "
            "intra-op thread reads the process's CPU seconds (`remat.profile(clock=time.process_time)`); it is "
            "compared with the CPU seconds of the steps' forward and backward, which the machine's other load "
            "does not inflate. The forward and backward columns are wall-clock."
        )
    return "- Predicted forward + backward: the simulator's step from the profile, against the measured wall-clock."


def predicted_step_cell(row: dict[str, Any]) -> str:
    """The simulator's forward + backward time and its ratio to the measured one, e.g. ``41.20 (1.03x)``."""
    if row.get("predicted_step_ms") is None:
        return "n/a"
    ratio = row.get("predicted_step_ratio")
    return cell(row["predicted_step_ms"], "ms") + (f" ({ratio:.2f}x)" if ratio is not None else "")


STEADY_WITHIN = 0.05  # no checkpointing's prediction off by more than this: the host's speed moved


def host_drift_note(rows: list[dict[str, Any]]) -> list[str]:
    """A note under the results when no checkpointing, which recomputes nothing, reads more than
    :data:`STEADY_WITHIN` off its own prediction: on a shared machine the host's speed moved between the profile
    and the runs, and every ratio moved with it. Gives each ratio over no checkpointing's beside it."""
    none = next((r for r in rows if r["strategy_name"] == "none" and r.get("predicted_step_ratio")), None)
    if none is None or abs(none["predicted_step_ratio"] - 1) <= STEADY_WITHIN:
        return []
    base = none["predicted_step_ratio"]
    over = ", ".join(
        f"{r['strategy']} {r['predicted_step_ratio'] / base:.2f}"
        for r in rows
        if r.get("predicted_step_ratio") and r is not none
    )
    return [
        "",
        f"The machine's speed moved between the profile and the runs: no checkpointing, which recomputes "
        f"nothing, read {base:.2f}x of its own prediction, and the other ratios moved with it. Over no "
        f"checkpointing's ratio they read: {over}. Runs go strategy by strategy, so drift within a seed remains.",
    ]


def results_section(res: Results, rows: list[dict[str, Any]]) -> list[str]:
    """One row per strategy, and a note under the table for each strategy measured another way."""
    lines = ["## Results per strategy", ""]
    unit = rows[0]["unit"] if rows else "items"
    metric = "val perplexity" if res.is_text else "val accuracy"
    lines.append(
        f"| strategy | plan fits (predicted peak) | measured peak | within budget | step ms (95% CI) "
        f"| forward ms | backward ms | predicted forward + backward ms (/ measured) | recompute ms "
        f"| recompute / step | {unit}/s | final train loss | val loss | {metric} | energy kWh |"
    )
    lines.append("|" + "---|" * 15)
    for r in rows:
        ci = (
            f" [{r['step_time_ms_ci_low']:.2f}, {r['step_time_ms_ci_high']:.2f}]"
            if r["step_time_ms_ci_low"] is not None
            else ""
        )
        mark = "" if r["memory_method"] in ("tracker", None) else " †"
        pred = (
            f"{cell(r['plan_fits'], 'bool')} ({cell(r['predicted_peak_bytes'], 'bytes')})"
            if r["predicted_peak_bytes"] is not None
            else "n/a"
        )
        val = r["val_perplexity"] if res.is_text else r["val_accuracy"]
        cells = [
            r["strategy"] + (" (lossy)" if r["strategy_name"] in LOSSY else ""),
            pred,
            cell(r["peak_activation_bytes"], "bytes") + mark,
            cell(r["within_budget"], "bool"),
            cell(r["step_time_ms"], "ms") + ci,
            cell(r["forward_ms"], "ms"),
            cell(r["backward_ms"], "ms"),
            predicted_step_cell(r),
            cell(r["recompute_ms"], "ms"),
            cell(r["recompute_overhead"], "pct"),
            cell(r["throughput"] and round(r["throughput"])),
            cell(r["final_loss"]),
            cell(r["val_loss"]),
            cell(val),
            cell(r["energy_kwh"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += host_drift_note(rows)
    for r in rows:
        if r["memory_method"] not in ("tracker", None):
            runs = res.runs_of(r["strategy"])
            ref = mean_of(x.get("reference_none_process_bytes") for x in runs)
            lines.append("")
            peak = r["peak_activation_bytes"]
            ratio = f" (ratio {peak / ref:.2f})" if ref and peak else ""
            note = runs[0].get("memory_note", "") if runs else ""
            lines.append(
                f"† {r['strategy']}: {r['memory_method']}; eager no-checkpoint step measured the same way: "
                f"{cell(ref, 'bytes')}{ratio}. {note}"
            )
    lines.append("")
    return lines


def baselines_section(cmp: dict[str, Any]) -> list[str]:
    """Paired step-time tests against static uniform checkpointing and DTR."""
    lines = ["## Step time against the baselines (paired t-tests)", ""]
    for name, title in (("static", "static uniform"), ("dtr", "DTR")):
        base = cmp[name]["baseline"]
        if base is None:
            lines.append(f"No {title} run: no comparison against it.")
            lines.append("")
            continue
        lines.append(f"Against {title} (`{base}`); difference = strategy - baseline, negative is faster.")
        lines.append("")
        lines.append(
            "| strategy | mean ms | baseline ms | difference | 95% CI (ms) | p (seed, step pairs) | n "
            "| p (per seed) | seeds |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for label, d in cmp[name]["by_step"].items():
            seed = cmp[name]["by_seed"].get(label, {})
            ci = f"[{d['ci_low'] * 1e3:.2f}, {d['ci_high'] * 1e3:.2f}]" if d["ci_low"] is not None else "n/a"
            seed_p = fmt_p(seed["p_value"]) if seed.get("p_value") is not None else (seed.get("reason") or "n/a")
            lines.append(
                f"| {label} | {fmt_ms(d['mean'])} | {fmt_ms(d['baseline_mean'])} | {fmt_pct(d['relative_diff'])} "
                f"| {ci} | {fmt_p(d['p_value'])} | {d['n']} | {seed_p} | {seed.get('n', 0)} |"
            )
        lines.append("")
    return lines


def claims_section(res: Results, claim_list: list[Claim]) -> list[str]:
    """The expected outcomes of the PGAC proposal against the measurements, and the context to weigh them."""
    lines = ["## Claims of the PGAC proposal (section 3.1)", ""]
    lines.append("| expected outcome | expected | measured here | test | verdict |")
    lines.append("|---|---|---|---|---|")
    for cl in claim_list:
        lines.append(f"| {cl.claim} | {cl.expected} | {cl.measured} | {cl.test} | **{cl.verdict}** |")
    lines += [
        "",
        "Verdicts: *confirmed* when the measured effect reaches the low end of the expected range and the "
        "test is significant at p < 0.05 (memory: every measured step within the budget; fidelity: every seed "
        "within 0.5%); *not confirmed* otherwise. The numbers are from this machine and this model size "
        "only.",
        "",
    ]
    notes = context_notes(res)
    if notes:
        lines += [f"- {n}" for n in notes] + [""]
    return lines


def exactness_section(exact: dict[str, dict[str, Any]]) -> list[str]:
    """The largest |loss - loss_none| of every strategy."""
    lines = ["## Exactness: training loss against no checkpointing", ""]
    if exact:
        lines.append("| strategy | max abs(loss - loss_none) | (seed, step) pairs | seeds | verdict |")
        lines.append("|---|---|---|---|---|")
        for label, e in exact.items():
            lines.append(f"| {label} | {e['max_abs_diff']:.3g} | {e['pairs']} | {e['seeds']} | {e['verdict']} |")
        lines.append("")
        lines.append(
            "Every strategy but `compile_budget` and the lossy ones runs the model's own kernels and only "
            "changes what is stored, so its losses must equal the no-checkpoint run's for the same seed. Lossy "
            "strategies (`compress`, `optimal_lossy`, `pgac_q`) store activations compressed: their losses "
            "differ by design, and the claims table gives their convergence gap."
        )
    else:
        lines.append("No `none` run to compare against.")
    lines.append("")
    return lines


def ablations_section(res: Results) -> list[str]:
    """One table per swept PGAC option (none without --sweep)."""
    lines: list[str] = []
    tables = sweep_tables(res)
    if tables:
        lines += ["## Ablations of PGAC", ""]
        for key, trows in tables:
            lines.append(f"**{key}**")
            lines.append("")
            lines.append(
                "| value | strategy | recompute ms | step ms | measured peak | within budget | stored blocks "
                "| val loss |"
            )
            lines.append("|---|---|---|---|---|---|---|---|")
            for t in trows:
                cells = [
                    str(t["value"]),
                    t["strategy"],
                    cell(t["recompute_ms"], "ms"),
                    cell(t["step_ms"], "ms"),
                    cell(t["peak"], "bytes"),
                    cell(t["within"], "bool"),
                    cell(t["stored"]),
                    cell(t["val_loss"]),
                ]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
    return lines


def figures_section(res: Results, figures: list[tuple[str, str]]) -> list[str]:
    """Every figure with its caption, machine and command."""
    lines: list[str] = []
    if figures:
        lines += ["## Figures", ""]
        for path, caption in figures:
            lines.append(f"![{caption}]({path})")
            lines.append("")
            lines.append(f"*{caption}* Machine: {res.env['machine']}. Command: `{res.command}`.")
            lines.append("")
    return lines


def failed_runs_section(res: Results) -> list[str]:
    """The runs that failed, with their errors."""
    lines: list[str] = []
    failed = [r for r in res.runs_all if r.get("status") != "ok"]
    if failed:
        lines += ["## Failed runs", ""]
        for r in failed:
            lines.append(f"- {r.get('strategy')} seed {r.get('seed')}: {r.get('error')}")
        lines.append("")
    return lines
