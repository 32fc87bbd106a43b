"""PGAC in training checkpoints: a run saved after N steps and resumed in a fresh model and controller makes
the decisions of the run that never stopped, and the state loads with torch.load(weights_only=True)."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.dynamic.pgac.state import plain

STEPS_BEFORE, STEPS_AFTER = 6, 10


class Residual(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.mlp(x))


class Chain(nn.Module):
    def __init__(self, d: int = 16, n: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Residual(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def batch(step: int) -> torch.Tensor:
    return torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(step))


class FakeClock:
    """Time moves only while a step runs, by an amount set by the plan: equal plans take equal times."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Run:
    model: Chain
    optimizer: torch.optim.Optimizer
    pgac: Any


@pytest.fixture(scope="module")
def costs() -> remat.CostTable:
    torch.manual_seed(0)
    return remat.profile(Chain(), batch(0))  # measured: its info holds torch's version object


def start(costs: remat.CostTable, gamma: Any, **options: Any) -> Run:
    torch.manual_seed(0)
    model = Chain()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    pgac = remat.PGAC(model, 0.6, gamma=gamma, alpha=0.5, total_steps=40, costs=costs, **options).attach(optimizer)
    pgac.clock = FakeClock()
    return Run(model, optimizer, pgac)


def train_step(run: Run, t: int) -> tuple[Any, ...]:
    torch.manual_seed(t)
    run.model(batch(t)).backward()
    run.pgac.clock.now += 1.0 + 50 * run.pgac.plan.predicted_recompute_s
    run.optimizer.step()
    run.optimizer.zero_grad()
    p = run.pgac
    return t, tuple(p.plan.actions.values()), tuple(p.mask.values()), p.gamma, p.tau, tuple(p.scores.values())


def save(run: Run) -> bytes:
    buffer = io.BytesIO()
    torch.save(
        {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(), "pgac": run.pgac.state_dict()},
        buffer,
    )
    return buffer.getvalue()


@pytest.mark.parametrize("gamma", ["learned", "constant", "linear"])
def test_resuming_makes_the_decisions_of_an_uninterrupted_run(costs, gamma):
    uninterrupted = start(costs, gamma)
    expected = [train_step(uninterrupted, t) for t in range(STEPS_BEFORE + STEPS_AFTER)]
    uninterrupted.pgac.remove()

    first = start(costs, gamma)
    for t in range(STEPS_BEFORE):
        train_step(first, t)
    saved, now = save(first), first.pgac.clock.now
    first.pgac.remove()

    checkpoint = torch.load(io.BytesIO(saved), weights_only=True)  # torch's default since 2.6
    resumed = start(costs, gamma)
    resumed.model.load_state_dict(checkpoint["model"])
    resumed.optimizer.load_state_dict(checkpoint["optimizer"])
    resumed.pgac.load_state_dict(checkpoint["pgac"])
    resumed.pgac.clock.now = now
    got = [train_step(resumed, t) for t in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)]
    assert got == expected[STEPS_BEFORE:]  # plans, masks, gamma, tau and scores, exactly
    if gamma != "constant":
        assert len({g[3] for g in got}) > 1  # gamma moved over the resumed steps
    if gamma == "learned":
        assert len({g[1] for g in got}) > 1  # and so did the plans
    assert resumed.pgac.history[0].step_time_s is not None  # the first resumed step counts for the schedule
    resumed.pgac.remove()


def test_state_is_plain_data(costs):
    run = start(costs, "learned")
    for t in range(3):
        train_step(run, t)
    state = run.pgac.state_dict()
    assert type(state["costs"]["info"]["torch"]) is str
    json.dumps(state)  # nothing but numbers, strings, lists and dicts
    run.pgac.remove()


def test_plain_names_what_it_cannot_hold():
    out = plain({"a": (1, 2.5, None, True), "version": torch.__version__})
    assert out == {"a": (1, 2.5, None, True), "version": str(torch.__version__)}
    assert type(out["version"]) is str and type(out["a"]) is tuple
    with pytest.raises(TypeError, match=r"state\['w'\] holds a Tensor"):
        plain({"w": torch.ones(1)})
    with pytest.raises(TypeError, match="keys must be strings"):
        plain({1: 2})


def test_loading_a_foreign_state_says_what_is_wrong(costs):
    run = start(costs, "constant")
    state = run.pgac.state_dict()
    with pytest.raises(ValueError, match="lacks"):
        run.pgac.load_state_dict({"ema": state["ema"]})
    with pytest.raises(ValueError, match="version 99"):
        run.pgac.load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match="load it into a PGAC of the same model"):
        run.pgac.load_state_dict({**state, "fqns": state["fqns"][:-1]})
    run.pgac.remove()


def test_history_is_capped(costs):
    run = start(costs, "constant", history_limit=3)
    for t in range(8):
        train_step(run, t)
    assert [r.step for r in run.pgac.history] == [5, 6, 7]
    run.pgac.remove()
    none_kept = start(costs, "constant", history_limit=0)
    train_step(none_kept, 0)
    assert len(none_kept.pgac.history) == 0 and none_kept.pgac.step_count == 1
    none_kept.pgac.remove()
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="history_limit"):
            start(costs, "constant", history_limit=bad)
