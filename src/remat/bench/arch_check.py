"""The architecture matrix: one model of each architecture through remat's whole flow, compared with plain steps.

For one :class:`~remat.bench.arch_zoo.Architecture`, :func:`check` runs, from the same weights, buffers and RNG
seed each time:

* a plain training step (the reference: loss, outputs, parameter gradients, buffers after the step);
* ``remat.profile`` (which runs one step itself: its buffers must be the plain step's), ``remat.plan("optimal",
  budget)`` and a step under ``remat.apply``, measured with ``remat.measure()``;
* the integration path: ``remat.integrations.hf.enable`` on Hugging Face models (a session on the others),
  whose first step is profiled with every block checkpointed and whose second step runs the plan.

Each step's gradients must be bitwise equal to the plain step's, its buffers equal, its outputs equal (every
tensor, and the number of hidden states and router logits), and the measured activation peak of the planned
step within the budget. A model with several chains is refused by ``profile`` unless its chains are named; the
matrix then plans all of them together under the one budget (``blocks=remat.find_chains(model)``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import remat
from remat.bench.arch_zoo import Architecture

from ..chains import cache_configs, resolve_blocks
from ..meters import LiveTensorTracker
from ..planning import minimum_peak_bytes

SEED = 1234


@dataclass
class StepRecord:
    """What one training step produced and left behind."""

    outputs: dict[str, Any]
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]


@dataclass
class ArchResult:
    """One row of the matrix. ``problems`` lists every difference from a plain step; empty means all exact."""

    name: str
    chains: list[str] = field(default_factory=list)
    blocks: list[str] = field(default_factory=list)
    planned: list[str] = field(default_factory=list)
    default_chains: int = 0  # chains a profile without blocks= covered (several chains: all of them)
    plan_refusal: str = ""
    actions: dict[str, str] = field(default_factory=dict)
    peak_bytes: int = 0
    budget_bytes: int = 0
    predicted_bytes: int = 0
    problems: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def exact(self) -> bool:
        return not self.problems and not self.error

    @property
    def within_budget(self) -> bool:
        return 0 < self.peak_bytes <= self.budget_bytes

    @property
    def status(self) -> str:
        if self.error:
            return "error: " + self.error.splitlines()[0][:80]
        if self.problems:
            return "differs: " + self.problems[0][:80]
        notes = []
        if len(self.chains) > 1:
            notes.append(f"{len(self.chains)} chains planned together")
        if self.plan_refusal:
            notes.append("budget under the minimum: planned at it")
        head = "ok" if self.within_budget else f"over budget by {self.peak_bytes - self.budget_bytes} B"
        return head + (f" ({'; '.join(notes)})" if notes else "")


def flatten_output(value: Any, prefix: str = "") -> dict[str, Any]:
    """Every tensor of a model output by path, plus the length of every tuple/list (``path#len``)."""
    if isinstance(value, torch.Tensor):
        return {prefix: value.detach().clone()}
    items: list[tuple[str, Any]]
    if isinstance(value, dict):  # ModelOutput is a dict of its non-None fields
        items = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, tuple | list):
        items = [(str(i), v) for i, v in enumerate(value)]
    elif hasattr(value, "to_tuple"):
        items = [(str(i), v) for i, v in enumerate(value.to_tuple())]
    else:
        return {}
    found: dict[str, Any] = {}
    if isinstance(value, tuple | list):
        found[f"{prefix}#len"] = len(value)
    for key, item in items:
        found.update(flatten_output(item, f"{prefix}.{key}" if prefix else key))
    return found


def _loss(arch: Architecture, output: Any) -> torch.Tensor:
    if arch.loss is not None:
        return arch.loss(output)
    if isinstance(output, torch.Tensor):
        return output
    return output.loss


def _step(arch: Architecture, model: nn.Module, batch: dict[str, Any]) -> Any:
    """One training step (seeded, gradients from zero); returns the model's output."""
    torch.manual_seed(SEED)
    model.zero_grad(set_to_none=True)
    output = model(**batch)
    _loss(arch, output).backward()
    return output


def _run_step(arch: Architecture, model: nn.Module, batch: dict[str, Any]) -> StepRecord:
    return record_step(model, _step(arch, model, batch))


def plan_peak(arch: Architecture, model: nn.Module, batch: dict[str, Any], plan: remat.Plan,
              chains: list[list[tuple[str, nn.Module]]] | None = None) -> int:  # fmt: skip
    """The measured peak activation bytes of one training step under ``plan`` (applied on ``chains``, default the
    model's blocks), the output counted as the simulator counts it: the tracker is closed once it is dropped.
    The plan is removed and the gradients set to None afterwards."""
    handle = remat.apply(model, plan, blocks=chains)
    tracker = LiveTensorTracker()
    try:
        with tracker:
            output = _step(arch, model, batch)
    finally:
        handle.remove()
    del output
    tracker.close()
    model.zero_grad(set_to_none=True)
    return tracker.peak(exclude_survivors=True)


def plain_step(arch: Architecture, model: nn.Module, batch: dict[str, Any]) -> StepRecord:
    """The reference step: no remat, and no key/value cache (a training step under remat runs without one, as
    under Hugging Face's own checkpointing; the cache changes the last bits of some models' gradients)."""
    configs = [c for c in cache_configs(model) if c.use_cache]
    for config in configs:
        config.use_cache = False
    try:
        return _run_step(arch, model, batch)
    finally:
        for config in configs:
            config.use_cache = True


def record_step(model: nn.Module, output: Any) -> StepRecord:
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return StepRecord(flatten_output(output), grads, buffers)


def compare(reference: StepRecord, got: StepRecord, what: str) -> list[str]:
    """Every difference between two steps, described."""
    problems = []
    for kind, ref, new in (
        ("output", reference.outputs, got.outputs),
        ("gradient", reference.grads, got.grads),
        ("buffer", reference.buffers, got.buffers),
    ):
        if ref.keys() != new.keys():
            missing, extra = sorted(ref.keys() - new.keys()), sorted(new.keys() - ref.keys())
            problems.append(f"{what}: {kind}s differ in names (missing {missing[:3]}, extra {extra[:3]})")
            continue
        for name, a in ref.items():
            b = new[name]
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
                same = a.shape == b.shape and torch.equal(a, b)
            else:
                same = a == b
            if not same:
                problems.append(f"{what}: {kind} {name} differs ({_describe(a)} vs {_describe(b)})")
    return problems


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.numel():
            return f"{tuple(value.shape)} sum {value.double().sum().item():.6g}"
        return f"{tuple(value.shape)} {value.flatten()[:4].tolist()}"
    return repr(value)


@contextmanager
def _state_kept(model: nn.Module) -> Iterator[Callable[[], None]]:
    """Yields a function that puts the model's parameters and buffers back to what they were on entry."""
    state = copy.deepcopy(model.state_dict(keep_vars=False))
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}

    def restore() -> None:
        model.load_state_dict(state)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(buffers[name])
        model.zero_grad(set_to_none=True)

    yield restore
    restore()


def chain_to_plan(model: nn.Module) -> Any:
    """The ``blocks=`` the matrix plans: the only chain, or all of several (planned together)."""
    chains = remat.find_chains(model)
    return chains[0] if len(chains) == 1 else chains


def check(arch: Architecture, *, budget: float = 0.5, integration: bool = True) -> ArchResult:
    """Run ``arch`` through the matrix; see the module docs."""
    result = ArchResult(arch.name)
    try:
        _check(arch, budget, integration, result)
    except Exception as err:  # noqa: BLE001 - a row of the matrix reports any failure
        result.error = f"{type(err).__name__}: {err}"
    return result


def _check(arch: Architecture, budget: float, integration: bool, result: ArchResult) -> None:
    model = arch.build()
    batch = arch.batch()
    chains = remat.find_chains(model)
    result.chains = [c[0][0].rsplit(".", 1)[0] for c in chains]
    result.blocks = [fqn for fqn, _ in remat.find_blocks(model)]
    chain = chain_to_plan(model)
    result.planned = [fqn for fqn, _ in resolve_blocks(model, chain)]
    loss_fn = lambda out: _loss(arch, out)  # noqa: E731
    with _state_kept(model) as restore:
        reference = plain_step(arch, model, batch)
        restore()
        if len(chains) > 1:
            default = remat.profile(model, batch, loss_fn=loss_fn, repeats=1)
            result.default_chains = len(default.chain_lengths)
            if sorted(default.fqns) != sorted(result.planned):
                result.problems.append("profile: without blocks= the table does not cover every chain")
            restore()
        torch.manual_seed(SEED)
        costs = remat.profile(model, batch, loss_fn=loss_fn, blocks=chain, repeats=1)
        profiled = record_step(model, None)
        profiled.grads = {n: p.grad for n, p in model.named_parameters()}
        result.problems += compare(
            StepRecord({}, {n: None for n in reference.grads}, reference.buffers), profiled, "profile"
        )
        restore()
        try:
            plan = remat.plan(costs, "optimal", budget)
        except remat.BudgetError as err:
            result.plan_refusal = str(err)
            plan = remat.plan(costs, "optimal", minimum_peak_bytes(costs))
        result.actions = dict(plan.actions)
        result.budget_bytes = plan.budget_bytes or 0
        result.predicted_bytes = plan.predicted_peak_bytes
        handle = remat.apply(model, plan, blocks=chain)
        try:
            # The step alone is tracked (not the copies record_step makes), and the tracker is closed once the
            # output is dropped, so the output counts as the activation it is (as the simulator counts it).
            tracker = LiveTensorTracker()
            with tracker:
                output = _step(arch, model, batch)
            got = record_step(model, output)
            del output
            tracker.close()
        finally:
            handle.remove()
        result.peak_bytes = tracker.peak(exclude_survivors=True)
        result.problems += compare(reference, got, "apply")
        restore()
        if integration:
            result.problems += _check_integration(arch, model, batch, chain, result.budget_bytes, reference, restore)


def _check_integration(
    arch: Architecture,
    model: nn.Module,
    batch: dict[str, Any],
    chain: list[tuple[str, nn.Module]],
    budget_bytes: int,
    reference: StepRecord,
    restore: Callable[[], None],
) -> list[str]:
    from transformers import PreTrainedModel

    from ..integrations import RematSession, hf

    hf_model = isinstance(model, PreTrainedModel) or isinstance(getattr(model, "base_model", None), nn.Module)
    start = hf.enable if hf_model and arch.needs else RematSession
    # The session profiles its own first step (every block checkpointed), whose figures differ a little from
    # remat.profile's: a tenth more room keeps the plan feasible.
    session = start(model, "optimal", int(1.1 * budget_bytes), blocks=chain)
    problems = []
    try:
        problems += compare(reference, _run_step(arch, model, batch), "profiled first step")
        session.step()
        restore()
        problems += compare(reference, _run_step(arch, model, batch), "planned step")
    finally:
        session.remove()
    return problems


def format_table(results: list[ArchResult]) -> str:
    """The matrix as a text table."""
    from ..core import format_bytes

    header = f"{'arch':<12} {'chains':>6} {'blocks':>6} {'exact':>5} {'peak / budget':>22} {'predicted':>11}  status"
    lines = [header, "-" * len(header)]
    for r in results:
        peak = f"{format_bytes(r.peak_bytes)} / {format_bytes(r.budget_bytes)}" if r.budget_bytes else "-"
        predicted = format_bytes(r.predicted_bytes) if r.predicted_bytes else "-"
        lines.append(
            f"{r.name:<12} {len(r.chains):>6} {len(r.planned):>6} {'yes' if r.exact else 'no':>5} {peak:>22} "
            f"{predicted:>11}  {r.status}"
        )
    return "\n".join(lines)
