"""What a plan file holds and how it is checked: the JSON shape :meth:`remat.Plan.to_json` writes, and the
errors a file that is not one gets, each naming what is wrong and the shape expected (:func:`plan_fields`).
Also whether a plan's blocks are those of a chain, in order (:func:`chain_mismatch`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..core import validate_action

PLAN_FILE_SHAPE = (
    '{"actions": {"<block FQN>": "<action>", ...}, "strategy": "<name>", "budget_bytes": <int or null>, '
    '"options": {...}} with every block of the chain in chain order (only "actions" is required)'
)
OPTIONAL_NUMBERS = {
    "budget_bytes": int,
    "predicted_peak_bytes": int,
    "predicted_recompute_s": (int, float),
    "predicted_step_s": (int, float),
}


def chain_mismatch(given: Sequence[str], expected: Sequence[str], chain_name: str) -> str | None:
    """Why a plan naming the blocks ``given`` (in its order) does not fit a chain of the blocks ``expected``, or
    None when it does."""
    given, expected = list(given), list(expected)
    if given == expected:
        return None
    missing = [f for f in expected if f not in given]
    unknown = [f for f in given if f not in expected]
    if missing or unknown:
        return (
            f"plan does not match {chain_name} (missing {missing}, unknown {unknown}); "
            "plans must name every block in chain order"
        )
    first = next(i for i, (g, e) in enumerate(zip(given, expected, strict=True)) if g != e)
    return (
        f"plan lists the blocks of {chain_name} reordered: position {first} holds {given[first]!r} where "
        f"{expected[first]!r} belongs; give the actions in chain order {expected}"
    )


def plan_fields(text: str, fqns: Sequence[str] | None = None) -> dict[str, Any]:
    """The fields of the plan file ``text`` as keyword arguments of :class:`remat.Plan`; with ``fqns`` (the
    chain's block FQNs in order) the plan must name exactly those blocks in that order. Raises ValueError
    naming what is wrong and the expected shape."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise _shape_error(f"a plan file is JSON, and this is not ({error})") from None
    if not isinstance(data, dict):
        raise _shape_error(f"a plan file holds a JSON object, not {_json_kind(data)}")
    if "actions" not in data:
        hint = ""
        if isinstance(data.get("plan"), dict) and "actions" in data["plan"]:
            hint = " (the output of `remat plan --json` holds the plan under 'plan': read that object)"
        raise _shape_error(f"the plan file has no 'actions' key (it has {sorted(data)}){hint}")
    actions = data["actions"]
    if not isinstance(actions, dict):
        raise _shape_error(
            f"the plan file's 'actions' is {_json_kind(actions)}; it must be an object mapping each block FQN to "
            "its action"
        )
    for fqn, action in actions.items():
        if not isinstance(action, str):
            raise _shape_error(f"the action of block {fqn!r} is {_json_kind(action)}, not a string like 'keep'")
        try:
            validate_action(action)
        except ValueError as error:
            raise _shape_error(f"block {fqn!r}: {error}") from None
    if fqns is not None:
        problem = chain_mismatch(list(actions), fqns, "the chain")
        if problem:
            raise _shape_error(problem)
    strategy = data.get("strategy", "custom")
    if not isinstance(strategy, str):
        raise _shape_error(f"the plan file's 'strategy' is {_json_kind(strategy)}; it must be a string or absent")
    options = data.get("options", {})
    if not isinstance(options, dict):
        raise _shape_error(f"the plan file's 'options' is {_json_kind(options)}; it must be an object or absent")
    numbers = {}
    for key, kind in OPTIONAL_NUMBERS.items():
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            raise _shape_error(f"the plan file's {key!r} is {_json_kind(value)}; it must be a number or null")
        numbers[key] = value
    return {"actions": dict(actions), "strategy": strategy, "options": options, **numbers}


def _shape_error(cause: str) -> ValueError:
    return ValueError(f"{cause}. A plan file looks like {PLAN_FILE_SHAPE}")


def _json_kind(value: Any) -> str:
    """How JSON names the type of ``value``, with an article."""
    if value is None:
        return "null"
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return kinds.get(type(value), type(value).__name__)


__all__ = ["PLAN_FILE_SHAPE", "chain_mismatch", "plan_fields"]
