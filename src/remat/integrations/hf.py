"""Hugging Face transformers: a remat plan (or PGAC) on any model whose layers are ``GradientCheckpointingLayer``.

>>> session = remat.integrations.hf.enable(model, strategy="optimal", budget=0.5)
>>> Trainer(model=model, args=TrainingArguments(...), ...).train()   # activation_checkpointing left False

**How the plan is plugged in, and why.** Transformers offers one hook: ``_set_gradient_checkpointing`` gives
every ``GradientCheckpointingLayer`` a flag and a ``_gradient_checkpointing_func``, and the layer then calls
``func(partial(forward, self, **kwargs), *args)``, one layer at a time. remat does not go through it; it puts
its plan on the layers with :func:`remat.apply` (a forward pre-hook and a forward hook per layer), because:

* a per-layer function can only say *keep*, *checkpoint* or *checkpoint with a policy* for one layer. remat's
  plans also have segments (``every_k``, ``sqrt``: one stored input for several layers) and memory-poor groups,
  which span layers, and the optimal planner and PGAC use them. The hooks run all of them, and the same
  handle (``stats``, ``set_plan``, ``remove``) serves Hugging Face models as any other;
* plans change between steps without touching the model (the profiled first step, PGAC), which the flags
  and the function would have to be rewritten for;
* only one of the two may checkpoint a layer, or the layer is recomputed twice. ``enable`` switches Hugging
  Face's own gradient checkpointing off (and keeps it off if a ``Trainer`` with
  ``TrainingArguments(activation_checkpointing=True)`` (``gradient_checkpointing`` before transformers 5)
  switches it on again, with a warning): leave that argument ``False``; the plan decides.

What Hugging Face's path did for free is done here: **``use_cache`` is set to ``False``** (in
``model.config`` and, with a warning, when a training forward asks for it). A cache filled during the forward
holds every layer's keys and values until the step ends, which undoes the saving; and a recomputed layer must
not append to it a second time (remat's runtime already re-runs layers without the cache object). Hugging
Face's own checkpointing makes the same choice. ``past_key_values`` passed to a training forward is dropped
for the same reason. ``remove()`` restores the config and the flags.

The recomputation calls each layer through ``module(...)``, so module hooks run again in backward: FSDP2's
hooks expect that (they skip their work while backward runs), and DDP's are on parameters, not modules.
Apply remat before ``fully_shard`` or DDP wrapping, as for any activation checkpointing.

To use Hugging Face's own path with remat's checkpoint function instead (every layer, one policy), see
:func:`use_remat_checkpoint`.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..chains import chain_name, model_chains
from ..checkpointing import PolicyLike, checkpoint_fn
from ..core import AutocastSpec, CostTable, StepSpec
from ..planning import Plan
from ..runtime import HandleHook
from .compiled_session import CompiledSession, compiled_route
from .session import RematSession, is_deepspeed

log = logging.getLogger("remat.integrations.hf")


def _layer_class() -> type:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError as err:  # transformers missing or older than 4.52
        raise ImportError(
            "remat.integrations.hf needs transformers with transformers.modeling_layers.GradientCheckpointingLayer "
            "(4.52 or newer): pip install -U transformers"
        ) from err
    return GradientCheckpointingLayer


def is_hugging_face(model: nn.Module) -> bool:
    """Whether ``model`` is (or holds) a Hugging Face ``transformers`` model."""
    return any(type(m).__module__.startswith("transformers.") for m in model.modules())


def layers(model: nn.Module) -> Any:
    """The model's ``GradientCheckpointingLayer`` modules in module order, as ``(fqn, module)`` (outermost only):
    one chain, or a list of chains (one per layer list) for an encoder-decoder or a model with several towers,
    planned together under one budget (pass ``blocks=`` one of them to plan that one). A model without such
    layers (ConvNeXt's and ResNet's stages are plain modules) gets the chains :func:`remat.find_chains` finds.
    """
    layer_class = _layer_class()
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, layer_class) and not any(name.startswith(f + ".") for f, _ in found):
            found.append((name, module))
    if not found and not is_hugging_face(model):
        raise ValueError(
            f"{type(model).__name__} has no GradientCheckpointingLayer and no Hugging Face module, so this door "
            "finds no layers: use remat.fit(model, ...) or remat.apply(model, plan, blocks=...), or pass blocks=[...]"
        )
    if not found:
        chains = model_chains(model)
        log.info(
            "%s has no GradientCheckpointingLayer; planning the chains remat finds: %s",
            type(model).__name__,
            ", ".join(f"{chain_name(chain)} ({len(chain)})" for chain in chains),
        )
        return chains[0] if len(chains) == 1 else chains
    by_container: dict[str, list[tuple[str, nn.Module]]] = {}
    for fqn, module in found:
        by_container.setdefault(fqn.rsplit(".", 1)[0] if "." in fqn else "", []).append((fqn, module))
    if len(by_container) > 1:
        return list(by_container.values())
    return found


class HFSession(RematSession):
    """A :class:`~remat.integrations.session.RematSession` on a Hugging Face model; made by :func:`enable`."""

    def __init__(self, model: nn.Module, strategy: str, budget: Any, **kwargs: Any) -> None:
        hf_model = model.module if is_deepspeed(model) else model  # the engine's model is the Hugging Face one
        config = getattr(hf_model, "config", None)
        self._config = config
        self._use_cache = getattr(config, "use_cache", None)
        self._flag_modules = [m for m in hf_model.modules() if hasattr(m, "gradient_checkpointing")]
        if config is not None and getattr(config, "use_cache", None):
            config.use_cache = False
        self._warned: set[str] = set()
        self._guard = hf_model.register_forward_pre_hook(HandleHook(self._training_guard), with_kwargs=True)
        try:
            super().__init__(model, strategy, budget, **kwargs)
        except BaseException:
            self._restore()
            raise

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def _training_guard(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not (module.training and torch.is_grad_enabled()):
            return None
        flagged = [m for m in self._flag_modules if m.gradient_checkpointing is True]
        if flagged:
            self._warn_once(
                "hf-gc",
                "remat: Hugging Face gradient checkpointing was switched on after remat.integrations.hf.enable "
                "(TrainingArguments(activation_checkpointing=True)?); remat switched it off again, its plan decides "
                "what is recomputed. Leave activation_checkpointing (gradient_checkpointing) False.",
            )
            for m in flagged:
                m.gradient_checkpointing = False
        changed = False
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
            changed = True
            self._warn_once(
                "use_cache",
                "remat: use_cache=True in training keeps every layer's keys and values alive through the step, "
                "which undoes the memory saving; setting use_cache=False.",
            )
        if kwargs.get("past_key_values") is not None:
            kwargs["past_key_values"] = None
            changed = True
            self._warn_once(
                "past",
                "remat: past_key_values cannot be used in training with recomputation; dropping them.",
            )
        return (args, kwargs) if changed else None

    def _restore(self) -> None:
        self._guard.remove()
        if self._config is not None and self._use_cache is not None:
            self._config.use_cache = self._use_cache

    def remove(self) -> None:
        """Remove remat's hooks and restore ``config.use_cache`` and Hugging Face's checkpointing flags."""
        if self._removed:
            return
        super().remove()
        self._restore()


def enable(
    model: nn.Module,
    strategy: str = "optimal",
    budget: int | float | str | None = None,
    *,
    costs: CostTable | None = None,
    batch: Any = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    plan: Plan | None = None,
    blocks: Sequence[str] | Sequence[tuple[str, nn.Module]] | None = None,
    sync: str | None = None,
    auto_step: bool = True,
    autocast: Any = None,
    step: StepSpec | None = None,
    **options: Any,
) -> HFSession | CompiledSession:
    """Put a remat plan on a Hugging Face model's layers and return the session (``remove()`` undoes it).

    ``strategy``: ``"optimal"`` (needs ``budget``), ``"full"``, ``"every_k"`` (``k=``), ``"sqrt"``,
    ``"memory_poor"``, ``"random"``, ``"none"``, or ``"pgac"`` (:class:`remat.PGAC`; ``alpha=``, ``q=``,
    ``gamma=``...). ``budget``: bytes, a string like ``"2GiB"`` or a float in (0, 1], a fraction of the activation
    memory without checkpointing.

    No example batch is needed: the first training step runs with every layer checkpointed and is profiled, and
    the plan applies from the second step on (the end of the first step is the first ``optimizer.step()``, so the
    ``Trainer`` needs nothing more). ``batch=`` profiles a sample batch now instead, ``costs=`` plans from a
    cost table, ``plan=`` applies a plan as it is. The chain is the model's ``GradientCheckpointingLayer``
    modules (:func:`layers`; where it has none, the chains :func:`remat.find_chains` finds) unless ``blocks=``
    names others. ``main_input=``/``main_output=`` (in ``options``) name
    the hidden state a layer takes and returns where remat's guess is wrong. See the module docs for ``use_cache``.

    Mixed precision: the profiled first step runs inside the training loop's ``torch.autocast`` (the
    ``Trainer``'s with ``bf16=True`` or ``fp16=True``) and is measured under it. A ``batch=`` is profiled under
    ``autocast=`` (``torch.bfloat16``, ``"fp16"``, or :func:`trainer_autocast` of the ``TrainingArguments``);
    costs measured under another setting than the first training step's are warned about.

    ``step=`` (a :class:`remat.StepSpec`) describes the training step; its fields may be given as keywords.
    ``memory=``, ``batch=`` and ``compile=True`` take the compiled route of :func:`remat.fit` (and return its
    handle, :class:`~remat.integrations.compiled_session.CompiledSession`).
    """
    spec = StepSpec.of(step, loss_fn=loss_fn, blocks=blocks, autocast=autocast)
    chain = list(spec.blocks) if spec.blocks is not None else layers(model)
    if options.get("compile"):  # the compiled route is the front door's, with the same arguments
        compile, memory = options.pop("compile"), options.pop("memory", None)
        return compiled_route(model, memory, batch=batch, optimizer=options.pop("optimizer", None),
                              step=replace(spec, blocks=chain), compile=compile, activations=budget, plan=plan,
                              costs=costs, strategy=strategy, **options)  # fmt: skip
    return HFSession(
        model,
        strategy,
        budget,
        costs=costs,
        batch=batch,
        plan=plan,
        sync=sync,
        auto_step=auto_step,
        step=replace(spec, blocks=chain),
        **options,
    )


def trainer_autocast(args: Any, device_type: str = "cpu") -> AutocastSpec:
    """The autocast setting a ``Trainer`` with these ``TrainingArguments`` trains under: bf16 autocast with
    ``bf16=True``, fp16 with ``fp16=True``, none otherwise (``device_type``: where the model trains)."""
    if getattr(args, "bf16", False):
        return AutocastSpec(device_type, torch.bfloat16)
    if getattr(args, "fp16", False):
        return AutocastSpec(device_type, torch.float16)
    return AutocastSpec(device_type, torch.float32, enabled=False)


def trainer_step(args: Any, device_type: str = "cpu") -> StepSpec:
    """The training step a ``Trainer`` with these ``TrainingArguments`` runs, for ``remat.fit(..., step=)``: its
    autocast (:func:`trainer_autocast`), the loss alone held through the backward, and gradient accumulation
    where ``gradient_accumulation_steps`` is above 1, so that a fit with a batch measures a micro-step that starts
    with the gradients there and adds into them (``device_type``: where the model trains)."""
    return StepSpec(
        autocast=trainer_autocast(args, device_type),
        holds_output=False,
        accumulates=int(getattr(args, "gradient_accumulation_steps", 1) or 1) > 1,
    )


PGAC_STATE_FILE = "remat_pgac_{rank}.pt"  # in each of the Trainer's checkpoint-N folders, one per process


@functools.cache
def _pgac_checkpoints_class() -> type:
    from transformers import TrainerCallback

    class PGACCheckpoints(TrainerCallback):  # type: ignore[misc]
        """PGAC's state (:meth:`remat.PGAC.state_dict`) beside each of a ``Trainer``'s checkpoints, and read back
        before the first step of a run resumed from one (``trainer.train(resume_from_checkpoint=...)``); made by
        :func:`pgac_checkpoints`."""

        def __init__(self, session: RematSession) -> None:
            if session.pgac is None:
                raise ValueError(
                    "pgac_checkpoints keeps PGAC's state: give it the session of remat.fit(model, strategy='pgac', "
                    "activations=...) or hf.enable(model, 'pgac', budget)"
                )
            self.session = session
            self.resumed_from: str | None = None
            self._first_step = True

        def _path(self, args: Any, step: int) -> Path:
            rank = int(getattr(args, "process_index", 0) or 0)
            return Path(args.output_dir) / f"checkpoint-{step}" / PGAC_STATE_FILE.format(rank=rank)

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            path = self._path(args, state.global_step)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(self.session.pgac.state_dict(), path)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if not self._first_step:
                return
            self._first_step = False
            if state.global_step == 0:
                return
            path = self._path(args, state.global_step)
            if not path.exists():
                warnings.warn(
                    f"remat: this run resumes at step {state.global_step}, and PGAC's state is not at {path} (a "
                    "checkpoint outside output_dir, or saved without pgac_checkpoints): PGAC starts afresh, its first "
                    "step profiled and its schedule from step 0",
                    stacklevel=2,
                )
                return
            self.session.load_pgac_state(torch.load(path, weights_only=True))
            self.resumed_from = str(path)

    return PGACCheckpoints


def pgac_checkpoints(session: RematSession) -> Any:
    """A ``TrainerCallback`` that keeps PGAC's state in the ``Trainer``'s checkpoints: saved beside each one as
    ``remat_pgac_<process>.pt``, and loaded before the first step of a run resumed from one, so that it goes on
    with its scores, step, schedule and costs (nothing profiled again). The checkpoint is looked for where the
    ``Trainer`` writes them, ``output_dir/checkpoint-<step>``.

    >>> session = remat.fit(model, strategy="pgac", activations=0.5)
    >>> Trainer(model=model, args=args, callbacks=[hf.pgac_checkpoints(session)]).train(resume_from_checkpoint=True)
    """
    return _pgac_checkpoints_class()(session)


def disable(model: nn.Module) -> None:
    """Remove the remat plan :func:`enable` put on ``model`` (no-op when there is none)."""
    session = getattr(model, "_remat_session", None)
    if session is not None:
        session.remove()


def use_remat_checkpoint(model: nn.Module, policy: PolicyLike = None, every_n_layers: int = 1) -> None:
    """Hugging Face's own gradient checkpointing, every ``every_n_layers``-th layer, with remat's checkpoint
    function as ``_gradient_checkpointing_func`` (non-reentrant, RNG preserved, an optional per-op ``policy``
    such as ``"dots_saveable"``). For plans, budgets and PGAC use :func:`enable` instead.

    Undo with ``model.gradient_checkpointing_disable()``.
    """
    fn = functools.partial(checkpoint_fn, policy=policy) if policy is not None else checkpoint_fn
    setter = getattr(model, "_set_gradient_checkpointing", None)
    if setter is None:
        raise ValueError(f"{type(model).__name__} is not a Hugging Face PreTrainedModel with gradient checkpointing")
    extra = {"every_n_layers": every_n_layers} if every_n_layers != 1 else {}
    setter(enable=True, gradient_checkpointing_func=fn, **extra)
    if getattr(model, "config", None) is not None and getattr(model.config, "use_cache", None):
        model.config.use_cache = False
