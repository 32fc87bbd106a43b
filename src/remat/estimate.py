"""Estimating costs without running the model for real: the transformer activation formula, a CostTable
measured on the ``meta`` device, and a FLOPs-based time model.

* :func:`transformer_layer_activation_bytes`: bytes one transformer layer keeps for backward, from its
  shape alone (``s*b*h*(34 + 5*a*s/h)`` for 16-bit activations with dropout, and its variants).
* :func:`meta_cost_table`: the same :class:`~remat.costs.CostTable` fields :func:`remat.profile` measures,
  for any model, computed on the ``meta`` device: no memory is allocated and no arithmetic runs, so models
  far larger than this machine can be planned for. Bytes are exact (every storage an operator creates is
  followed until it dies); times are estimates from FLOPs and bytes moved.
* :func:`flops_time_model`, :func:`count_flops`, :data:`DEVICE_PRESETS`: seconds from FLOPs (counted with
  ``torch.utils.flop_counter.FlopCounterMode``, which works on ``meta``) over a device throughput.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from . import policies as _policies
from .blocks import main_input_slot, main_tensor, replace_slot, resolve_blocks, slot_value, without_caches
from .costs import CHECKPOINT, KEEP, SELECTIVE_PREFIX, BlockCost, CostTable
from .profiler import (
    Batch,
    BlockArguments,
    ByteTerms,
    _backward_releasing_output,
    _GradsRestored,
    _run_action,
    clear_grads,
    run_step,
    run_tracked,
)
from .runtime import suspend_all

# ---------------------------------------------------------------------------------------------------------
# The transformer layer formula


def transformer_layer_activation_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    *,
    bytes_per_element: int = 2,
    mask_bytes: int = 1,
    dropout: bool = True,
    flash_attention: bool = False,
    activation: str = "gelu",
    full_recompute: bool = False,
) -> int:
    """Bytes of activations one transformer layer keeps for its backward pass.

    ``s`` sequence length, ``b`` batch size, ``h`` hidden size, ``a`` attention heads. With 16-bit
    activations (``bytes_per_element=2``), 1-byte dropout masks, dropout, GELU and attention that stores its
    scores, this is ``s*b*h*(34 + 5*a*s/h)`` = ``34sbh + 5as²b``. Term by term, with ``p`` bytes per
    element and ``m`` bytes per mask element:

    Attention block, ``x_out = softmax(QK^T/sqrt(d)) V W_o + x``:

    1. Q, K and V projections keep their common input x: ``p·sbh``.
    2. ``QK^T`` keeps Q and K: ``2p·sbh``.
    3. softmax keeps its result, ``a`` score matrices of ``s x s`` per sequence: ``p·as²b``.
    4. dropout on the attention probabilities keeps its mask: ``m·as²b``.
    5. ``probs · V`` keeps the (dropped-out) probabilities and V: ``p·as²b + p·sbh``.
    6. the output projection keeps its input, its dropout a mask: ``p·sbh + m·sbh``.

    That is ``11sbh + 5as²b`` for ``p=2, m=1``. MLP block, ``x = f(x_out W_1) W_2 + x_out`` (4h inner):

    1. the first linear keeps its input: ``p·sbh``.
    2. GELU keeps its input: ``4p·sbh``; ReLU needs only its output, which the next linear keeps anyway,
       so nothing more (``activation="relu"``; SiLU counts as GELU).
    3. the second linear keeps its input: ``4p·sbh``.
    4. dropout keeps a mask: ``m·sbh``.

    That is ``19sbh``. The two layer norms keep their inputs: ``2p·sbh`` (their per-token mean and variance
    are ignored). Total ``34sbh + 5as²b``.

    Variants: ``dropout=False`` drops the three masks, and the softmax result is then the very tensor
    ``probs · V`` keeps, so the ``s²`` term is stored once: ``32sbh + 2as²b``. ``flash_attention=True``
    (fused attention) keeps no ``s x s`` tensor at all, only Q, K, V, its output and a float32 log-sum-exp
    per row and head (``4asb``; dropout there is replayed from the RNG state, no mask):
    ``34sbh + 4asb``. ``activation="relu"``: ``26sbh + 5as²b``. ``bytes_per_element=4`` (float32, masks
    still 1 byte): ``66sbh + 9as²b``. ``mask_bytes``: GPUs keep dropout masks as 1-byte booleans; eager
    CPU dropout keeps them in the activation dtype (``mask_bytes=bytes_per_element``).
    ``full_recompute=True`` (the layer checkpointed): only the layer input stays, ``p·sbh`` (``2sbh``).
    """
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a), ("bytes_per_element", bytes_per_element)):
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if activation not in ("gelu", "silu", "relu"):
        raise ValueError(f"unknown activation {activation!r}; use 'gelu' (or 'silu': keeps its input) or 'relu'")
    p, sbh = bytes_per_element, s * b * h
    if full_recompute:
        return p * sbh
    m = mask_bytes if dropout else 0
    keeps_activation_input = activation != "relu"
    per_sbh = 12 * p + (4 * p if keeps_activation_input else 0) + 2 * m
    if flash_attention:
        scores = 4 * a * s * b  # float32 log-sum-exp per row and head
    else:
        scores = a * s * s * b * ((2 * p + m) if dropout else p)
    return per_sbh * sbh + scores


# ---------------------------------------------------------------------------------------------------------
# The time model


@dataclass(frozen=True)
class DeviceThroughput:
    """What a device sustains in training: FLOP/s, and bytes/s of memory traffic (``None``: not modelled)."""

    flops: float
    bandwidth: float | None = None
    name: str = "custom"


# Sustained, not peak: about half the dense peak FLOP/s and 80% of the memory bandwidth, which is what
# well-tuned training reaches. Estimates only.
DEVICE_PRESETS: dict[str, DeviceThroughput] = {
    "h100-bf16": DeviceThroughput(0.5 * 989e12, 0.8 * 3.35e12, "h100-bf16"),
    "h200-bf16": DeviceThroughput(0.5 * 989e12, 0.8 * 4.8e12, "h200-bf16"),
    "a100-bf16": DeviceThroughput(0.5 * 312e12, 0.8 * 2.0e12, "a100-bf16"),
    "a100-fp32": DeviceThroughput(0.5 * 19.5e12, 0.8 * 2.0e12, "a100-fp32"),
    "cpu": DeviceThroughput(1e11, 2e10, "cpu"),
}


def device_throughput(device_flops: float | str | DeviceThroughput) -> DeviceThroughput:
    """A :class:`DeviceThroughput` from a preset name, a number of FLOP/s, or one itself."""
    if isinstance(device_flops, DeviceThroughput):
        return device_flops
    if isinstance(device_flops, str):
        try:
            return DEVICE_PRESETS[device_flops]
        except KeyError:
            raise ValueError(
                f"unknown device preset {device_flops!r}; use one of {sorted(DEVICE_PRESETS)} or a number of FLOP/s"
            ) from None
    if device_flops <= 0:
        raise ValueError(f"device_flops must be positive FLOP/s, got {device_flops}")
    return DeviceThroughput(float(device_flops), None, f"{device_flops:.3g} FLOP/s")


def flops_time_model(
    flops: float, bytes_moved: float = 0.0, *, device_flops: float | str | DeviceThroughput = "h100-bf16"
) -> float:
    """Estimated seconds for work of ``flops`` FLOPs writing ``bytes_moved`` bytes: ``flops / FLOP/s`` plus,
    when the device has a bandwidth, ``bytes_moved / bandwidth`` (what elementwise work costs)."""
    device = device_throughput(device_flops)
    seconds = flops / device.flops
    if device.bandwidth:
        seconds += bytes_moved / device.bandwidth
    return seconds


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """Run ``fn(*args, **kwargs)`` (on any device, ``meta`` included) and return its result and FLOPs."""
    with FlopCounterMode(display=False) as counter:
        result = fn(*args, **kwargs)
    return result, int(counter.get_total_flops())


# ---------------------------------------------------------------------------------------------------------
# Bytes on the meta device


def _storage_key(t: torch.Tensor) -> int | None:
    """Identity of ``t``'s storage (its address in memory on ``meta`` too, where data pointers are 0)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


class _LiveBytes(TorchDispatchMode):
    """Follows every storage an operator creates while active until it dies; works on ``meta``, where
    storages have no data pointers. Figures are read after :meth:`close` and, as in
    :class:`remat.memory.LiveTensorTracker`, leave out the survivors (storages still alive at close, such
    as parameter gradients): they outlive the step and are not activations."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []  # (event id of the creation, +bytes / -bytes on death)
        self.marks: dict[str, int] = {}
        self.survivors: set[int] = set()
        self._alive: dict[int, tuple[int, int]] = {}  # storage key -> (event id, bytes)
        self._finalizers: list[weakref.finalize] = []
        self._closed = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = _storage_key(t)
                if key is not None and key not in inputs and key not in self._alive:
                    # Storage addresses are reused once freed; events get ids of their own.
                    storage, event_id = t.untyped_storage(), len(self.events)
                    self._alive[key] = (event_id, storage.nbytes())
                    self.events.append((event_id, storage.nbytes()))
                    self._finalizers.append(weakref.finalize(storage, self._died, key))
        return out

    def _died(self, key: int) -> None:
        event_id, nbytes = self._alive.pop(key, (None, 0))
        if event_id is not None:
            self.events.append((event_id, -nbytes))

    def mark(self, label: str) -> None:
        self.marks.setdefault(label, len(self.events))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.survivors = {event_id for event_id, _ in self._alive.values()}
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()

    def _series(self) -> list[int]:
        live, series = 0, [0]
        for key, change in self.events:
            if key not in self.survivors:
                live += change
            series.append(live)
        return series

    def bytes_at(self, label: str) -> int:
        return self._series()[self.marks[label]]

    def peak_between(self, start: str, end: str) -> int:
        return max(self._series()[self.marks[start] : self.marks[end] + 1])

    def written_between(self, start: str, end: str) -> int:
        """Bytes of all storages created between the marks, survivors included (work the device does)."""
        return sum(change for _, change in self.events[self.marks[start] : self.marks[end]] if change > 0)


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
) -> BlockCost:
    """One block run alone under each action, as :func:`remat.profiler.measure_block` does on a real device:
    bytes kept after its forward (its input excluded, its output included), forward and backward
    transients; times from its FLOPs and the bytes its operators write."""
    slot = main_input_slot(args, kwargs)
    main = slot_value(args, kwargs, slot).detach().requires_grad_(True)
    args, kwargs = replace_slot(args, kwargs, slot, main)
    trackers: dict[str, _LiveBytes] = {}
    times: dict[str, tuple[float, float]] = {}
    output_bytes = 0
    with suspend_all(), _GradsRestored(module):
        for action in actions:
            tracker = trackers[action] = _LiveBytes()
            output_bytes = run_tracked(tracker, module, action, args, kwargs, main, _storage_bytes)
            fwd_flops, bwd_flops = _block_flops(module, action, args, kwargs, main)
            times[action] = (
                flops_time_model(fwd_flops, tracker.written_between("start", "fwd_end"), device_flops=device),
                flops_time_model(bwd_flops, tracker.written_between("bwd_start", "bwd_end"), device_flops=device),
            )
    terms = ByteTerms.from_trackers(trackers)
    fwd_s, bwd_s = times[KEEP]
    recompute = {KEEP: 0.0}
    for action in actions:
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
    )


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _block_flops(
    module: nn.Module, action: str, args: tuple[Any, ...], kwargs: dict[str, Any], main: torch.Tensor
) -> tuple[int, int]:
    """Forward and backward FLOPs of the block under ``action``, counted in a run of their own: the counter
    keeps references into the backward that would distort the byte figures (a recomputed block's backward
    peaks 16 MiB higher on a GPT-2 layer while it counts)."""
    with FlopCounterMode(display=False) as fwd_flops:
        out = main_tensor(_run_action(module, action, args, kwargs))
    holder = [out]
    grad = torch.ones_like(out)
    del out
    with FlopCounterMode(display=False) as bwd_flops:
        _backward_releasing_output(holder, grad)
    main.grad = None
    clear_grads(module)
    return int(fwd_flops.get_total_flops()), int(bwd_flops.get_total_flops())


def meta_cost_table(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    batch: Batch,
    *,
    blocks: Sequence[str] | Sequence[tuple[str, nn.Module]] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    policies: Iterable[str] = ("dots_saveable",),
    device_flops: float | str | DeviceThroughput = "h100-bf16",
) -> CostTable:
    """The :class:`~remat.costs.CostTable` of a model computed on the ``meta`` device, without memory.

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

    Limits: the meta device has shapes but no values, so a forward that reads values (``.item()``,
    data-dependent branches) cannot run there. Operators are the ones PyTorch runs on ``meta``:
    ``scaled_dot_product_attention`` takes its math form there and keeps the ``s x s`` scores, so for a
    fused-attention target the attention bytes are overestimated (compare with
    ``transformer_layer_activation_bytes(..., flash_attention=True)``). Dropout keeps its masks in the
    activation dtype, as eager CPU dropout does (GPUs keep 1-byte masks), and selective regions keep them at
    one byte per element (see :mod:`remat.replayed_draws`).
    """
    device = device_throughput(device_flops)
    model = _meta_model(model_or_factory)
    chain = resolve_blocks(model, blocks)
    actions = [KEEP, CHECKPOINT] + [SELECTIVE_PREFIX + _policies.get(p).name for p in policies]
    inputs: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    tracker = _LiveBytes()
    arguments = BlockArguments()
    held_args = [0]

    def remember_inputs(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if i not in inputs and torch.is_grad_enabled():
                tracker.mark("stem")
                arguments.add(args, kwargs)
                inputs[i] = without_caches(*_stand_ins((args, kwargs)))

        return hook

    def chain_end(module: nn.Module, args: Any, output: Any) -> None:
        out = main_tensor(output)
        if out is not None and out.requires_grad and "chain_end" not in tracker.marks:
            tracker.mark("chain_end")
            out.register_hook(lambda grad: head_end())

    def head_end() -> None:
        tracker.mark("head_end")
        held_args[0] = arguments.freed_bytes()

    hooks = [m.register_forward_pre_hook(remember_inputs(i), with_kwargs=True) for i, (_, m) in enumerate(chain)]
    hooks.append(chain[-1][1].register_forward_hook(chain_end))
    meta_batch = _to_meta(batch)
    try:
        with _GradsRestored(model):
            with tracker:
                run_step(model, meta_batch, loss_fn)
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
    stem = tracker.bytes_at("stem") if "stem" in tracker.marks else 0
    head = head_retained = 0
    if {"chain_end", "head_end"} <= tracker.marks.keys():
        head = max(0, tracker.peak_between("chain_end", "head_end") - tracker.bytes_at("chain_end"))
        head_retained = max(0, tracker.bytes_at("head_end") - tracker.bytes_at("chain_end"))
    measured: dict[Any, BlockCost] = {}
    rows = []
    for i, (fqn, module) in enumerate(chain):
        args, kwargs = inputs[i]
        key = _block_key(module, args, kwargs)
        if key not in measured:
            measured[key] = _meta_block_cost(fqn, module, args, kwargs, actions, device)
        row = measured[key]
        rows.append(BlockCost(**{**row.__dict__, "fqn": fqn, "saved_bytes": dict(row.saved_bytes),
                                 "recompute_s": dict(row.recompute_s)}))  # fmt: skip
    return CostTable(
        blocks=rows,
        stem_bytes=stem,
        head_bytes=head,
        head_retained_bytes=head_retained,
        held_args_bytes=held_args[0],
        device="meta",
        source="meta",
        info={
            "time_source": "flops-estimate",
            "device_flops": device.name,
            "flops_per_s": device.flops,
            "bandwidth_bytes_per_s": device.bandwidth,
            "torch": torch.__version__,
        },
    )


__all__ = [
    "DEVICE_PRESETS",
    "DeviceThroughput",
    "count_flops",
    "device_throughput",
    "flops_time_model",
    "meta_cost_table",
    "transformer_layer_activation_bytes",
]
