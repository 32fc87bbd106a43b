"""The PyPI planner ``ckptplan`` as a contender, where it installs and runs.

It is looked for on the import path and then in a folder of its own (``pip install --target /tmp/ckptplan
ckptplan``, so that the shared environment is not touched; that folder is appended to ``sys.path``, so the
environment's own torch stays the one imported). Its pipeline is tried on the model's blocks as its README
writes it: ``declare_blocks`` -> ``profile_blocks`` -> ``plan_checkpoints`` at each budget. The result says how
far it got and, where it stopped, the error it gave; where it planned, each plan is measured as a contender
(``contenders.ckptplan_contender``). It plans on CUDA only: on a CPU it refuses its own profiles.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

DEFAULT_PATH = "/tmp/ckptplan"


def load_ckptplan(path: str | None) -> tuple[Any, str]:
    """The ``ckptplan`` module and where it came from, or ``(None, why not)``."""
    try:
        return importlib.import_module("ckptplan"), "the environment"
    except ImportError:
        pass
    if path and Path(path, "ckptplan").is_dir():
        if path not in sys.path:
            sys.path.append(path)
        try:
            return importlib.import_module("ckptplan"), path
        except ImportError as err:
            return None, f"installed in {path} but does not import: {err}"
    return None, (f"not installed (looked on the import path and in {path}); install it with "
                  f"`pip install --target {path or DEFAULT_PATH} ckptplan`")


def first_block_input(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """The hidden states entering the first block, and the keyword arguments the blocks need."""
    if hasattr(model, "transformer"):  # GPT-2
        t = model.transformer
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        return t.wte(ids) + t.wpe(positions), {}
    inner = model.model  # Llama: the rotary embeddings go to every layer
    hidden = inner.embed_tokens(ids)
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    return hidden, {"position_embeddings": inner.rotary_emb(hidden, positions)}


def try_ckptplan(model: nn.Module, blocks: list[nn.Module], ids: torch.Tensor, budgets: list[float],
                 path: str | None) -> dict[str, Any]:
    """Run ckptplan's pipeline on ``blocks``: one profile, a plan per budget (the fraction of activation bytes it
    may keep). ``status`` is "planned", with ``checkpointed`` (budget -> which blocks its plan checkpoints) for
    the plans to be measured like any contender, or "not run" with ``reason``."""
    module, source = load_ckptplan(path)
    if module is None:
        return {"status": "not run", "reason": source}
    version = getattr(module, "__version__", "?")
    stage = "declare_blocks"
    checkpointed: dict[str, list[bool]] = {}
    try:
        declared = module.declare_blocks(model, [(f"block{i}", b) for i, b in enumerate(blocks)])
        stage = "profile_blocks"
        with torch.no_grad():
            hidden, kwargs = first_block_input(model, ids)
        profiles = module.profile_blocks(declared, (hidden,), kwargs or None, device=ids.device.type,
                                         dtype=torch.float32, num_warmup=1, num_trials=2)
        stage = "plan_checkpoints"
        for budget in budgets:
            plan = module.plan_checkpoints(profiles, declared, target_kind="activation_saving_fraction",
                                           target_value=1.0 - budget, planner="dynamic_programming")
            checkpointed[f"{budget:g}"] = [bool(d.checkpointed) for d in plan.decisions]
    except Exception as err:  # any failure is the finding: report where and why
        message = " ".join(str(err).split())
        return {"status": "not run", "version": version, "source": source, "stage": stage,
                "reason": f"ckptplan {version} stops at {stage}: {type(err).__name__}: {message}"}
    return {"status": "planned", "version": version, "source": source, "checkpointed": checkpointed,
            "reason": f"ckptplan {version} planned at each budget (dynamic programming, the saving fraction 1 - "
                      "budget); its plans run as the rows 'ckptplan (PyPI) plan', blocks under torch.utils.checkpoint "
                      "as its CheckpointedSequential runs them"}
