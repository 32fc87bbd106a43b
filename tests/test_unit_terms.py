"""One table of units run through every form of the memory and time model: the simulator's scalar form, the
vectorised tables of :mod:`remat.planning.unit_terms`, and the columns the optimal planner searches over
(:class:`remat.planning.chain_units.ChainUnits`, by start and by end). Every form must give the same numbers,
floating-point seconds included."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from remat.core import MEMORY_POOR, SEGMENT, SINGLE, BlockCost, CostTable, Unit, units_from_actions
from remat.planning import simulate
from remat.planning.chain_units import ChainUnits
from remat.planning.unit_terms import TIME_GRID_S, ChainNumbers, group_table, on_time_grid, single_table, unit_terms

SELECTIVE = "selective:dots_saveable"


def block(i: int, keep: int, checkpointed: int, out: int, fwd_temp: int, bwd_temp: int, rerun: float) -> BlockCost:
    """A block with costs for every single action; its selective and offload rows differ from keep and
    checkpoint, and selective's backward peaks higher (``bwd_extra``)."""
    saved = {"keep": keep, "checkpoint": checkpointed, SELECTIVE: (keep + checkpointed) // 2, "offload": out + 3}
    # Seconds that are not sums of powers of two: the forms only agree if they add in the same order.
    recompute = {"keep": 0.0, "checkpoint": rerun, SELECTIVE: rerun * 0.3, "offload": rerun * 0.11}
    extra = {SELECTIVE: 7 + i, "offload": 2}
    # a checkpointed forward may save time (negative overhead), never more than its recomputation
    checkpoint = rerun * (0.07 if i % 2 else -0.4) + i / 3000
    overhead = {"keep": 0.0, "checkpoint": checkpoint, SELECTIVE: rerun * 0.19, "offload": rerun * 0.05}
    return BlockCost(
        f"b{i}", rerun, 2 * rerun, out, out, saved, recompute, fwd_temp, bwd_temp, extra, overhead_s=overhead
    )


def chain(n: int, head_retained: int = 0, held_args: int = 0, forward_decides: bool = False) -> CostTable:
    """Blocks of different sizes. Usually a unit's backward decides its peak (keep saves more than checkpoint);
    with ``forward_decides`` checkpointing saves more than keeping (a block whose stored input is a copy) and
    the forward temporaries are the larger ones, so the forward formulas decide."""
    blocks = []
    for i in range(n):
        out, keep, temp = 10 + 3 * (i % 3), 90 + 17 * i, 5 + 11 * i
        checkpointed = keep + 200 if forward_decides else out + 1
        bwd_temp = temp // 2 if forward_decides else temp + 9 * (i % 2)
        blocks.append(block(i, keep, checkpointed, out, temp, bwd_temp, math.sqrt(2 + i) / 1000))
    return CostTable(blocks, stem_bytes=4, head_bytes=50, head_retained_bytes=head_retained, held_args_bytes=held_args)


def with_no_grad_forwards(costs: CostTable) -> CostTable:
    """``costs`` whose blocks' forwards under no_grad were timed (faster than their recomputation)."""
    blocks = [replace(b, nograd_fwd_s=b.recompute_s["checkpoint"] * 0.61) for b in costs.blocks]
    return replace(costs, blocks=blocks)


# (case id, cost table, the plan's block actions); every unit of every plan is checked.
CASES = [
    ("single keep", chain(1), ["keep"]),
    ("single checkpoint", chain(1), ["checkpoint"]),
    ("single selective", chain(1), [SELECTIVE]),
    ("single offload", chain(1), ["offload"]),
    ("every single action", chain(4), ["keep", "checkpoint", SELECTIVE, "offload"]),
    ("segment of two", chain(2), ["segment:0"] * 2),
    ("segment of the whole chain", chain(6), ["segment:0"] * 6),
    ("segments back to back", chain(5), ["segment:a"] * 2 + ["segment:b"] * 3),
    ("memory-poor group of two", chain(2), ["memory_poor:0"] * 2),
    ("memory-poor group of the whole chain", chain(6), ["memory_poor:0"] * 6),
    ("memory-poor group, forward decides", chain(5, forward_decides=True), ["memory_poor:0"] * 5),
    ("memory-poor group, no-grad forwards timed", with_no_grad_forwards(chain(6)), ["memory_poor:0"] * 6),
    ("segment, forward decides", chain(2, forward_decides=True), ["segment:0"] * 2),
    ("checkpoint, forward decides", chain(1, forward_decides=True), ["checkpoint"]),
    (
        "head_retained",
        chain(6, head_retained=37),
        ["keep", "segment:0", "segment:0", "memory_poor:1", "memory_poor:1", SELECTIVE],
    ),
    ("bwd_extra of selective", chain(3, head_retained=5), [SELECTIVE, SELECTIVE, "offload"]),
    (
        "head_retained negative",  # the model's forward frees stem bytes before the chain's backward
        chain(5, head_retained=-3, held_args=2),
        ["checkpoint", "segment:0", "segment:0", "memory_poor:1", "memory_poor:1"],
    ),
    ("held args", chain(4, held_args=23), ["keep", "memory_poor:0", "memory_poor:0", "checkpoint"]),
    (
        "held args row by row",  # an argument the first block computes for the later ones (T5's position bias)
        replace(chain(5, held_args=23), held_args_rows=[3, 3, 23, 23, 23]),
        ["checkpoint", "segment:0", "segment:0", "memory_poor:1", "memory_poor:1"],
    ),
    ("segment, outputs kept", replace(chain(4), outputs_kept=True), ["keep", *["segment:0"] * 3]),
    ("memory-poor group, outputs kept", replace(chain(5), outputs_kept=True), ["memory_poor:0"] * 4 + ["keep"]),
    (
        "memory-poor group, forward decides, outputs kept",
        replace(chain(5, forward_decides=True), outputs_kept=True),
        ["memory_poor:0"] * 5,
    ),
    (
        "segments and a memory-poor group, deferral priced",
        replace(chain(7), deferred_s_per_byte=1.3e-6),
        ["segment:a"] * 3 + ["memory_poor:b"] * 2 + ["segment:c"] * 2,
    ),
    (
        "mixed",
        chain(9, head_retained=3, held_args=6),
        [SELECTIVE, *["segment:0"] * 2, *["memory_poor:1"] * 3, "offload", "checkpoint", "keep"],
    ),
]

# retained bytes, peak bytes above the prefix, time cost (recompute plus overhead seconds), re-runs, deferred
Terms = tuple[int, int, float, int, int]


def simulator_form(costs: CostTable, actions: list[str]) -> list[Terms]:
    """The simulator: :func:`unit_terms` per unit, with the peaks :func:`simulate` charges (held args included)."""
    sim = simulate(costs, actions)
    units = units_from_actions(actions)
    rows = []
    for unit, peak in zip(units, sim.unit_peaks, strict=True):
        terms = unit_terms(costs, unit)
        rows.append((terms.retained, peak, terms.time_cost_s, sum(terms.reexecutions), terms.deferred))
    return rows


def simulator_seconds(costs: CostTable, actions: list[str]) -> list[tuple[float, float]]:
    """Recompute and overhead seconds of each unit, in the simulator's form."""
    return [(t.recompute_s, t.overhead_s) for t in (unit_terms(costs, u) for u in units_from_actions(actions))]


def table_seconds(costs: CostTable, actions: list[str]) -> list[tuple[float, float]]:
    """Recompute and overhead seconds of each unit, read from the vectorised tables."""
    n = len(costs)
    rows = []
    for unit in units_from_actions(actions):
        if unit.kind == SINGLE:
            t = single_table(costs, [unit.action])
            rows.append((float(t.recompute_s[0, unit.start]), float(t.overhead_s[0, unit.start])))
            continue
        g = group_table(ChainNumbers.of(costs), costs.head_retained_bytes, n, [SEGMENT, MEMORY_POOR])
        s, j = unit.start, unit.size - 1
        rows.append((float(g.recompute_s[unit.kind][s, j]), float(g.overhead_s[unit.kind][s, j])))
    return rows


def held_at(costs: CostTable, unit: Unit) -> int:
    """The held arguments a unit's peak counts under a plan that recomputes: the most alive at any of its rows."""
    return max(costs.held_args_per_row()[unit.start : unit.end + 1])


def table_form(costs: CostTable, actions: list[str]) -> list[Terms]:
    """:func:`single_table` and :func:`group_table` over the whole chain, with each unit's held arguments and
    backward bytes added as the simulator adds them."""
    n = len(costs)
    extra = costs.backward_bytes_per_row()
    rows = []
    for unit in units_from_actions(actions):
        added = held_at(costs, unit) + max(extra[unit.start : unit.end + 1])
        if unit.kind == SINGLE:
            t = single_table(costs, [unit.action])
            rows.append((t.retained[0, unit.start], t.peak[0, unit.start] + added, t.time_cost_s[0, unit.start],
                         t.reexecutions[0], 0))  # fmt: skip
            continue
        g = group_table(ChainNumbers.of(costs), costs.head_retained_bytes, n, [SEGMENT, MEMORY_POOR],
                        outputs_kept=costs.outputs_kept)  # fmt: skip
        s, j = unit.start, unit.size - 1
        rows.append((g.retained[s, j], g.peak[unit.kind][s, j] + added, g.time_cost_s[unit.kind][s, j],
                     g.reexecutions[unit.kind][j], g.deferred[unit.kind][j]))  # fmt: skip
    return rows


def planner_form(costs: CostTable, actions: list[str], by: str) -> list[Terms]:
    """The columns the optimal planner's search reads: units listed by the block they start (``by="start"``,
    the suffix bounds) or end at (``by="end"``, the search)."""
    chain_units = ChainUnits.from_costs(costs, None)
    n = len(costs)
    rows = []
    for unit in units_from_actions(actions):
        listed = chain_units.starting_at(unit.start, n) if by == "start" else chain_units.ending_at(unit.end, n)
        retained, peak, time_cost, reexec, deferred = _pick(chain_units, listed, unit)
        rows.append((retained, peak, time_cost, reexec, deferred))
    return rows


def _pick(chain_units: ChainUnits, listed, unit: Unit) -> Terms:  # noqa: ANN001
    if unit.kind == SINGLE:
        code = chain_units.singles.actions.index(unit.action)
    else:
        code = len(chain_units.singles.actions) + chain_units.group_kinds.index(unit.kind)
    (row,) = [r for r in range(len(listed.code)) if listed.code[r] == code and listed.start[r] == unit.start
              and listed.end[r] == unit.end]  # fmt: skip
    return listed.retained[row], listed.peak[row], listed.time[row], listed.reexec[row], listed.deferred[row]


def as_python(rows: list[Terms]) -> list[Terms]:
    return [(int(r), int(p), float(t), int(x), int(d)) for r, p, t, x, d in rows]


@pytest.mark.parametrize("name, costs, actions", CASES, ids=[c[0] for c in CASES])
def test_every_form_gives_the_same_numbers(name: str, costs: CostTable, actions: list[str]) -> None:
    expected = as_python(simulator_form(costs, actions))
    assert len(expected) == len(units_from_actions(actions))
    assert as_python(table_form(costs, actions)) == expected
    assert as_python(planner_form(costs, actions, by="start")) == expected
    assert as_python(planner_form(costs, actions, by="end")) == expected
    assert table_seconds(costs, actions) == simulator_seconds(costs, actions)
    sim = simulate(costs, actions)
    assert sim.time_cost_s == sum(t for _, _, t, _, _ in expected)  # summed unit by unit, as the search does
    assert sim.deferred == sum(d for *_, d in expected)
    assert sim.step_s == sum(b.fwd_s + b.bwd_s for b in costs.blocks) + sim.time_cost_s


def test_the_table_exercises_what_it_names() -> None:
    """Guards the table itself: the cases must reach the terms their names promise."""
    by_name = {name: (costs, actions) for name, costs, actions in CASES}
    kinds = {u.kind for _, _, actions in CASES for u in units_from_actions(actions)}
    assert kinds == {SINGLE, SEGMENT, MEMORY_POOR}
    for name in ("segment of the whole chain", "memory-poor group of the whole chain", "segment, forward decides",
                 "memory-poor group, forward decides", "checkpoint, forward decides"):  # fmt: skip
        costs, actions = by_name[name]
        (unit,) = units_from_actions(actions)
        blocks = costs.blocks[unit.start : unit.end + 1]
        forward_peak = max(
            (blocks[m - 1].output_bytes if m else 0) + b.saved("checkpoint") + b.fwd_temp_bytes
            for m, b in enumerate(blocks)
        )
        decided_by_forward = unit_terms(costs, unit).peak == forward_peak
        assert decided_by_forward == ("forward decides" in name), name
    for name in ("segment, outputs kept", "memory-poor group, outputs kept"):
        costs, actions = by_name[name]
        group = [u for u in units_from_actions(actions) if u.kind != SINGLE][0]
        inner = sum(b.output_bytes for b in costs.blocks[group.start : group.end])
        freed = replace(costs, outputs_kept=False)
        assert unit_terms(costs, group).retained == unit_terms(freed, group).retained + inner, name
        assert unit_terms(costs, group).peak > unit_terms(freed, group).peak, name
    costs, actions = by_name["held args"]
    held = simulate(costs, actions).unit_peaks[0] - unit_terms(costs, units_from_actions(actions)[0]).peak
    assert held == costs.held_args_bytes
    costs, actions = by_name["held args row by row"]
    units = units_from_actions(actions)
    held = [p - unit_terms(costs, u).peak for u, p in zip(units, simulate(costs, actions).unit_peaks, strict=True)]
    assert held == [3, 23, 23]  # the segment over rows 1 and 2 holds what row 2 does
    costs, actions = by_name["memory-poor group of the whole chain"]
    (unit,) = units_from_actions(actions)
    rerun = [b.recompute_s["checkpoint"] for b in costs.blocks]
    assert unit_terms(costs, unit).reexecutions == (6, 5, 4, 3, 2, 1)
    assert unit_terms(costs, unit).recompute_s == pytest.approx(sum(sum(rerun[: m + 1]) for m in range(6)))
    # with the no-grad forwards timed, block m's backward re-runs s..m-1 at that speed and m as a recomputation
    timed, _ = by_name["memory-poor group, no-grad forwards timed"]
    inner = [b.nograd_fwd_s for b in timed.blocks]
    expected = sum(sum(inner[:m]) + rerun[m] for m in range(6))
    assert unit_terms(timed, unit).recompute_s == pytest.approx(expected)
    assert unit_terms(timed, unit).recompute_s < unit_terms(costs, unit).recompute_s
    # head_retained counts in a unit's backward only: a unit its forward decides is not moved by it
    costs, _ = by_name["memory-poor group, forward decides"]
    (unit,) = units_from_actions(["memory_poor:0"] * 5)
    assert unit_terms(replace(costs, head_retained_bytes=-3), unit).peak == unit_terms(costs, unit).peak
    costs, _ = by_name["memory-poor group of the whole chain"]
    (unit,) = units_from_actions(["memory_poor:0"] * 6)
    assert unit_terms(replace(costs, head_retained_bytes=-3), unit).peak == unit_terms(costs, unit).peak - 3
    # Every block of a group adds its checkpoint overhead once, in a segment as in a memory-poor group.
    frames = [b.overhead_s["checkpoint"] for b in costs.blocks]
    assert len(set(frames)) == 6
    assert unit_terms(costs, unit).overhead_s == pytest.approx(sum(frames))
    assert unit_terms(costs, unit).deferred == 0  # each block's backward follows its own re-run
    costs, actions = by_name["segment of the whole chain"]
    (unit,) = units_from_actions(actions)
    assert unit_terms(costs, unit).overhead_s == pytest.approx(sum(frames))
    assert unit_terms(costs, unit).deferred == 5  # every block but the last waits for the later ones
    # Priced, each block a segment re-runs ahead of a later one's backward adds the rate times its keep bytes.
    costs, actions = by_name["segments and a memory-poor group, deferral priced"]
    segment, memory_poor, short = units_from_actions(actions)
    unpriced = replace(costs, deferred_s_per_byte=0.0)
    for unit, waiting in ((segment, costs.blocks[0:2]), (short, costs.blocks[5:6]), (memory_poor, [])):
        extra = unit_terms(costs, unit).overhead_s - unit_terms(unpriced, unit).overhead_s
        assert extra == pytest.approx(1.3e-6 * sum(b.saved("keep") for b in waiting), abs=4 * TIME_GRID_S), unit
        assert (extra > 0) == bool(waiting)


def test_time_terms_lie_on_a_grid_where_every_sum_is_exact() -> None:
    """Invariant 1: a segment costs exactly what checkpoints of its blocks cost, summed in any order."""
    costs = chain(6)
    for b, seconds in zip(costs.blocks, (0.1, 1 / 3, 0.7, 2e-4, 3.3e-3, 0.011), strict=True):
        b.recompute_s["checkpoint"], b.overhead_s["checkpoint"] = seconds, seconds / 7
    (segment,) = units_from_actions(["segment:0"] * 6)
    singles = [unit_terms(costs, Unit(SINGLE, i, i, "checkpoint")).time_cost_s for i in range(6)]
    assert all(t / TIME_GRID_S == round(t / TIME_GRID_S) for t in singles)
    assert unit_terms(costs, segment).time_cost_s == sum(singles) == sum(reversed(singles))
    assert abs(on_time_grid(0.1) - 0.1) <= TIME_GRID_S / 2
    assert on_time_grid(-3 * TIME_GRID_S) == -3 * TIME_GRID_S


def test_group_kind_and_missing_checkpoint_costs_are_named() -> None:
    costs = chain(3)
    numbers = ChainNumbers.of(costs)
    with pytest.raises(ValueError, match="unknown group kind 'nested'; use 'segment' or 'memory_poor'"):
        group_table(numbers, 0, 3, ["nested"])
    for b in costs.blocks:
        del b.recompute_s["checkpoint"]
    with pytest.raises(KeyError, match="no 'checkpoint' costs, which a segment or memory-poor group needs"):
        unit_terms(costs, Unit(SEGMENT, 0, 1, "checkpoint"))
