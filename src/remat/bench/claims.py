"""The claims table: each expected outcome of section 3.1 of the PGAC proposal against what a bench measured.

For every claim: the expected effect, the measured value, the test behind it and a verdict -- *confirmed* when
the effect reaches the low end of the expected range and the paired t-test is significant at p < 0.05
(memory: every measured step within the budget; fidelity: every seed within 0.5%), *not confirmed* otherwise,
*not measurable here* when this run lacks what the claim needs (a baseline, an energy counter, other models).
PGAC is compared with static uniform checkpointing (``every_k``, else ``full``) and with DTR. The lossy
strategies add two rows each (:mod:`remat.bench.lossy_claims`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core import format_bytes
from . import stats
from .formatting import fmt_ms, fmt_pct, mean_of, p_text
from .lossy_claims import lossy_claims

if TYPE_CHECKING:
    from .results import Results


@dataclass
class Claim:
    """One expected outcome of the proposal, as measured here."""

    claim: str
    expected: str
    measured: str
    test: str
    verdict: str  # "confirmed", "not confirmed" or "not measurable here"

    def to_dict(self) -> dict[str, str]:
        return dict(self.__dict__)


def evaluate_claims(res: Results) -> list[Claim]:
    """The expected outcomes of section 3.1 of the PGAC proposal against what this run measured."""
    P, S, D = res.pgac_label, res.static_label, res.dtr_label
    out = [
        _recompute_claim(res, P, S, "static checkpointing", (0.15, 0.30)),
        _recompute_claim(res, P, D, "DTR", (0.10, 0.20)),
        _memory_claim(res, P),
        _throughput_claim(res, P, S),
        _fidelity_claim(res, P),
        _energy_claim(res, P, S),
        Claim(
            "Robust across NLP and CV tasks, depths and widths",
            "stable behaviour",
            f"one model here ({res.settings['model']}-{res.settings['preset']})",
            "needs one bench per model: `remat bench --model gpt2|bert|vit|mlp`, then compare the reports",
            "not measurable here",
        ),
    ]
    return out + [Claim(**row) for row in lossy_claims(res)]


def _missing(what: str, needs: str) -> Claim:
    return Claim(what, "", "n/a", f"needs {needs} in --strategies", "not measurable here")


def _recompute_claim(res: Results, P: str | None, B: str | None, against: str, band: tuple[float, float]) -> Claim:
    what = f"Recompute time vs {against}"
    expected = f"{band[0]:.0%}-{band[1]:.0%} less"
    if P is None or B is None:
        return _missing(what, "pgac and " + ("every_k or full" if against.startswith("static") else "dtr"))
    c = stats.paired_test(res.values(P, "recompute_time_s"), res.values(B, "recompute_time_s"))
    if c.mean is None or c.baseline_mean is None:
        return Claim(what, expected, "no paired steps", "paired t-test", "not measurable here")
    if c.baseline_mean == 0:
        return Claim(
            what, expected, f"{B} recomputes nothing ({fmt_ms(c.mean)} ms for {P})", "-", "not measurable here"
        )
    reduction = -c.relative_diff if c.relative_diff is not None else None
    ci = f"[{fmt_ms(c.ci_low)}, {fmt_ms(c.ci_high)}]"
    measured = (
        f"{fmt_pct(c.relative_diff)} ({P} {fmt_ms(c.mean)} ms vs {B} {fmt_ms(c.baseline_mean)} ms per step; "
        f"difference 95% CI {ci} ms)"
    )
    test = f"paired t-test on recompute seconds, {c.n} (seed, step) pairs, {p_text(c.p_value)}"
    ok = reduction is not None and reduction >= band[0] and c.significant
    if ok and reduction is not None and reduction > band[1]:
        measured += "; above the expected range"
    return Claim(what, expected, measured, test, "confirmed" if ok else "not confirmed")


def _memory_claim(res: Results, P: str | None) -> Claim:
    what = "Activation memory within the fixed budget"
    expected = f"peak <= budget ({format_bytes(res.budget)})"
    if P is None:
        return _missing(what, "pgac")
    measured_steps = [s for s in res.steps if s["strategy"] == P and s.get("peak_activation_bytes") is not None]
    if not measured_steps:
        return Claim(what, expected, "no measured step", "-", "not measurable here")
    peak = max(s["peak_activation_bytes"] for s in measured_steps)
    predicted = mean_of(r.get("predicted_peak_bytes") for r in res.runs_of(P))
    measured = (
        f"max {format_bytes(peak)} = {peak / res.budget:.0%} of the budget over {len(measured_steps)} "
        f"measured steps (plan predicted {format_bytes(predicted)})"
    )
    test = "live-tensor tracker peak on every measured step of every seed, compared with the budget"
    return Claim(what, expected, measured, test, "confirmed" if peak <= res.budget else "not confirmed")


def _throughput_claim(res: Results, P: str | None, S: str | None) -> Claim:
    what = "Throughput at the same budget vs static checkpointing"
    expected = "10%-25% more"
    if P is None or S is None:
        return _missing(what, "pgac and every_k or full")
    c = stats.paired_test(res.values(P, "throughput"), res.values(S, "throughput"))
    if c.relative_diff is None:
        return Claim(what, expected, "no paired steps", "paired t-test", "not measurable here")
    unit = (res.runs_of(P) or [{}])[0].get("unit", "items")
    within = all(r.get("within_budget") for r in res.runs_of(P))
    measured = f"{fmt_pct(c.relative_diff)} (mean per-step {c.mean:,.0f} vs {c.baseline_mean:,.0f} {unit}/s)" + (
        "" if within else "; PGAC exceeded the budget"
    )
    test = f"paired t-test on per-step throughput, {c.n} (seed, step) pairs, {p_text(c.p_value)}"
    ok = c.relative_diff >= 0.10 and c.significant and within
    return Claim(what, expected, measured, test, "confirmed" if ok else "not confirmed")


def _fidelity_claim(res: Results, P: str | None) -> Claim:
    text = res.is_text
    metric = "val_perplexity" if text else "val_accuracy"
    what = f"Final validation {'perplexity' if text else 'accuracy'} vs no checkpointing"
    expected = "< 0.5% difference"
    if P is None or "none" not in res.labels:
        return _missing(what, "pgac and none")
    mine = {r["seed"]: r for r in res.runs_of(P)}
    ref = {r["seed"]: r for r in res.runs_of("none")}
    seeds = sorted(s for s in mine if s in ref and mine[s].get(metric) is not None and ref[s].get(metric))
    if not seeds:
        return Claim(what, expected, "no common seeds", "-", "not measurable here")
    rel = [abs(mine[s][metric] - ref[s][metric]) / abs(ref[s][metric]) for s in seeds]
    c = stats.paired_test([mine[s]["val_loss"] for s in seeds], [ref[s]["val_loss"] for s in seeds])
    mine_mean, ref_mean = mean_of(mine[s][metric] for s in seeds), mean_of(ref[s][metric] for s in seeds)
    measured = (
        f"largest relative difference {max(rel):.3%} over {len(seeds)} seed(s) "
        f"({P} {mine_mean:.4g} vs none {ref_mean:.4g})"
    )
    test = (
        f"same seeds, same {res.config.get('settings', {}).get('eval_batches')} validation batches; paired "
        f"t-test on validation loss over seeds: {c.reason or p_text(c.p_value)}"
    )
    return Claim(what, expected, measured, test, "confirmed" if max(rel) < 0.005 else "not confirmed")


def _energy_claim(res: Results, P: str | None, S: str | None) -> Claim:
    what = "Training energy vs static checkpointing"
    expected = "10%-15% less"
    if P is None or S is None:
        return _missing(what, "pgac and every_k or full")
    mine = {r["seed"]: r for r in res.runs_of(P) if r.get("energy_j") is not None}
    ref = {r["seed"]: r for r in res.runs_of(S) if r.get("energy_j") is not None}
    seeds = sorted(set(mine) & set(ref))
    if not seeds:
        reasons = {r.get("energy_note") for r in res.runs_of(P) + res.runs_of(S) if r.get("energy_note")}
        why = "; ".join(sorted(reasons)) or "no energy counter was read"
        return Claim(what, expected, "not available", f"no hardware energy counter: {why}", "not measurable here")

    def per_step(run: dict[str, Any]) -> float:
        return run["energy_j"] / max(1, run["timed_steps"])

    c = stats.paired_test([per_step(mine[s]) for s in seeds], [per_step(ref[s]) for s in seeds])
    measured = (
        f"{fmt_pct(c.relative_diff)} ({c.mean:.3g} vs {c.baseline_mean:.3g} J per timed step; "
        f"{mean_of(mine[s]['energy_kwh'] for s in seeds):.3g} kWh per run)"
    )
    source = mine[seeds[0]].get("energy_source")
    test = f"{source} counters, paired over {len(seeds)} seed(s): {c.reason or p_text(c.p_value)}"
    ok = c.relative_diff is not None and c.relative_diff <= -0.10 and c.significant
    return Claim(what, expected, measured, test, "confirmed" if ok else "not confirmed")


def context_notes(res: Results) -> list[str]:
    """Facts a reader needs to weigh the verdicts: where PGAC's saving comes from and what DTR's costs are."""
    notes = []
    P, S, D = res.pgac_label, res.static_label, res.dtr_label
    opt = res.first("optimal")
    if P and S:
        notes.append(
            f"Static uniform checkpointing (`{S}`) re-runs every block once whatever the budget; PGAC spends the "
            "budget on stored blocks, which is where its saving against it comes from."
        )
    if P and opt:
        rec = stats.paired_test(res.values(P, "recompute_time_s"), res.values(opt, "recompute_time_s"))
        step = stats.paired_test(res.values(P, "step_time_s"), res.values(opt, "step_time_s"))
        if rec.relative_diff is not None and step.relative_diff is not None:
            notes.append(
                f"Against the optimal static plan at the same budget (`{opt}`, least predicted step time): PGAC "
                f"recompute {fmt_pct(rec.relative_diff)} ({p_text(rec.p_value)}), step time "
                f"{fmt_pct(step.relative_diff)} ({p_text(step.p_value)})."
            )
    if P and D:
        overhead = stats.paired_test(res.values(D, "step_time_s"), res.values(P, "step_time_s"))
        rec = stats.paired_test(res.values(D, "recompute_time_s"), res.values(P, "recompute_time_s"))
        if overhead.diff is not None and rec.diff is not None:
            notes.append(
                f"DTR's recompute seconds count only the operators it re-runs. Its step is {fmt_ms(overhead.diff)} ms "
                f"({fmt_pct(overhead.relative_diff)}) longer than PGAC's while its recompute differs by "
                f"{fmt_ms(rec.diff)} ms: the rest is the cost of tracking every operator (a Python dispatch mode)."
            )
    twins = identical_plans(res)
    for a, b in twins:
        c = stats.paired_test(res.values(a, "step_time_s"), res.values(b, "step_time_s"))
        if c.relative_diff is not None:
            notes.append(
                f"`{a}` and `{b}` ran the same plan, yet their step times differ by {fmt_pct(c.relative_diff)} "
                f"({p_text(c.p_value)}): differences of that size between strategies are within this machine's "
                "timing noise."
            )
    return notes


def identical_plans(res: Results) -> list[tuple[str, str]]:
    """Pairs of static strategies that ran the same plan on every seed (a direct view of timing noise)."""
    plans: dict[str, tuple[Any, ...]] = {}
    for label in res.labels:
        runs = sorted(res.runs_of(label), key=lambda r: r["seed"])
        if runs and all(r.get("plan") for r in runs) and res.name_of[label] not in ("pgac", "pgac_q"):
            plans[label] = tuple((r["seed"], tuple(sorted(r["plan"].items()))) for r in runs)
    labels = list(plans)
    return [(a, b) for i, a in enumerate(labels) for b in labels[i + 1 :] if plans[a] == plans[b]]
