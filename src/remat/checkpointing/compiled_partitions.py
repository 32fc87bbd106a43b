"""Compiled blocks partitioned under torch.compile's activation memory budget: one compiled variant per budget,
and the ``partition:<budget>`` actions that choose among them.

Inside a compiled graph, torch.compile's min-cut partitioner decides which values the forward saves for the
backward and which the backward recomputes; ``torch._functorch.config.activation_memory_budget`` (a fraction in
[0, 1] of what saving everything would keep) caps what it saves, recomputing the cheapest operators first. torch
applies one budget to one graph. For a block compiled with ``module.compile()``, :func:`add_partitions` compiles
one more callable per budget (the same code, partitioned under that budget) and :func:`select` makes one of
them the block's compiled call, by swapping the module's ``_compiled_call_impl``: no recompilation once a
variant has run. So a plan can give every block its own partition (``"partition:0.5"``), measured by the
profiler like any other action, and the planner chooses per block among keep, checkpoint and the partitions
under one byte budget; ``keep``, ``checkpoint`` and ``offload`` run the block's own compiled call.

Invariants, enforced here:

1. A block runs the variant of a partition action only while :func:`running` or :func:`select` put it there;
   :func:`running` puts the block's own compiled call back on every exit path.
2. A partition action names a budget the block was compiled for (:func:`add_partitions`); any other is refused
   with the budgets it has, before a step runs.
3. Partitions stay exact: on a block whose forward draws random numbers (:class:`RandomDraws` here, applied by
   :func:`remat.profiling.block_measure.measure_block` around the block's first call; dropout in training mode draws),
   the profiler measures only the partitions whose compiled variant keeps what the forward drew
   (:func:`saves_draws`). torch's partitioner, under a budget below 1, may recompute a random operator in the
   backward, where it draws anew, and the gradients differ from a step that keeps everything
   (pytorch/pytorch#190758). Under inductor with a budget in (0, 1) the variant is compiled with
   :func:`save_draws_pass`, a joint-graph pass that marks every seeded operator (inductor's seeds, one small integer
   tensor per graph) ``MUST_SAVE``: the backward regenerates the same masks from the saved seeds. A budget of 0
   returns the graph inputs as the saved set whatever is marked, and other backends do not run inductor's
   joint-graph passes, so their variants do not save draws: such a variant raises once a call of it draws
   (a hand-written plan), before the backward could use what it drew.

The budget takes effect where the compiler partitions with torch's min-cut partitioner: ``inductor`` (the
default) and ``aot_eager_decomp_partition``. Under another backend every variant saves what keep saves.

Invariant 3 is about what is drawn, not how it rounds: a variant is another graph to the compiler, its recomputed
operators fused into other kernels than keep's, where a reduction or a cast to a lower precision may round
differently (under bf16 autocast on HF Llama, gradients within 1.8e-04 of keep's; bitwise in fp32 there,
``docs/compile.md``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from ..core import KEEP, PARTITION, Action, kind_of

__all__ = [
    "RandomDraws",
    "add_partitions",
    "budgeted_backend",
    "check",
    "is_partition",
    "partition_actions",
    "remove_partitions",
    "running",
    "save_draws_pass",
    "saves_draws",
    "saves_draws_under",
    "select",
    "select_for",
    "variants_for",
]


class _Variants:
    """A compiled block's own compiled call and one compiled call per budget."""

    def __init__(self, own: Callable[..., Any]) -> None:
        self.own = own
        self.by_budget: dict[float, Callable[..., Any]] = {}
        self.saves_draws: dict[float, bool] = {}


# Held by the module itself, as its own compiled call is: each variant refers to the module (a bound method), so
# a registry outside it would keep it alive.
_ATTRIBUTE = "_remat_partitions"


def _variants_of(module: Any) -> _Variants | None:
    return module.__dict__.get(_ATTRIBUTE) if isinstance(module, nn.Module) else None


class RandomDraws:
    """Whether the code run within this context advanced the CPU generator or ``device``'s (``.seen``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seen = False

    def _states(self) -> list[torch.Tensor]:
        states = [torch.get_rng_state()]
        if self.device.type == "cuda":
            states.append(torch.cuda.get_rng_state(self.device))
        return states

    def __enter__(self) -> RandomDraws:
        self._before = self._states()
        return self

    def __exit__(self, *exc: Any) -> None:
        after = self._states()
        self.seen = any(not torch.equal(a, b) for a, b in zip(self._before, after, strict=True))


def save_draws_pass(previous: Any = None) -> Callable[[torch.fx.Graph], None]:
    """An inductor joint-graph pass (``torch._inductor.config.joint_custom_post_pass``) that marks every seeded
    operator's output (inductor's seeds; aten's random operators where inductor leaves them) ``MUST_SAVE``, so
    the partitioner saves it rather than drawing it again in the backward (Invariant 3); it runs ``previous``,
    the passes configured before (one, a list or None), first."""
    return _save_draws_type()(previous)


@functools.cache
def _save_draws_type() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass  # imported on use: 2 s at import time

    class SaveDraws(CustomGraphPass):
        def __init__(self, previous: Any) -> None:
            # torch takes one pass or a list of them
            self.previous = (
                list(previous) if isinstance(previous, (list, tuple)) else [] if previous is None else [previous]
            )

        def __call__(self, graph: torch.fx.Graph) -> None:
            for earlier in self.previous:
                earlier(graph)
            for node in graph.nodes:
                if node.op == "call_function" and _seeded(node.target):
                    node.meta["recompute"] = CheckpointPolicy.MUST_SAVE

        def uuid(self) -> Any:  # the FX graph cache's key
            earlier = [p.uuid() if isinstance(p, CustomGraphPass) else p for p in self.previous]
            return ("remat.checkpointing.compiled_partitions.save_draws_pass", 1, *earlier)

    return SaveDraws


def _seeded(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def is_partition(action: str) -> bool:
    """Whether ``action`` is a ``partition:<budget>`` action."""
    return kind_of(action) == PARTITION


def runs_plainly(action: str) -> bool:
    """Whether a block under ``action`` runs as a plain call, with no region around it: ``keep``, or a partition
    (its compiled variant saves what its budget says)."""
    return action == KEEP or is_partition(action)


_BACKENDS: dict[Hashable, Callable[..., Any]] = {}


def budgeted_backend(
    backend: str | Callable[..., Any],
    mode: str | None,
    options: dict[str, Any] | None,
    dynamic: bool | None,
    budget: float,
) -> Callable[..., Any]:
    """The compiler ``torch.compile(backend=..., mode=..., options=...)`` would use, run with the activation
    memory budget ``budget``, as a backend of its own: dynamo keeps compiled graphs per backend, so each budget
    gets its own graph. One callable per setting and budget, shared by every block and model of the process:
    dynamo compiles a new entry for each backend callable it has not seen, up to its recompile limit."""
    key = (backend, mode, repr(sorted((options or {}).items())), dynamic, budget)
    if key not in _BACKENDS:
        compiler = _compiler(backend, mode, options, dynamic)
        save_draws = saves_draws_under(backend, options, budget)
        import torch._functorch.config as functorch_config

        def budgeted(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            with contextlib.ExitStack() as stack:
                stack.enter_context(functorch_config.patch(activation_memory_budget=budget))
                if save_draws:
                    import torch._inductor.config as inductor_config

                    marks = save_draws_pass(inductor_config.joint_custom_post_pass)
                    stack.enter_context(inductor_config.patch(joint_custom_post_pass=marks))
                return compiler(graph, example_inputs)

        _BACKENDS[key] = budgeted
    return _BACKENDS[key]


def saves_draws_under(backend: str | Callable[..., Any], options: dict[str, Any] | None, budget: float) -> bool:
    """Whether :func:`budgeted_backend` compiles variants that keep what the forward draws (Invariant 3):
    inductor, under a budget in (0, 1), with no joint-graph pass of the user's in ``options`` to replace
    :func:`save_draws_pass`."""
    return backend == "inductor" and 0.0 < budget < 1.0 and "joint_custom_post_pass" not in (options or {})


def _compiler(
    backend: str | Callable[..., Any], mode: str | None, options: dict[str, Any] | None, dynamic: bool | None
) -> Callable[..., Any]:
    """The compiler ``torch.compile(backend=..., mode=..., options=...)`` would use."""
    if callable(backend):
        if mode is not None or options is not None:
            raise ValueError("mode= and options= go with the 'inductor' backend, not with a backend callable")
        return backend
    if backend == "inductor":
        return torch._TorchCompileInductorWrapper(mode, options, dynamic)
    if mode is not None or options is not None:
        raise ValueError(f"mode= and options= go with the 'inductor' backend, not with {backend!r}")
    from torch._dynamo import lookup_backend

    return lookup_backend(backend)


def add_partitions(module: nn.Module, budgets: Iterable[float], **compile_options: Any) -> list[str]:
    """Compile ``module`` (already ``module.compile(**compile_options)``d) once more per budget in ``budgets``,
    with the same ``compile_options``, partitioned under that activation memory budget; returns the actions
    (``partition:<budget>``). Each variant compiles on its first call. Dynamo's recompile limit is raised to 8
    entries per variant (the block's own call included): they all compile the same code (``Module._call_impl``)."""
    own = getattr(module, "_compiled_call_impl", None)
    if own is None:
        raise ValueError(
            f"{type(module).__name__} is not compiled: call module.compile(...) (or "
            "remat.integrations.compile.compile_blocks) before adding partition budgets"
        )
    options = dict(compile_options)
    setting = (options.pop("backend", "inductor"), options.pop("mode", None), options.pop("options", None))
    variants = _variants_of(module)
    if variants is None:
        variants = module.__dict__[_ATTRIBUTE] = _Variants(own)
    actions = []
    for budget in budgets:
        action = Action.partition(budget).text
        budget = Action.parse(action).budget
        if budget not in variants.by_budget:
            backend = budgeted_backend(*setting, options.get("dynamic"), budget)
            variant = torch.compile(module._call_impl, backend=backend, **options)
            variants.saves_draws[budget] = saves_draws_under(setting[0], setting[2], budget)
            if not variants.saves_draws[budget]:
                variant = _refusing_draws(variant, module, action)
            variants.by_budget[budget] = variant
        actions.append(action)
    dynamo = torch._dynamo.config
    dynamo.cache_size_limit = max(dynamo.cache_size_limit, 8 * (1 + len(variants.by_budget)))
    return actions


def remove_partitions(module: nn.Module) -> Any:
    """Forget ``module``'s partition variants (nothing happens where it has none); its compiled call is left as
    it is. Returns them (None where it had none), for :func:`restore_partitions`."""
    return module.__dict__.pop(_ATTRIBUTE, None)


def restore_partitions(module: nn.Module, variants: Any) -> None:
    """Give ``module`` back the partition variants :func:`remove_partitions` returned (None: nothing)."""
    if variants is not None:
        module.__dict__[_ATTRIBUTE] = variants


def _refusing_draws(variant: Callable[..., Any], module: nn.Module, action: str) -> Callable[..., Any]:
    """``variant``, raising once a call with grad enabled draws random numbers (Invariant 3: its backward may
    draw them anew)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return variant(*args, **kwargs)
        parameter = next(module.parameters(), None)
        with RandomDraws(parameter.device if parameter is not None else torch.device("cpu")) as draws:
            output = variant(*args, **kwargs)
        if draws.seen:
            raise RuntimeError(
                f"{type(module).__name__} drew random numbers (dropout in training mode?) under {action!r}, whose "
                "compiled variant may draw them again in the backward, so the gradients would differ from keep's. "
                "Plan this block with a partition budget in (0, 1) compiled with the 'inductor' backend (its "
                "variants save the forward's seeds), or with keep or checkpoint; remat.profile offers only those"
            )
        return output

    return run


def partition_actions(module: nn.Module) -> list[str]:
    """The partition actions ``module`` was compiled for, smallest budget first (none where it has none)."""
    variants = _variants_of(module)
    return [Action.partition(b).text for b in sorted(variants.by_budget)] if variants is not None else []


def saves_draws(module: nn.Module, action: str) -> bool:
    """Whether ``module``'s variant of the partition ``action`` keeps what its forward draws, so that it stays
    exact on a block with dropout (Invariant 3); False for any other action or a budget it was not compiled for."""
    variants = _variants_of(module)
    if variants is None or not is_partition(action):
        return False
    return variants.saves_draws.get(Action.parse(action).budget, False)


def _variant(module: nn.Module, action: str) -> Callable[..., Any]:
    variants = _variants_of(module)
    if not is_partition(action):
        return variants.own if variants is not None else module._compiled_call_impl
    budget = Action.parse(action).budget
    if variants is None or budget not in variants.by_budget:
        has = partition_actions(module)
        raise ValueError(
            f"action {action!r}: {type(module).__name__} was not compiled for that budget (it has "
            f"{has or 'no partition budgets'}); compile it with "
            f"remat.integrations.compile.compile_blocks(model, partition_budgets=[{budget:g}, ...])"
        )
    return variants.by_budget[budget]


def check(module: nn.Module, action: str) -> None:
    """Raise ValueError unless ``module`` can run ``action`` (Invariant 2)."""
    if is_partition(action):
        _variant(module, action)


def select(module: nn.Module, action: str) -> None:
    """Make the variant of ``action`` ``module``'s compiled call (its own one for every non-partition action)."""
    if is_partition(action) or _variants_of(module) is not None:
        module._compiled_call_impl = _variant(module, action)


def variants_for(blocks: Sequence[tuple[str, nn.Module]], planned: Sequence[set[str]]) -> list[str]:
    """Per block, the action whose compiled variant it runs in a step whose plan gives its calls the actions
    ``planned[i]``: its partition action, else ``keep`` (its own compiled call). Raises ValueError where a block
    cannot run its partition action (Invariant 2) or its calls disagree: the variant is chosen before a block's
    compiled call starts, so every call of a block in a step runs the same one."""
    chosen = []
    for (fqn, module), actions in zip(blocks, planned, strict=True):
        partitions = {a for a in actions if is_partition(a)}
        if partitions and len(actions) > 1:
            raise ValueError(
                f"block {fqn!r} is called more than once per forward and its calls are planned {sorted(actions)}: "
                "a compiled block runs one partition per step, so give all its calls the same partition action"
            )
        action = partitions.pop() if partitions else KEEP
        try:
            check(module, action)
        except ValueError as err:
            raise ValueError(f"block {fqn!r}: {err}") from None
        chosen.append(action)
    return chosen


def select_for(blocks: Sequence[tuple[str, nn.Module]], planned: Sequence[set[str]] | None) -> None:
    """Make each block's compiled call the variant :func:`variants_for` chooses (its own one where ``planned`` is
    None); nothing changes where any block's choice is refused."""
    actions = variants_for(blocks, planned) if planned is not None else [KEEP] * len(blocks)
    for (_, module), action in zip(blocks, actions, strict=True):
        select(module, action)


@contextlib.contextmanager
def running(module: Any, action: str) -> Iterator[None]:
    """``module`` runs the variant of ``action`` within this context (its own compiled call for any other
    action, where it has variants), and what it ran before after it (Invariant 1). Nothing changes for a module
    without variants under a non-partition action."""
    if not is_partition(action) and _variants_of(module) is None:
        yield
        return
    previous = module._compiled_call_impl
    module._compiled_call_impl = _variant(module, action)
    try:
        yield
    finally:
        module._compiled_call_impl = previous
