"""Blocks a training step calls more than once in its forward: a loop over the same layers, layers shared
across depth (ALBERT-style), a universal transformer. A cost table has one row per block and a plan one action
per block, so the later calls are not planned: the runtime runs every call of a block under its action (the
gradients stay exact), but the profile counts the later calls' activations in the head, and predictions and
budgets are off (predictions up to 30% high on a model looping twice). :class:`RepeatedCalls` counts such calls
during a profiled step and says so."""

from __future__ import annotations

import warnings


class RepeatedCalls:
    """Forward calls per block beyond its first, counted in one step (recomputation in backward not included)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}  # block FQN -> calls in the step's forward, for blocks called twice or more

    def called_again(self, fqn: str) -> None:
        """Block ``fqn`` was called again in the step's forward (with grad enabled)."""
        self.calls[fqn] = self.calls.get(fqn, 1) + 1

    def message(self) -> str | None:
        """What is wrong and what to do, or None when every block ran once."""
        if not self.calls:
            return None
        listed = ", ".join(f"{fqn} ({n} calls)" for fqn, n in self.calls.items())
        return (
            f"remat: the step calls some blocks more than once in its forward: {listed}. remat plans and costs each "
            "block once per step: every call runs under the block's action and gradients stay exact, but the later "
            "calls' activations are counted as the head's, so predicted peaks and budgets are unreliable for this "
            "model. Check the measured peak (remat.measure()) or give remat a chain of modules each called once"
        )

    def warn(self, stacklevel: int = 3) -> None:
        text = self.message()
        if text:
            warnings.warn(text, stacklevel=stacklevel)
