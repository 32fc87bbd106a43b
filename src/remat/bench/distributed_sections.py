"""The sections of ``report.md`` on the sweeps that run under torchrun, one function per section: DDP's
``sync=local`` against ``sync=global`` (:mod:`~remat.bench.ddp_sweep`) and the two-stage pipeline's
``stage_sync=local`` against ``stage_sync=global`` (:mod:`~remat.bench.pipeline_sweep`)."""

from __future__ import annotations

from ..core import format_bytes
from .formatting import cell, fmt_ms
from .pipeline_summary import compare_modes, mode_rows
from .results import Results


def distributed_section(res: Results) -> list[str]:
    """sync=local against sync=global under torchrun (none without --sweep sync=...)."""
    lines: list[str] = []
    summaries = [d for d in res.ddp if d.get("record") == "summary"]
    if summaries:
        lines += [
            "## Distributed thresholds: sync=local against sync=global",
            "",
            "Two CPU ranks (torchrun, gloo, DistributedDataParallel), each on its own batches, PGAC planning "
            "from seed 0's cost table at the same budget.",
            "",
            "| sync | status | step ms | recompute ms | masks equal across ranks | mean stored blocks | final loss |",
            "|---|---|---|---|---|---|---|",
        ]
        for d in summaries:
            if d.get("status") != "ok":
                lines.append(f"| {d['sync']} | failed: {d.get('error', '')[:200]} | | | | | |")
                continue
            lines.append(
                f"| {d['sync']} | ok | {fmt_ms(d['step_time_s'])} | {fmt_ms(d['recompute_time_s'])} | "
                f"{cell(d['mask_agreement'], 'pct')} of steps | {cell(d['mean_stored_blocks'])} | "
                f"{cell(d['final_loss'])} |"
            )
        lines.append("")
    return lines


def pipeline_section(res: Results) -> list[str]:
    """stage_sync=local against stage_sync=global on a two-stage pipeline (none without --sweep stage_sync=...)."""
    rows = mode_rows(res.pipeline)
    if not rows:
        return []
    ok = next((d for d in res.pipeline if d.get("record") == "summary" and d.get("status") == "ok"), {})
    lines = [
        "## Pipeline thresholds: stage_sync=local against stage_sync=global",
        "",
        f"Two CPU stages (torchrun, gloo), {ok.get('schedule', '1f1b')} over {ok.get('micro_batches', '?')} "
        "micro-batches, the model of seed 0 on the same batches and dropout seeds in both modes; a PGAC per "
        "stage at the budget fraction of the stage's no-checkpoint activation memory with its micro-batches in "
        "flight. local: each stage thresholds its own scores; global: the quantile of the whole chain's scores "
        "(one all-reduce per step). Peaks measured by the live-tensor tracker on every step (step times "
        "include it).",
        "",
        "| thresholds | stage | blocks | in flight | budget | largest measured peak | within | last step's peak "
        "| blocks recomputed | recompute ms | mask changes | final tau | step ms | final loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['stage_sync']} | failed: {str(r.get('error', ''))[:200]} |" + " |" * 12)
            continue
        cells = [
            r["stage_sync"],
            str(r["stage"]),
            str(r["blocks"]),
            str(r["in_flight"]),
            format_bytes(r["budget_bytes"]),
            format_bytes(r["max_peak_bytes"]),
            cell(r["within_budget"], "bool"),
            format_bytes(r["last_peak_bytes"]),
            cell(r["recompute_fraction"], "pct"),
            f"{r['recompute_ms']:.2f}",
            f"{r['mask_changes']} of {r['steps'] - 1}",
            f"{r['final_tau']:.4g}",
            f"{r['step_ms']:.1f}",
            cell(r["final_loss"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    cmp = compare_modes(res.pipeline)
    if cmp is not None:
        per_stage = ", ".join(f"stage {p} {a:.0%}" for p, a in enumerate(cmp["mask_agreement_per_stage"]))
        lines += [
            f"Over the {cmp['steps']} steps both ran: the two modes ran the same mask on "
            f"{cmp['mask_agreement']:.0%} of (step, stage) pairs ({per_stage}); the thresholds PGAC set after a "
            f"step differed on some stage after {cmp['steps_tau_differs']} of them; largest loss difference "
            f"{cell(cmp['max_loss_diff'])}"
            + (
                f", step 0 loss {cmp['loss_step0'][0]:.6g} (local) and {cmp['loss_step0'][1]:.6g} (global)."
                if cmp["loss_step0"] and None not in cmp["loss_step0"]
                else "."
            ),
            "",
        ]
    return lines
