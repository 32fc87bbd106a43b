"""Per-operator save/recompute policies, named as in JAX, on top of PyTorch's selective checkpointing.

A policy decides, for each operator run inside a checkpointed region, whether its output is saved (no
recompute in backward) or recomputed. Use one with ``remat.checkpoint(fn, x, policy=...)``,
``remat.Checkpoint(module, policy=...)`` or a plan action ``"selective:<name>"``.

* ``everything_saveable``: save every output (as without checkpointing, but inside the region).
* ``nothing_saveable``: recompute everything (plain checkpointing).
* ``dots_saveable``: save the outputs of matmuls, convolutions and attention; recompute elementwise ops.
* ``save_only(*ops)``, ``save_all_but(*ops)``: name operators as ``torch.ops.aten.mm``, ``"aten.mm"`` or
  ``"mm"``.
* ``offload_dots``: keep the outputs of matmuls, convolutions and attention in host memory (pinned on CUDA),
  copy them back in recompute instead of running the op again; recompute everything else.
* ``offload_only(*ops)``: the same for the outputs of ``ops``; ``save_and_offload(save=ops, offload=ops)``
  saves some outputs on the device and offloads others (see :mod:`remat.host_copies`, which also says what
  offloading does on CPU: the copy stays in the same memory).
* any callable ``(ctx, op, *args, **kwargs) -> bool | CheckpointPolicy`` (True = save).

Whatever the policy:

* outputs of fresh-buffer ops (``empty_like``, ``zeros``...) and of ops that mutate their inputs (``add_``...)
  are recomputed, never saved: saving them costs memory for no work and breaks when the buffer is filled in
  place afterwards;
* random ops (``native_dropout``, ``rand``, ``bernoulli``...) are run again in recompute from the restored
  generator, in the forward's order, as plain checkpointing does; saving some of them but not others would
  shift the random stream under the rest;
* except CPU dropout draws (``bernoulli_``), which are kept from forward at one byte per element and replayed
  (:mod:`remat.replayed_draws`): on CPU the draw costs far more than the byte.

Offloaded outputs follow the same two rules (fresh buffers, mutating and random ops are recomputed instead),
and so do outputs that are views of an op's inputs. Under ``torch.compile`` offloaded outputs are saved on
the device instead (the compiled graph decides its own storage).

A region that mutates in place the output of an op its policy saves (``Linear`` then ``ReLU(inplace=True)``
under ``dots_saveable``) still fails in backward (torch refuses a mutated cache entry): use an out-of-place op
or plain checkpointing there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from . import host_copies, replayed_draws

aten = torch.ops.aten

DOT_OPS: frozenset[Any] = frozenset(
    op
    for op in (
        aten.mm,
        aten.addmm,
        aten.bmm,
        aten.baddbmm,
        aten.matmul,
        aten.linear,
        aten.convolution,
        aten._convolution,
        aten.cudnn_convolution,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_cudnn_attention,
        getattr(aten, "_flash_attention_forward", None),
        getattr(aten, "_efficient_attention_forward", None),
    )
    if op is not None
)


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


def _never_saved(op: Any) -> bool:
    """Ops whose outputs a policy never saves, whatever it says: fresh buffers, and ops that mutate their
    inputs (their output is a mutated input; a saved entry that is mutated again makes torch's selective
    checkpoint fail in backward, and recomputing them replays the same mutation)."""
    if _packet(op) in FRESH_BUFFER_OPS:
        return True
    schema = getattr(op, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _random(op: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())


def _aliases_input(op: Any) -> bool:
    """Whether ``op``'s outputs may be views of its inputs (``view``, ``t``, ``split``...): not worth a copy."""
    schema = getattr(op, "_schema", None)
    return bool(schema is not None and any(r.alias_info is not None for r in schema.returns))


def _packet(op: Any) -> Any:
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
        return _packet(op)
    raise TypeError(
        f"expected an operator such as torch.ops.aten.mm, aten.mm.default, 'aten.mm' or 'mm', got {op!r} "
        f"({type(op).__name__}); for torch.mm or nn.Linear name the aten op they run (mm, addmm)"
    )


@dataclass(frozen=True)
class Policy:
    """A named per-operator policy; ``context_fn()`` gives the contexts ``torch.utils.checkpoint`` takes."""

    name: str
    save: Callable[..., bool | CheckpointPolicy]
    offload: Callable[[Any], bool] | None = None  # op -> whether its outputs go to host memory

    def offloads(self, op: Any) -> bool:
        """Whether this policy keeps ``op``'s outputs in host memory (in eager mode)."""
        if self.offload is None or _never_saved(op) or _random(op) or _aliases_input(op):
            return False
        return bool(self.offload(op))

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if _never_saved(op) or _random(op):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if self.offloads(op):
            # torch recomputes it as far as it knows; the host copy modes under it answer the recompute.
            return CheckpointPolicy.MUST_SAVE if replayed_draws.tracing() else CheckpointPolicy.PREFER_RECOMPUTE
        decision = self.save(ctx, op, *args, **kwargs)
        if isinstance(decision, CheckpointPolicy):
            return decision
        return CheckpointPolicy.MUST_SAVE if decision else CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn(self) -> Any:
        forward, recompute = create_selective_checkpoint_contexts(self)
        if replayed_draws.tracing():  # torch.compile takes torch's own pair of dispatch modes
            return forward, recompute
        record, replay = replayed_draws.contexts()
        # torch's mode innermost: it decides what to cache, and what it runs reaches the draw log below it.
        if self.offload is None:
            return (
                replayed_draws.StackedContexts(record, forward),
                replayed_draws.StackedContexts(replay, recompute),
            )
        store, serve = host_copies.contexts(self.offloads)
        return (
            replayed_draws.StackedContexts(record, store, forward),
            replayed_draws.StackedContexts(replay, serve, recompute),
        )


everything_saveable = Policy("everything_saveable", lambda ctx, op, *a, **k: True)
nothing_saveable = Policy("nothing_saveable", lambda ctx, op, *a, **k: False)
dots_saveable = Policy("dots_saveable", lambda ctx, op, *a, **k: _packet(op) in DOT_OPS)


def _op_names(ops: Iterable[Any]) -> str:
    return ",".join(sorted(str(o).split(".")[-1] for o in ops))


def save_only(*ops: Any, name: str | None = None) -> Policy:
    """Save only the outputs of ``ops``; recompute everything else."""
    chosen = frozenset(resolve_op(o) for o in ops)
    label = name or f"save_only({_op_names(chosen)})"
    return Policy(label, lambda ctx, op, *a, **k: _packet(op) in chosen)


def save_all_but(*ops: Any, name: str | None = None) -> Policy:
    """Save every output except those of ``ops`` (which are recomputed)."""
    chosen = frozenset(resolve_op(o) for o in ops)
    label = name or f"save_all_but({_op_names(chosen)})"
    return Policy(label, lambda ctx, op, *a, **k: _packet(op) not in chosen)


offload_dots = Policy("offload_dots", lambda ctx, op, *a, **k: False, offload=lambda op: _packet(op) in DOT_OPS)


def offload_only(*ops: Any, name: str | None = None) -> Policy:
    """Keep the outputs of ``ops`` in host memory (pinned on CUDA) and copy them back in recompute; recompute
    everything else."""
    chosen = frozenset(resolve_op(o) for o in ops)
    if not chosen:
        raise ValueError("offload_only() needs at least one operator, e.g. offload_only('mm', 'addmm')")
    label = name or f"offload_only({_op_names(chosen)})"
    return Policy(label, lambda ctx, op, *a, **k: False, offload=lambda op: _packet(op) in chosen)


def save_and_offload(save: Iterable[Any] = (), offload: Iterable[Any] = (), *, name: str | None = None) -> Policy:
    """Save the outputs of the ``save`` ops on the device, keep those of the ``offload`` ops in host memory,
    recompute everything else (JAX's ``save_and_offload_only_these_names``, by operator)."""
    kept = frozenset(resolve_op(o) for o in save)
    moved = frozenset(resolve_op(o) for o in offload)
    both = kept & moved
    if both:
        raise ValueError(f"operators {_op_names(both)} are both saved and offloaded: name each in one list only")
    label = name or f"save_and_offload(save=({_op_names(kept)}),offload=({_op_names(moved)}))"
    return Policy(label, lambda ctx, op, *a, **k: _packet(op) in kept, offload=lambda op: _packet(op) in moved)


_REGISTRY: dict[str, Policy] = {p.name: p for p in (everything_saveable, nothing_saveable, dots_saveable, offload_dots)}


def register(policy: Policy) -> Policy:
    """Make ``policy`` usable by name in plan actions (``"selective:<name>"``)."""
    _REGISTRY[policy.name] = policy
    return policy


def get(name_or_policy: str | Policy | Callable[..., Any]) -> Policy:
    """A :class:`Policy` from a registered name, a Policy, or a user callable."""
    if isinstance(name_or_policy, Policy):
        return name_or_policy
    if isinstance(name_or_policy, str):
        try:
            return _REGISTRY[name_or_policy]
        except KeyError:
            raise ValueError(
                f"unknown policy {name_or_policy!r}; registered: {sorted(_REGISTRY)}. "
                "Register your own with remat.policies.register(Policy(name, fn))."
            ) from None
    if callable(name_or_policy):
        return Policy(getattr(name_or_policy, "__name__", "custom"), name_or_policy)
    raise TypeError(f"a policy is a name, a remat.policies.Policy or a callable, got {type(name_or_policy)}")


def names() -> Iterable[str]:
    return sorted(_REGISTRY)
