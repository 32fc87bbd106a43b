"""Several chains in one cost table (an encoder and a decoder, two towers): the joint ledger of the simulator,
the optimal planner against brute force over every plan whose groups stay inside a chain, the static planners,
and tables and plans written to JSON."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_optimal import check_against, cost_tables, every_plan

import remat
from remat.core import BlockCost, BudgetError, CostTable
from remat.planning import Plan, simulate
from remat.planning.optimal_plan import min_peak_bytes
from remat.planning.unit_terms import single_terms


def _block(fqn: str, keep: int, checkpointed: int, rerun: float = 1 / 64) -> BlockCost:
    return BlockCost(fqn, rerun, 2 * rerun, checkpointed, checkpointed, {"keep": keep, "checkpoint": checkpointed},
                     {"keep": 0.0, "checkpoint": rerun}, 3, 5)  # fmt: skip


def _two_chains() -> CostTable:
    encoder = [_block(f"encoder.block.{i}", 40, 4) for i in range(2)]
    decoder = [_block(f"decoder.block.{i}", 60, 6) for i in range(3)]
    return CostTable(encoder + decoder, stem_bytes=7, head_bytes=30, head_retained_bytes=2, chain_lengths=[2, 3],
                     between_bytes=[11])  # fmt: skip


def test_the_ledger_counts_the_bytes_between_chains_from_the_next_chain_on() -> None:
    costs = _two_chains()
    actions = ["checkpoint", "keep", "keep", "checkpoint", "keep"]
    terms = [single_terms(b, a, costs.head_retained_bytes) for b, a in zip(costs.blocks, actions, strict=True)]
    prefix, peak = 0, 0
    for i, t in enumerate(terms):
        peak = max(peak, prefix + t.peak)
        prefix += t.retained + (11 if i == 1 else 0)  # alive from the decoder's first block on
    expected = max(peak, prefix + costs.head_bytes) + costs.stem_bytes
    sim = simulate(costs, actions)
    assert sim.peak_bytes == expected and sim.retained_bytes == prefix
    # The gap is not in the encoder's own units: without it the encoder's peaks are unchanged.
    alone = CostTable(costs.blocks[:2], head_retained_bytes=2)
    assert sim.unit_peaks[:2] == simulate(alone, actions[:2]).unit_peaks
    one_chain = CostTable(costs.blocks, stem_bytes=7, head_bytes=30, head_retained_bytes=2)
    assert sim.peak_bytes > simulate(one_chain, actions).peak_bytes  # the 11 bytes count once the decoder runs


def test_a_group_across_two_chains_is_refused() -> None:
    costs = _two_chains()
    with pytest.raises(ValueError, match=r"from 'encoder.block.1' to 'decoder.block.0', across two chains"):
        simulate(costs, ["keep", "segment:0", "segment:0", "keep", "keep"])
    simulate(costs, ["segment:0", "segment:0", "segment:1", "segment:1", "keep"])  # one group per chain


def test_a_table_of_several_chains_checks_its_shape_and_round_trips() -> None:
    costs = _two_chains()
    assert [list(c) for c in costs.chains] == [[0, 1], [2, 3, 4]]
    assert CostTable.from_json(costs.to_json()) == costs
    with pytest.raises(ValueError, match="sum to the 5 blocks"):
        CostTable(costs.blocks, chain_lengths=[2, 2], between_bytes=[0])
    with pytest.raises(ValueError, match="one per pair of consecutive chains"):
        CostTable(costs.blocks, chain_lengths=[2, 3])


@pytest.mark.parametrize("strategy", ["every_k", "sqrt", "memory_poor", "full", "none", "random"])
def test_static_planners_group_each_chain_on_its_own(strategy: str) -> None:
    costs = _two_chains()
    plan = remat.plan(costs, strategy, strict=False, **({"k": 2} if strategy == "every_k" else {}))
    sim = simulate(costs, plan.actions)  # raises if a group spans the chains
    assert plan.predicted_peak_bytes == sim.peak_bytes and plan.options["chains"] == [2, 3]
    if strategy == "every_k":
        assert list(plan.actions.values()) == ["segment:0", "segment:0", "segment:1", "segment:1", "checkpoint"]
    if strategy == "memory_poor":
        assert list(plan.actions.values()) == ["memory_poor:0", "keep", "memory_poor:1", "memory_poor:1", "keep"]


def _every_joint_plan(costs: CostTable, singles: list[str], groups: tuple[str, ...]):
    """Every plan of ``costs`` whose groups lie inside one chain, group ids numbered across the plan."""

    def runs(chain: list[int]):  # each block chooses among the singles it has costs for
        return lambda i: [a for a in singles if a in costs.blocks[chain[i]].actions]

    per_chain = [list(every_plan(len(chain), runs(chain), groups)) for chain in costs.chains]
    for parts in itertools.product(*per_chain):
        actions, offset = [], 0
        for part in parts:
            ids = sorted({a for a in part if ":" in a and a.split(":")[0] in groups}, key=part.index)
            rename = {a: f"{a.split(':')[0]}:{offset + k}" for k, a in enumerate(ids)}
            actions += [rename.get(a, a) for a in part]
            offset += len(ids)
        yield actions


@st.composite
def joint_tables(draw: st.DrawFn) -> CostTable:
    """A random table of two or three chains: random rows, split at random, random bytes between chains."""
    table = draw(cost_tables(max_blocks=7))
    n = len(table)
    if n < 2:
        table = CostTable(table.blocks * 2, table.stem_bytes, table.head_bytes, table.head_retained_bytes,
                          table.held_args_bytes)  # fmt: skip
        n = 2
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=1, max_size=min(2, n - 1))))
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    blocks = [BlockCost(**{**vars(b), "fqn": f"chain.{i}"}) for i, b in enumerate(table.blocks)]
    between = [draw(st.integers(0, 25)) for _ in lengths[1:]]
    return CostTable(blocks, table.stem_bytes, table.head_bytes, table.head_retained_bytes, table.held_args_bytes,
                     chain_lengths=lengths, between_bytes=between, outputs_kept=table.outputs_kept)  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(joint_tables(), st.randoms(use_true_random=False))
def test_optimal_over_several_chains_matches_brute_force(costs: CostTable, rng: random.Random) -> None:
    singles = costs.plannable_actions()
    sims = [simulate(costs, a) for a in _every_joint_plan(costs, singles, ("segment", "memory_poor"))]
    assert min_peak_bytes(costs) == min(s.peak_bytes for s in sims)
    least = min(s.peak_bytes for s in sims)
    peaks = sorted({s.peak_bytes for s in sims})
    for budget in sorted({least - 1, least, peaks[-1], rng.choice(peaks)}):
        check_against(costs, sims, budget)


def test_the_optimal_plan_checkpoints_both_chains_when_the_budget_needs_it() -> None:
    costs = _two_chains()
    keep_all = simulate(costs, ["keep"] * 5).peak_bytes
    plan = remat.plan(costs, "optimal", budget=min_peak_bytes(costs))
    assert plan.fits and plan.options["exact"] and plan.options["chains"] == [2, 3]
    encoder, decoder = list(plan.actions.values())[:2], list(plan.actions.values())[2:]
    assert any(a != "keep" for a in encoder) and any(a != "keep" for a in decoder)
    assert plan.predicted_peak_bytes < keep_all
    with pytest.raises(BudgetError):
        remat.plan(costs, "optimal", budget=min_peak_bytes(costs) - 1)
    again = Plan.from_json(plan.to_json(), costs.fqns)
    assert again.options["chains"] == [2, 3] and again.actions == plan.actions
