"""From a results folder to ``summary.csv``, ``summary.json``, ``report.md`` and the plots.

The report reads only the files the runner wrote (``config.json``, ``steps.jsonl``, ``runs.jsonl``,
``costs/``, ``runs/``, ``ddp.jsonl``, ``pipeline.jsonl``), so it can be rebuilt at any time with
``python -m remat.bench.report RESULTS_DIR``. It holds:

* one row per strategy: plan prediction and whether it fits, measured peak activation memory against the
  budget, step / forward / backward / recompute time, recompute overhead, throughput, losses, validation
  metric, energy;
* paired t-tests of step time against static uniform checkpointing and against DTR (pairs are the same
  ``(seed, step)``: the same weights, batch and dropout stream), with a per-seed test beside them;
* the claims table (:mod:`remat.bench.claims`): each expected outcome of section 3.1 of the PGAC proposal
  with the measured value, the test and a verdict (confirmed / not confirmed / not measurable here);
* the exactness table: the largest ``|loss - loss_none|`` of every strategy over the same seeds and steps;
* the ablations (PGAC variants from ``--sweep``, the distributed ``sync`` sweep, the pipeline ``stage_sync``
  sweep) and the figures.

This module puts them together; :mod:`~remat.bench.results` reads the folder, :mod:`~remat.bench.summary`
computes the tables, :mod:`~remat.bench.figures` draws the figures and :mod:`~remat.bench.markdown` writes
``report.md``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from .claims import evaluate_claims
from .figures import make_plots
from .markdown import render_markdown
from .pipeline_summary import compare_modes, mode_rows
from .results import Results
from .summary import comparisons, loss_differences, strategy_rows, sweep_tables, write_csv


def build_report(out: Path | str) -> dict[str, Any]:
    """Write summary.csv, summary.json, report.md and plots/ for the results folder ``out``."""
    res = Results(Path(out))
    rows = strategy_rows(res)
    cmp = comparisons(res)
    claim_list = evaluate_claims(res)
    exact = loss_differences(res)
    figures = make_plots(res, rows)
    write_csv(res.out / "summary.csv", rows)
    (res.out / "report.md").write_text(render_markdown(res, rows, cmp, claim_list, exact, figures))
    summary = {
        "settings": res.settings,
        "environment": res.env,
        "budget": res.config["budget"],
        "commands": res.config.get("commands", []),
        "strategies": rows,
        "comparisons": cmp,
        "claims": [c.to_dict() for c in claim_list],
        "exactness": exact,
        "sweeps": [{"key": k, "rows": v} for k, v in sweep_tables(res)],
        "ddp": [d for d in res.ddp if d.get("record") == "summary"],
        "pipeline": {"rows": mode_rows(res.pipeline), "comparison": compare_modes(res.pipeline)},
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
