"""Each single-block action's time read within whole steps, where a plan pays it.

The profiler times a block alone under every action, each run paired with keep's in the same round
(:mod:`remat.profiling.block_timing`, :mod:`remat.profiling.action_times`). Alone, an action's forward and backward do
not run as they do between the other blocks of a step: in the fp32 GPT-2 of ``benchmarks/peers.py`` (10 ms blocks, a
2-core Xeon), a checkpointed block timed alone cost 1.2-3.1 ms more than within steps and
``selective:all_but_pointwise_saveable`` 0-1.9 ms less, enough to rank that policy, 2 ms per block slower in whole
steps, ahead of checkpointing.

:func:`time_actions_in_steps` runs whole steps with a plan applied (:func:`remat.runtime.handle.apply`) that puts every
block under one action (a block without costs for it keeps), one step per action and one keeping everything
in each round, for ``rounds`` rounds, the order reversed every other round. The hooks of
:class:`remat.profiling.outside_time.BlockWindows` read each block's forward and backward within each step (a
recomputation falls in its block's backward window). Per block and action, the differences from the round's
keep step, medians over rounds and over the blocks the profile found to cost the same (it measured one and
copied its row: ``info["same_costs_as"]``; read block by block, their figures differed by position by about as
much as from round to round), move the action's forward and backward from the block's keep figures, and its
overhead becomes what it adds in the step less its recomputation, which stays the isolated runs' figure
(floored at minus the recomputation, as :mod:`remat.profiling.action_times` does). So the time cost of each action, the
figure the planners weigh, is the one measured in the step. It runs ``rounds`` steps per action timed, plus as many
keeping everything: 21 steps with the policy menu, which took the profile of the peers' GPT-2 from 1.9 s to 5 s.

Where every block can be checkpointed and each block's output feeds the next (so that a segment of them runs),
each round also runs a step with the whole chain as one segment right after the step checkpointing every block,
and ``segment_rounds - rounds`` more rounds run that pair alone. What the blocks take in the segment step beyond
their time in its pair (the hooks' windows, so the stem, head and loss add no noise; the median over rounds, at
least 0), over the bytes its blocks but the last save under keep, is ``CostTable.deferred_s_per_byte``: what the
recomputed activations a segment holds while its later blocks re-run and run backward cost per byte (see
:mod:`remat.planning.unit_terms`). The whole chain gives the largest such difference. Six profiles of each of the peers'
models on a shared 2-core CPU read it at 0.11-0.20 ms per MiB (GPT-2) and 0.11-0.24 (Llama) with six rounds,
0.11-0.14 and 0.12-0.19 with nine, 0.04-0.17 and 0.02-0.33 from whole steps with three. Read so, it predicts
what segments of two and four blocks add to a step within 1.5% of the step (``benchmarks/segments.py``). The
pair's nine steps take the profile of the peers' GPT-2 from 4.8-5.0 s to 5.3-5.5 s and of its Llama from 3.4-3.7 s
to 3.9-4.1 s; where the head outweighs the blocks (``remat profile --model gpt2-tiny``: 27 ms of blocks in a
384 ms step) they cost the most, 10.0 s to 12.2-12.4 s.

How far each action's figure moved from round to round (its range over the square root of the rounds, the median
over actions and groups of blocks) is ``info["time_noise_s"]``: the optimal planner takes differences below it
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

from ..chains import BlockIO, interleaved_rounds, refuse_hf_checkpointing, timed_step
from ..core import CHECKPOINT, KEEP, SEGMENT, Action, Batch, BlockCost, CostTable, InputName, OutputName
from ..planning import Plan
from ..runtime import applied, apply
from .outside_time import BlockWindows

__all__ = [
    "actions_to_time",
    "deferral_rate",
    "in_step_block",
    "one_segment",
    "same_cost_groups",
    "time_actions_in_steps",
]

# Rounds of steps. Per block, an action's shift from keep varies by about 1 ms from round to round in a GPT-2
# step of 10 ms blocks on a shared CPU, and now and then a whole round is off: the median over three rounds and
# over the blocks that cost the same keeps checkpointing and a selective policy 1.5 ms apart in their order.
ROUNDS = 3
# Rounds of the pair that prices a segment's waiting blocks (the whole chain as one segment, and checkpointing every
# block): their difference is a few percent of the blocks' time in a step, about as much as two steps differ.
SEGMENT_ROUNDS = 6
STEPS = "steps"
ISOLATED = "isolated runs"
ONE_SEGMENT = "one segment"


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


def one_segment(costs: CostTable) -> list[str] | None:
    """The actions putting the chain in one segment, or None where the table cannot say what a deferred block
    costs from it: fewer than two blocks, several chains, a block without checkpoint costs, or blocks a segment
    cannot hold (the plain steps did not see each block's output feed the next block)."""
    if len(costs) < 2 or costs.chain_lengths or any(CHECKPOINT not in b.actions for b in costs.blocks):
        return None
    if not costs.info.get("outputs_feed_next_block"):
        return None
    return [Action.group(SEGMENT, 0).text] * len(costs)


def deferral_rate(costs: CostTable, segment_s: Sequence[float], checkpoint_s: Sequence[float]) -> float:
    """Seconds per byte that a segment's waiting recomputed activations cost: the median over rounds of the
    blocks' seconds in the one-segment step less theirs in the all-checkpoint step (at least 0), over the keep
    bytes of every block but the last."""
    waiting = sum(b.saved(KEEP) for b in costs.blocks[:-1])
    extra = statistics.median(a - b for a, b in zip(segment_s, checkpoint_s, strict=True))
    return max(extra, 0.0) / waiting if waiting > 0 else 0.0


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


def time_actions_in_steps(
    model: nn.Module,
    batch: Batch,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    costs: CostTable,
    chain: Sequence[tuple[str, nn.Module]],
    ios: Sequence[BlockIO],
    *,
    rounds: int = ROUNDS,
    segment_rounds: int = SEGMENT_ROUNDS,
    main_input: InputName | Mapping[str, InputName] = None,
    main_output: OutputName | Mapping[str, OutputName] = None,
    autocast: Any = None,
    clock: Callable[[], float] = time.perf_counter,
    holds_output: bool = True,
) -> None:
    """Replace, in ``costs`` (whose rows are the blocks of ``chain``, in order), each exact action's forward,
    backward and overhead by the figures read within whole steps (module notes), where that can be done;
    ``costs.info["action_times_from"]`` says which figures the table holds. The caller forks the RNG and
    restores gradients and buffers around it."""
    actions = actions_to_time(costs)
    why = _why_not(model, costs) if actions else "no action besides keep was profiled"
    if why is not None:
        costs.info["action_times_from"] = f"{ISOLATED} ({why})"
        return
    plans = {KEEP: Plan.from_actions(costs, [KEEP] * len(costs), "keep")}
    for action in actions:
        per_block = [action if action in b.actions else KEEP for b in costs.blocks]
        plans[action] = Plan.from_actions(costs, per_block, action)
    segment = one_segment(costs) if CHECKPOINT in actions else None
    if segment is not None:
        plans[ONE_SEGMENT] = Plan.from_actions(costs, segment, ONE_SEGMENT)
    handle = apply(model, plans[KEEP], list(chain), main_input=main_input, main_output=main_output)
    windows = BlockWindows([m for _, m in chain], ios, clock)

    def step_under(name: str) -> tuple[float, tuple[list[float], list[float]] | None]:
        """One step under plan ``name``: the seconds its blocks took in it, and each block's forward and backward
        seconds (None where a block did not run once each way)."""
        handle.set_plan(plans[name])
        windows.reset()
        timed_step(model, batch, loss_fn, autocast=autocast, clock=clock, holds_output=holds_output)
        return windows.inside, (windows.fwd_s, windows.bwd_s) if windows.each_block_once else None

    try:
        order = [KEEP, CHECKPOINT, ONE_SEGMENT] if segment is not None else [KEEP]  # the pair compared, side by side
        steps = interleaved_rounds(list(dict.fromkeys([*order, *plans])), step_under, rounds)
        pair = [CHECKPOINT, ONE_SEGMENT]
        more = interleaved_rounds(pair, step_under, segment_rounds - rounds) if segment is not None else {}
    finally:
        windows.remove()
        handle.remove()
    if segment is not None:
        blocks_s = {name: [seconds for seconds, _ in steps[name] + more.get(name, [])] for name in pair}
        costs.deferred_s_per_byte = deferral_rate(costs, blocks_s[ONE_SEGMENT], blocks_s[CHECKPOINT])
    windows_by = {name: [w for _, w in results] for name, results in steps.items()}
    timed = []
    errors = []  # per action and group of blocks: how far the round-by-round figures spread, per round's root
    for action in actions:
        pairs = [(run, keep) for run, keep in zip(windows_by[action], windows_by[KEEP], strict=True) if run and keep]
        if not pairs:
            continue
        timed.append(action)
        for rows in same_cost_groups(costs):
            rows = [i for i in rows if action in costs.blocks[i].actions]
            if rows:
                by_round = [
                    statistics.median(run[0][i] + run[1][i] - keep[0][i] - keep[1][i] for i in rows)
                    for run, keep in pairs
                ]
                errors.append((max(by_round) - min(by_round)) / len(by_round) ** 0.5)
                fwd_shift = statistics.median(run[0][i] - keep[0][i] for run, keep in pairs for i in rows)
                bwd_shift = statistics.median(run[1][i] - keep[1][i] for run, keep in pairs for i in rows)
                for i in rows:
                    costs.blocks[i] = in_step_block(costs.blocks[i], action, fwd_shift, bwd_shift)
    if errors:  # the width the optimal planner reads time costs on (remat.planning.optimal_plan, invariant 1)
        costs.info["time_noise_s"] = statistics.median(errors)
    untimed = [a for a in actions if a not in timed]
    costs.info["action_times_from"] = STEPS if not untimed else f"{STEPS}, {ISOLATED} for {untimed}"
