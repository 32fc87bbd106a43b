"""The ``remat`` command: ``bench``, ``plan``, ``profile``, ``estimate`` and ``advise`` (:mod:`.commands`), its
argument types and early checks (:mod:`.args`), and the per-stage tables of a model split across pipeline stages,
tensor-parallel and data-parallel ranks (:mod:`.parallel`). The top layer: it uses every stage and the
experiment harness, and nothing imports it.
"""

from __future__ import annotations

from .commands import build_parser, main, model_costs
from .parallel import layer_shape, stage_figures

__all__ = ["build_parser", "layer_shape", "main", "model_costs", "stage_figures"]
