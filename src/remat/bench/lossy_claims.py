"""The claims table's rows for the lossy strategies (``compress``, ``optimal_lossy``, ``pgac_q``): what storing
activations compressed buys in memory at a fixed step time, and what it costs in convergence.

* **Memory at fixed step time**: the lossy strategy's largest measured peak against the least measured peak of
  the exact strategies that are no slower (mean step time at most the lossy strategy's); where no exact
  strategy is that fast, against the fastest exact one. *Confirmed* when the lossy peak is lower. The paired
  t-test over (seed, step) on step times says how far apart the two steps are.
* **Convergence gap**: final validation loss (and perplexity or accuracy) against exact training (``none``) on
  the same seeds; paired t-test over seeds. *Confirmed* when every seed is within 0.5% in validation loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core import format_bytes
from . import stats
from .formatting import fmt_ms, fmt_pct, mean_of, p_text
from .strategies import LOSSY

if TYPE_CHECKING:
    from .results import Results

Row = dict[str, str]  # claim, expected, measured, test, verdict: a row of the claims table

GAP = 0.005  # the largest relative validation-loss gap that counts as converging like exact training


def _row(claim: str, expected: str, measured: str, test: str, verdict: str) -> Row:
    return {"claim": claim, "expected": expected, "measured": measured, "test": test, "verdict": verdict}


def lossy_labels(res: Results) -> list[str]:
    return [label for label in res.labels if res.name_of.get(label) in LOSSY]


def exact_labels(res: Results) -> list[str]:
    return [label for label in res.labels if res.name_of.get(label) not in (*LOSSY, "compile_budget")]


def _peak(res: Results, label: str) -> int | None:
    peaks = [r["peak_activation_bytes"] for r in res.runs_of(label) if r.get("peak_activation_bytes") is not None]
    return max(peaks) if peaks else None


def _step_s(res: Results, label: str) -> float | None:
    return mean_of(res.values(label, "step_time_s").values())


def memory_claim(res: Results, label: str) -> Row:
    what = f"Memory at fixed step time: `{label}` (lossy) vs exact strategies"
    expected = "lower peak than every exact strategy at the same or lower step time"
    mine, t = _peak(res, label), _step_s(res, label)
    rivals = [(e, _peak(res, e), _step_s(res, e)) for e in exact_labels(res)]
    rivals = [(e, p, s) for e, p, s in rivals if p is not None and s is not None]
    if mine is None or t is None or not rivals:
        return _row(what, expected, "no measured peak or step time to compare", "-", "not measurable here")
    as_fast = [r for r in rivals if r[2] <= t]
    base, base_peak, base_t = min(as_fast, key=lambda r: r[1]) if as_fast else min(rivals, key=lambda r: r[2])
    c = stats.paired_test(res.values(label, "step_time_s"), res.values(base, "step_time_s"))
    measured = (
        f"{format_bytes(mine)} vs `{base}` {format_bytes(base_peak)} ({fmt_pct(mine / base_peak - 1)}); step "
        f"{fmt_ms(t)} vs {fmt_ms(base_t)} ms ({fmt_pct(c.relative_diff)})"
        + ("" if as_fast else "; no exact strategy was as fast")
    )
    test = f"largest measured peak over seeds; paired t-test on step seconds, {c.n} (seed, step) pairs, "
    test += c.reason or p_text(c.p_value)
    ok = mine < base_peak
    return _row(what, expected, measured, test, "confirmed" if ok else "not confirmed")


def convergence_claim(res: Results, label: str) -> Row:
    what = f"Convergence gap: `{label}` (lossy) vs exact training"
    expected = f"validation loss within {GAP:.1%} of exact"
    if "none" not in res.labels:
        return _row(what, expected, "n/a", "needs none in --strategies", "not measurable here")
    metric = "val_perplexity" if res.is_text else "val_accuracy"
    mine = {r["seed"]: r for r in res.runs_of(label) if r.get("val_loss") is not None}
    ref = {r["seed"]: r for r in res.runs_of("none") if r.get("val_loss")}
    seeds = sorted(set(mine) & set(ref))
    if not seeds:
        return _row(what, expected, "no common seeds", "-", "not measurable here")
    gaps = [mine[s]["val_loss"] / ref[s]["val_loss"] - 1 for s in seeds]
    c = stats.paired_test([mine[s]["val_loss"] for s in seeds], [ref[s]["val_loss"] for s in seeds])
    extra = ""
    values = [(mine[s].get(metric), ref[s].get(metric)) for s in seeds]
    if all(a is not None and b for a, b in values):
        extra = f"; {metric.split('_')[1]} {fmt_pct(mean_of(a / b - 1 for a, b in values), 2)} on average"
    measured = (
        f"val loss {fmt_pct(mean_of(gaps), 2)} on average (largest {fmt_pct(max(gaps, key=abs), 2)}) over "
        f"{len(seeds)} seed(s){extra}"
    )
    test = "same seeds and validation batches; paired t-test on validation loss over seeds: "
    test += c.reason or p_text(c.p_value)
    ok = max(abs(g) for g in gaps) < GAP
    return _row(what, expected, measured, test, "confirmed" if ok else "not confirmed")


def lossy_claims(res: Results) -> list[Row]:
    """Two rows per lossy strategy that ran: memory at fixed step time and convergence gap."""
    out = []
    for label in lossy_labels(res):
        out += [memory_claim(res, label), convergence_claim(res, label)]
    return out
