"""The peers benchmark's head-to-head rounds (benchmarks/peers/duel.py) on a stand-in bench whose steps take
chosen seconds: rounds go on, a block at a time up to the cap, only while remat's ratio to a peer that fits
is unresolved from the speed target."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import pytest


@pytest.fixture(scope="module")
def duel():
    yield importlib.import_module("benchmarks.peers.duel")


@dataclass
class Row:
    budget: float | None
    key: str
    name: str


@dataclass
class Contender:
    key: str


@dataclass
class ContenderSet:
    rows: list[Row]
    contenders: dict[str, Contender]


@dataclass
class StandIn:
    """Steps of ``seconds[key]`` (cycled), memory records the table's fit rule reads."""

    seconds: dict[str, list[float]]
    tracker: dict[str, int]
    job: dict[str, Any]
    memory: dict[str, dict[str, Any]] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    steps: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.memory = {k: {"process_bytes": None, "tracker_bytes": b} for k, b in self.tracker.items()}

    def timed(self, c: Contender, seed: int) -> dict[str, float]:
        i = self.steps.get(c.key, 0)
        self.steps[c.key] = i + 1
        s = self.seconds[c.key][i % len(self.seconds[c.key])]
        return {"seconds": s, "cpu_seconds": s}

    def emit(self, record: str, **fields: Any) -> None:
        self.records.append({"record": record, **fields})


def run(duel, optimal: list[float], hand: list[float], hand_bytes: int = 400, first: int = 8, most: int = 40):
    rows = [
        Row(None, "none", "no checkpointing"),
        Row(0.5, "opt", "remat optimal"),
        Row(0.5, "hand", "torch checkpoint, first k blocks"),
    ]
    cs = ContenderSet(rows, {r.key: Contender(r.key) for r in rows})
    bench = StandIn(
        {"opt": optimal, "hand": hand, "none": [0.1]},
        {"none": 1000, "opt": 450, "hand": hand_bytes},
        {"duel_rounds": first, "duel_max_rounds": most, "seed": 0},
    )
    duel.duel_rounds(bench, cs)
    rounds = {r["round"] for r in bench.records if r["key"] == "opt"}
    assert {r["key"] for r in bench.records} == {"opt", "hand", "opt#aa"}
    assert rounds == set(range(len(rounds)))  # numbered in order, every slot each round
    assert len(bench.records) == 3 * len(rounds)
    return len(rounds)


def test_a_ratio_clear_of_the_target_stops_after_the_first_rounds(duel):
    assert run(duel, [0.100, 0.101], [0.100]) == 8  # ratios 1.00-1.01: the interval is under 1.02
    assert run(duel, [0.110, 0.111], [0.100]) == 8  # 1.10-1.11: over it


def test_a_ratio_near_the_target_gets_blocks_of_rounds_up_to_the_cap(duel):
    near = [0.0995, 0.1045, 0.1005, 0.1035]  # ratios around 1.02, spread 0.995-1.045
    assert run(duel, near, [0.100]) == 40
    assert run(duel, near, [0.100], most=12) == 12  # the last block is cut to the cap
    assert run(duel, near, [0.100], most=4) == 8  # a cap under --duel-rounds runs those


def test_a_peer_that_does_not_fit_does_not_ask_for_rounds(duel):
    near = [0.0995, 0.1045, 0.1005, 0.1035]
    assert run(duel, near, [0.100], hand_bytes=600) == 8  # 0.60 of the reference: over the 50% budget


def test_no_head_to_head_rounds_when_none_are_asked_for(duel):
    rows = [
        Row(None, "none", "no checkpointing"),
        Row(0.5, "opt", "remat optimal"),
        Row(0.5, "hand", "torch checkpoint, first k blocks"),
    ]
    bench = StandIn(
        {"opt": [0.1], "hand": [0.1]},
        {"none": 1000, "opt": 450, "hand": 400},
        {"duel_rounds": 0, "duel_max_rounds": 40, "seed": 0},
    )
    duel.duel_rounds(bench, ContenderSet(rows, {r.key: Contender(r.key) for r in rows}))
    assert bench.records == []


def test_remats_measured_choice_runs_beside_optimal_with_one_aa_pair(duel):
    rows = [
        Row(None, "none", "no checkpointing"),
        Row(0.5, "opt", "remat optimal"),
        Row(0.5, "fit", "remat fit"),
        Row(0.5, "hand", "torch checkpoint, first k blocks"),
    ]
    bench = StandIn(
        {"opt": [0.1], "fit": [0.1], "hand": [0.2]},
        {"none": 1000, "opt": 450, "fit": 450, "hand": 400},
        {"duel_rounds": 6, "duel_max_rounds": 40, "seed": 0},
    )
    duel.duel_rounds(bench, ContenderSet(rows, {r.key: Contender(r.key) for r in rows}))
    assert [r["key"] for r in bench.records[:4]] == ["opt", "fit", "hand", "opt#aa"]
    assert len(bench.records) == 4 * 6  # both clear of the target (0.5x): no more rounds
