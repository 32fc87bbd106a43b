"""A CostTable computed on the ``meta`` device: the fields :func:`remat.profile` measures, without memory.

No memory is allocated and no arithmetic runs, so models far larger than this machine can be planned for. Bytes are
exact: the one live-bytes tracker (:class:`~remat.meters.memory.LiveTensorTracker`) follows every storage an operator
creates until it dies, on ``meta`` as on a real device, and the byte fields are derived as the profiler derives them
(:mod:`remat.profiling.block_bytes`, :mod:`remat.profiling.chain_bounds`). Times are estimates from FLOPs and bytes
written (:mod:`remat.profiling.estimate.time_model`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

from ...chains import (
    BlockIO,
    block_ios,
    drops_layers,
    every_layer_runs,
    refuse_recomputed_blocks,
    replace_slot,
    resolve_blocks,
    run_step,
    several_chains,
    slot_value,
    without_caches,
)
from ...checkpointing import policies as _policies
from ...core import (
    CHECKPOINT,
    KEEP,
    Action,
    AutocastSpec,
    Batch,
    BlockCost,
    BlocksArg,
    CostTable,
    InputName,
    OutputName,
    StepSpec,
    active_device_types,
)
from ...meters import LiveTensorTracker
from ...runtime import suspend_all
from ..block_bytes import ByteTerms, run_tracked
from ..block_run import GradsRestored, backward_releasing_output, clear_grads, run_action
from ..block_signature import renamed
from ..chain_bounds import ChainBounds
from .time_model import DeviceThroughput, device_throughput, flops_time_model


def _to_meta(batch: Batch) -> Batch:
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, batch)


def _stand_ins(value: Any) -> Any:
    """Fresh meta tensors shaped like those in ``value``: a block's inputs kept for later runs must not
    keep the step's own tensors alive, or the step's stem and head bytes would change."""

    def stand_in(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        fresh = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return fresh.requires_grad_(t.requires_grad and (t.is_floating_point() or t.is_complex()))

    return tree_map(stand_in, value)


def _meta_model(model_or_factory: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    if isinstance(model_or_factory, nn.Module):
        model = model_or_factory
        real = [name for name, p in model.named_parameters() if p.device.type != "meta"]
        if real:
            raise ValueError(
                f"the model has parameters outside the meta device (e.g. {real[0]!r}); pass a factory such as "
                "lambda: Model(config), or a model built under torch.device('meta'). A model that fits in "
                "memory can be measured for real with remat.profile(model, batch)."
            )
        return model
    if not callable(model_or_factory):
        raise TypeError(f"expected an nn.Module built on meta or a factory returning one, got {model_or_factory!r}")
    with torch.device("meta"):
        model = model_or_factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"the factory returned {type(model).__name__}, not an nn.Module")
    return model


class FusedAttention(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` on ``meta`` run as a fused kernel: the meta device has only the math form,
    which keeps the ``s x s`` scores for the backward, where flash and memory-efficient kernels keep the output and
    one float32 log-sum-exp per row. The CPU's flash kernel (whose meta form exists) stands in for them; calls it
    does not take (dropout, grouped heads of unequal counts) run as PyTorch would."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is nn.functional.scaled_dot_product_attention:
            fused = _fused_attention(*args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)


def _fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor | None:
    if query.device.type != "meta" or dropout_p or query.dim() != 4 or query.shape[1] != key.shape[1]:
        return None
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        return None  # the CPU kernel takes additive float masks only
    output, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale
    )
    return output


def _signature(value: Any) -> Any:
    """What a block's result depends on besides its weights: tensor shapes and dtypes, other values."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.requires_grad)
    if isinstance(value, dict):
        return tuple((k, _signature(v)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return tuple(_signature(v) for v in value)
    if isinstance(value, int | float | bool | str | type(None)):
        return value
    return type(value).__name__


def _block_key(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    weights = tuple((name, tuple(p.shape), p.dtype) for name, p in module.named_parameters())
    return type(module), repr(module), module.training, weights, _signature(args), _signature(kwargs)


def _meta_block_cost(
    fqn: str,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    actions: Sequence[str],
    device: DeviceThroughput,
    io: BlockIO,
) -> BlockCost:
    """One block run alone under each action, as :func:`remat.profiling.block_measure.measure_block` does on a real
    device: bytes kept after its forward (its input excluded, its output included), forward and backward transients;
    times from its FLOPs and the bytes its operators write."""
    slot = io.input_slot(args, kwargs)
    main = slot_value(args, kwargs, slot).detach().requires_grad_(True)
    args, kwargs = replace_slot(args, kwargs, slot, main)

    def pick(value: Any) -> torch.Tensor | None:
        return io.output(value, main.shape)

    trackers: dict[str, LiveTensorTracker] = {}
    times: dict[str, tuple[float, float]] = {}
    unavailable: dict[str, str] = {}
    output_bytes = 0
    with suspend_all(), GradsRestored(module):
        for action in actions:
            tracker = LiveTensorTracker()
            ran = run_tracked(tracker, module, action, args, kwargs, main, _storage_bytes, pick, unavailable)
            if ran is None:
                continue
            trackers[action], output_bytes = tracker, ran
            fwd_flops, bwd_flops = _block_flops(module, action, args, kwargs, main, pick)
            times[action] = (
                flops_time_model(fwd_flops, tracker.written_between("start", "fwd_end"), device_flops=device),
                flops_time_model(bwd_flops, tracker.written_between("bwd_start", "bwd_end"), device_flops=device),
            )
    terms = ByteTerms.from_trackers(trackers)
    fwd_s, bwd_s = times[KEEP]
    recompute = {KEEP: 0.0}
    for action in times:
        if action == CHECKPOINT:
            recompute[action] = fwd_s
        elif action != KEEP:
            recompute[action] = min(max(times[action][1] - bwd_s, 0.0), fwd_s)
    return BlockCost(
        fqn=fqn,
        fwd_s=fwd_s,
        bwd_s=bwd_s,
        input_bytes=_storage_bytes(main),
        output_bytes=output_bytes,
        saved_bytes=terms.saved,
        recompute_s=recompute,
        fwd_temp_bytes=terms.fwd_temp,
        bwd_temp_bytes=terms.bwd_temp,
        bwd_extra_bytes=terms.bwd_extra,
        unavailable=unavailable,
    )


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _block_flops(
    module: nn.Module,
    action: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    main: torch.Tensor,
    pick: Callable[[Any], torch.Tensor | None],
) -> tuple[int, int]:
    """Forward and backward FLOPs of the block under ``action``, counted in a run of their own: the counter
    keeps references into the backward that would distort the byte figures (a recomputed block's backward
    peaks 16 MiB higher on a GPT-2 layer while it counts)."""
    with FlopCounterMode(display=False) as fwd_flops:
        out = pick(run_action(module, action, args, kwargs))
    holder = [out]
    grad = torch.ones_like(out)
    del out
    with FlopCounterMode(display=False) as bwd_flops:
        backward_releasing_output(holder, grad)
    main.grad = None
    clear_grads(module)
    return int(fwd_flops.get_total_flops()), int(bwd_flops.get_total_flops())


def meta_cost_table(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    batch: Batch,
    *,
    blocks: BlocksArg = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    policies: str | Iterable[str] = _policies.PROFILED_BY_DEFAULT,
    device_flops: float | str | DeviceThroughput = "h100-bf16",
    main_input: InputName | Mapping[str, InputName] = None,
    main_output: OutputName | Mapping[str, OutputName] = None,
    step: StepSpec | None = None,
    fused_attention: bool = False,
) -> CostTable:
    """The :class:`~remat.core.costs.CostTable` of a model computed on the ``meta`` device, without memory.
    ``step`` (a :class:`remat.StepSpec`, or its fields ``blocks``, ``loss_fn``, ``main_input``, ``main_output``
    as keywords; its ``holds_output``) is the training step; the meta device has no autocast, so its ``autocast``
    must be None.

    ``model_or_factory`` is a model whose parameters are on ``meta`` or a factory (``lambda:
    Model(config)``) that is called under ``torch.device("meta")``. ``batch`` is as for
    :func:`remat.profile` (tensors on any device are taken as shapes). One forward and backward of the whole
    model gives each block's inputs and the stem and head bytes; then every block runs alone under
    ``keep``, ``checkpoint`` and ``selective:<policy>`` for each of ``policies``. Byte fields are exact:
    every storage an operator creates is followed until it dies, as :func:`remat.profile` does on a real
    device. Blocks identical in structure and inputs are measured once.

    Times are estimates (``info["time_source"] == "flops-estimate"``): FLOPs counted by
    ``FlopCounterMode`` over ``device_flops`` (a preset of :data:`DEVICE_PRESETS` or FLOP/s), plus bytes
    written over the preset's bandwidth (see :func:`flops_time_model`).

    Limits: the meta device has shapes but no values, so a forward that reads values (``.item()``, data-dependent
    branches) cannot run there. Operators are the ones PyTorch runs on ``meta``: ``scaled_dot_product_attention`` takes
    its math form there and keeps the ``s x s`` scores, so for a fused-attention target the attention bytes are
    overestimated (compare with ``transformer_layer_activation_bytes(..., flash_attention=True)``), unless
    ``fused_attention=True`` runs it as a fused kernel (:class:`FusedAttention`: output and log-sum-exp kept, as
    flash attention keeps them on GPUs and on the CPU). Dropout keeps its
    masks in the activation dtype, as eager CPU dropout does (GPUs keep 1-byte masks), and selective regions keep them
    at one byte per element (see :mod:`remat.checkpointing.replayed_draws`). PyTorch has no autocast on ``meta``: the
    estimate is in the parameters' dtype (cast the model, e.g. ``remat plan --device meta --dtype bfloat16``, for bf16
    parameters) and records no autocast, so a session training under autocast warns about it; for a mixed-precision
    step, profile a smaller configuration on a real device under its ``torch.autocast``.
    """
    spec = StepSpec.of(step, blocks=blocks, loss_fn=loss_fn, main_input=main_input, main_output=main_output)
    if spec.autocast not in (None, False):
        raise ValueError("the meta estimate cannot run under autocast (PyTorch has none on the meta device): give "
                         "a step without autocast, and cast the model's parameters for a lower-precision estimate")
    blocks, loss_fn, main_input, main_output = spec.blocks, spec.loss_fn, spec.main_input, spec.main_output
    if active_device_types():
        warnings.warn(
            "remat: the meta estimate cannot run under torch.autocast (PyTorch has no autocast on the meta device); "
            "its figures are in the parameters' dtype. Profile on a real device inside the autocast context for a "
            "mixed-precision step",
            stacklevel=2,
        )
    if several_chains(blocks):
        raise ValueError(
            "the meta estimate plans one chain at a time, and blocks= names several. Estimate one with "
            "blocks=remat.find_chains(model)[i] (the other chains then count as its stem and head), or plan them "
            "together from a profile on a real device: remat.profile(model, batch, blocks=remat.find_chains(model))"
        )
    device = device_throughput(device_flops)
    model = _meta_model(model_or_factory)
    chain = resolve_blocks(model, blocks)
    refuse_recomputed_blocks(chain)  # as remat.profile does: their costs would be those of recomputed blocks
    io = block_ios(chain, main_input, main_output)
    actions = [KEEP, CHECKPOINT] + [Action.selective(name).text for name in _policies.expand(policies)]
    inputs: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    tracker = LiveTensorTracker()
    bounds = ChainBounds(tracker)

    def remember_inputs(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if i not in inputs and torch.is_grad_enabled():
                bounds.block_called(args, kwargs, io[i].input_tensor(args, kwargs))
                inputs[i] = without_caches(*_stand_ins((args, kwargs)))

        return hook

    def chain_end(module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        bounds.chain_output(io[-1].output(output, io[-1].input_tensor(args, kwargs).shape))

    hooks = [m.register_forward_pre_hook(remember_inputs(i), with_kwargs=True) for i, (_, m) in enumerate(chain)]
    hooks.append(chain[-1][1].register_forward_hook(chain_end, with_kwargs=True))
    meta_batch = _to_meta(batch)
    with FusedAttention() if fused_attention else contextlib.nullcontext():
        try:
            with GradsRestored(model), every_layer_runs(model):
                with tracker:
                    run_step(model, meta_batch, loss_fn, holds_output=spec.holds_output)
                tracker.close()  # while parameter gradients are alive: survivors, as in remat.profile
        except RuntimeError as error:
            if "meta" not in str(error):
                raise
            raise RuntimeError(
                f"the model's forward or backward cannot run on the meta device: {error}. The meta device has "
                "shapes but no values, so code that reads tensor values (.item(), data-dependent branches) fails. "
                "For Hugging Face models keep use_cache at its default or pass an attention_mask in the batch."
            ) from error
        finally:
            for hook in hooks:
                hook.remove()
        missing = [fqn for i, (fqn, _) in enumerate(chain) if i not in inputs]
        if missing:
            raise RuntimeError(f"blocks {missing} did not run with grad enabled in the model's forward on meta")
        measured: dict[Any, BlockCost] = {}
        rows = []
        for i, (fqn, module) in enumerate(chain):
            args, kwargs = inputs[i]
            key = (_block_key(module, args, kwargs), io[i].main_input, io[i].main_output)
            if key not in measured:
                measured[key] = _meta_block_cost(fqn, module, args, kwargs, actions, device, io[i])
            rows.append(renamed(measured[key], fqn))
    return CostTable(
        blocks=rows,
        **bounds.figures(len(rows)),
        device="meta",
        source="meta",
        autocast=AutocastSpec("meta", torch.float32, enabled=False).to_dict(),
        info={
            "time_source": "flops-estimate",
            "device_flops": device.name,
            "flops_per_s": device.flops,
            "bandwidth_bytes_per_s": device.bandwidth,
            "torch": str(torch.__version__),
            "attention": "fused" if fused_attention else "as the meta device runs it",
            **({"layer_drop": True} if drops_layers(model) else {}),
        },
    )
