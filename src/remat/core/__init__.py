"""The shared vocabulary every stage speaks: actions, cost tables, sizes and budgets, the autocast setting and
the description of a training step.

* :mod:`.actions`: the action grammar, owned here alone: :class:`Action` (parse, write, kind, what it stores,
  whether it is exact, whether it allows a second backward), the units a chain's actions group into, the
  old memory-poor spelling.
* :mod:`.costs`: :class:`CostTable` and :class:`BlockCost`, plain data: what each block costs in seconds and
  bytes under each action.
* :mod:`.shape_costs`: :class:`ShapeCosts`, a table for any batch size and sequence length from three measured
  shapes (invariant 1 there).
* :mod:`.sizes`: byte sizes and budgets at the edges of the library, and :class:`BudgetError`.
* :mod:`.precision`: the autocast setting a step runs under.
* :mod:`.step`: :class:`StepSpec`, how a training step of a model runs, and the batch type.

Nothing here imports another folder of remat. Rules: the action grammar's rules 1-3 (:mod:`.actions`).
"""

from __future__ import annotations

from .actions import (
    CHECKPOINT,
    COMPRESS,
    COMPRESS_FORMATS,
    COMPRESS_POLICIES,
    DEFAULT_COMPRESS_POLICY,
    GROUP_KINDS,
    INPUT_COMPRESS,
    KEEP,
    LOSSY_KINDS,
    MEMORY_POOR,
    OFFLOAD,
    PARTITION,
    RECOMPUTE_COMPRESS,
    SEGMENT,
    SELECTIVE,
    SINGLE,
    Action,
    Unit,
    compress_action_of,
    current_action,
    is_legacy,
    kind_of,
    lossy_actions,
    regroup,
    units_from_actions,
    validate_action,
    warn_legacy,
)
from .costs import (
    LAYER_DROP_GROUPS,
    BlockCost,
    CostTable,
    plan_choices,
    profile_summary,
    reads_own_peaks,
    temp_terms,
)
from .precision import (
    AutocastArg,
    AutocastSpec,
    active_device_types,
    autocast_off,
    autocast_spec,
    casts_uncached,
    dtype_name,
    parse_dtype,
    precision_mismatch,
    recorded_spec,
    step_autocast,
)
from .shape_costs import ShapeCosts, shape_of
from .sizes import BudgetError, format_bytes, normalize_budget, parse_budget, parse_bytes
from .step import Batch, BlocksArg, InputName, OutputName, StepSpec

__all__ = [
    "ShapeCosts",
    "shape_of",
    "CHECKPOINT",
    "COMPRESS",
    "COMPRESS_FORMATS",
    "COMPRESS_POLICIES",
    "DEFAULT_COMPRESS_POLICY",
    "GROUP_KINDS",
    "INPUT_COMPRESS",
    "KEEP",
    "LOSSY_KINDS",
    "MEMORY_POOR",
    "OFFLOAD",
    "PARTITION",
    "RECOMPUTE_COMPRESS",
    "SEGMENT",
    "SELECTIVE",
    "SINGLE",
    "Action",
    "AutocastArg",
    "AutocastSpec",
    "Batch",
    "BlockCost",
    "LAYER_DROP_GROUPS",
    "BlocksArg",
    "BudgetError",
    "CostTable",
    "InputName",
    "OutputName",
    "StepSpec",
    "Unit",
    "active_device_types",
    "autocast_off",
    "autocast_spec",
    "casts_uncached",
    "compress_action_of",
    "current_action",
    "dtype_name",
    "format_bytes",
    "is_legacy",
    "kind_of",
    "lossy_actions",
    "normalize_budget",
    "parse_budget",
    "parse_bytes",
    "parse_dtype",
    "plan_choices",
    "precision_mismatch",
    "profile_summary",
    "reads_own_peaks",
    "temp_terms",
    "recorded_spec",
    "regroup",
    "step_autocast",
    "units_from_actions",
    "validate_action",
    "warn_legacy",
]
