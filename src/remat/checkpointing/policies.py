"""Per-operator save/recompute policies, named as in JAX, on top of PyTorch's selective checkpointing.

A policy decides, for each operator run inside a checkpointed region, whether its output is saved (no
recompute in backward) or recomputed. Use one with ``remat.checkpoint(fn, x, policy=...)``,
``remat.Checkpoint(module, policy=...)`` or a plan action ``"selective:<name>"``.

* ``everything_saveable``: save every output (as without checkpointing, but inside the region).
* ``nothing_saveable``: recompute everything (plain checkpointing).
* ``dots_saveable``: save the outputs of matmuls, convolutions and attention; recompute elementwise ops.
* ``all_but_pointwise_saveable``: save every output except those of pointwise ops (``torch.Tag.pointwise``:
  activations, residual adds, scalings, casts) and views, which are recomputed; the first saving
  torch.compile's min-cut partitioner and memory budget make (they recompute fusible ops first).
* ``attention_saveable``: save only the outputs of the attention kernels ``scaled_dot_product_attention``
  dispatches to (flash, memory-efficient, cuDNN, the CPU flash kernel); recompute everything else. It saves
  nothing where there is no such kernel (eager attention; SDPA's math form, which CPU takes under attention
  dropout) or where the kernel applies dropout (it draws, and random ops are recomputed: see below).
* ``dots_every_other_saveable``: save attention outputs and every other matmul (the 1st, 3rd... of each region
  run), recompute the others and everything elementwise: torchtitan's op-level policy. The count starts afresh
  in every region and recompute sees the same decisions, so gradients stay exact.
* :data:`MENU`: ``dots_saveable`` and the three above; ``remat.profile`` measures every one unless told
  otherwise (:data:`PROFILED_BY_DEFAULT`), and ``optimal`` picks per block among them.
* ``save_only(*ops)``, ``save_all_but(*ops)``: name operators as ``torch.ops.aten.mm``, ``"aten.mm"`` or
  ``"mm"``.
* ``offload_dots``: keep the outputs of matmuls, convolutions and attention in host memory (pinned on CUDA),
  copy them back in recompute instead of running the op again; recompute everything else.
* ``offload_only(*ops)``: the same for the outputs of ``ops``; ``save_and_offload(save=ops, offload=ops)``
  saves some outputs on the device and offloads others (see :mod:`remat.checkpointing.host_copies`, which also says what
  offloading does on CPU: the copy stays in the same memory).
* any callable ``(ctx, op, *args, **kwargs) -> bool | CheckpointPolicy`` (True = save).

Whatever the policy:

* outputs of fresh-buffer ops (``empty_like``, ``zeros``...) and of ops that mutate their inputs (``add_``...)
  are recomputed, never saved: saving them costs memory for no work and breaks when the buffer is filled in
  place afterwards;
* random ops (``native_dropout``, ``rand``, ``bernoulli``...) are run again in recompute from the restored
  generator, in the forward's order, as plain checkpointing does; saving some of them but not others would
  shift the random stream under the rest. Attention kernels count as random only when they apply dropout
  (``dropout_p > 0``): without it they draw nothing and a policy may save them;
* except CPU dropout draws (``bernoulli_``), which are kept from forward at one byte per element and replayed
  (:mod:`remat.checkpointing.replayed_draws`): on CPU the draw costs far more than the byte.

Offloaded outputs follow the same two rules (fresh buffers, mutating and random ops are recomputed instead),
and so do outputs that are views of an op's inputs. Under ``torch.compile`` offloaded outputs are saved on
the device instead (the compiled graph decides its own storage).

A region that mutates in place the output of an op its policy saves (``Linear`` then ``ReLU(inplace=True)``
under ``dots_saveable``) still fails in backward (torch refuses a mutated cache entry): use an out-of-place op
or plain checkpointing there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from . import host_copies, replayed_draws
from .op_kinds import (
    ATTENTION_OPS,
    DOT_OPS,
    MATMUL_OPS,
    aliases_input,
    draws_random,
    never_saved,
    packet,
    resolve_op,
    worth_saving,
)

__all__ = [
    "naming_second_backward",
    "second_backward_error",
    "ATTENTION_OPS",
    "DOT_OPS",
    "MATMUL_OPS",
    "MENU",
    "PROFILED_BY_DEFAULT",
    "SavedOutputChanged",
    "EveryOtherMatmul",
    "Policy",
    "all_but_pointwise_saveable",
    "attention_saveable",
    "dots_every_other_saveable",
    "dots_saveable",
    "everything_saveable",
    "expand",
    "get",
    "names",
    "nothing_saveable",
    "offload_dots",
    "offload_only",
    "register",
    "resolve_op",
    "save_all_but",
    "save_and_offload",
    "save_only",
]


_ASK = object()  # a decision that is not the op's alone: ask the policy's ``save`` each time
_OFFLOADED = object()  # an offloaded op: the decision depends on whether torch.compile is tracing


@dataclass(frozen=True)
class Policy:
    """A named per-operator policy; ``context_fn()`` gives the contexts ``torch.utils.checkpoint`` takes.

    ``by_op``: ``save`` decides from the operator alone (not its arguments), so each operator's decision is
    worked out once and looked up after; the stateless built-in policies are. A user callable is asked at every
    op.
    """

    name: str
    save: Callable[..., bool | CheckpointPolicy]
    offload: Callable[[Any], bool] | None = None  # op -> whether its outputs go to host memory
    by_op: bool = False
    _decisions: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def offloads(self, op: Any) -> bool:
        """Whether this policy keeps ``op``'s outputs in host memory (in eager mode)."""
        if self.offload is None or never_saved(op) or draws_random(op) or aliases_input(op):
            return False
        return bool(self.offload(op))

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        # keyed by id (an OpOverload hashes in Python), the op kept beside its decision so that an id reused by
        # another object is not mistaken for it
        entry = self._decisions.get(id(op))
        if entry is None or entry[0] is not op:
            entry = self._decisions[id(op)] = (op, *self._decide_by_op(ctx, op, *args, **kwargs))
        _, draws_per_call, decision = entry
        if draws_per_call and draws_random(op, args, kwargs):  # an attention kernel draws when its dropout_p > 0
            return CheckpointPolicy.PREFER_RECOMPUTE
        if decision is _OFFLOADED:
            # torch recomputes it as far as it knows; the host copy modes under it answer the recompute.
            return CheckpointPolicy.MUST_SAVE if replayed_draws.tracing() else CheckpointPolicy.PREFER_RECOMPUTE
        if decision is _ASK:
            return _as_checkpoint_policy(self.save(ctx, op, *args, **kwargs))
        return decision

    def _decide_by_op(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        """Whether each call of ``op`` must first be asked if it draws (an attention kernel), and the decision for
        every call that does not: a ``CheckpointPolicy``, ``_OFFLOADED``, or ``_ASK``. Fresh buffers, ops that
        mutate their inputs and random ops are recomputed whatever the policy says
        (:func:`remat.checkpointing.op_kinds.asks_policy`)."""
        draws_per_call = draws_random(op)  # tagged random; an attention kernel only when its dropout_p > 0
        if never_saved(op) or (draws_per_call and packet(op) not in ATTENTION_OPS):
            return False, CheckpointPolicy.PREFER_RECOMPUTE
        if self.offloads(op):
            return draws_per_call, _OFFLOADED
        if not self.by_op:
            return draws_per_call, _ASK
        return draws_per_call, _as_checkpoint_policy(self.save(ctx, op, *args, **kwargs))

    def for_region(self) -> Policy:
        """This policy with its own per-region state (a fresh call count for :data:`dots_every_other_saveable`);
        itself when it keeps none."""
        fresh = getattr(self.save, "fresh", None)
        return self if fresh is None else replace(self, save=fresh())

    def context_fn(self) -> Any:
        policy = self.for_region()
        if replayed_draws.tracing():  # torch.compile takes torch's own pair of dispatch modes
            return create_selective_checkpoint_contexts(policy)
        log = replayed_draws.DrawLog()
        replay = replayed_draws.ReplayDraws(log)
        if replayed_draws.POLICY_SEES_OUTPUT:
            forward, recompute = create_selective_checkpoint_contexts(replayed_draws.recording(policy, log))
            below: tuple[Any, ...] = ()
        else:
            forward, recompute = create_selective_checkpoint_contexts(policy)
            below = (replayed_draws.RecordDraws(log),)
        # Counting policies start each recompute from the first call (torch < 2.6 asks them again there).
        restart = getattr(policy.save, "recompute_started", None)
        replay_first = (_ExplainsChangedSaves(self.name), replay, *([_OnEnter(restart)] if restart is not None else []))
        # torch's mode innermost: it decides what to cache, and what it runs reaches the draw log below it.
        if self.offload is None:
            return (
                replayed_draws.StackedContexts(*below, forward),
                replayed_draws.StackedContexts(*replay_first, recompute),
            )
        store, serve = host_copies.contexts(self.offloads)
        return (
            replayed_draws.StackedContexts(*below, store, forward),
            replayed_draws.StackedContexts(*replay_first, serve, recompute),
        )


def _as_checkpoint_policy(decision: bool | CheckpointPolicy) -> CheckpointPolicy:
    if isinstance(decision, CheckpointPolicy):
        return decision
    return CheckpointPolicy.MUST_SAVE if decision else CheckpointPolicy.PREFER_RECOMPUTE


class SavedOutputChanged(RuntimeError):
    """A policy saved an operator's output that its region then changed in place, which torch's selective
    checkpointing refuses in the backward (this error's cause)."""


class _ExplainsChangedSaves:
    """Around a recompute: torch's refusal of a saved output the region changed in place after saving it, said
    with what to do about it (re-enterable, like the other contexts of a region)."""

    def __init__(self, policy_name: str) -> None:
        self.policy_name = policy_name

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if isinstance(error, RuntimeError) and "cached during selective activation checkpoint has been mutated" in str(
            error
        ):
            raise SavedOutputChanged(
                f"remat: the policy {self.policy_name!r} saved an operator's output that the region then changed in "
                "place (x /= ..., x += residual), so its recomputation cannot use it; torch refuses it in the "
                "backward. Use a policy that does not save that operator here (remat.profile leaves such a policy "
                "out of a block's costs, see BlockCost.unavailable), or write the in-place op out of place."
            ) from error


class _OnEnter:
    """A context manager that calls ``fn()`` each time it is entered (and can be entered again)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def __enter__(self) -> None:
        self.fn()

    def __exit__(self, *exc: Any) -> None:
        return None


everything_saveable = Policy("everything_saveable", lambda ctx, op, *a, **k: True, by_op=True)
nothing_saveable = Policy("nothing_saveable", lambda ctx, op, *a, **k: False, by_op=True)
dots_saveable = Policy("dots_saveable", lambda ctx, op, *a, **k: packet(op) in DOT_OPS, by_op=True)
attention_saveable = Policy("attention_saveable", lambda ctx, op, *a, **k: packet(op) in ATTENTION_OPS, by_op=True)


def _pointwise(op: Any) -> bool:
    return torch.Tag.pointwise in getattr(op, "tags", ())


def _save_unless_pointwise(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
    # Views are recomputed too (free): a saved view would keep alive the recomputed output it looks into.
    return not _pointwise(op) and worth_saving(op)


all_but_pointwise_saveable = Policy("all_but_pointwise_saveable", _save_unless_pointwise, by_op=True)


class EveryOtherMatmul:
    """The decisions of :data:`dots_every_other_saveable` for one region run: attention kernels saved, the
    1st, 3rd, 5th... matmul of the region saved, the 2nd, 4th... recomputed. The count restarts in every
    region (:meth:`fresh`), and is kept apart for the recompute, which makes the same calls in the same order
    (torchtitan's per-op policy counts ``mm`` calls the same way)."""

    def __init__(self) -> None:
        self.calls = {False: 0, True: 0}  # by ctx.is_recompute

    def fresh(self) -> EveryOtherMatmul:
        return EveryOtherMatmul()

    def recompute_started(self) -> None:
        self.calls[True] = 0

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        kind = packet(op)
        if kind in ATTENTION_OPS:
            return True
        if kind not in MATMUL_OPS:
            return False
        recompute = bool(getattr(ctx, "is_recompute", False))
        self.calls[recompute] += 1
        return self.calls[recompute] % 2 == 1


dots_every_other_saveable = Policy("dots_every_other_saveable", EveryOtherMatmul())


def _op_names(ops: Iterable[Any]) -> str:
    return ",".join(sorted(str(o).split(".")[-1] for o in ops))


def save_only(*ops: Any, name: str | None = None) -> Policy:
    """Save only the outputs of ``ops``; recompute everything else."""
    chosen = frozenset(resolve_op(o) for o in ops)
    label = name or f"save_only({_op_names(chosen)})"
    return Policy(label, lambda ctx, op, *a, **k: packet(op) in chosen)


def save_all_but(*ops: Any, name: str | None = None) -> Policy:
    """Save every output except those of ``ops`` (which are recomputed)."""
    chosen = frozenset(resolve_op(o) for o in ops)
    label = name or f"save_all_but({_op_names(chosen)})"
    return Policy(label, lambda ctx, op, *a, **k: packet(op) not in chosen)


offload_dots = Policy("offload_dots", lambda ctx, op, *a, **k: False, offload=lambda op: packet(op) in DOT_OPS)


def offload_only(*ops: Any, name: str | None = None) -> Policy:
    """Keep the outputs of ``ops`` in host memory (pinned on CUDA) and copy them back in recompute; recompute
    everything else."""
    chosen = frozenset(resolve_op(o) for o in ops)
    if not chosen:
        raise ValueError("offload_only() needs at least one operator, e.g. offload_only('mm', 'addmm')")
    label = name or f"offload_only({_op_names(chosen)})"
    return Policy(label, lambda ctx, op, *a, **k: False, offload=lambda op: packet(op) in chosen)


def save_and_offload(save: Iterable[Any] = (), offload: Iterable[Any] = (), *, name: str | None = None) -> Policy:
    """Save the outputs of the ``save`` ops on the device, keep those of the ``offload`` ops in host memory,
    recompute everything else (JAX's ``save_and_offload_only_these_names``, by operator)."""
    kept = frozenset(resolve_op(o) for o in save)
    moved = frozenset(resolve_op(o) for o in offload)
    both = kept & moved
    if both:
        raise ValueError(f"operators {_op_names(both)} are both saved and offloaded: name each in one list only")
    label = name or f"save_and_offload(save=({_op_names(kept)}),offload=({_op_names(moved)}))"
    return Policy(label, lambda ctx, op, *a, **k: packet(op) in kept, offload=lambda op: packet(op) in moved)


_REGISTRY: dict[str, Policy] = {
    p.name: p
    for p in (
        everything_saveable,
        nothing_saveable,
        dots_saveable,
        all_but_pointwise_saveable,
        attention_saveable,
        dots_every_other_saveable,
        offload_dots,
    )
}

# The per-operator policies a profile measures with ``policies="menu"``: each saves a different share of a
# block's activations at a different recompute price, and the optimal planner picks per block among them.
MENU: tuple[str, ...] = (
    "dots_saveable",
    "all_but_pointwise_saveable",
    "attention_saveable",
    "dots_every_other_saveable",
)
# What ``remat.profile``, the meta estimate and ``remat profile``/``plan`` measure when ``policies`` is not given.
PROFILED_BY_DEFAULT = "menu"


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


def expand(policies: str | Iterable[str | Policy]) -> list[str]:
    """Policy names from a ``policies=`` argument: a name, ``"menu"`` (every policy of :data:`MENU`), a
    comma-separated string of them, or an iterable of names and :class:`Policy` objects (which must be
    registered to be used in plans). Duplicates are dropped; unknown names raise ValueError."""
    items: Iterable[str | Policy] = policies.split(",") if isinstance(policies, str) else policies
    out: list[str] = []
    for item in items:
        if isinstance(item, str) and item.strip() == "menu":
            names_ = list(MENU)
        elif isinstance(item, str) and not item.strip():
            continue
        else:
            names_ = [get(item.strip() if isinstance(item, str) else item).name]
        out.extend(n for n in names_ if n not in out)
    return out


@contextmanager
def naming_second_backward() -> Iterator[None]:
    """Within the block, torch's second-backward error is raised as :func:`second_backward_error` words it."""
    try:
        yield
    except RuntimeError as err:
        clearer = second_backward_error(err)
        if clearer is None:
            raise
        raise clearer from None


def second_backward_error(error: BaseException) -> RuntimeError | None:
    """torch's error for a second backward through a region whose policy keeps operator outputs (each kept output
    is handed out once), with what to do; None for any other error."""
    if not isinstance(error, RuntimeError) or "backward an extra time" not in str(error):
        return None
    return RuntimeError(
        f"{error} A per-operator policy that keeps operator outputs allows one backward through its region. For a "
        "second one (retain_graph=True twice, create_graph=True for gradients of gradients) plan with "
        "remat.plan(costs, 'optimal', budget, double_backward=True), which leaves such policies out, or use "
        "checkpoint or a policy that keeps nothing on the device (nothing_saveable, offload_dots)."
    )
