"""Choosing by measurement, written once: candidates run on the caller's step, each one's peak measured, the
ones that fit timed head to head, the fastest kept.

Every fit of remat (the eager plan chosen between ``optimal`` with and without per-operator policies, the
whole-model ``torch.compile`` budget fitted to bytes, the compiled route chosen between the whole model and
compiled blocks) records its candidates as :class:`Trial` rows in a :class:`Fit`, and reports them with the one
:meth:`Fit.describe`.

Rules, enforced here:

1. A candidate is kept only where its *measured* peak fits the byte budget (:func:`over`); one that was not run
   says why in ``refused``.
2. Steps are compared as ratios within one process, the candidates interleaved round by round (the order
   reversed every other round) after one untimed step each (:func:`head_to_head`); a step's seconds alone are
   compared only where the steps were timed the same way. A candidate whose rank is settled stops being timed:
   from the second round on, one whose fastest round is more than ``SETTLE_MARGIN`` slower than the slowest
   round of the fastest candidate (by median) is timed no more, and keeps the ratios it has.
3. Among the candidates that fit, the fastest is kept (:func:`fastest`), the first listed on a tie.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, TypeVar

import torch

from ..chains import ratios_text
from ..core import format_bytes
from ..meters import measure
from ..planning import Plan

Name = TypeVar("Name", bound=Hashable)


@dataclass(frozen=True)
class Trial:
    """One candidate of a fit as measured.

    ``name``: what it is among the fit's candidates (a plan's strategy, a route, a budget); ``detail``: what it
    runs; ``plan``/``budget``: the plan or the ``activation_memory_budget`` it runs, where it has one;
    ``peak_bytes``: its measured peak activation bytes (None: not run); ``predicted_bytes``: the peak predicted
    for it; ``ratios``: its step's per-round ratios to the fit's first timed candidate; ``step_s``: its median
    step in seconds, where it was timed on its own; ``refused``: why it is not kept (empty where it fits)."""

    name: str
    detail: str = ""
    plan: Plan | None = None
    budget: float | None = None
    peak_bytes: int | None = None
    predicted_bytes: int | None = None
    ratios: tuple[float, ...] = ()
    step_s: float | None = None
    refused: str = ""

    @property
    def step_ratio(self) -> float | None:
        """Median of the per-round step ratios."""
        return statistics.median(self.ratios) if self.ratios else None

    @property
    def label(self) -> str:
        """The name, with the budget where the fit holds several of the same name."""
        return self.name if self.budget is None else f"{self.name} at {self.budget:g}"

    @property
    def fits(self) -> bool:
        return not self.refused


@dataclass(frozen=True)
class Fit:
    """The candidate chosen for ``max_bytes`` and every candidate as measured, in the order they were listed."""

    max_bytes: int
    chosen: Trial
    trials: tuple[Trial, ...]

    heading: ClassVar[str] = "within {max_bytes}"  # what the first line of describe() says, before the choice
    reference: ClassVar[str | None] = None  # the trial every peak is shown against, by name (None: no ratio)

    def describe(self) -> str:
        """What was chosen and why: one line, then one line per candidate with its measured peak, its step and
        whether it fits."""
        reference = next((t for t in self.trials if t.name == self.reference), None)
        chosen = self.chosen
        head = self.heading.format(max_bytes=format_bytes(self.max_bytes)) + f": {chosen.label}"
        head += f" ({chosen.detail})" if chosen.detail else ""
        timed = [t for t in self.trials if t.ratios]  # head_to_head's order: the first is the ratios' denominator
        if reference is not None and reference.ratios and chosen.step_ratio is not None and chosen is not reference:
            head += f", {chosen.step_ratio:.3f}x {reference.label}'s step"
        elif reference is not None and timed and not reference.ratios:
            head += f"; steps as ratios to {timed[0].label}'s ({reference.label}: {reference.refused or 'not timed'})"
        lines = [head]
        for t in self.trials:
            what = t.label + (f" ({t.detail})" if t.detail else "")
            if t.peak_bytes is None:
                lines.append(f"  {what}: not run ({t.refused})" if t.refused else f"  {what}: not run")
                continue
            peak = f"peak {format_bytes(t.peak_bytes)}"
            if reference is not None and reference.peak_bytes:
                peak += f" ({t.peak_bytes / reference.peak_bytes:.2f}x)"
            if t.predicted_bytes is not None:
                peak += f", predicted {format_bytes(t.predicted_bytes)}"
            step = ""
            if t.ratios:
                step = f", step {ratios_text(t.ratios)}"
            elif t.step_s is not None:
                step = f", step {t.step_s * 1e3:.1f} ms"
                if reference is not None and reference.step_s:
                    step += f" ({t.step_s / reference.step_s:.2f}x)"
            verdict = "" if t is reference else f", {t.refused}" if t.refused else ", fits"
            mark = "  <- chosen" if t is chosen else ""
            lines.append(f"  {what}: {peak}{step}{verdict}{mark}")
        return "\n".join(lines)


def peak_of(step: Callable[[], Any], device: torch.device, *, allocations: bool = False, warm: bool = True) -> int:
    """The peak activation bytes of one ``step()``, by the live-tensor tracker or, with ``allocations``, the
    allocator's events (which see inside compiled code); one untimed step first where ``warm``."""
    if warm:
        step()
    with measure(device, allocations=allocations) as meter:
        step()
    return meter.activation_bytes


def over(peak: int, limit: int) -> str:
    """Rule 1: why a candidate whose measured peak is ``peak`` is refused under ``limit`` bytes ("" where it fits)."""
    return f"measured over {format_bytes(limit)}" if peak > limit else ""


SETTLE_MARGIN = 0.02  # rule 2: how much slower than the leader's slowest round a candidate's fastest must be
SETTLE_AFTER = 2  # rule 2: the rounds every candidate runs before any is set aside


def head_to_head(
    names: Sequence[Name], run: Callable[[Name], float], rounds: int, *, warm: bool = True, settle: bool = True
) -> dict[Name, tuple[float, ...]]:
    """Rule 2: each name's step (``run(name)``: seconds) in up to ``rounds`` interleaved rounds, as ratios to the
    first name's of the same round (the first is timed every round); one untimed ``run`` of each first where
    ``warm``; with ``settle``, a name whose rank is settled is timed no more (its tuple is shorter)."""
    names = list(names)
    if warm:
        for name in names:
            run(name)
    first = names[0]
    ratios: dict[Name, list[float]] = {name: [] for name in names}
    timed = list(names)
    for done in range(1, rounds + 1):
        seconds = {name: run(name) for name in (timed if done % 2 else timed[::-1])}
        for name in timed:
            ratios[name].append(seconds[name] / seconds[first])
        if settle and SETTLE_AFTER <= done < rounds:
            leader = min(timed, key=lambda name: statistics.median(ratios[name]))
            ceiling = max(ratios[leader]) * (1 + SETTLE_MARGIN)
            timed = [name for name in timed if name in (first, leader) or min(ratios[name]) <= ceiling]
    return {name: tuple(values) for name, values in ratios.items()}


def with_ratios(trials: Sequence[Trial], ratios: dict[str, tuple[float, ...]]) -> list[Trial]:
    """``trials`` with the ratios of :func:`head_to_head` keyed by their labels (others as they are)."""
    return [replace(t, ratios=ratios[t.label]) if t.label in ratios else t for t in trials]


def fastest(trials: Sequence[Trial], by: Callable[[Trial], float | None] | None = None) -> Trial | None:
    """Rule 3: the trial that fits with the least ``by`` (default: its step ratio; a trial without one counts as
    1.0), or None where none fits."""
    key = by or (lambda t: t.step_ratio)
    kept = [t for t in trials if t.fits and t.peak_bytes is not None]
    if not kept:
        return None
    return min(kept, key=lambda t: v if (v := key(t)) is not None else 1.0)
