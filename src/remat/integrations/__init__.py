"""Integrations: remat plans and PGAC where training already happens.

Each submodule is imported on first use, so ``import remat`` never imports Hugging Face, Lightning or
DeepSpeed:

* :mod:`remat.integrations.front_door`: ``fit(model, "22GiB")``, ``remat.fit``: the one call, which picks the
  door below that the model needs and returns the same handle.
* :mod:`remat.integrations.compiled_session`: the handle of ``remat.fit(..., compile=True)``, the fastest route
  that fits, eager or compiled, set up on the model in place.
* :mod:`remat.integrations.hf`: ``enable(model, strategy, budget)`` for Hugging Face models whose layers are
  ``GradientCheckpointingLayer`` (GPT-2, BERT, Llama, ViT...); works with the ``Trainer``.
* :mod:`remat.integrations.distributed`: plans for DDP and FSDP2, applied before wrapping or sharding, the
  same plan on every rank; gradient helpers for tests.
* :mod:`remat.integrations.deepspeed`: remat's checkpoint function as DeepSpeed's ``activation_checkpoint_func``
  and in place of ``deepspeed.checkpointing.checkpoint``; ``remat.fit(engine, ...)`` measures through the engine.
* :mod:`remat.integrations.lightning`: ``RematCallback`` for Lightning's ``Trainer``.
* :mod:`remat.integrations.compile`: using plans and policies with ``torch.compile``.
* :mod:`remat.integrations.pipeline`: ``torch.distributed.pipelining`` stages cut from a chain, GPipe or 1F1B,
  a plan or a PGAC mask per stage under a per-stage budget that counts the micro-batches in flight.
* :mod:`remat.integrations.torchtitan`: ``RematAC``, torchtitan's activation-checkpointing mode, with its plan
  estimated on the ``meta`` model torchtitan builds (or read from a saved plan or cost table), eager or inside the
  blocks torchtitan compiles.
* :mod:`remat.integrations.session`: :class:`~remat.integrations.session.RematSession`, the object the
  integrations above return: a plan now, or every block checkpointed and profiled during the first training
  step and the plan from the second step on, or PGAC.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

_SUBMODULES = (
    "compile",
    "compiled_session",
    "deepspeed",
    "distributed",
    "front_door",
    "hf",
    "lightning",
    "pipeline",
    "session",
    "torchtitan",
)
# Names taken from a submodule, imported with it on first use.
_NAMES = {"fit": "front_door", "RematSession": "session", "Stage": "pipeline", "split_chain": "pipeline"}

__all__ = [*_SUBMODULES, *_NAMES]


def __getattr__(name: str) -> ModuleType | Any:
    if name in _SUBMODULES:
        value: Any = importlib.import_module(f"{__name__}.{name}")
    elif name in _NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}; integrations: {', '.join(_SUBMODULES)}")
    globals()[name] = value
    return value
