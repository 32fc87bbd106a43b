"""How a block of the chain is called: which argument is its main input, which tensor its main output, what a
re-run must leave out, and which chain a ``blocks=`` argument names.

The runtime, the profiler and the meta estimator all run blocks again outside the step that called them
(recomputation in backward, measurement in isolation). They agree here on what a call consists of:

* the **main input** is the hidden state flowing along the chain: the first positional tensor, else the
  ``hidden_states`` keyword, else the first keyword tensor (:func:`main_input_slot`). It is the one argument
  a recomputation replaces (the rest are kept as called, see :func:`replace_slot`);
* the **main output** is the output tensor itself or the first tensor inside a tuple, list, dict or dataclass
  (:func:`main_tensor`);
* key/value caches are dropped from a re-run's arguments (:func:`without_caches`);
* ``blocks=`` is ``None`` (the chain :func:`remat.find_blocks` finds), a list of FQNs, or ``(fqn, module)``
  pairs (:func:`resolve_blocks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .chain import find_blocks, only_chain

InputSlot = tuple[str, Any]
"""Where a call's main input sits: ``("arg", position)`` or ``("kw", keyword)``."""

BlocksArg = Sequence[str] | Sequence[tuple[str, nn.Module]] | Sequence[Sequence[Any]] | None


def main_tensor(value: Any) -> torch.Tensor | None:
    """The hidden-state tensor of a block's output: the tensor itself, or the first tensor inside it."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    elif hasattr(value, "__dataclass_fields__"):
        value = [getattr(value, f) for f in value.__dataclass_fields__]
    if isinstance(value, list | tuple):
        for item in value:
            found = main_tensor(item)
            if found is not None:
                return found
    return None


def without_caches(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A block's arguments with key/value caches (Hugging Face ``*Cache`` objects) replaced by ``None``.

    A block run again (recomputation, isolated measurement) must not append to the step's cache. In training
    the cache starts empty each forward, so a layer attends to exactly its current keys with or without it.
    """

    def drop(value: Any) -> Any:
        return None if type(value).__name__.endswith("Cache") else value

    return tuple(drop(v) for v in args), {k: drop(v) for k, v in kwargs.items()}


def main_input_slot(args: tuple[Any, ...], kwargs: dict[str, Any]) -> InputSlot:
    """Where the main input of a block call is: the first positional tensor, else ``hidden_states``, else the
    first keyword tensor. Raises if the call has no tensor argument at all."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return "arg", i
    if "hidden_states" in kwargs:
        return "kw", "hidden_states"
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            return "kw", k
    raise RuntimeError("a block was called without any tensor argument; remat cannot find its input")


def slot_value(args: tuple[Any, ...], kwargs: dict[str, Any], slot: InputSlot) -> Any:
    """The argument at ``slot``."""
    return args[slot[1]] if slot[0] == "arg" else kwargs[slot[1]]


def main_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The main input tensor of a block call (see :func:`main_input_slot`)."""
    return slot_value(args, kwargs, main_input_slot(args, kwargs))


def replace_slot(
    args: tuple[Any, ...], kwargs: dict[str, Any], slot: InputSlot, value: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """New ``(args, kwargs)`` with ``value`` at ``slot``; the originals are not changed."""
    if slot[0] == "arg":
        args = args[: slot[1]] + (value,) + args[slot[1] + 1 :]
    else:
        kwargs = {**kwargs, slot[1]: value}
    return args, kwargs


def several_chains(blocks: Any) -> bool:
    """Whether a ``blocks=`` argument names several chains (a list of chains, e.g. ``remat.find_chains(model)``)
    rather than one (a list of FQNs or of ``(fqn, module)`` pairs)."""
    if blocks is None or isinstance(blocks, str):
        return False
    blocks = list(blocks)
    if not blocks:
        return False
    first = blocks[0]
    return not isinstance(first, str) and not (
        isinstance(first, tuple) and len(first) == 2 and isinstance(first[0], str)
    )


def resolve_chains(model: nn.Module, blocks: Any) -> list[list[tuple[str, nn.Module]]]:
    """The chains a ``blocks=`` argument names: several when it is a list of chains (each as
    :func:`resolve_blocks` reads one), else the one chain :func:`resolve_blocks` reads. A block in two chains
    is refused."""
    chains = [resolve_blocks(model, c) for c in blocks] if several_chains(blocks) else [resolve_blocks(model, blocks)]
    seen: set[str] = set()
    for chain in chains:
        twice = [fqn for fqn, _ in chain if fqn in seen]
        if twice:
            raise ValueError(f"blocks {twice} are in two of the chains given; give each block in one chain only")
        seen.update(fqn for fqn, _ in chain)
    return chains


def resolve_blocks(model: nn.Module, blocks: BlocksArg) -> list[tuple[str, nn.Module]]:
    """The chain a ``blocks=`` argument names: ``None`` for the model's one chain (:func:`~remat.chain.only_chain`
    refuses a model with several and says how to choose), a list of FQNs, or ``(fqn, module)`` pairs taken as given.
    Several chains (a list of chains) are joined one after the other, in the order given."""
    if blocks is None:
        return only_chain(model)
    if several_chains(blocks):
        return [pair for chain in resolve_chains(model, blocks) for pair in chain]
    blocks = list(blocks)
    if blocks and isinstance(blocks[0], str):
        return find_blocks(model, names=blocks)  # type: ignore[arg-type]
    return [(str(f), m) for f, m in blocks]  # type: ignore[misc]
