"""torchtitan's activation-checkpointing mode for remat: :class:`RematAC`, and :func:`remat_ac` that names it.

torchtitan builds its model on the ``meta`` device and hands it to ``parallelize_fn``, which applies the
activation-checkpointing mode (``ac_config.build(...).apply(model)``), then its per-block ``torch.compile``, then
``fully_shard``; weights exist only afterwards. So the plan is made without a real step, from one of three sources,
first given first used:

1. ``plan``: a saved plan (``Plan.to_json``), applied as it is;
2. ``costs``: a saved cost table (``CostTable.to_json``, from ``remat.profile`` of this model at this batch on the
   training device), planned under the budget;
3. neither: the cost table estimated on the ``meta`` device (:func:`remat.profiling.meta_cost_table`) at the
   configured batch and sequence length, in the activations' dtype, attention counted as a fused kernel keeps it
   (flex and varlen attention estimated as SDPA's). Its bytes are exact; its times come from FLOPs.

The plan is installed with :func:`remat.apply` on ``model.layers`` (hooks, no wrapper module), so torchtitan's
``fully_shard`` of each block and its state-dict names are those of a model without checkpointing. The plan and
the cost table it was made from are written to the job's dump folder (``remat_plan.json``, ``remat_costs.json``):
a restarted job can name the plan, and its figures are there to read.

Under torchtitan's ``compile`` (each block compiled after this mode applies, ``fullgraph=True``), hooks around a
compiled block would break its graph, so the plan goes inside instead (``compiled=True``, which :func:`remat_ac`
sets from the trainer's config): each block the plan recomputes runs its forward through :func:`remat.checkpoint`
with its policy, the region torch's compiler recomputes in the compiled backward, as torchtitan's own ``FullAC`` and
``SelectiveAC`` make theirs. The block's ``forward`` is replaced on the instance, not wrapped in another module, so
the module tree, its state-dict names and the order in which torchtitan initialises the weights stay those of a
model without checkpointing (a wrapper module would change that order, and with it the initial weights). Only
whole-block actions go there (keep, checkpoint, a per-operator policy); the plan is made among them.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing

from ..checkpointing import checkpoint
from ..core import CHECKPOINT, KEEP, SELECTIVE, Action, CostTable, StepSpec
from ..meters import is_compiled
from ..planning import Plan, make_plan
from ..profiling import meta_cost_table
from ..runtime import HandleHook, RematHandle, apply

__all__ = ["RematAC", "remat_ac"]

LAYERS = "layers"
PLAN_FILE = "remat_plan.json"
COSTS_FILE = "remat_costs.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

logger = logging.getLogger(__name__)


def _estimate_loss(labels: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(logits: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    return loss


class RematAC(ActivationCheckpointing):
    """remat's plan for ``model.layers`` as a torchtitan activation-checkpointing mode.

    ``Trainer.Config(activation_checkpoint=RematAC.Config(activations=0.5, batch_size=8, seq_len=2048))``, or
    :func:`remat_ac` which reads the batch and sequence length from the trainer's config. After an eager ``apply``,
    ``mode.handle`` is the :class:`~remat.runtime.handle.RematHandle` (``plan``, ``stats``, ``remove()``), and the
    model's ``_remat_handle`` too; under ``compiled=True`` the plan lives in the blocks' forwards and ``handle`` is
    None. ``mode.costs`` is the table the plan was made from (None for a saved plan).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config):
        activations: str = "0.5"
        """The activation budget: bytes (``"6GiB"``) or a fraction (``"0.5"``) of the no-checkpoint activations of
        one micro-batch. torchtitan shards and compiles after this mode runs, so the device's whole-step memory
        cannot be measured here: ``remat.fit`` does that where the model exists before training. Sharded over
        several ranks, ``fully_shard``'s all-gathered parameters of the block running come on top."""

        strategy: str = "optimal"
        """Any of ``remat.STRATEGIES`` that plans from a cost table."""

        plan: str = ""
        """A saved plan (JSON) to apply as it is; the budget and the cost sources are then not used."""

        costs: str = ""
        """A saved cost table (JSON) measured at this batch on the training device, planned under the budget."""

        batch_size: int = 0
        """Rows of one micro-batch, for the ``meta`` estimate (``remat_ac`` sets it)."""

        seq_len: int = 0
        """Tokens per row, for the ``meta`` estimate (``remat_ac`` sets it)."""

        dtype: str = "bfloat16"
        """The activations' dtype, for the ``meta`` estimate: torchtitan's ``training.mixed_precision_param``, which
        ``fully_shard`` computes in (``remat_ac`` sets it)."""

        device_flops: str = "h100-bf16"
        """The device preset or FLOP/s the ``meta`` estimate's times are computed for."""

        compiled: bool = False
        """Whether torchtitan compiles the blocks (``compile.enable`` with ``"model"``): the plan then runs as
        checkpoint regions inside them (``remat_ac`` sets it)."""

    def __init__(self, config: RematAC.Config, dump_folder: str = "") -> None:
        super().__init__(config, dump_folder)
        self.handle: RematHandle | None = None
        self.costs: CostTable | None = None

    def apply(self, model: nn.Module) -> None:
        config: RematAC.Config = self.config  # type: ignore[assignment]
        plan = self._plan(model, config)
        if config.compiled:
            _checkpoint_forwards(model, plan)
        else:
            self.handle = apply(model, plan, blocks=_layers(model))
            _refuse_compiled_blocks_once(model)
        self._save(plan)
        logger.info("remat plan applied to %s:\n%s", LAYERS, plan.table(self.costs))

    def _plan(self, model: nn.Module, config: RematAC.Config) -> Plan:
        if config.plan:
            with open(config.plan) as f:
                return Plan.from_json(f.read())
        if config.costs:
            with open(config.costs) as f:
                self.costs = CostTable.from_json(f.read())
        else:
            self.costs = self._estimate(model, config)
        options = {}
        if config.compiled and config.strategy == "optimal":
            options["actions"] = _whole_block_actions(self.costs)
        return make_plan(self.costs, config.strategy, config.activations, **options)  # bytes, "6GiB", "0.5", "50%"

    def _estimate(self, model: nn.Module, config: RematAC.Config) -> CostTable:
        if config.batch_size <= 0 or config.seq_len <= 0:
            raise ValueError(
                "RematAC estimates its plan on the meta device at the configured batch: give batch_size and seq_len "
                "(remat.integrations.torchtitan.remat_ac(config) sets them from config.training), or a saved "
                "plan= or costs="
            )
        if config.dtype not in _DTYPES:
            raise ValueError(f"dtype {config.dtype!r} is not one of {sorted(_DTYPES)}")
        if any(p.device.type != "meta" for p in model.parameters()):
            raise ValueError(
                "RematAC's estimate runs on the meta device, where torchtitan builds the model; this model has real "
                "weights: measure it with remat.profile(model, batch, blocks=['layers.0', ...]) and pass the table as "
                "costs="
            )
        # A copy in the activations' dtype (free on meta): the model torchtitan shards keeps its own dtype.
        estimated = copy.deepcopy(model).to(_DTYPES[config.dtype])
        _sdpa_for_masked_attention(estimated)
        rows, positions = config.batch_size, config.seq_len
        embedding = getattr(estimated, "tok_embeddings", None)
        if isinstance(embedding, nn.Embedding):
            first = torch.randint(0, embedding.num_embeddings, (rows, positions), device="meta")
        elif embedding is None:  # a pipeline stage after the first: it takes the hidden states
            first = torch.empty(rows, positions, _width(estimated), dtype=_DTYPES[config.dtype], device="meta")
            first.requires_grad_()
        else:
            raise ValueError(
                "RematAC's estimate feeds tokens to model.tok_embeddings, an nn.Embedding, or hidden "
                f"states to a pipeline stage without one; this model's is {type(embedding).__name__}"
            )
        head = getattr(estimated, "lm_head", None)
        if head is not None and not getattr(estimated, "_skip_lm_head", False):
            labels = torch.randint(0, head.out_features, (rows, positions), device="meta")
            loss = _estimate_loss(labels)
        else:  # a stage before the last: the next stage's gradient arrives for its output
            loss = _stage_loss
        # torchtitan's step drops the logits before the backward (`del pred`): so does the estimated one.
        step = StepSpec(blocks=_layers(estimated), loss_fn=loss, holds_output=False)
        return meta_cost_table(estimated, (first,), step=step, device_flops=_flops(config), fused_attention=True)

    def _save(self, plan: Plan) -> None:
        if not self.dump_folder:
            return
        os.makedirs(self.dump_folder, exist_ok=True)
        with open(os.path.join(self.dump_folder, PLAN_FILE), "w") as f:
            f.write(plan.to_json())
        if self.costs is not None:
            with open(os.path.join(self.dump_folder, COSTS_FILE), "w") as f:
                f.write(self.costs.to_json())


def _layers(model: nn.Module) -> list[str]:
    layers = getattr(model, LAYERS, None)
    if not isinstance(layers, nn.Module) or not len(list(layers.children())):
        raise ValueError("RematAC plans model.layers, torchtitan's transformer blocks; this model has none")
    return [f"{LAYERS}.{name}" for name, _ in layers.named_children()]


def _sdpa_for_masked_attention(model: nn.Module) -> None:
    """Flex and varlen attention take the masks torchtitan's trainer builds from the batch's documents, which the
    estimate's batch of one document does not have: SDPA, causal, stands in for them in the estimated copy. All three
    are fused kernels that keep the output and one log-sum-exp per row for the backward, which is what the estimate
    counts (``meta_cost_table(fused_attention=True)``)."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention

    for name, module in list(model.named_modules()):
        if isinstance(module, FlexAttention | VarlenAttention):
            parent, _, child = name.rpartition(".")
            stand_in = ScaledDotProductAttention(ScaledDotProductAttention.Config())
            model.get_submodule(parent).register_module(child, stand_in)


def _refuse_compiled_blocks_once(model: nn.Module) -> None:
    """At the first forward: blocks torchtitan compiled after this mode applied hooks around them would break
    their ``fullgraph`` compilation at remat's hooks; say what to set instead of the compiler's error."""

    def check(module: nn.Module, args: Any) -> None:
        compiled = [name for name, block in module.get_submodule(LAYERS).named_children() if is_compiled(block)]
        if compiled:
            raise RuntimeError(
                f"RematAC's plan runs around the blocks, and torchtitan compiled them ({LAYERS}.{compiled[0]}, ...): "
                "give RematAC.Config(compiled=True) (remat_ac(config) sets it from config.compile), so that the plan "
                "runs inside the compiled blocks"
            )
        hook.remove()

    hook = model.register_forward_pre_hook(HandleHook(check))


def _whole_block(action: str) -> bool:
    """Whether ``action`` runs inside a compiled block: keep, checkpoint or a per-operator policy."""
    return action in (KEEP, CHECKPOINT) or Action.parse(action).kind == SELECTIVE


def _whole_block_actions(costs: CostTable) -> list[str]:
    return [a for a in costs.plannable_actions() if _whole_block(a)]


def _checkpoint_forwards(model: nn.Module, plan: Plan) -> None:
    """Each block ``plan`` recomputes runs its forward through :func:`remat.checkpoint` with its policy."""
    for fqn, action in plan.actions.items():
        if action == KEEP:
            continue
        if not _whole_block(action):
            raise ValueError(
                f"{fqn}: {action!r} cannot run inside torchtitan's compiled blocks, which take whole-block actions "
                "only (keep, checkpoint, selective:<policy>); plan with strategy 'optimal', which chooses among them"
            )
        block = model.get_submodule(fqn)
        parsed = Action.parse(action)
        block.forward = _checkpointed(block.forward, parsed.arg if parsed.kind == SELECTIVE else None)


def _checkpointed(forward: Any, policy: str | None) -> Any:
    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, policy=policy, **kwargs)

    return checkpointed_forward


def _flops(config: RematAC.Config) -> float | str:
    try:
        return float(config.device_flops)
    except ValueError:
        return config.device_flops


def _width(model: nn.Module) -> int:
    """The hidden width a stage's first block takes: the input features of its first linear layer."""
    first = next(iter(model.get_submodule(LAYERS).children()))
    for module in first.modules():
        if isinstance(module, nn.Linear):
            return module.in_features
    raise ValueError(
        "RematAC's estimate of a pipeline stage reads the hidden width from its first block's first "
        "linear layer; this block has none: pass a saved plan= or costs="
    )


def _stage_loss(output: torch.Tensor) -> torch.Tensor:
    return output.sum()


def remat_ac(trainer_config: Any, activations: str | float = 0.5, **options: Any) -> RematAC.Config:
    """The :class:`RematAC` mode for ``trainer_config`` (torchtitan's ``Trainer.Config``): its estimate at the
    trainer's micro-batch, sequence length and parameter dtype, its plan inside the blocks where torchtitan compiles
    them. ``options`` are the other fields of ``RematAC.Config`` (``strategy``, ``plan``, ``costs``,
    ``device_flops``). In a config function: ``config.activation_checkpoint = remat_ac(config, 0.5)``."""
    training, parallelism, compile_config = trainer_config.training, trainer_config.parallelism, trainer_config.compile
    rows = training.local_batch_size
    if parallelism.pipeline_parallel_degree > 1:
        rows = parallelism.pipeline_parallel_microbatch_size
    return RematAC.Config(
        activations=str(activations),
        batch_size=rows,
        seq_len=training.seq_len,
        dtype=training.mixed_precision_param,
        compiled=bool(compile_config.enable and "model" in compile_config.components),
        **options,
    )
