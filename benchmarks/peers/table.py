"""The peers benchmark's records turned into its table, and the summary of where remat's optimal plan stands.

Memory: each contender's peak over its reference's, by the peak meter (every contender: the whole-process
meter on the CPU, the CUDA allocator on a GPU) and by ``remat.measure`` (the "tracker" column: the live-tensor
tracker for eager contenders, the allocator's events, ``allocations=True``, for compiled ones); the reference is
eager no checkpointing for eager contenders and the whole model under ``torch.compile`` without a budget for
compiled ones. A contender fits a budget when its ratio by each meter that measured it is at most the budget:
on the CPU under bf16 autocast the two disagree by up to a third (``docs/results/peers-cpu-bf16-avx2.md``: hand
selective checkpointing on Llama at 0.45 of its reference by the process meter and 0.57 by the tracker), and
remat plans by the tracker's bytes, so a peer over by it is not one remat could have chosen. Step time: in
every round, the contender's step over its reference's step of the same round (CPU seconds on the CPU,
wall-clock seconds on CUDA); the table gives the median over rounds and their range.

Predictions, for the contenders that run a remat plan (no checkpointing as remat's plan keeping every block,
the static strategies, ``optimal``, PGAC, and on compiled blocks keep-all and ``optimal``, predicted from the
profile of the compiled blocks; not DTR):
``pred/meas step`` is the simulator's step time for the plans the timed steps ran (for PGAC plus its own
scoring and update seconds, ``PGAC.own_seconds``; median over rounds) over
the measured step (median, absolute seconds of the same clock as ``step ms``); ``pred/meas step over keep-all``
is the same with both sides over the group's keep-all plan (no checkpointing; keep-all on compiled blocks):
the predicted ratio over the measured one, median of the per-round ratios. The profile is taken once, before
the timing rounds: where the machine's speed changed in between, the first moves with it (the keep-all row
itself reads off 1.00) and the second does not. ``pred/meas peak`` is the predicted peak activation bytes of
the plan of the measured step over the "tracker" column's figure.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from remat.bench import median_interval

REFERENCE = {"eager": "none", "compiled": "compiled"}
KEEP_ALL = {"eager": "none", "compiled": "compiled-blocks"}  # each group's keep-all remat plan (predicted)
EAGER_PEERS = ("torch checkpoint, first k blocks", "torch selective (matmuls saved), first k", "ckptplan (PyPI) plan")
COMPILED_PEER = "torch.compile + activation_memory_budget"
FITTED_PEER = "torch.compile, budget fitted by remat"
COMPILED_PEERS = (COMPILED_PEER, FITTED_PEER)
PEERS = {"eager": EAGER_PEERS, "compiled": COMPILED_PEERS}
# remat's contender in each group, the one its target judges (on compiled code the first present at a budget:
# records written before fit_compiled had a row judge the plan on compiled blocks)
MINE = {"eager": ("remat optimal",),
        "compiled": ("remat.fit(compile=True)", "remat fit_compiled", "remat optimal on compiled blocks")}
# judged as well where present: remat's measured choice between its eager plans (remat.fitting.measured_fit.fit)
ALSO = {"eager": ("remat fit",), "compiled": ()}
# the head-to-head rounds of peers_duel: remat's contenders against the peers of their group
DUELS = tuple((group, (MINE[group][0], *ALSO[group]), peers) for group, peers in PEERS.items())
HAND_PEER = EAGER_PEERS[0]  # torch.utils.checkpoint around the first k blocks: a plan remat's codes spell


@dataclass
class Unit:
    """Every record of one (model, precision)."""

    model: str
    dtype: str
    start: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, dict[str, Any]] = field(default_factory=dict)
    times: dict[str, dict[int, float]] = field(default_factory=lambda: defaultdict(dict))  # CPU s (CUDA: wall)
    wall: dict[str, dict[int, float]] = field(default_factory=lambda: defaultdict(dict))
    predicted: dict[str, dict[int, float]] = field(default_factory=lambda: defaultdict(dict))  # remat's, s
    # head to head at each budget (child.duel_rounds): (budget, key) -> round -> CPU s (CUDA: wall)
    duel: dict[tuple[float, str], dict[int, float]] = field(default_factory=lambda: defaultdict(dict))
    rows: dict[str, Any] = field(default_factory=dict)
    ckptplan: dict[str, Any] = field(default_factory=dict)
    done: bool = False
    failed: str | None = None


def group_units(records: list[dict[str, Any]]) -> list[Unit]:
    units: dict[tuple[str, str], Unit] = {}
    for r in records:
        if "model" not in r or "dtype" not in r:
            continue
        unit = units.setdefault((r["model"], r["dtype"]), Unit(r["model"], r["dtype"]))
        kind = r.get("record")
        if kind == "unit_start":
            unit.start = r
        elif kind == "memory":
            unit.memory[r["key"]] = r
        elif kind == "timing":
            unit.times[r["key"]][r["round"]] = r.get("cpu_seconds", r["seconds"])
            unit.wall[r["key"]][r["round"]] = r["seconds"]
            if r.get("predicted_step_s") is not None:
                unit.predicted[r["key"]][r["round"]] = r["predicted_step_s"]
        elif kind == "duel":
            unit.duel[(r["budget"], r["key"])][r["round"]] = r.get("cpu_seconds", r["seconds"])
        elif kind == "rows":
            unit.rows = r
        elif kind == "ckptplan":
            unit.ckptplan = r
        elif kind == "unit_done":
            unit.done = True
        elif kind == "unit_failed":
            unit.failed = r.get("error", "failed")
    return list(units.values())


def paired_ratios(unit: Unit, key: str, reference: str, wall: bool = False) -> list[float]:
    """``key``'s step over ``reference``'s step, round by round (CPU seconds, or wall-clock ones)."""
    times = unit.wall if wall else unit.times
    return _paired(times.get(key, {}), times.get(reference, {}))


def _paired(a: dict[int, float], b: dict[int, float]) -> list[float]:
    return [a[r] / b[r] for r in sorted(a) if r in b and b[r] > 0]


def peak_bytes(memory: dict[str, Any]) -> int | None:
    """The peak meter's figure of a memory record: the CUDA allocator's, else the whole-process meter's."""
    allocator = memory.get("allocator_bytes")
    return allocator if allocator is not None else memory.get("process_bytes")


def fits_by_every_meter(budget: float | None, *ratios: float | None) -> bool | None:
    """Whether each ratio a meter measured is at most ``budget`` (None: no budget, or no meter measured)."""
    measured = [r for r in ratios if r is not None]
    return all(r <= budget for r in measured) if budget is not None and measured else None


def meter_ratios(memory: dict[str, Any], reference: dict[str, Any]) -> tuple[float | None, float | None]:
    """A memory record over its reference's by the peak meter and by ``remat.measure`` (None where one did not
    run)."""
    return (ratio(peak_bytes(memory), peak_bytes(reference)),
            ratio(memory.get("tracker_bytes"), reference.get("tracker_bytes")))


def ratio(value: Any, reference: Any) -> float | None:
    if value is None or not reference:
        return None
    return value / reference


@dataclass
class Line:
    """One line of the table."""

    model: str
    dtype: str
    budget: float | None
    name: str
    group: str
    key: str
    detail: str = ""
    process_ratio: float | None = None
    tracker_ratio: float | None = None
    fits: bool | None = None
    step_median: float | None = None
    step_low: float | None = None
    step_high: float | None = None
    step_ms: float | None = None
    wall_median: float | None = None
    predicted_step_ms: float | None = None  # remat's prediction for the plans the timed steps ran (median)
    pred_step_ratio: float | None = None  # that prediction over the measured step (absolute seconds)
    pred_rel_ratio: float | None = None  # the same, each step over its group's keep-all plan's (KEEP_ALL)
    pred_peak_ratio: float | None = None  # remat's predicted peak over remat.measure's (tracker or allocations)
    grads: str = ""
    note: str = ""


# Where no checkpointing does not reproduce its own gradients (atomics in CUDA kernels), one A/A pair samples
# the run-to-run difference once; a strategy that computes something else (other rounding, other dropout masks)
# differs by orders of magnitude more (torch selective checkpointing under bf16 on an H200: 100x).
RUN_TO_RUN_FACTOR = 10.0


def _grads_text(memory: dict[str, Any], exact: bool, floor: float | None = None) -> str:
    """The gradients against the reference's. ``floor``: how far no checkpointing's own gradients moved between
    two runs (the A/A pair), where they were not bitwise equal (kernels that are not deterministic, as on CUDA
    by default); an exact strategy within ``RUN_TO_RUN_FACTOR`` times it differs as the reference does from
    itself."""
    if memory.get("grads_bitwise"):
        return "bitwise"
    diff, scale = memory.get("grad_max_abs_diff"), memory.get("grad_max_abs") or 1.0
    if diff is None:
        return "not compared"
    text = f"max abs diff {diff:.1e} ({diff / scale:.0e} of max)"
    if not exact:
        return text
    if floor is not None and diff <= RUN_TO_RUN_FACTOR * floor:
        return text + f"; the order of no checkpointing's own run-to-run difference ({floor:.1e}: kernels not " \
                      "deterministic)"
    return text + "; NOT EQUAL (exact strategy)"


def _run_to_run(unit: Unit) -> float | None:
    """The A/A pair's gradient difference where no checkpointing did not reproduce its own gradients bitwise."""
    aa = unit.memory.get("none-aa", {})
    return None if aa.get("grads_bitwise", True) else aa.get("grad_max_abs_diff")


def unit_lines(unit: Unit) -> list[Line]:
    contenders = unit.rows.get("contenders", {})
    lines: list[Line] = []
    keep_all_s = {g: _median(unit.predicted.get(k, {})) for g, k in KEEP_ALL.items()}
    floor = _run_to_run(unit)
    for row in unit.rows.get("rows", []):
        key, group, budget = row["key"], row["group"], row["budget"]
        info = contenders.get(key, {})
        mem = unit.memory.get(key, {})
        ref_key = REFERENCE[group]
        ref = unit.memory.get(ref_key, {})
        ratios = paired_ratios(unit, key, ref_key)
        wall = paired_ratios(unit, key, ref_key, wall=True)
        process_ratio, tracker_ratio = meter_ratios(mem, ref)
        own_s = _median(unit.times.get(key, {}))
        predicted = unit.predicted.get(key, {})
        pred_s = _median(predicted)
        over_keep_all = paired_ratios(unit, key, KEEP_ALL[group])
        keep_all = keep_all_s[group]
        pred_rel = (pred_s / keep_all / statistics.median(over_keep_all)
                    if pred_s is not None and keep_all and over_keep_all else None)
        detail = info.get("detail", "")
        extra = mem.get("info") or {}
        if "plan" in extra:
            detail = f"plan after step: {extra['plan']}"
        if "evictions" in extra:
            detail = f"{extra['evictions']} evictions, {extra['rematerializations']} recomputed"
        lines.append(Line(
            model=unit.model, dtype=unit.dtype, budget=budget, name=row["name"], group=group, key=key, detail=detail,
            process_ratio=process_ratio, tracker_ratio=tracker_ratio,
            fits=fits_by_every_meter(budget, process_ratio, tracker_ratio),
            step_median=statistics.median(ratios) if ratios else None,
            step_low=min(ratios) if ratios else None, step_high=max(ratios) if ratios else None,
            step_ms=own_s * 1e3 if own_s is not None else None,
            wall_median=statistics.median(wall) if wall else None,
            predicted_step_ms=pred_s * 1e3 if pred_s is not None else None,
            pred_step_ratio=pred_s / own_s if pred_s is not None and own_s else None,
            pred_rel_ratio=pred_rel,
            pred_peak_ratio=ratio(mem.get("predicted_peak_bytes"), mem.get("tracker_bytes")),
            grads=_grads_text(mem, info.get("exact", True), floor) if mem else "", note=info.get("note", ""),
        ))
    for refused in unit.rows.get("refused", []):
        lines.append(Line(unit.model, unit.dtype, refused["budget"], refused["name"], refused["group"], "",
                          note=f"refused: {refused['reason']}"))
    if unit.ckptplan:
        lines.append(Line(unit.model, unit.dtype, None, "ckptplan (PyPI)", "eager", "",
                          note=unit.ckptplan.get("reason", "")))
    order = {None: -1.0}
    lines.sort(key=lambda line: order.get(line.budget, line.budget))  # stable: references first
    return lines


def _median(values: dict[int, float]) -> float | None:
    return statistics.median(values.values()) if values else None


def _num(value: float | None, fmt: str = "{:.2f}") -> str:
    return fmt.format(value) if value is not None else "—"


def _step(line: Line) -> str:
    if line.step_median is None:
        return "—"
    return f"{line.step_median:.2f} [{line.step_low:.2f}–{line.step_high:.2f}]"


def markdown_table(lines: list[Line], device: str = "cpu") -> str:
    """The table; on CUDA the peak column is the allocator's and the step times are wall-clock (no CPU column)."""
    cuda = device == "cuda"
    meter, clock = ("allocator", "wall") if cuda else ("process", "CPU")
    head = (f"| model | dtype | budget | contender | detail | peak/ref ({meter}) | peak/ref (tracker) | fits | "
            f"step/ref {clock} median [range] | step ms {clock} |" + ("" if cuda else " step/ref wall |")
            + " pred/meas peak (tracker) | pred/meas step | pred/meas step over keep-all | gradients |")
    out = [head, "|" + "---|" * (14 if cuda else 15)]
    for x in lines:
        budget = f"{x.budget:.0%}" if x.budget is not None else "ref"
        fits = {True: "yes", False: "no", None: "—"}[x.fits]
        grads = x.grads or x.note
        wall = "" if cuda else f" {_num(x.wall_median)} |"
        out.append(f"| {x.model} | {x.dtype} | {budget} | {x.name} | {x.detail} | {_num(x.process_ratio)} | "
                   f"{_num(x.tracker_ratio)} | {fits} | {_step(x)} | {_num(x.step_ms, '{:.1f}')} |{wall} "
                   f"{_num(x.pred_peak_ratio)} | {_num(x.pred_step_ratio)} | {_num(x.pred_rel_ratio)} | {grads} |")
    return "\n".join(out)


@dataclass
class Standing:
    """At one budget: the fastest fitting peer against remat's contender (eager ``remat optimal``, then compiled
    ``remat.fit(compile=True)``)."""

    model: str
    dtype: str
    budget: float
    group: str
    mine: str
    peer: str
    peer_step: float | None
    remat_fits: bool | None
    remat_step: float | None
    remat_over_peer: float | None
    aa: float | None = None  # remat's contender against itself in the same head-to-head rounds
    rounds: int = 0  # paired rounds behind remat_over_peer
    head_to_head: bool = False  # from the head-to-head rounds (else from the rounds over every contender)
    interval: tuple[float, float] | None = None  # 95% distribution-free interval of remat_over_peer
    same_plan: bool = False  # remat's contender runs what the peer runs (the same blocks checkpointed, budget)


def same_configuration(mine: Line, peer: Line) -> bool:
    """Whether remat's contender runs the peer's configuration: ``torch.utils.checkpoint`` around the first ``k``
    of ``n`` blocks against a remat plan of ``k`` checkpoints then ``n - k`` kept blocks, or the same
    ``activation_memory_budget`` of the whole compiled model."""
    if peer.name == HAND_PEER and peer.detail.startswith("k="):
        k, n = (int(v) for v in peer.detail[2:].split("/"))
        return mine.detail.split(" (")[0] == "C" * k + "K" * (n - k)  # remat fit's detail adds the plan it left
    if peer.name in COMPILED_PEERS and peer.detail.startswith("budget="):
        return mine.detail.removeprefix("whole model: ") == peer.detail
    return False


def standings(unit: Unit, lines: list[Line]) -> list[Standing]:
    out = []
    budgets = sorted({x.budget for x in lines if x.budget is not None})
    ran = {x.group for x in lines}  # a group may not have run (--no-compiled)
    for budget in budgets:
        at = [x for x in lines if x.budget == budget and x.key]
        for group, peers in ((g, p) for g, p in PEERS.items() if g in ran):
            fitting = [x for x in at if x.name in peers and x.fits and x.step_median is not None]
            peer = min(fitting, key=lambda x: x.step_median) if fitting else None
            first = next((name for name in MINE[group] if any(x.name == name for x in at)), MINE[group][0])
            first_line = next((x for x in at if x.name == first), None)
            also = [name for name in ALSO[group] if any(x.name == name for x in at)]
            for mine in (first, *also):
                remat = next((x for x in at if x.name == mine), None)
                out.append(_standing(unit, budget, group, mine, remat, peer, first_line))
    return out


def _standing(unit: Unit, budget: float, group: str, mine: str, remat: Line | None, peer: Line | None,
              first: Line | None) -> Standing:
    """``remat`` (the contender ``mine``) against ``peer``, paired round by round: in the head-to-head rounds where
    they ran (the A/A pair is the group's first contender's, ``first``), else in the rounds over every contender."""
    paired, aa, ratios, duel, interval = None, None, [], False, None
    if peer is not None and remat is not None:
        ratios = _paired(unit.duel.get((budget, remat.key), {}), unit.duel.get((budget, peer.key), {}))
        duel = bool(ratios)
        if duel and first is not None:
            same = _paired(unit.duel.get((budget, f"{first.key}#aa"), {}), unit.duel.get((budget, first.key), {}))
            aa = statistics.median(same) if same else None
        elif not duel:
            ratios = paired_ratios(unit, remat.key, peer.key)
        paired = statistics.median(ratios) if ratios else None
        spread = median_interval(ratios)
        interval = (spread.low, spread.high) if spread.low is not None else None
    against = f"{peer.name} ({peer.detail})" if peer else "none fits"
    return Standing(unit.model, unit.dtype, budget, group, mine, against, peer.step_median if peer else None,
                    remat.fits if remat else None,
                    remat.step_median if remat else None, paired, aa, len(ratios), duel, interval,
                    peer is not None and remat is not None and same_configuration(remat, peer))


def standings_table(rows: list[Standing]) -> str:
    out = ["| model | dtype | budget | group | remat's contender | fastest fitting peer | its step/ref | remat fits | "
           "remat step/ref | remat / peer (paired) | its 95% interval | rounds | "
           "A/A (the group's first remat contender twice) |",
           "|" + "---|" * 13]
    for s in rows:
        fits = {True: "yes", False: "no", None: "—"}[s.remat_fits]
        rounds = f"{s.rounds} head to head" if s.head_to_head else f"{s.rounds}" if s.rounds else "—"
        spread = f"{s.interval[0]:.3f}–{s.interval[1]:.3f}" if s.interval else "—"
        same = " (same plan)" if s.same_plan else ""
        out.append(f"| {s.model} | {s.dtype} | {s.budget:.0%} | {s.group} | {s.mine} | {s.peer}{same} | "
                   f"{_num(s.peer_step)} | {fits} | {_num(s.remat_step)} | {_num(s.remat_over_peer, '{:.3f}')} | "
                   f"{spread} | {rounds} | {_num(s.aa, '{:.3f}')} |")
    return "\n".join(out)


def noise_floor(units: list[Unit], device: str = "cpu") -> str:
    parts = []
    for unit in units:
        cpu, wall = paired_ratios(unit, "none-aa", "none"), paired_ratios(unit, "none-aa", "none", wall=True)
        if cpu and device == "cuda":
            parts.append(f"{unit.model}/{unit.dtype} wall {statistics.median(wall):.3f} "
                         f"[{min(wall):.3f}–{max(wall):.3f}]")
        elif cpu:
            parts.append(f"{unit.model}/{unit.dtype} CPU {statistics.median(cpu):.3f} [{min(cpu):.3f}–{max(cpu):.3f}], "
                         f"wall {statistics.median(wall):.3f} [{min(wall):.3f}–{max(wall):.3f}]")
    return "A/A (no checkpointing against itself, step/ref): " + ("; ".join(parts) if parts else "not measured")


def render(records: list[dict[str, Any]], device: str = "cpu") -> str:
    """The whole report body: the device, the table, the standing of remat's optimal plan, the noise floor."""
    units = group_units(records)
    lines_of = {(u.model, u.dtype): unit_lines(u) for u in units}
    standings_of = {(u.model, u.dtype): standings(u, lines_of[(u.model, u.dtype)]) for u in units}
    lines = [x for unit in units for x in lines_of[(unit.model, unit.dtype)]]
    standing = [s for unit in units for s in standings_of[(unit.model, unit.dtype)]]
    names = sorted({u.start["device_name"] for u in units if u.start.get("device_name")})
    where = f"Device: {device}" + (f" ({', '.join(names)})" if names else "")
    parts = [where, "", markdown_table(lines, device), "", standings_table(standing), "", noise_floor(units, device),
             "", "Targets:", "", targets_table(units, lines_of, standings_of)]
    failed = [f"{u.model}/{u.dtype}: {u.failed}" for u in units if u.failed]
    unfinished = [f"{u.model}/{u.dtype}" for u in units if not u.done and not u.failed]
    if failed:
        parts.append("failed: " + "; ".join(failed))
    if unfinished:
        parts.append("unfinished (resume with --resume): " + ", ".join(unfinished))
    return "\n".join(parts)

# ----------------------------------------------------------------------------------------------------
# The table read against remat's targets (below): one line per target and (model, precision), met or by how
# much not.

#
# The targets, each judged from the figures of the table (:mod:`benchmarks.peers.table`):
#
# * ``prediction``: every contender running a remat plan has its predicted step within 10% of its measured one;
#   read twice, in absolute seconds and with both over the group's keep-all plan (``benchmarks.peers.table``).
# * ``eager``: at every budget, ``remat optimal`` (and ``remat fit``, its measured choice, where it ran) fits and
#   its step is at most 1.02x the fastest eager peer that fits (paired round by round, in the head-to-head rounds
#   where the run has them). Where the median is over, the verdict says whether the ratio's 95% interval still
#   holds 1.02 (the rounds did not resolve it) and whether remat runs the peer's own plan (then the gap is remat's
#   runtime against the peer's, and noise).
# * ``compiled``: remat's compiled contender, ``remat.fit(compile=True)`` (``remat fit_compiled``, then
#   ``remat optimal on compiled blocks`` in older records), is at most 1.02x the fastest fitting ``torch.compile``
#   with ``activation_memory_budget`` at the same byte budget:
#   torch's budget at the fraction, or the fraction fitted to the bytes by measurement.
# * ``bf16 peak`` (every precision is checked, the target names bf16): every remat plan predicted to fit has a
#   tracker peak within its budget +2% and a predicted peak within 5% of the tracker's.

STEP_TOLERANCE = 0.10
PEAK_TOLERANCE = 0.05
BUDGET_SLACK = 0.02
SPEED_TARGET = 1.02
PLANNED = ("remat full", "remat sqrt", "remat memory_poor", "remat every_k (k fitted)", "remat optimal",
           "remat PGAC")


def _where(x: Line) -> str:
    return f"{x.name} at {x.budget:.0%}" if x.budget is not None else x.name


def prediction_check(lines: list[Line]) -> str:
    """Both readings of the predicted step: absolute, and over the group's keep-all plan
    (``benchmarks.peers.table``)."""
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
            parts.append(f"{at}: NOT met ({_ratio(s.remat_over_peer)}x{_interval(s)} {s.peer}{_aa(s)}){_why(s)}")
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


def _ratio(value: float | None) -> str:
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
           "remat compiled (remat.fit(compile=True)) <= 1.02x fastest fitting torch.compile budget | "
           "plans fit (+2%), predicted peak within 5% |",
           "|" + "---|" * 6]
    for unit in units:
        key = (unit.model, unit.dtype)
        lines, rows = lines_of.get(key, []), standings_of.get(key, [])
        out.append(f"| {unit.model} | {unit.dtype} | {prediction_check(lines)} | {speed_check(rows, 'eager')} | "
                   f"{speed_check(rows, 'compiled')} | {peak_check(unit, lines)} |")
    return "\n".join(out)
