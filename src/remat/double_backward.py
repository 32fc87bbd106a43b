"""Which plan actions allow a second backward pass through their block.

A second pass happens with ``loss.backward(retain_graph=True)`` followed by another backward of the same
graph, and with ``torch.autograd.grad(..., create_graph=True)`` followed by a backward of the gradients
(gradient penalties, higher-order derivatives). ``keep``, ``checkpoint``, ``offload``, segments and
memory-poor groups support both: a checkpointed block is recomputed again for each pass, and gradients are
those of training without checkpointing. A ``selective:<policy>`` block whose policy saves operator outputs
does not: torch's selective checkpointing hands out each saved output once, and the second pass fails with
``RuntimeError: Trying to backward an extra time. You are only allowed to backward once on any region
computed under selective activation checkpoint.`` (``selective:nothing_saveable`` saves nothing and works, and so
does ``selective:offload_dots``, whose host copies serve every recompute).

``remat.plan(costs, "optimal", budget, double_backward=True)`` restricts the optimal planner to the actions
:func:`double_backward_safe` accepts; the static strategies choose none of the others.
"""

from __future__ import annotations

from collections.abc import Sequence

from .actions import plan_choices
from .costs import SELECTIVE_PREFIX, CostTable

# Selective policies that save no operator output on the device (offload_dots keeps host copies, which serve
# every recompute), so their regions can be passed through more than once.
SAVES_NOTHING = frozenset({"nothing_saveable", "offload_dots"})


def double_backward_safe(action: str) -> bool:
    """Whether a block under ``action`` (or a group kind, ``"segment"``/``"memory_poor"``) can be passed through by
    more than one backward (``retain_graph=True`` twice, or ``create_graph=True``)."""
    if action.startswith(SELECTIVE_PREFIX):
        return action[len(SELECTIVE_PREFIX) :] in SAVES_NOTHING
    return True


def double_backward_actions(costs: CostTable, actions: Sequence[str] | None = None) -> list[str]:
    """The optimal planner's ``actions=`` for a step that runs a second backward: ``actions`` (default: every
    single-block action of ``costs`` and both group kinds) without the ones that fail a second pass."""
    return [a for a in (plan_choices(costs) if actions is None else actions) if double_backward_safe(a)]


def check_double_backward(actions: Sequence[str]) -> None:
    """Raise ValueError naming the actions of a plan that fail a second backward pass."""
    unsafe = sorted({a for a in actions if not double_backward_safe(a)})
    if unsafe:
        raise ValueError(
            f"actions {unsafe} keep operator outputs under selective checkpointing, which allows one backward "
            "pass per forward; for retain_graph=True or create_graph=True plan with double_backward=True"
        )
