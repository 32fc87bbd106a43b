"""The bench report's note on the machine's speed moving between the profile and the runs
(:func:`remat.bench.markdown.host_drift_note`): shown only when no checkpointing misses its own prediction by more
than 5%, with every ratio over no checkpointing's."""

from __future__ import annotations

from remat.bench.markdown import host_drift_note


def rows(**ratios: float | None) -> list[dict]:
    return [{"strategy": name, "strategy_name": name, "predicted_step_ratio": r} for name, r in ratios.items()]


def test_a_drifted_run_gets_the_ratios_over_no_checkpointings() -> None:
    note = " ".join(host_drift_note(rows(none=0.81, full=0.83, optimal=0.68, dtr=None)))
    assert "read 0.81x of its own prediction" in note
    assert "full 1.02, optimal 0.84." in note and "dtr" not in note and "none 1.00" not in note


def test_a_steady_run_or_one_without_no_checkpointing_gets_no_note() -> None:
    assert host_drift_note(rows(none=1.04, full=0.7)) == []
    assert host_drift_note(rows(none=0.96)) == []
    assert host_drift_note(rows(full=0.7, optimal=0.6)) == []
    assert host_drift_note(rows(none=None, full=0.7)) == []
