"""Plan files: what :meth:`Plan.from_json` accepts, the errors for files that are not plans (each naming the
cause and the expected shape), and plans written with the old spelling of memory-poor groups."""

from __future__ import annotations

import json
import warnings

import pytest

import remat
from remat.core import BlockCost, CostTable
from remat.planning import Plan, optimal, simulate

FQNS = ["h.0", "h.1", "h.2"]
KEEP_ALL = dict.fromkeys(FQNS, "keep")
SHAPE_WORDS = ('{"actions": {"<block FQN>": "<action>"', "chain order")


def costs() -> CostTable:
    blocks = [
        BlockCost(
            fqn, 0.25, 0.5, 8, 8, {"keep": 40, "checkpoint": 9}, {"keep": 0.0, "checkpoint": 0.25},
            overhead_s={"checkpoint": 0.125},
        )
        for fqn in FQNS
    ]  # fmt: skip
    return CostTable(blocks, head_bytes=10, outside_s=1.0)


def plan_text(actions: object, **fields: object) -> str:
    return json.dumps({"strategy": "custom", **fields, "actions": actions})


def test_a_written_plan_reads_back_checked_against_its_chain() -> None:
    plan = remat.plan(costs(), "every_k", k=2)
    back = Plan.from_json(plan.to_json(), fqns=FQNS)
    assert back == plan and list(back.actions) == FQNS
    # Three blocks of 0.75 s and 1 s outside them; a segment of two and a checkpoint recompute all three (0.25 s
    # each) and each block adds its checkpoint overhead (0.125 s).
    assert list(plan.actions.values()) == ["segment:0", "segment:0", "checkpoint"]
    assert back.predicted_step_s == 3 * 0.75 + 1.0 + 3 * 0.25 + 3 * 0.125
    assert f"step {back.predicted_step_s * 1e3:.2f} ms" in back.table()
    older = json.loads(plan.to_json())
    del older["predicted_step_s"]  # files written before plans predicted step times
    assert Plan.from_json(json.dumps(older), fqns=FQNS).predicted_step_s is None
    assert Plan.from_json(plan_text({"h.0": "keep"})).actions == {"h.0": "keep"}  # no chain given: any blocks


@pytest.mark.parametrize(
    "text, cause",
    [
        ("{not json", "a plan file is JSON, and this is not"),
        (json.dumps([["h.0", "keep"]]), "a plan file holds a JSON object, not a list"),
        (json.dumps({"strategy": "full"}), "the plan file has no 'actions' key (it has ['strategy'])"),
        (
            json.dumps({"plan": {"actions": {"h.0": "keep"}}, "costs": {}}),
            "holds the plan under 'plan'",
        ),
        (plan_text(["keep", "keep", "keep"]), "the plan file's 'actions' is a list; it must be an object mapping"),
        (plan_text({"h.0": 1, "h.1": "keep", "h.2": "keep"}), "the action of block 'h.0' is a number, not a string"),
        (
            plan_text({"h.0": "keep", "h.1": "recompute", "h.2": "keep"}),
            "block 'h.1': unknown action 'recompute'; use 'keep', 'checkpoint'",
        ),
        (plan_text({"h.0": "keep", "h.1": "segment:", "h.2": "keep"}), "block 'h.1': unknown action 'segment:'"),
        (
            plan_text({"h.1": "keep", "h.0": "keep", "h.2": "keep"}),
            "plan lists the blocks of the chain reordered: position 0 holds 'h.1' where 'h.0' belongs",
        ),
        (
            plan_text({"h.0": "keep", "h.1": "keep"}),
            "plan does not match the chain (missing ['h.2'], unknown [])",
        ),
        (
            plan_text({"h.0": "keep", "h.1": "keep", "h.2": "keep", "h.9": "keep"}),
            "plan does not match the chain (missing [], unknown ['h.9'])",
        ),
        (plan_text(KEEP_ALL, options=[1]), "the plan file's 'options' is a list; it must be an object"),
        (plan_text(KEEP_ALL, budget_bytes="2GiB"), "the plan file's 'budget_bytes' is a string"),
        (plan_text(KEEP_ALL, predicted_step_s=True), "the plan file's 'predicted_step_s' is a boolean"),
        (plan_text(KEEP_ALL, strategy=3), "the plan file's 'strategy' is a number"),
    ],
    ids=[
        "not json", "not an object", "no actions", "cli output", "actions as a list", "action not a string",
        "unknown action", "empty group id", "blocks reordered", "block missing", "unknown block", "options",
        "budget", "step", "strategy",
    ],
)  # fmt: skip
def test_files_that_are_not_plans_name_the_cause_and_the_shape(text: str, cause: str) -> None:
    with pytest.raises(ValueError) as caught:
        Plan.from_json(text, fqns=FQNS)
    message = str(caught.value)
    assert cause in message
    assert all(words in message for words in SHAPE_WORDS), message


def test_simulate_names_reordered_and_missing_blocks() -> None:
    table = costs()
    with pytest.raises(ValueError, match="reordered: position 0 holds 'h.1' where 'h.0' belongs"):
        simulate(table, {"h.1": "keep", "h.0": "keep", "h.2": "keep"})
    with pytest.raises(ValueError, match=r"missing \['h.2'\]"):
        simulate(table, {"h.0": "keep", "h.1": "keep"})


def test_a_bad_action_in_a_plan_names_its_block() -> None:
    with pytest.raises(ValueError, match="block 'b': unknown action 'nested'"):
        Plan({"a": "keep", "b": "nested"})


def test_the_old_spelling_of_memory_poor_groups_is_read_and_converted() -> None:
    old = json.dumps({"strategy": "memory_poor", "actions": {"h.0": "nested:0", "h.1": "nested:0", "h.2": "keep"}})
    with pytest.warns(DeprecationWarning, match="'nested:<id>'.*read as 'memory_poor:<id>'"):
        plan = Plan.from_json(old, fqns=FQNS)
    assert list(plan.actions.values()) == ["memory_poor:0", "memory_poor:0", "keep"]
    assert plan.actions == remat.plan(costs(), "memory_poor").actions
    assert simulate(costs(), ["nested:0", "nested:0", "keep"]) == simulate(costs(), plan.actions)
    with pytest.warns(DeprecationWarning, match="group kind 'nested'"):
        restricted = optimal(costs(), 60, actions=["keep", "nested"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert restricted == optimal(costs(), 60, actions=["keep", "memory_poor"])
    assert "memory_poor:0" in restricted.actions.values()
