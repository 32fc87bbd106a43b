"""The optimal planner: the plan of least predicted step time whose predicted peak fits a byte budget.

A plan's predicted step is the step keeping everything plus the time cost of each unit, its recomputation
plus its overhead (:mod:`remat.planning.simulator`), so the least step is the least sum of time costs.

It searches every plan the simulator in :mod:`remat.planning.simulator` can express: per unit, a single-block action the
cost table has costs for (``keep``, ``checkpoint``, ``selective:<policy>``, ``offload``), a ``segment``
group of two or more blocks, or a ``memory_poor`` group of two or more blocks.

The simulator's structure makes this a prefix-constrained knapsack over a chain
(:mod:`remat.planning.search`): ``stem + need[0]`` is the minimum peak of any plan (:func:`min_peak_bytes`),
and the search runs left to right over positions, keeping at each position the Pareto front of partial plans
by (prefix bytes, time-cost seconds) (:mod:`remat.planning.pareto`). The units it chooses among and their
terms come from :mod:`remat.planning.chain_units`, which reads the vectorised form of :mod:`remat.planning.unit_terms`.

Ties in time cost go to fewer block re-executions in backward, then to fewer blocks re-run ahead of a later
block's backward (a segment's blocks but its last: whole steps measure a segment slower than checkpoints of
the same blocks, which the time terms price only where the profile measured it, ``CostTable.deferred_s_per_byte``,
see :mod:`remat.planning.unit_terms`), then to the lower peak. Time terms lie on a grid that makes their sums exact
(invariant 1 of :mod:`remat.planning.unit_terms`), so a tie is a real one: unpriced, a segment and checkpoints of its
blocks cost the same, and the checkpoints win where both fit.

Noise (invariant 1, enforced here): a measured table records how much its time costs move from profile to
profile (``costs.info["time_noise_s"]``, :mod:`remat.profiling.action_steps`). The search leaves out, per block,
an action that holds more memory than another for a time saving within twice the noise (:func:`noise_dominated`),
and takes a per-operator policy or offload over keeping or checkpointing only where it saves more than the
noise (:func:`within_noise`). Whole plans too: a complete plan whose predicted time exceeds the fastest's by no
more than twice the noise times the root of the summed squares of the per-action block counts by which the two
differ is a tie (:func:`remat.planning.search.plans_tied`), and among ties a fixed order decides (fewest
deferred blocks, fewest re-executions, lowest peak, then recomputation on the earliest blocks), taking the first
that no tied plan beats beyond the two plans' own tie width (ties are not transitive: a far-off fastest plan ties
with both of two plans one of which is clearly the faster; see :meth:`remat.planning.search.Search.run`): on a
Llama whose actions all
save memory at about the same price per byte, mixes as far apart as ``8 checkpoint, 1 dots_saveable, 3 keep`` and
``6 checkpoint, 3 dots_every_other_saveable, 3 keep`` came first in different profiles of the same step. A choice
the noise could flip is made by that fixed order instead, so that the same
model, batch, budget and machine give the same plan profile after profile (``benchmarks/time_to_plan.py``
counts them). The plan's predictions are then made on the table as measured, and
``Plan.options["time_noise_s"]`` records the noise assumed (0 where the table records none, as a table written
by hand; ``time_noise_s=`` overrides it).

An unmeasured price is not a zero price (invariant 2, enforced here): a table whose segment price was left to be
measured (``costs.info["segments_priced"] is False``: ``remat.profile(..., price_segments=False)``) prices a
segment's waiting blocks at nothing. Where the plan found holds a segment and a plan without segments fits and
ties with it (:func:`~remat.planning.search.plans_tied`), that plan is returned; otherwise the plan with segments
is, and the caller measures the price (:func:`remat.profiling.price_segments`, as ``remat.fit`` does) and plans
again.

Exactness and long chains: the search is exact under the simulator unless a front had to be thinned or
group lengths were capped (``Plan.options["exact"]`` says which). Thinning rounds the memory axis: partial
plans whose prefix bytes fall in the same bucket are merged, keeping per bucket the fastest one and the
best ones at an estimated price of memory (a Lagrange multiplier, see
:func:`remat.planning.search.memory_prices`). Merged partial plans keep their exact byte counts, so a returned
plan never exceeds the budget; thinning can only miss a better plan. ``resolution`` (bytes) sets the bucket
width for every front; ``resolution=None`` keeps fronts exact while they stay small and sizes the buckets so
that the work stays bounded (a chain of 1,000 blocks plans in well under a second). ``max_segment`` bounds
group lengths: ``None`` allows every length on chains of up to 32 blocks and fewer (down to 8) on longer ones,
where a longer group saves only the retained output of one split point; budgets that need longer groups get
them.
"""

from __future__ import annotations

import dataclasses

from ..core import (
    CHECKPOINT,
    KEEP,
    SEGMENT,
    Action,
    BlockCost,
    BudgetError,
    CostTable,
    current_action,
    format_bytes,
    is_legacy,
    plan_choices,
    warn_legacy,
)
from .chain_units import ChainUnits, allowed_actions
from .plan import Plan
from .search import Search, default_max_segment, front_limit, plans_tied, suffix_need
from .simulator import simulate


def min_peak_bytes(costs: CostTable, actions: list[str] | None = None) -> int:
    """The least predicted peak activation bytes of any plan on ``costs`` using ``actions`` (default: all),
    exact under the simulator."""
    if len(costs) == 0:
        return int(costs.stem_bytes + costs.head_bytes)
    chain = ChainUnits.from_costs(costs, actions)
    least = chain.stem + int(suffix_need(chain, chain.n)[0])
    if costs.held_args_bytes:
        least = min(least, simulate(costs, [KEEP] * len(costs)).peak_bytes)
    return least


def _budget_error(budget: int, floor: int, detail: str = "") -> BudgetError:
    return BudgetError(
        f"no plan fits a budget of {format_bytes(budget)} ({budget} bytes): the minimum feasible peak on this "
        f"chain is {format_bytes(floor)} ({floor} bytes){detail}. Raise the budget to at least that, or shrink "
        "the batch or the sequence length.",
        floor=floor,
    )


def optimal(
    costs: CostTable,
    budget: int | None,
    *,
    actions: list[str] | None = None,
    resolution: int | None = None,
    max_segment: int | None = None,
    time_noise_s: float | None = None,
) -> Plan:
    """The plan of least predicted step time (recomputation plus overheads) whose predicted peak is at most
    ``budget`` bytes.

    ``actions`` restricts the choices: single-block actions from the cost table plus ``"segment"`` and
    ``"memory_poor"`` for groups (default: every action of the table and both group kinds). ``resolution``
    (bytes) merges partial plans whose prefix bytes share a bucket of that width at every position (see the
    module notes; ``None`` = exact while fronts stay small, automatic widths on large ones). ``max_segment``
    caps the blocks in one group; ``None`` allows every length on chains of up to 32 blocks and fewer (down
    to 8) on longer ones, more where the budget can only be met with longer groups.

    Raises :class:`remat.planning.strategies.BudgetError` naming the minimum feasible peak when nothing fits.
    ``Plan.options`` records ``exact`` (True when the search proved the plan optimal under the simulator
    among the allowed actions and group lengths), ``max_segment`` (the group length searched),
    ``resolution`` (the widest bucket used when thinning, else None) and ``partial_plans`` (work done).
    """
    if budget is None:
        raise ValueError("the optimal planner needs a budget in bytes; pass budget=... (e.g. '2GiB')")
    if len(costs) == 0:
        raise ValueError("the cost table has no blocks; profile a model with at least one block")
    if resolution is not None and resolution < 1:
        raise ValueError(f"resolution is a bucket width in bytes and must be at least 1, got {resolution}")
    if max_segment is not None and max_segment < 1:
        raise ValueError(f"max_segment must be at least 1 block, got {max_segment}")
    if actions is not None and any(is_legacy(a) for a in actions):
        warn_legacy(f"actions={actions!r}", stacklevel=2)
        actions = [current_action(a) for a in actions]
    budget = int(budget)
    noise = float(costs.info.get(NOISE_KEY, 0.0) if time_noise_s is None else time_noise_s)
    if noise > 0:  # invariant 1
        read = within_noise(costs, noise, actions)
        if actions is not None:  # those left out on every block are left out of the choices
            actions = [a for a in actions if any(a in b.actions for b in read.blocks)
                       or not any(a in b.actions for b in costs.blocks)]  # fmt: skip
        searched = _optimal(read, budget, actions, resolution, max_segment, ties_s=noise)
        plan = Plan.from_actions(costs, searched.actions, "optimal", budget, **{**searched.options, NOISE_KEY: noise})
    else:
        plan = _optimal(costs, budget, actions, resolution, max_segment)
    if costs.info.get(SEGMENTS_PRICED) is False and (actions is None or SEGMENT in actions):  # invariant 2
        singles = [a for a in (actions or plan_choices(costs)) if Action.choice(a).kind != SEGMENT]
        try:
            without = optimal(costs, budget, actions=singles, resolution=resolution, max_segment=max_segment,
                              time_noise_s=noise)  # fmt: skip
        except BudgetError:
            return plan
        assert plan.predicted_step_s is not None and without.predicted_step_s is not None
        holds_segment = any(Action.parse(a).kind == SEGMENT for a in plan.actions.values())
        if not holds_segment or plans_tied(noise, plan.actions.values(), without.actions.values(),
                                           plan.predicted_step_s, without.predicted_step_s):  # fmt: skip
            return without
    return plan


SEGMENTS_PRICED = "segments_priced"


def _optimal(
    costs: CostTable,
    budget: int,
    actions: list[str] | None,
    resolution: int | None,
    max_segment: int | None,
    ties_s: float = 0.0,
) -> Plan:
    """:func:`optimal` on ``costs`` as given; ``ties_s``: the noise whole plans are read as ties within
    (:func:`~remat.planning.search.plans_tied`)."""
    keep_everything: Plan | None = None
    if costs.held_args_bytes and KEEP in allowed_actions(costs, actions)[0]:
        keep_everything = Plan.from_actions(
            costs, [KEEP] * len(costs), "optimal", budget, exact=True, max_segment=1, resolution=None,
            partial_plans=0,
        )  # fmt: skip
    try:
        plan = _search(costs, budget, actions, resolution, max_segment, ties_s)
    except BudgetError as error:
        if keep_everything is None or keep_everything.predicted_peak_bytes >= error.floor:
            raise
        if keep_everything.fits:
            return keep_everything
        raise _budget_error(budget, keep_everything.predicted_peak_bytes) from None
    # The search weighed keeping everything with the held arguments added; without them it may rank first.
    if keep_everything is not None and keep_everything.fits and _rank(costs, keep_everything) <= _rank(costs, plan):
        return keep_everything
    return plan


NOISE_KEY = "time_noise_s"


def within_noise(costs: CostTable, noise_s: float, actions: list[str] | None = None) -> CostTable:
    """Invariant 1: ``costs`` as the search reads it under a measured noise of ``noise_s`` seconds: every
    action but keep and checkpoint ``noise_s`` dearer (a per-operator policy or offload is taken where it saves
    more than the noise), and without the actions a block holds more memory under for a time saving within
    twice the noise (:func:`noise_dominated`: the difference of two figures each off by up to the noise)."""

    def block(b):  # noqa: ANN001, ANN202
        dropped = noise_dominated(b, 2 * noise_s, actions)
        surcharge = {a: 0.0 if a in (KEEP, CHECKPOINT) else noise_s for a in b.recompute_s}
        return dataclasses.replace(
            b,
            saved_bytes={a: v for a, v in b.saved_bytes.items() if a not in dropped},
            recompute_s={a: v for a, v in b.recompute_s.items() if a not in dropped},
            overhead_s={a: b.overhead_s.get(a, 0.0) + surcharge[a] for a in b.recompute_s if a not in dropped},
            unavailable=b.unavailable | dict.fromkeys(dropped, "within the noise of an action holding less"),
        )

    return dataclasses.replace(costs, blocks=[block(b) for b in costs.blocks])


def noise_dominated(block: BlockCost, noise_s: float, allowed: list[str] | None = None) -> set[str]:
    """The single-block actions of ``block`` that another of its actions (one of ``allowed``, default any)
    matches in memory (no more bytes saved, no higher backward peak) within ``noise_s`` of its time cost: a
    choice between them would be the noise's. ``keep`` and ``checkpoint`` always stay (groups are built from
    them). Actions are decided leanest first, and only one kept can stand for another, so an action left out is
    at most ``noise_s`` faster than the one that stands for it (no chains)."""

    def order(a: str) -> tuple[int, int, float, str]:
        return block.saved(a), block.bwd_extra_bytes.get(a, 0), block.time_cost(a), a

    ranked = sorted(block.actions, key=order)
    dropped: set[str] = set()
    for position, b in enumerate(ranked):
        if b in (KEEP, CHECKPOINT):
            continue
        for a in ranked[:position]:
            if a in dropped or (allowed is not None and a not in allowed):
                continue
            leaner = block.bwd_extra_bytes.get(a, 0) <= block.bwd_extra_bytes.get(b, 0)  # saved: by the order
            if leaner and block.time_cost(a) <= block.time_cost(b) + noise_s:
                dropped.add(b)
                break
    return dropped


def _rank(costs: CostTable, plan: Plan) -> tuple[float, int, int, int]:
    """The search's order: least time cost, then fewest block re-executions, then fewest deferred blocks, then
    the lowest peak."""
    sim = simulate(costs, plan.actions)
    return sim.time_cost_s, sum(sim.reexecutions), sim.deferred, sim.peak_bytes


def _search(
    costs: CostTable,
    budget: int,
    actions: list[str] | None,
    resolution: int | None,
    max_segment: int | None,
    ties_s: float = 0.0,
) -> Plan:
    """The optimal plan on ``costs`` with the held arguments counted in every unit (see
    :meth:`remat.planning.chain_units.ChainUnits.from_costs`), predicted on ``costs`` itself."""
    chain = ChainUnits.from_costs(costs, actions)
    n = chain.n
    room = budget - chain.stem
    max_segment_used = min(n, max_segment) if max_segment is not None else default_max_segment(n)
    need = suffix_need(chain, max_segment_used)
    if room < need[0]:
        full_need = suffix_need(chain, n) if max_segment_used < n else need
        if room < full_need[0]:
            raise _budget_error(budget, chain.stem + int(full_need[0]))
        if max_segment is not None:
            floor = chain.stem + int(need[0])
            raise _budget_error(
                budget, floor, f" with groups of at most {max_segment_used} blocks; longer groups reach "
                f"{format_bytes(chain.stem + int(full_need[0]))}, so raise max_segment",
            )  # fmt: skip
        while room < need[0]:  # this budget needs longer groups: double the length until it fits
            max_segment_used = min(n, 2 * max_segment_used)
            need = full_need if max_segment_used == n else suffix_need(chain, max_segment_used)
        max_segment_used = min(n, 2 * max_segment_used)
        need = full_need if max_segment_used == n else suffix_need(chain, max_segment_used)
    if (n + 1) * (room + 1) >= 2**62:
        raise ValueError(
            f"a budget of {format_bytes(budget)} is beyond what the optimal planner handles; every plan fits, "
            "so use strategy 'none' (keep everything)"
        )
    limit = front_limit(chain, max_segment_used)
    search = Search(chain, room, need, max_segment_used, resolution, limit, ties_s=ties_s)
    units = search.run()
    plan = Plan.from_actions(
        costs,
        chain.actions_from_units(units),
        "optimal",
        budget,
        exact=search.thinned == 0 and (max_segment_used == n or max_segment is not None),
        max_segment=max_segment_used,
        resolution=search.widest_bucket or None,
        partial_plans=search.stored,
    )
    if plan.predicted_peak_bytes > budget:  # the search only builds plans that fit; this guards it
        raise AssertionError(
            f"internal error: optimal plan predicts {plan.predicted_peak_bytes} bytes above budget {budget}"
        )
    return plan


__all__ = ["min_peak_bytes", "optimal"]
