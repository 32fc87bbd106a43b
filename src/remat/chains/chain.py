"""Finding the chains of repeated blocks in a model: the units that plans act on.

A chain is the ordered list of ``(fqn, module)`` of one stack of repeated layers: a Hugging Face layer list
(``transformer.h``, ``encoder.layer``, ``model.layers``...), any ``nn.ModuleList`` or ``nn.ModuleDict`` (in its
order, as torchtitan keeps its layers) whose children share one class, hold parameters and are not lists
themselves (a list of lists of layers, as Funnel keeps them, gives the inner lists), and in an
``nn.Sequential`` each run of two or more consecutive children of one class (``nn.Sequential(stem, *blocks,
head)`` gives its blocks). Only outermost stacks count: a list inside a block of another stack (the experts of a
mixture-of-experts layer, the layers of a ResNet stage) is part of that block, not a chain of its own.

A model may have several chains: an encoder and a decoder, the text and vision towers of CLIP.
:func:`find_chains` returns all of them in module order, each on its own (towers are never merged into one
chain). :func:`find_blocks` returns one: the longest (on a tie, the first in module order), or the modules
the user names. With no blocks given, ``profile``, ``apply``, ``remat.fit`` and the integrations plan every
chain of the model together under one budget (:func:`model_chains`); ``blocks=find_chains(model)[i]`` plans one.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

Chain = list[tuple[str, nn.Module]]


def _candidate_lists(model: nn.Module) -> list[tuple[str, Chain]]:
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential | nn.ModuleDict):
            continue
        prefix = f"{name}." if name else ""
        for run in _runs_of_one_class(list(module.named_children()), whole=not isinstance(module, nn.Sequential)):
            found.append((name, [(prefix + child_name, child) for child_name, child in run]))
    return found


# Modules that only hold others and have no forward: a list of them (Funnel's blocks, each a list of layers) is
# no chain, since the model calls the layers inside, which are the chains.
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def _runs_of_one_class(children: list[tuple[str, nn.Module]], whole: bool) -> list[list[tuple[str, nn.Module]]]:
    """The maximal runs of two or more consecutive children of one class that hold parameters (a Sequential of
    activations has nothing worth checkpointing) and can be called (not lists of lists). ``whole``: only a run of
    every child counts. A Sequential runs its children one into the next, so its repeated blocks between a stem
    and a head are a chain; a ModuleList or ModuleDict of mixed classes says nothing of how the model calls them
    (the convolutions of a speech model's feature extractor after its first, differing one are not the layers to
    plan)."""
    runs: list[list[tuple[str, nn.Module]]] = []
    for child in children:
        if runs and type(runs[-1][-1][1]) is type(child[1]):
            runs[-1].append(child)
        else:
            runs.append([child])
    if whole and len(runs) > 1:
        return []
    return [
        run for run in runs
        if len(run) >= 2 and not isinstance(run[0][1], CONTAINERS) and any(_holds_parameters(c) for _, c in run)
    ]  # fmt: skip


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _outermost(candidates: list[tuple[str, Chain]]) -> list[tuple[str, Chain]]:
    """Drop the candidates that lie inside a block of another candidate (module order is kept)."""
    block_prefixes = [f"{fqn}." for _, chain in candidates for fqn, _ in chain]
    return [(name, chain) for name, chain in candidates if not any(name.startswith(p) for p in block_prefixes)]


def _no_chain_error(model: nn.Module) -> ValueError:
    shared = [
        f"{name}.{child_name}" if name else child_name
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList | nn.Sequential | nn.ModuleDict)
        for child_name, child in module.named_children()
        if len(module) == 1 and _holds_parameters(child)
    ]
    hint = (
        f" A single layer that the forward calls several times (shared weights, as in ALBERT) is a chain of its "
        f"calls, each planned on its own: blocks={shared[:1]!r}."
        if shared
        else ""
    )
    return ValueError(
        f"no chain of repeated blocks found in {type(model).__name__}: no nn.ModuleList or nn.ModuleDict in it "
        "holds two or more modules of one class only, and no nn.Sequential two consecutive ones. Name the blocks "
        "yourself, e.g. remat.find_blocks(model, names=['layer1', 'layer2']) or blocks=[...] in profile/apply." + hint
    )


def find_chains(model: nn.Module) -> list[Chain]:
    """Every outermost chain of repeated blocks in ``model``, in module order, each as ``(fqn, module)`` pairs.

    An encoder-decoder has two (encoder, decoder), CLIP two (text tower, vision tower); a decoder-only language
    model one. Raises ``ValueError`` when there is none.
    """
    chains = [chain for _, chain in _outermost(_candidate_lists(model))]
    if not chains:
        raise _no_chain_error(model)
    return chains


def chain_name(chain: Chain) -> str:
    """The module name of the container holding ``chain`` (``"model.layers"``), or ``""`` for the model itself."""
    first = chain[0][0]
    return first.rsplit(".", 1)[0] if "." in first else ""


def find_blocks(model: nn.Module, names: Sequence[str] | None = None) -> Chain:
    """Return one chain of ``model`` as ``(fully qualified name, module)`` pairs in order.

    Without ``names``: the longest chain of :func:`find_chains` (on a tie the first in module order; for all of
    them, or to choose another, use :func:`find_chains`). ``names`` selects blocks explicitly by FQN (as in
    ``model.named_modules()``), in the order given.
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
    return max(find_chains(model), key=len)


def model_chains(model: nn.Module) -> list[Chain]:
    """Every chain of ``model`` (what no ``blocks=`` argument means); a ``ValueError`` saying how to name blocks
    where it has none."""
    chains = find_chains(model)
    if not chains:
        raise ValueError(
            f"{type(model).__name__} has no chain of repeated blocks (a ModuleList, ModuleDict or a run of one "
            "class in a Sequential): name the blocks to plan with blocks=[<module names>]"
        )
    return chains
