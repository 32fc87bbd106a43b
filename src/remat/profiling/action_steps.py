"""Each single-block action's time read within whole steps, where a plan pays it.

The profiler times a block alone under every action, each run paired with keep's in the same round
(:mod:`remat.profiling.block_timing`, :mod:`remat.profiling.action_times`). Alone, an action's forward and backward do
not run as they do between the other blocks of a step: in the fp32 GPT-2 of ``benchmarks/peers.py`` (10 ms blocks, a
2-core Xeon), a checkpointed block timed alone cost 1.2-3.1 ms more than within steps and
``selective:all_but_pointwise_saveable`` 0-1.9 ms less, enough to rank that policy, 2 ms per block slower in whole
steps, ahead of checkpointing.

:func:`time_actions_in_steps` runs whole steps with a plan applied (:func:`remat.runtime.handle.apply`) that mixes
the actions: within each group of blocks the profile found to cost the same (it measured one and copied its row:
``info["same_costs_as"]``), keep and every action the group has costs for are dealt to its blocks in turn
(:func:`mixed_schedule`), so that one step runs them all where the group has as many blocks as actions (a group of
fewer blocks takes more steps a round). Each of ``rounds`` rounds moves the deal on by one block, so an action runs
on other blocks from round to round. The hooks of :class:`remat.profiling.outside_time.BlockWindows` read each
block's forward and backward within each step (a recomputation falls in its block's backward window).

An action's shift is, over the rounds and the group's blocks that ran it, the median of the block's windows less
keep's in the same step (the median over the group's blocks that kept in it; a step where the group kept none
reads the block's own keep figures instead: the plain step's, with its windows in the rounds where it kept). A
change in the machine's speed from step to step so does not enter the shift (five profiles of the Llama of
``docs/results/time-to-plan.md``, 24 blocks, put checkpointing at 18.6-19.8 ms a block). The shift moves the
action's forward and backward from the block's keep figures, and its overhead becomes what it adds in the step
less its recomputation, which stays the isolated runs' figure (floored at minus the recomputation, as
:mod:`remat.profiling.action_times` does). So the time cost of each action, the figure the planners weigh, is the
one measured in the step. The steps then anchor the table again
(:func:`remat.profiling.outside_time.anchor_to_plain_steps`): each block's keep figures are the median of the plain
step's, its keep windows and its windows in every other step less the shift of the action it ran there, the time
outside the blocks the median over all the steps. With the GPT-2 of ``benchmarks/time_to_plan.py`` (12 blocks,
five actions besides keep) a round is one step, where timing one action per step took six.

Where every block can be checkpointed and each block's output feeds the next (so that a segment of them runs),
``segment_pairs`` pairs of steps price a segment's waiting blocks: a step with the whole chain as one segment and
one checkpointing every block, the first of each pair in turn (the steps of a profile drift in speed, which one
pair would read as part of the price and two pairs in turn cancel).
What the blocks take in the segment step beyond the checkpoint step, the median over pairs (at least 0), over the
bytes its blocks but the last save under keep, is ``CostTable.deferred_s_per_byte``: what the recomputed
activations a segment holds while its later blocks re-run and run backward cost per byte (see
:mod:`remat.planning.unit_terms`). It is the profile's least certain figure (``docs/results/time-to-plan.md``: the
chain as one segment predicted 2.6% below and 6.5% above its measured step), so a profile can leave it out
(``remat.profile(..., price_segments=False)``) and :func:`price_segments_in_steps` measure it once a plan holds a
segment, as ``remat.fit`` does.

How far each action's figure moved from round to round (its range over the square root of the rounds, the median
over actions and groups of blocks, at least :data:`NOISE_FLOOR` of a block's keep time) is
``info["time_noise_s"]``: the optimal planner takes differences below it
for ties (:mod:`remat.planning.optimal_plan`), so that profiles of the same step give the same plan.

This needs the blocks timed within plain steps (``costs.info["times_from"] == "plain steps"``: one chain of
blocks each called once, on the CPU) and no other plan on the model; the table says in
``info["action_times_from"]`` which figures it holds (``"steps"``, or ``"isolated runs"`` and why).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..chains import BlockIO, refuse_hf_checkpointing, timed_step
from ..core import CHECKPOINT, KEEP, SEGMENT, Action, Batch, BlockCost, CostTable, InputName, OutputName
from ..planning import Plan
from ..runtime import applied, apply
from .outside_time import BlockWindows, PlainSteps, anchor_to_plain_steps

__all__ = [
    "actions_to_time",
    "deferral_rate",
    "in_step_block",
    "mixed_schedule",
    "one_segment",
    "price_segments_in_steps",
    "same_cost_groups",
    "StepRun",
    "time_actions_in_steps",
]

# Rounds of mixed steps. Per block, an action's shift from keep varies by about 1 ms from round to round in a GPT-2
# step of 10 ms blocks on a shared CPU, and now and then a whole round is off: the median over three rounds and
# over the blocks that cost the same keeps checkpointing and a selective policy 1.5 ms apart in their order.
ROUNDS = 3
# Pairs of steps (one segment, every block checkpointed) that price a segment's waiting blocks (module notes).
SEGMENT_PAIRS = 2
# The least noise a profile records, as a share of a block's keep time: five fresh profiles of each model of
# benchmarks/time_to_plan.py spread an action's figure over 1-3% of its block's keep time
# (docs/results/time-to-plan.md), more than three rounds within one profile often read.
NOISE_FLOOR = 0.01
STEPS = "steps"
ISOLATED = "isolated runs"


def actions_to_time(costs: CostTable) -> list[str]:
    """The exact single-block actions some block of ``costs`` has costs for, keep aside (lossy actions keep the
    isolated runs' figures: they are planned on their gradient error first)."""
    seen: dict[str, None] = {}
    for block in costs.blocks:
        for action in block.actions:
            if action != KEEP and Action.parse(action).is_exact:
                seen[action] = None
    return list(seen)


def in_step_block(block: BlockCost, action: str, fwd_shift_s: float, bwd_shift_s: float) -> BlockCost:
    """``block`` with ``action``'s forward and backward set to keep's moved by the shifts measured in steps, and
    its overhead set to what the action adds in the step less its recomputation (at least minus it)."""
    recompute = block.recompute_s[action]
    overhead = max(fwd_shift_s + bwd_shift_s - recompute, -recompute)
    return dataclasses.replace(
        block,
        fwd_s_by_action=block.fwd_s_by_action | {action: block.fwd_s + fwd_shift_s},
        bwd_s_by_action=block.bwd_s_by_action | {action: block.bwd_s + bwd_shift_s},
        overhead_s=block.overhead_s | {action: overhead},
    )


def same_cost_groups(costs: CostTable) -> list[list[int]]:
    """The rows of ``costs`` grouped by cost: each measured row with the rows the profile copied from it
    (``info["same_costs_as"]``), every other row alone."""
    index = {block.fqn: i for i, block in enumerate(costs.blocks)}
    copies = costs.info.get("same_costs_as", {})
    groups: dict[int, list[int]] = {}
    for i, block in enumerate(costs.blocks):
        groups.setdefault(index.get(copies.get(block.fqn, block.fqn), i), []).append(i)
    return list(groups.values())


def mixed_schedule(costs: CostTable, actions: Sequence[str], rounds: int) -> list[list[list[str]]]:
    """Per round, its steps, each given as every block's action: in each group of blocks that cost the same,
    keep and the group's ``actions`` dealt to its blocks in turn, over as many steps as the group needing the
    most takes; each round deals from one block further on."""
    groups = same_cost_groups(costs)
    menus = [[KEEP, *(a for a in actions if a in costs.blocks[rows[0]].actions)] for rows in groups]
    steps_per_round = max(-(-len(menu) // len(rows)) for rows, menu in zip(groups, menus, strict=True))
    schedule = []
    for r in range(rounds):
        steps = []
        for s in range(steps_per_round):
            per_block = [KEEP] * len(costs)
            for rows, menu in zip(groups, menus, strict=True):
                for j, i in enumerate(rows):
                    action = menu[(j + s * len(rows) + r) % len(menu)]
                    per_block[i] = action if action in costs.blocks[i].actions else KEEP
            steps.append(per_block)
        schedule.append(steps)
    return schedule


def one_segment(costs: CostTable) -> list[str] | None:
    """The actions putting the chain in one segment, or None where the table cannot say what a deferred block
    costs from steps: fewer than two blocks, several chains, a block without checkpoint costs, or blocks a
    segment cannot hold (the steps did not see each block's output feed the next block)."""
    if len(costs) < 2 or costs.chain_lengths or any(CHECKPOINT not in b.actions for b in costs.blocks):
        return None
    if not costs.info.get("outputs_feed_next_block"):
        return None
    return [Action.group(SEGMENT, 0).text] * len(costs)


def deferral_rate(costs: CostTable, extra_s: Sequence[float]) -> float:
    """Seconds per byte that a segment's waiting recomputed activations cost: the median over pairs of steps of
    what the blocks took in the one-segment step beyond the all-checkpoint step (at least 0), over the keep bytes
    of every block but the last."""
    waiting = sum(b.saved(KEEP) for b in costs.blocks[:-1])
    return max(statistics.median(extra_s), 0.0) / waiting if waiting > 0 and extra_s else 0.0


def _why_not(model: nn.Module, costs: CostTable) -> str | None:
    """Why the actions cannot be timed within steps here, or None."""
    if costs.info.get("times_from") != "plain steps":
        return "the blocks could not be timed within plain steps"
    if applied.owner_of(model) is not None:
        return "the model has a plan applied"
    try:
        applied.refuse_overlap(model)
        refuse_hf_checkpointing(model)
    except RuntimeError as error:
        return str(error)
    return None


@dataclasses.dataclass(frozen=True)
class _Reading:
    """One step under a mixed plan: each block's action, the step's seconds, the blocks' share, each block's
    forward and backward seconds, and whether each block's main input was the previous block's main output."""

    actions: list[str]
    step_s: float
    inside_s: float
    fwd_s: list[float]
    bwd_s: list[float]
    hands_on: bool

    @property
    def blocks_s(self) -> float:
        """Seconds the blocks took in the step, forward and backward."""
        return sum(self.fwd_s) + sum(self.bwd_s)


@dataclasses.dataclass(frozen=True)
class StepRun:
    """The training step the profile's steps run: the model, a sample batch, the loss, the chain's blocks in
    order with how each one's hidden state is read, and the step's settings."""

    model: nn.Module
    batch: Batch
    loss_fn: Callable[[Any], torch.Tensor] | None
    chain: Sequence[tuple[str, nn.Module]]
    ios: Sequence[BlockIO]
    main_input: InputName | Mapping[str, InputName] = None
    main_output: OutputName | Mapping[str, OutputName] = None
    autocast: Any = None
    clock: Callable[[], float] = time.perf_counter
    holds_output: bool = True


class _MixedSteps:
    """Steps of ``run`` with a plan applied to its chain that the caller sets step by step, each block's forward
    and backward read by :class:`~remat.profiling.outside_time.BlockWindows`."""

    def __init__(self, run: StepRun, costs: CostTable) -> None:
        self.run, self.costs = run, costs
        self.plans: dict[tuple[str, ...], Plan] = {}
        keep = Plan.from_actions(costs, [KEEP] * len(costs), KEEP)
        self.handle = apply(run.model, keep, list(run.chain), main_input=run.main_input, main_output=run.main_output)
        self.windows = BlockWindows([m for _, m in run.chain], run.ios, run.clock)

    def __enter__(self) -> _MixedSteps:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.windows.remove()
        self.handle.remove()

    def under(self, per_block: list[str]) -> _Reading | None:
        """One step with each block under its action in ``per_block``; None where a block did not run once
        each way."""
        key = tuple(per_block)
        if key not in self.plans:
            self.plans[key] = Plan.from_actions(self.costs, per_block, "in-step timing")
        self.handle.set_plan(self.plans[key])
        self.windows.reset()
        run = self.run
        seconds = timed_step(run.model, run.batch, run.loss_fn, autocast=run.autocast, clock=run.clock,
                             holds_output=run.holds_output)  # fmt: skip
        w = self.windows
        if not w.each_block_once:
            return None
        return _Reading(per_block, seconds, w.inside, list(w.fwd_s), list(w.bwd_s), w.hands_on)


def time_actions_in_steps(
    run: StepRun, costs: CostTable, *, rounds: int = ROUNDS, segment_pairs: int = SEGMENT_PAIRS
) -> None:
    """Replace, in ``costs`` (whose rows are the blocks of ``run.chain``, in order, anchored to plain steps), each
    exact action's forward, backward and overhead by the figures read within mixed steps, anchor the blocks'
    keep figures and the time outside them to those steps too, and, with ``segment_pairs``, price a segment's
    waiting blocks (module notes), where that can be done; ``costs.info["action_times_from"]`` says which figures
    the table holds, ``info["segments_priced"]`` whether a segment's price was measured where it could be. The
    caller forks the RNG and restores gradients and buffers around it."""
    actions = actions_to_time(costs)
    why = _why_not(run.model, costs) if actions else "no action besides keep was profiled"
    if why is not None:
        costs.info["action_times_from"] = f"{ISOLATED} ({why})"
        return
    readings: list[list[_Reading]] = []
    with _MixedSteps(run, costs) as steps:
        for r, deal in enumerate(mixed_schedule(costs, actions, rounds)):
            done = [steps.under(per_block) for per_block in (deal if r % 2 == 0 else deal[::-1])]
            if any(reading is None for reading in done):
                break
            readings.append(done)  # type: ignore[arg-type]
    if len(readings) < rounds:
        costs.info["action_times_from"] = f"{ISOLATED} (a block did not run once forward and once backward in a step)"
        return
    hands_on = all(x.hands_on for done in readings for x in done)
    costs.info["outputs_feed_next_block"] = bool(costs.info.get("outputs_feed_next_block")) and hands_on
    _read_rounds(costs, actions, readings)
    if one_segment(costs) is not None:
        costs.info["segments_priced"] = False
        if segment_pairs > 0:
            price_segments_in_steps(run, costs, pairs=segment_pairs)


def price_segments_in_steps(run: StepRun, costs: CostTable, *, pairs: int = SEGMENT_PAIRS) -> bool:
    """Set ``costs.deferred_s_per_byte`` from ``pairs`` pairs of steps, the whole chain as one segment and every
    block checkpointed, each first in turn (module notes), where the table's actions were timed within steps and
    its chain can be one segment (:func:`one_segment`); ``info["segments_priced"]`` becomes True. Returns
    whether it priced them. The caller forks the RNG and restores gradients and buffers around it."""
    segment = one_segment(costs)
    if segment is None or costs.info.get("action_times_from") != STEPS or pairs < 1:
        return False
    checkpoint = [CHECKPOINT] * len(costs)
    extra_s = []
    with _MixedSteps(run, costs) as steps:
        for p in range(pairs):
            order = (checkpoint, segment) if p % 2 == 0 else (segment, checkpoint)
            done = {id(per_block): steps.under(per_block) for per_block in order}
            ran_segment, ran_checkpoint = done[id(segment)], done[id(checkpoint)]
            if ran_segment is not None and ran_checkpoint is not None:
                extra_s.append(ran_segment.blocks_s - ran_checkpoint.blocks_s)
    if not extra_s:
        return False
    costs.deferred_s_per_byte = deferral_rate(costs, extra_s)
    costs.info["segments_priced"] = True
    return True


def _read_rounds(costs: CostTable, actions: Sequence[str], readings: list[list[_Reading]]) -> None:
    """Shifts, noise and keep anchors from the mixed steps' ``readings`` (per round, its steps), into ``costs``."""
    n = len(costs)
    keep_fwd = [[b.fwd_s] for b in costs.blocks]  # per block: the plain step's figure, then its keep windows
    keep_bwd = [[b.bwd_s] for b in costs.blocks]
    for done in readings:
        for reading in done:
            for i in range(n):
                if reading.actions[i] == KEEP:
                    keep_fwd[i].append(reading.fwd_s[i])
                    keep_bwd[i].append(reading.bwd_s[i])
    per_block = [(statistics.median(f), statistics.median(b)) for f, b in zip(keep_fwd, keep_bwd, strict=True)]
    shifts: dict[tuple[int, str], tuple[float, float]] = {}  # (block, action) -> forward and backward shift
    errors = []  # per action and group of blocks: how far the round-by-round figures spread, per round's root
    for rows in same_cost_groups(costs):
        for action in actions:
            by_round = [_shifts_in(done, rows, action, per_block) for done in readings]
            by_round = [ran for ran in by_round if ran]
            if not by_round:
                continue
            totals = [statistics.median(f + b for f, b in ran) for ran in by_round]
            errors.append((max(totals) - min(totals)) / len(totals) ** 0.5)
            every = [x for ran in by_round for x in ran]
            shift = (statistics.median(f for f, _ in every), statistics.median(b for _, b in every))
            for i in rows:
                if action in costs.blocks[i].actions:
                    shifts[i, action] = shift
    fwd, bwd = [], []
    for i in range(n):
        f, b = list(keep_fwd[i]), list(keep_bwd[i])
        for done in readings:
            for reading in done:
                action = reading.actions[i]
                if action != KEEP and (i, action) in shifts:
                    f.append(reading.fwd_s[i] - shifts[i, action][0])
                    b.append(reading.bwd_s[i] - shifts[i, action][1])
        fwd.append(statistics.median(f))
        bwd.append(statistics.median(b))
    outside = [costs.outside_s] + [x.step_s - x.inside_s for done in readings for x in done]
    step_s = costs.info.get("plain_step_s", 0.0)
    feeds = bool(costs.info.get("outputs_feed_next_block"))
    anchor_to_plain_steps(costs, PlainSteps(step_s, statistics.median(outside), fwd, bwd, feeds), costs.fqns)
    for (i, action), (fwd_shift, bwd_shift) in shifts.items():
        costs.blocks[i] = in_step_block(costs.blocks[i], action, fwd_shift, bwd_shift)
    if errors:  # the width the optimal planner reads time costs on (remat.planning.optimal_plan, invariant 1)
        block_s = statistics.median(b.fwd_s + b.bwd_s for b in costs.blocks)
        costs.info["time_noise_s"] = max(statistics.median(errors), NOISE_FLOOR * block_s)
    untimed = [a for a in actions if not any(key[1] == a for key in shifts)]
    costs.info["action_times_from"] = STEPS if not untimed else f"{STEPS}, {ISOLATED} for {untimed}"


def _shifts_in(
    steps: Sequence[_Reading], rows: Sequence[int], action: str, per_block: Sequence[tuple[float, float]]
) -> list[tuple[float, float]]:
    """In one round's ``steps``, each forward and backward shift of ``action`` on a block of ``rows`` (a group that
    costs the same): its windows less keep's in the same step (the median over the group's blocks that kept in
    it), or less the block's own keep figures where none kept in that step."""
    ran = []
    for step in steps:
        kept = [i for i in rows if step.actions[i] == KEEP]
        same_step = (
            (statistics.median(step.fwd_s[i] for i in kept), statistics.median(step.bwd_s[i] for i in kept))
            if kept else None
        )  # fmt: skip
        for i in rows:
            if step.actions[i] == action:
                ref = same_step or per_block[i]
                ran.append((step.fwd_s[i] - ref[0], step.bwd_s[i] - ref[1]))
    return ran
