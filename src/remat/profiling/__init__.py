"""From a model and a batch to a :class:`~remat.core.CostTable`: each block measured under each action on the real
device (bytes by the live-tensor tracker, seconds in interleaved rounds and then within whole steps), or
estimated on the ``meta`` device (:mod:`.estimate`).

* :mod:`.profiler`: :func:`profile` (``remat.profile``) and :class:`BlockProfiler`, the actions a block is
  profiled under, and the block times anchored to plain steps;
* one block aside from the step: :mod:`.block_run` (running it under an action), :mod:`.block_measure`,
  :mod:`.block_bytes`, :mod:`.block_timing` and :mod:`.action_times` (its bytes and seconds),
  :mod:`.block_signature` (blocks that cost the same, measured once), :mod:`.grad_error` (a lossy action's
  error);
* the step around the blocks: :mod:`.chain_bounds` (stem, head, held arguments), :mod:`.outside_time` (seconds
  outside the blocks), :mod:`.action_steps` (each action's time read within whole steps, which runs plans through
  :mod:`remat.runtime`: the reason this stage sits above it);
* :mod:`.shape_profile`: :func:`profile_shapes`, the costs at every input shape from three profiled ones;
  :func:`measure_beyond`, which measures them again before the forward of a batch beyond them;
* :mod:`.profile_cache`: :func:`cached_profile`, a machine's profiles kept on disk per model, batch shape and
  precision, so that a restarted run plans at once.
"""

from __future__ import annotations

from .block_run import GradsRestored, clear_grads, run_action, step_aside
from .block_timing import TimedCalls
from .estimate import (
    LayerShape,
    StageEstimate,
    estimate_stages,
    meta_cost_table,
    shard_costs,
    transformer_layer_activation_bytes,
)
from .profile_cache import cache_directory, cached_profile, keep_profile, profile_key
from .profiler import BlockProfiler, price_segments, profile
from .shape_profile import batch_at, batch_of_call, measure_beyond, profile_shapes

__all__ = [
    "batch_at",
    "batch_of_call",
    "measure_beyond",
    "profile_shapes",
    "cache_directory",
    "cached_profile",
    "keep_profile",
    "profile_key",
    "BlockProfiler",
    "TimedCalls",
    "GradsRestored",
    "step_aside",
    "LayerShape",
    "StageEstimate",
    "estimate_stages",
    "clear_grads",
    "meta_cost_table",
    "price_segments",
    "profile",
    "run_action",
    "shard_costs",
    "transformer_layer_activation_bytes",
]
