"""Estimating costs without running the model for real: the transformer activation formula, a CostTable
computed on the ``meta`` device, and a FLOPs-based time model.

* :func:`transformer_layer_activation_bytes` (:mod:`.activation_formula`): bytes one transformer layer keeps
  for backward, from its shape alone (``s*b*h*(34 + 5*a*s/h)`` for 16-bit activations with dropout, and its
  variants).
* :func:`meta_cost_table` (:mod:`.meta`): the same :class:`~remat.core.costs.CostTable` fields :func:`remat.profile`
  measures, for any model, computed on the ``meta`` device: no memory is allocated and no arithmetic runs, so
  models far larger than this machine can be planned for. Bytes are exact (every storage an operator creates
  is followed until it dies); times are estimates from FLOPs and bytes moved.
* :func:`flops_time_model`, :func:`count_flops`, :data:`DEVICE_PRESETS` (:mod:`.time_model`): seconds from
  FLOPs (counted with ``torch.utils.flop_counter.FlopCounterMode``, which works on ``meta``) over a device
  throughput.
* :func:`estimate_stages`, :func:`shard_costs` (:mod:`.parallel`): activation memory and plans per pipeline stage
  for a model split across stages, tensor-parallel and data-parallel ranks, from one micro-batch's table.
"""

from __future__ import annotations

from .activation_formula import transformer_layer_activation_bytes
from .meta import meta_cost_table
from .parallel import LayerShape, StageEstimate, estimate_stages, shard_costs
from .time_model import DEVICE_PRESETS, DeviceThroughput, count_flops, device_throughput, flops_time_model

__all__ = [
    "DEVICE_PRESETS",
    "DeviceThroughput",
    "LayerShape",
    "StageEstimate",
    "count_flops",
    "device_throughput",
    "estimate_stages",
    "flops_time_model",
    "meta_cost_table",
    "shard_costs",
    "transformer_layer_activation_bytes",
]
