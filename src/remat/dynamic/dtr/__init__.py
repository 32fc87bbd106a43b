"""DTR, Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021) with stock PyTorch: every operator of a
step runs through a dispatch mode that keeps the tensor graph, evicts the tensor of least cost per byte and
staleness when the step's live bytes would pass the budget, and replays what an evicted tensor's record needs
when backward (or the forward) reads it again.

* :mod:`.controller`: :class:`DTR`, installed on a model, and its per-step statistics;
* :mod:`.runtime`: the dispatch mode and saved-tensor hooks of one step, and which operators may be replayed;
* :mod:`.graph`: cells, records and the eviction scores (:data:`HEURISTICS`); :mod:`.evict`: eviction under the
  budget; :mod:`.remat`: getting an evicted cell back; :mod:`.predict`: what an operator will allocate.
"""

from __future__ import annotations

from .controller import DTR, DTRStats
from .graph import HEURISTICS

__all__ = ["DTR", "HEURISTICS", "DTRStats"]
