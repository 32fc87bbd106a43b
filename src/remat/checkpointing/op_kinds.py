"""What kind of operator a call is, for the per-operator policies of :mod:`remat.policies` and the knapsack
policy of :mod:`remat.checkpointing.knapsack`: the matmul, attention and fresh-buffer operator sets, which calls a
policy is asked about at all (not fresh buffers, in-place or random ops), which outputs are worth saving (not views),
and operator names resolved to overload packets.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten

# The attention kernels scaled_dot_product_attention dispatches to (CPU and CUDA); its math form (taken on CPU
# with attention dropout, and on meta) runs plain matmuls and softmax instead.
ATTENTION_OPS: frozenset[Any] = frozenset(
    getattr(aten, name)
    for name in (
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    if hasattr(aten, name)
)

MATMUL_OPS: frozenset[Any] = frozenset(
    getattr(aten, name)
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "matmul",
        "linear",
        "convolution",
        "_convolution",
        "cudnn_convolution",
    )
    if hasattr(aten, name)
)

DOT_OPS: frozenset[Any] = MATMUL_OPS | ATTENTION_OPS


# Fresh buffers (uninitialised or constant): free to recompute, and often filled in place right after
# (CPU dropout is ``empty_like(x).bernoulli_()``), which would invalidate a saved copy.
FRESH_BUFFER_OPS: frozenset[Any] = frozenset(
    getattr(aten, name)
    for name in (
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "zeros",
        "zeros_like",
        "new_zeros",
        "ones",
        "ones_like",
        "new_ones",
        "full",
        "full_like",
        "new_full",
        "scalar_tensor",
    )
    if hasattr(aten, name)
)


def never_saved(op: Any) -> bool:
    """Ops whose outputs a policy never saves, whatever it says: fresh buffers, and ops that mutate their
    inputs (their output is a mutated input; a saved entry that is mutated again makes torch's selective
    checkpoint fail in backward, and recomputing them replays the same mutation)."""
    if packet(op) in FRESH_BUFFER_OPS:
        return True
    schema = getattr(op, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def draws_random(op: Any, args: tuple[Any, ...] | None = None, kwargs: dict[str, Any] | None = None) -> bool:
    """Whether ``op`` draws from the generator. The attention kernels are tagged as random for their dropout;
    given their arguments, one with ``dropout_p == 0`` is not (it leaves the generator alone)."""
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    if args is None or packet(op) not in ATTENTION_OPS:
        return True
    return dropout_p(op, args, kwargs or {}) != 0


def dropout_p(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    """The ``dropout_p`` argument of an attention kernel call (1.0 when the schema has none: assume a draw)."""
    for i, argument in enumerate(op._schema.arguments):
        if argument.name == "dropout_p":
            if argument.name in kwargs:
                return float(kwargs[argument.name])
            if i < len(args):
                return float(args[i])
            return float(argument.default_value or 0.0)
    return 1.0


def asks_policy(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a :class:`Policy` consults its decision function on this call: not for fresh buffers, ops that
    mutate their inputs, or random ops, which are recomputed whatever it says."""
    return not (never_saved(op) or draws_random(op, args, kwargs))


def worth_saving(op: Any) -> bool:
    """Whether saving ``op``'s output keeps memory of its own: not a view of an input (``view``, ``split``,
    ``_unsafe_view``, whose schema does not say so), which would only keep alive the tensor it looks into."""
    return not (aliases_input(op) or packet(op) is aten._unsafe_view)


def aliases_input(op: Any) -> bool:
    """Whether ``op``'s outputs may be views of its inputs (``view``, ``t``, ``split``...): not worth a copy."""
    schema = getattr(op, "_schema", None)
    return bool(schema is not None and any(r.alias_info is not None for r in schema.returns))


def packet(op: Any) -> Any:
    """The overload packet of an op overload (aten.mm.default -> aten.mm); packets pass through."""
    return getattr(op, "overloadpacket", op)


def resolve_op(op: Any) -> Any:
    """Turn ``torch.ops.aten.mm``, ``aten.mm.default``, ``"aten.mm"`` or ``"mm"`` into an overload packet."""
    if isinstance(op, str):
        name = op.split(".", 1)[1] if op.startswith("aten.") else op
        name = name.split(".")[0]
        if not hasattr(aten, name):
            raise ValueError(f"unknown operator {op!r}: torch.ops.aten has no {name!r}")
        return getattr(aten, name)
    if isinstance(op, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return packet(op)
    raise TypeError(
        f"expected an operator such as torch.ops.aten.mm, aten.mm.default, 'aten.mm' or 'mm', got {op!r} "
        f"({type(op).__name__}); for torch.mm or nn.Linear name the aten op they run (mm, addmm)"
    )
