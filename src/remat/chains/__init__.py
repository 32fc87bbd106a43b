"""The model's side of the step: the ordered chains of repeated layers plans act on, how a block is called and
re-run, how a training step of the model runs, and the model state a re-run must leave as a plain step would.

* :mod:`.chain`: :func:`find_chains` (every stack of repeated layers: Hugging Face layer lists, ``ModuleList`` stacks,
  ``nn.Sequential`` runs) and :func:`find_blocks` (one of them);
* :mod:`.blocks`: a block's main input and output, what a re-run leaves out, which chain a ``blocks=`` names;
* :mod:`.block_calls`: blocks a forward calls more than once, each call planned on its own (``<fqn>@<k>``);
* :mod:`.training_step`: one step of the model (forward, loss, backward) and its timing in interleaved rounds;
* :mod:`.model_state`: buffers and caches as a plain step leaves them (Note [1] there);
* :mod:`.hf_guards`: the Hugging Face settings a step checks (``use_cache``, its own checkpointing).
"""

from __future__ import annotations

from .block_calls import CallCounter, CallPositions, ProfiledCalls, names_calls, waiting_grad_bytes
from .blocks import (
    HOW_TO_NAME,
    BlockIO,
    InputSlot,
    block_ios,
    main_input_slot,
    main_tensor,
    profiled_blocks,
    replace_slot,
    resolve_blocks,
    resolve_chains,
    several_chains,
    slot_value,
    without_caches,
)
from .chain import chain_name, find_blocks, find_chains, model_chains
from .hf_guards import (
    cache_configs,
    drops_layers,
    every_layer_runs,
    layer_drop_settings,
    megatron_recomputes,
    profiled_step,
    recomputed_by,
    refuse_groups_under_layer_drop,
    refuse_hf_checkpointing,
    refuse_recomputed_blocks,
    training_forward_guards,
)
from .model_state import detached_from_step, extra_run
from .training_step import (
    batch_structure,
    default_loss,
    in_train_mode,
    interleaved_rounds,
    ratios_text,
    ratios_to_first,
    run_step,
    stepped_before,
    timed_step,
    warn_if_evaluating,
)

__all__ = [
    "BlockIO",
    "CallCounter",
    "CallPositions",
    "HOW_TO_NAME",
    "InputSlot",
    "ProfiledCalls",
    "block_ios",
    "cache_configs",
    "chain_name",
    "batch_structure",
    "default_loss",
    "detached_from_step",
    "extra_run",
    "find_blocks",
    "find_chains",
    "model_chains",
    "interleaved_rounds",
    "main_input_slot",
    "main_tensor",
    "names_calls",
    "drops_layers",
    "every_layer_runs",
    "layer_drop_settings",
    "profiled_step",
    "refuse_groups_under_layer_drop",
    "ratios_text",
    "ratios_to_first",
    "megatron_recomputes",
    "recomputed_by",
    "refuse_hf_checkpointing",
    "refuse_recomputed_blocks",
    "replace_slot",
    "resolve_blocks",
    "profiled_blocks",
    "resolve_chains",
    "run_step",
    "stepped_before",
    "several_chains",
    "slot_value",
    "timed_step",
    "training_forward_guards",
    "waiting_grad_bytes",
    "in_train_mode",
    "warn_if_evaluating",
    "without_caches",
]
