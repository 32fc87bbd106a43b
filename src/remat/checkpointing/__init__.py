"""The mechanism: what happens to a block's activations. The checkpoint API (function, decorator, module
wrapper, drop-in ``checkpoint_fn``), the per-operator policies and their menu, per-block save sets by knapsack,
RNG replay, host copies, compression codecs and the regions module hooks open and close; compiled blocks'
partition variants.

* :mod:`.api`: :func:`checkpoint`, :class:`Checkpoint`, :func:`checkpointed`, :func:`checkpoint_fn`;
* :mod:`.policies` (``remat.policies``) with :mod:`.op_kinds`, :mod:`.replayed_draws` and :mod:`.host_copies`;
  :mod:`.knapsack`: a block's save set chosen from its own operators;
* :mod:`.offload_streams`: the ``offload`` action's copies on side streams, bounded (invariants 1-2 there);
* :mod:`.rng`: RNG snapshots replayed in recomputation, extra streams (Megatron's, DeepSpeed's trackers) included;
  :mod:`.regions`: checkpoint frames opened by hooks;
* :mod:`.compression`, :mod:`.input_compression`, :mod:`.recompute_compression`: the lossy actions' storage;
* :mod:`.compiled_partitions`: ``partition:<budget>`` variants of compiled blocks (invariants 1-3 there).
"""

from __future__ import annotations

from . import compiled_partitions, knapsack, policies
from .api import Checkpoint, PolicyLike, checkpoint, checkpoint_fn, checkpointed
from .compiled_partitions import (
    RandomDraws,
    add_partitions,
    budgeted_backend,
    partition_actions,
    remove_partitions,
    restore_partitions,
    saves_draws_under,
)
from .compression import compressed_saving
from .host_copies import saved_on_host
from .input_compression import open_block_frame, run_compressed_input
from .offload_streams import MAX_CALLS_IN_FLIGHT, CopyEngine, OffloadQueue, QueueStats, SameMemory
from .policies import PROFILED_BY_DEFAULT, SavedOutputChanged
from .recompute_compression import run_recompute_compressed, storing_context
from .regions import (
    CallRecord,
    OpenRegion,
    compiled_caller_check,
    eager,
    exception_propagating,
    handoff_error,
    in_place_error,
    missing_start_error,
    open_checkpoint_frame,
    output_refs,
    same_tensor,
)
from .rng import Forked, RngSnapshot, register_stream, unregister_stream

__all__ = [
    "register_stream",
    "unregister_stream",
    "MAX_CALLS_IN_FLIGHT",
    "CallRecord",
    "CopyEngine",
    "OffloadQueue",
    "QueueStats",
    "SameMemory",
    "Checkpoint",
    "Forked",
    "OpenRegion",
    "PROFILED_BY_DEFAULT",
    "PolicyLike",
    "RandomDraws",
    "RngSnapshot",
    "SavedOutputChanged",
    "add_partitions",
    "budgeted_backend",
    "checkpoint",
    "checkpoint_fn",
    "checkpointed",
    "compiled_caller_check",
    "compiled_partitions",
    "compressed_saving",
    "eager",
    "exception_propagating",
    "handoff_error",
    "in_place_error",
    "knapsack",
    "missing_start_error",
    "open_block_frame",
    "open_checkpoint_frame",
    "output_refs",
    "partition_actions",
    "policies",
    "remove_partitions",
    "restore_partitions",
    "run_compressed_input",
    "run_recompute_compressed",
    "same_tensor",
    "saved_on_host",
    "saves_draws_under",
    "storing_context",
]
