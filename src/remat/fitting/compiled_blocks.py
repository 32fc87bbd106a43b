"""Compiling the blocks of a chain in place, and undoing it.

A plan on compiled blocks keeps remat's hooks in eager code around each block's compiled forward
(``docs/compile.md``): :func:`compile_blocks` calls ``block.compile()`` on each block of the chain (and, with
``partition_budgets``, compiles its partition variants, :mod:`remat.checkpointing.compiled_partitions`);
:func:`uncompile_blocks` makes each block run its eager forward again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..chains import find_blocks, resolve_blocks
from ..checkpointing import add_partitions, remove_partitions
from ..runtime import owner_of

__all__ = ["compile_blocks", "uncompile_blocks"]


def compile_blocks(
    model: nn.Module,
    blocks: Sequence[str] | Sequence[tuple[str, nn.Module]] | None = None,
    *,
    partition_budgets: Sequence[float] = (),
    **compile_options: Any,
) -> list[tuple[str, nn.Module]]:
    """``module.compile(**compile_options)`` on every block of the chain, in place; returns the chain.

    The chain is the one remat applied to ``model`` (if any), else ``blocks`` or :func:`remat.find_blocks`.
    Parameter names and ``state_dict`` keys do not change. ``partition_budgets`` (fractions in [0, 1)) compile
    each block once more per budget, partitioned by torch's min-cut partitioner under that activation memory
    budget: :func:`remat.profile` then measures the actions ``partition:<budget>`` too, and plans may give each
    block its own (:mod:`remat.checkpointing.compiled_partitions`). Each variant compiles on its first call.
    """
    handle = owner_of(model)
    if blocks is not None:
        chain = resolve_blocks(model, blocks)
    elif handle is not None:
        chain = list(handle.blocks)
    else:
        chain = find_blocks(model)
    for _, block in chain:
        block.compile(**compile_options)
        if partition_budgets:
            add_partitions(block, partition_budgets, **compile_options)
    return chain


def uncompile_blocks(chain: Sequence[tuple[str, nn.Module]]) -> None:
    """Each block of ``chain`` runs its eager forward again, as before :func:`compile_blocks` (its partition
    variants forgotten). Remove an applied plan first: a plan on partitions selects the variants it runs."""
    for _, block in chain:
        block._compiled_call_impl = None
        remove_partitions(block)
