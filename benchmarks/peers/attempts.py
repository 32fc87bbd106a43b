"""Units of the peers benchmark run again when the machine's speed changed under them: the check, the records kept.

A unit's "no checkpointing" row is remat's keep-all plan, whose blocks' kept forward and backward the profile
reads within its own plain steps of the same model: on a steady machine its predicted step over its measured
one is 1.00 up to the noise of a few steps. Off by more than a tolerance, the machine's speed changed between
the profile and the timing rounds (another tenant of a shared host), and every prediction of the unit moved with
it. :func:`steadiness` reads that ratio from a finished unit's records; ``peers.py`` then runs the unit again
(``--retries``) and writes a :data:`DISCARDED` record naming the attempt. Every record a unit writes carries its
``attempt``; :func:`without_discarded` drops those of discarded attempts wherever a file is read, and
:func:`discarded_text` says which attempts were dropped and why.
"""

from __future__ import annotations

from typing import Any

from .table import REFERENCE, group_units, unit_lines

DISCARDED = "attempt_discarded"


def steadiness(records: list[dict[str, Any]]) -> float | None:
    """The "no checkpointing" row's predicted step over its measured one, for the records of one finished unit
    (None when the unit did not finish or has no such prediction)."""
    units = group_units(records)
    if len(units) != 1 or not units[0].done:
        return None
    line = next((x for x in unit_lines(units[0]) if x.key == REFERENCE["eager"]), None)
    return line.pred_step_ratio if line is not None else None


def unsteady(ratio: float | None, tolerance: float) -> bool:
    return ratio is not None and abs(ratio - 1.0) > tolerance


def discard_record(job: dict[str, Any], attempt: int, ratio: float, tolerance: float) -> dict[str, Any]:
    return {"record": DISCARDED, "model": job["model"], "dtype": job["dtype"], "attempt": attempt,
            "none_pred_over_measured": ratio, "tolerance": tolerance}


def without_discarded(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` without those of discarded attempts (the discard records themselves are kept)."""
    gone = {(r["model"], r["dtype"], r["attempt"]) for r in records if r.get("record") == DISCARDED}
    return [r for r in records
            if r.get("record") == DISCARDED or (r.get("model"), r.get("dtype"), r.get("attempt")) not in gone]


def discarded_text(records: list[dict[str, Any]]) -> str:
    """One line per discarded attempt, or an empty string."""
    lines = [
        f"- {r['model']}/{r['dtype']} attempt {r['attempt']}: no checkpointing predicted "
        f"{r['none_pred_over_measured']:.2f}x its measured step (more than {r['tolerance']:.0%} off: the machine's "
        "speed changed between the profile and the timing rounds); run again"
        for r in records if r.get("record") == DISCARDED
    ]
    return "Discarded attempts:\n\n" + "\n".join(lines) if lines else ""
