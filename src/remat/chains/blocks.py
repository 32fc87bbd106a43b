"""How a block of the chain is called: which argument is its main input, which tensor its main output, what a
re-run must leave out, and which chain a ``blocks=`` argument names.

The runtime, the profiler and the meta estimator all run blocks again outside the step that called them
(recomputation in backward, measurement in isolation). They agree here on what a call consists of:

* the **main input** is the hidden state flowing along the chain: the first positional tensor, else the
  ``hidden_states`` keyword, else the keyword named like the first parameter of the block's ``forward``, else
  the only keyword tensor (:meth:`BlockIO.input_slot`); a keyword-only call with several tensors and none of
  those names is ambiguous and refused. It is the one argument a recomputation replaces (the rest are kept as
  called, see :func:`replace_slot`);
* the **main output** is the output tensor itself, else the first tensor inside a tuple, list, dict or
  dataclass with the main input's shape, else the first tensor (:meth:`BlockIO.output`), so that a block
  returning ``(aux, hidden)`` passes ``hidden`` along;
* the user names them where the guess is wrong: ``main_input=`` (a keyword or a position) and
  ``main_output=`` (an index or a key of the output), one value for every block or a dict ``{fqn: value}``
  (:func:`block_ios`), accepted by :func:`remat.profile`, :func:`remat.apply`, :class:`remat.PGAC` and the
  integrations;
* key/value caches are dropped from a re-run's arguments (:func:`without_caches`);
* ``blocks=`` is ``None`` (the chain :func:`remat.find_blocks` finds), a list of FQNs, or ``(fqn, module)``
  pairs (:func:`resolve_blocks`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core import BlocksArg, InputName, OutputName
from .chain import find_blocks, model_chains

InputSlot = tuple[str, Any]
"""Where a call's main input sits: ``("arg", position)`` or ``("kw", keyword)``."""


HOW_TO_NAME = (
    "pass main_input=<keyword or position> and/or main_output=<index or key> to remat.profile, remat.apply, "
    "remat.PGAC or the integrations (hf.enable, distributed.prepare); a dict {fqn: value} names them per block"
)


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


@dataclass(frozen=True)
class BlockIO:
    """How one block of the chain is called: its FQN, the main input and output the user named (``None``:
    guessed), and the names of its ``forward``'s parameters (to match keywords with positions)."""

    fqn: str = "?"
    main_input: InputName = None
    main_output: OutputName = None
    params: tuple[str, ...] = ()

    @classmethod
    def of(cls, fqn: str, module: nn.Module, main_input: InputName = None, main_output: OutputName = None) -> BlockIO:
        try:
            signature = inspect.signature(module.forward)
        except (TypeError, ValueError):
            params: tuple[str, ...] = ()
        else:
            kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            params = tuple(n for n, p in signature.parameters.items() if p.kind in kinds)
        return cls(fqn, main_input, main_output, params)

    def input_slot(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> InputSlot:
        """Where this call's main input is: as named by the user, else guessed (see the module docs)."""
        if self.main_input is not None:
            return self._named_slot(args, kwargs)
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                return "arg", i
        if "hidden_states" in kwargs:
            return "kw", "hidden_states"
        tensors = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        if self.params and self.params[0] in tensors:
            return "kw", self.params[0]
        if len(tensors) == 1:
            return "kw", tensors[0]
        if not tensors:
            raise RuntimeError(
                f"block {self.fqn!r} was called without any tensor argument; remat cannot find its input"
            )
        raise ValueError(
            f"block {self.fqn!r} was called with keyword arguments only ({', '.join(tensors)}) and remat cannot "
            "tell which one is the hidden state passed from block to block; name it: " + HOW_TO_NAME
        )

    def input_tensor(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        """This call's main input tensor."""
        return slot_value(args, kwargs, self.input_slot(args, kwargs))

    def input_shape(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Size | None:
        """This call's main input shape; ``None`` where the block is not told which argument it is (a kept
        block need not say)."""
        try:
            return self.input_tensor(args, kwargs).shape
        except ValueError:
            return None

    def _named_slot(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> InputSlot:
        name = self.main_input
        position = self.params.index(name) if isinstance(name, str) and name in self.params else name
        slot: InputSlot | None = None
        if isinstance(name, str) and name in kwargs:
            slot = ("kw", name)
        elif isinstance(position, int) and 0 <= position < len(args):
            slot = ("arg", position)
        elif isinstance(position, int) and 0 <= position < len(self.params) and self.params[position] in kwargs:
            slot = ("kw", self.params[position])
        if slot is None or not isinstance(slot_value(args, kwargs, slot), torch.Tensor):
            raise ValueError(
                f"main_input={name!r} does not name a tensor argument of block {self.fqn!r}, called with "
                f"{len(args)} positional arguments and keywords {sorted(kwargs)}; name one of its tensor arguments"
            )
        return slot

    def output(self, value: Any, like: torch.Size | None = None) -> torch.Tensor | None:
        """The main output of this block in ``value`` (what it returned): the one the user named, else the
        first tensor shaped ``like`` (the main input's shape), else the first tensor."""
        if self.main_output is not None:
            return self._named_output(value)
        if isinstance(value, torch.Tensor) or like is None:
            return main_tensor(value)
        first: torch.Tensor | None = None
        for item in _items(value):
            found = main_tensor(item)
            if found is not None and found.shape == like:
                return found
            first = first if first is not None else found
        return first

    def _named_output(self, value: Any) -> torch.Tensor:
        key = self.main_output
        found: Any = None
        try:
            if isinstance(value, Mapping):
                found = value[key] if key in value else list(value.values())[key]  # type: ignore[index]
            elif isinstance(key, str):
                found = getattr(value, key)
            else:
                found = value[key]  # type: ignore[index]
        except (IndexError, KeyError, TypeError, AttributeError):
            found = None
        if not isinstance(found, torch.Tensor):
            raise ValueError(
                f"main_output={key!r} does not name a tensor in the output of block {self.fqn!r} "
                f"({type(value).__name__}); name the index or key of the hidden state it returns"
            )
        return found

    def output_positions(self, value: Any) -> list[tuple[Any, torch.Tensor]]:
        """The top-level tensors of ``value`` with their index or key (for diagnostics)."""
        if isinstance(value, torch.Tensor):
            return [(None, value)]
        keys: list[Any] = list(value.keys()) if isinstance(value, Mapping) else list(range(len(_items(value))))
        return [(k, t) for k, t in zip(keys, _items(value), strict=False) if isinstance(t, torch.Tensor)]


def _items(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        return list(value.values())
    if hasattr(value, "__dataclass_fields__"):
        return [getattr(value, f) for f in value.__dataclass_fields__]
    if isinstance(value, list | tuple):
        return list(value)
    return []


def block_ios(
    chain: Sequence[tuple[str, nn.Module]],
    main_input: InputName | Mapping[str, InputName] = None,
    main_output: OutputName | Mapping[str, OutputName] = None,
) -> list[BlockIO]:
    """The :class:`BlockIO` of each block of ``chain``; ``main_input``/``main_output`` are one value for every
    block or a dict ``{fqn: value}`` (blocks it leaves out are guessed)."""
    fqns = [f for f, _ in chain]
    for given, what in ((main_input, "main_input"), (main_output, "main_output")):
        if isinstance(given, Mapping) and set(given) - set(fqns):
            raise ValueError(
                f"{what} names blocks not in the chain: {sorted(set(given) - set(fqns))}; the chain is {fqns}"
            )

    def pick(given: Any, fqn: str) -> Any:
        return given.get(fqn) if isinstance(given, Mapping) else given

    return [BlockIO.of(f, m, pick(main_input, f), pick(main_output, f)) for f, m in chain]


def main_input_slot(args: tuple[Any, ...], kwargs: dict[str, Any]) -> InputSlot:
    """Where the main input of a call of a block remat knows nothing else about is (:meth:`BlockIO.input_slot`)."""
    return BlockIO().input_slot(args, kwargs)


def slot_value(args: tuple[Any, ...], kwargs: dict[str, Any], slot: InputSlot) -> Any:
    """The argument at ``slot``."""
    return args[slot[1]] if slot[0] == "arg" else kwargs[slot[1]]


def main_input(args: tuple[Any, ...], kwargs: dict[str, Any], io: BlockIO | None = None) -> torch.Tensor:
    """The main input tensor of a block call (see :meth:`BlockIO.input_slot`)."""
    return slot_value(args, kwargs, (io or BlockIO()).input_slot(args, kwargs))


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
    if blocks is None:
        return model_chains(model)
    chains = [resolve_blocks(model, c) for c in blocks] if several_chains(blocks) else [resolve_blocks(model, blocks)]
    seen: set[str] = set()
    for chain in chains:
        twice = [fqn for fqn, _ in chain if fqn in seen]
        if twice:
            raise ValueError(f"blocks {twice} are in two of the chains given; give each block in one chain only")
        seen.update(fqn for fqn, _ in chain)
    return chains


def profiled_blocks(model: nn.Module, blocks: Any) -> Any:
    """What a profiler of the chains ``blocks`` names is given: the list of chains where there are several (they
    are profiled, and planned, together), else the one chain."""
    chains = resolve_chains(model, blocks)
    return chains if len(chains) > 1 else chains[0]


def resolve_blocks(model: nn.Module, blocks: BlocksArg) -> list[tuple[str, nn.Module]]:
    """The chain a ``blocks=`` argument names: ``None`` for every chain of the model
    (:func:`~remat.chains.chain.model_chains`, joined), a list of FQNs, or ``(fqn, module)`` pairs taken as given.
    Several chains (a list of chains) are joined one after the other, in the order given."""
    if blocks is None:
        return [pair for chain in model_chains(model) for pair in chain]
    if isinstance(blocks, str):
        raise TypeError(
            f"blocks={blocks!r} is one string; give a list of block names, e.g. blocks=[{blocks + '.0'!r}, ...], or "
            "(fqn, module) pairs"
        )
    if several_chains(blocks):
        return [pair for chain in resolve_chains(model, blocks) for pair in chain]
    blocks = list(blocks)
    if blocks and isinstance(blocks[0], str):
        return find_blocks(model, names=blocks)  # type: ignore[arg-type]
    return [(str(f), m) for f, m in blocks]  # type: ignore[misc]
