"""PGAC's state for training checkpoints: plain Python values only, checked when loaded.

``PGAC.state_dict()`` holds numbers, strings, bools, None, lists, tuples and dicts with string keys, nothing
else (no tensors, numpy values or library objects such as ``torch.__version__``'s ``TorchVersion``), so a
checkpoint that holds it loads with ``torch.load(path)`` under its default ``weights_only=True``, and with
``json`` after turning tuples into lists.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

STATE_VERSION = 1
STATE_KEYS = ("fqns", "step", "ema", "tau", "gamma", "schedule", "costs", "budget", "actions")


def plain(value: Any, where: str = "state") -> Any:
    """``value`` rebuilt from plain Python types (subclasses of str, int and float become the base type).
    Raises TypeError naming the entry (``where``) that holds anything else."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where} has a key {key!r} of type {type(key).__name__}; keys must be strings")
            out[str(key)] = plain(item, f"{where}[{key!r}]")
        return out
    if isinstance(value, tuple):
        return tuple(plain(item, f"{where}[{i}]") for i, item in enumerate(value))
    if isinstance(value, Sequence):
        return [plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise TypeError(
        f"{where} holds a {type(value).__name__}, which a training checkpoint cannot hold as plain data; "
        "convert it to numbers, strings, lists or dicts"
    )


def check_state(state: Mapping[str, Any], fqns: Sequence[str]) -> None:
    """Raise ValueError unless ``state`` is a PGAC state of this version for the chain ``fqns``."""
    if not isinstance(state, Mapping):
        raise ValueError(f"a PGAC state is the dict PGAC.state_dict() returns, got {type(state).__name__}")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"this is not a PGAC state: it lacks {missing}; pass what PGAC.state_dict() returned")
    version = state.get("version", STATE_VERSION)
    if version != STATE_VERSION:
        raise ValueError(
            f"this PGAC state has version {version!r}, this remat reads version {STATE_VERSION}; save it again "
            "with the remat that loads it"
        )
    if list(state["fqns"]) != list(fqns):
        raise ValueError(
            f"this PGAC state is for the chain {list(state['fqns'])}, but the model's chain is {list(fqns)}; "
            "load it into a PGAC of the same model"
        )
