"""Anchors the profile's block times to the same blocks timed within plain steps.

The profiler times each block alone (:mod:`remat.block_timing`), every action paired with keep in the same
round, and flushes the CPU caches before each timed backward. The differences between actions (recomputation,
overhead) come out right that way, but a block's own keep forward and backward do not: alone, a block's
forward does not find its input in cache as it does after the previous block, and its flushed backward is
colder than the backward of a step, where the previous block's backward has just run (5-15% slower on a CPU,
the more so for small blocks). The plain steps that give ``outside_s`` (:func:`remat.outside_time.plain_steps`)
time every block's forward and backward within the step; each block's keep figures are set to those, and its
figures under every other action are moved by the same amount, so that every recomputation and overhead, being
differences, stays what the paired runs measured. A keep-all plan's predicted step is then the plain step as
it was timed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .costs import KEEP, BlockCost, CostTable
from .outside_time import PlainSteps

__all__ = ["anchor_to_plain_steps", "anchored_block"]


def anchored_block(block: BlockCost, fwd_s: float, bwd_s: float) -> BlockCost:
    """A copy of ``block`` whose keep forward and backward are ``fwd_s`` and ``bwd_s``, its other actions'
    forward and backward moved by the same amounts (recomputation and overhead unchanged). The copy's other
    fields are ``block``'s own (the profiler's rows share none between blocks)."""
    fwd_shift, bwd_shift = fwd_s - block.fwd_s, bwd_s - block.bwd_s
    return dataclasses.replace(
        block,
        fwd_s=fwd_s,
        bwd_s=bwd_s,
        fwd_s_by_action={a: s + fwd_shift for a, s in block.fwd_s_by_action.items()} | {KEEP: fwd_s},
        bwd_s_by_action={a: s + bwd_shift for a, s in block.bwd_s_by_action.items()} | {KEEP: bwd_s},
    )


def anchor_to_plain_steps(costs: CostTable, plain: PlainSteps, fqns: Sequence[str]) -> None:
    """Sets ``costs.outside_s`` from ``plain`` (whose blocks are ``fqns``, in order) and, where ``plain`` timed
    every block within the step, each block's keep times to those. ``costs.info["times_from"]`` says which
    (``"plain steps"`` or ``"isolated runs"``), ``info["plain_step_s"]`` is the plain steps' median and
    ``info["outputs_feed_next_block"]`` whether each block's main input was the previous block's main output
    (what a segment of them needs, :mod:`remat.runtime`). Where the blocks could not be timed within the step,
    ``outside_s`` is the step less the blocks' isolated times, not floored at 0: blocks timed alone can run slower
    than within a step."""
    fwd, bwd = plain.block_fwd_s, plain.block_bwd_s
    within = plain.outside_s is not None and fwd is not None and bwd is not None and list(fqns) == costs.fqns
    if within:
        costs.blocks = [anchored_block(b, f, g) for b, f, g in zip(costs.blocks, fwd, bwd, strict=True)]
    costs.info["times_from"] = "plain steps" if within else "isolated runs"
    costs.info["plain_step_s"] = plain.step_s
    costs.info["outputs_feed_next_block"] = plain.hands_on
    if plain.outside_s is not None:
        costs.outside_s = plain.outside_s
    else:
        costs.outside_s = plain.step_s - sum(b.fwd_s + b.bwd_s for b in costs.blocks)
