"""Finding the chain of repeated blocks in a model: the units that plans act on.

A chain is the ordered list of ``(fqn, module)`` of the model's repeated layers: a Hugging Face layer list
(``transformer.h``, ``encoder.layer``, ``model.layers``...), an ``nn.Sequential`` or any ``nn.ModuleList``
whose children share one class. When several candidates exist the one with the most blocks wins (ties: the
first in module order). Users can name blocks explicitly instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def _candidate_lists(model: nn.Module) -> list[tuple[str, list[tuple[str, nn.Module]]]]:
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential):
            continue
        children = list(module.named_children())
        if len(children) < 2:
            continue
        classes = {type(child) for _, child in children}
        if len(classes) != 1:
            continue
        if all(sum(1 for _ in child.parameters()) == 0 for _, child in children):
            continue  # e.g. a Sequential of activations: nothing worth checkpointing
        prefix = f"{name}." if name else ""
        found.append((name, [(prefix + child_name, child) for child_name, child in children]))
    return found


def find_blocks(model: nn.Module, names: Sequence[str] | None = None) -> list[tuple[str, nn.Module]]:
    """Return the repeated blocks of ``model`` as ``(fully qualified name, module)`` pairs in order.

    ``names`` selects blocks explicitly by FQN (as in ``model.named_modules()``).
    """
    modules = dict(model.named_modules())
    if names is not None:
        missing = [n for n in names if n not in modules]
        if missing:
            sample = ", ".join(list(modules)[1:8])
            raise ValueError(f"no module named {missing} in the model; module names look like: {sample} ...")
        if not names:
            raise ValueError("names is empty: give the FQNs of the blocks to checkpoint")
        return [(n, modules[n]) for n in names]
    candidates = _candidate_lists(model)
    if not candidates:
        raise ValueError(
            f"no chain of repeated blocks found in {type(model).__name__}: it has no nn.ModuleList or "
            "nn.Sequential of two or more modules of one class. Name the blocks yourself, e.g. "
            "remat.find_blocks(model, names=['layer1', 'layer2']) or blocks=[...] in profile/apply."
        )
    best = max(candidates, key=lambda c: len(c[1]))
    return best[1]
