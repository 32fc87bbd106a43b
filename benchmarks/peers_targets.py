"""The peers table read against remat's targets: one line per target and (model, precision), met or by how much not.

The targets, each judged from the figures of the table (:mod:`peers_table`):

* ``prediction``: every contender running a remat plan has its predicted step within 10% of its measured one;
  read twice, in absolute seconds and with both over the group's keep-all plan (``peers_table``).
* ``eager``: at every budget, ``remat optimal`` (and ``remat fit``, its measured choice, where it ran) fits and
  its step is at most 1.02x the fastest eager peer that fits (paired round by round, in the head-to-head rounds
  where the run has them). Where the median is over, the verdict says whether the ratio's 95% interval still
  holds 1.02 (the rounds did not resolve it) and whether remat runs the peer's own plan (then the gap is remat's
  runtime against the peer's, and noise).
* ``compiled``: remat's compiled contender, ``remat fit_compiled`` (``remat optimal on compiled blocks`` in records
  without it), is at most 1.02x the fastest fitting ``torch.compile`` with ``activation_memory_budget`` at the
  same byte budget: torch's budget at the fraction, or the fraction fitted to the bytes by measurement.
* ``bf16 peak`` (every precision is checked, the target names bf16): every remat plan predicted to fit has a
  tracker peak within its budget +2% and a predicted peak within 5% of the tracker's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the table's types; the table module imports this one
    from peers_table import Line, Standing, Unit

STEP_TOLERANCE = 0.10
PEAK_TOLERANCE = 0.05
BUDGET_SLACK = 0.02
SPEED_TARGET = 1.02
PLANNED = ("remat full", "remat sqrt", "remat memory_poor", "remat every_k (k fitted)", "remat optimal",
           "remat PGAC")


def _where(x: Line) -> str:
    return f"{x.name} at {x.budget:.0%}" if x.budget is not None else x.name


def prediction_check(lines: list[Line]) -> str:
    """Both readings of the predicted step: absolute, and over the group's keep-all plan (``peers_table``)."""
    absolute = _within(lines, "pred_step_ratio")
    relative = _within(lines, "pred_rel_ratio")
    return f"{absolute}; over keep-all: {relative}"


def _within(lines: list[Line], field: str) -> str:
    judged = [x for x in lines if getattr(x, field) is not None]
    if not judged:
        return "no prediction"
    off = [x for x in judged if abs(getattr(x, field) - 1.0) > STEP_TOLERANCE]
    worst = max(judged, key=lambda x: abs(getattr(x, field) - 1.0))
    if not off:
        return f"met: {len(judged)} contenders, worst {getattr(worst, field):.2f} ({_where(worst)})"
    parts = ", ".join(f"{_where(x)} {getattr(x, field):.2f}" for x in off)
    return f"NOT met for {len(off)} of {len(judged)}: {parts}"


def speed_check(rows: list[Standing], group: str) -> str:
    parts = []
    judged = [r for r in rows if r.group == group]
    several = {r.budget for r in judged if sum(x.budget == r.budget for x in judged) > 1}
    for s in judged:
        at = f"{s.budget:.0%}" + (f" {s.mine}" if s.budget in several else "")
        if s.remat_step is None:
            parts.append(f"{at}: remat refused or missing")
        elif s.peer_step is None:
            parts.append(f"{at}: no peer fits (remat {'fits' if s.remat_fits else 'does not fit'})")
        elif not s.remat_fits:
            parts.append(f"{at}: remat does not fit")
        elif s.remat_over_peer is not None and s.remat_over_peer <= SPEED_TARGET:
            parts.append(f"{at}: met ({s.remat_over_peer:.3f}x{_interval(s)}{_aa(s)})")
        else:
            parts.append(f"{at}: NOT met ({_num(s.remat_over_peer)}x{_interval(s)} {s.peer}{_aa(s)}){_why(s)}")
    return "; ".join(parts) if parts else "not measured"


def unresolved(low: float | None, high: float | None) -> bool:
    """Whether a ratio's interval ``[low, high]`` still holds the speed target (no interval: unresolved)."""
    return low is None or high is None or low <= SPEED_TARGET < high


def _why(s: Standing) -> str:
    notes = []
    if s.interval is not None and unresolved(*s.interval):
        notes.append(f"its 95% interval holds {SPEED_TARGET:.2f} after {s.rounds} rounds")
    if s.same_plan:
        notes.append("the same plan as the peer: remat's runtime against the peer's")
    return f": {'; '.join(notes)}" if notes else ""


def _interval(s: Standing) -> str:
    return f" [{s.interval[0]:.3f}–{s.interval[1]:.3f}]" if s.interval is not None else ""


def _aa(s: Standing) -> str:
    return f", A/A {s.aa:.3f}" if s.aa is not None else ""


def _num(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "—"


def peak_check(unit: Unit, lines: list[Line]) -> str:
    predicted_none = unit.start.get("predicted_none_bytes")
    parts = []
    for x in lines:
        mem: dict[str, Any] = unit.memory.get(x.key, {})
        predicted, tracker = mem.get("predicted_peak_bytes"), mem.get("tracker_bytes")
        if x.name not in PLANNED or x.budget is None or not predicted_none or predicted is None or not tracker:
            continue
        budget_bytes = x.budget * predicted_none
        if predicted > budget_bytes:
            continue  # not predicted to fit: the planner said so (strict=False static strategies)
        over = tracker / budget_bytes - 1.0
        error = predicted / tracker - 1.0
        if over > BUDGET_SLACK or abs(error) > PEAK_TOLERANCE:
            parts.append(f"{_where(x)}: tracker {over:+.1%} of budget, prediction {error:+.1%}")
    return "met" if not parts else "NOT met: " + "; ".join(parts)


def targets_table(units: list[Unit], lines_of: dict[tuple[str, str], list[Line]],
                  standings_of: dict[tuple[str, str], list[Standing]]) -> str:
    out = ["| model | dtype | predicted step within 10% | optimal (and fit) <= 1.02x fastest fitting eager peer | "
           "remat compiled (fit_compiled) <= 1.02x fastest fitting torch.compile budget | "
           "plans fit (+2%), predicted peak within 5% |",
           "|" + "---|" * 6]
    for unit in units:
        key = (unit.model, unit.dtype)
        lines, rows = lines_of.get(key, []), standings_of.get(key, [])
        out.append(f"| {unit.model} | {unit.dtype} | {prediction_check(lines)} | {speed_check(rows, 'eager')} | "
                   f"{speed_check(rows, 'compiled')} | {peak_check(unit, lines)} |")
    return "\n".join(out)
