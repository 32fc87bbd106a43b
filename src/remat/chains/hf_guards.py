"""Hugging Face settings that a remat training step must check: the key/value cache, Hugging Face's own gradient
checkpointing, and its collection of extra outputs. Nothing here imports ``transformers``: the checks read
attributes (``config.use_cache``, ``module.gradient_checkpointing``) and the output collector only when
``transformers`` is already loaded.

* ``use_cache``: a causal language model's config asks for a cache by default, also in training. A cache
  filled in the forward keeps every layer's keys and values alive through the step, and a recomputed layer
  (which runs without it) would save different tensors than the forward did: a selective region then fails in
  backward (``aten.clone.default invocation index ... not found in storage``) and a checkpointed one can differ
  in the last bits. Training forwards under :func:`training_forward_guards` (installed by ``remat.apply``) and
  under :func:`profiled_step` (``remat.profile``) run with ``use_cache=False``, as Hugging Face's own
  checkpointing does; the model's config is left as it was.
* Hugging Face's gradient checkpointing (``model.gradient_checkpointing_enable()`` or
  ``TrainingArguments(gradient_checkpointing=True)``): with it on, a profile would measure checkpointed layers
  and a plan would recompute them twice. ``remat.profile`` switches it off for the profiled step with a warning;
  ``remat.apply`` refuses (:func:`refuse_hf_checkpointing`).
* LayerDrop (``config.layerdrop``, ``encoder_layerdrop``, ``decoder_layerdrop``, copied to the stacks'
  ``layerdrop``: wav2vec 2.0, HuBERT, Whisper, BART...): a training forward skips each layer with that
  probability. :func:`profiled_step` sets them to 0 for the profiled step, so that every layer runs and is
  measured (a step that skips layers holds less than the prediction), and the profile records it
  (``CostTable.info["layer_drop"]``); a segment or memory-poor group cannot span a skipped layer, so plans of such
  a table use single-block actions only, and ``remat.apply`` refuses a group on a model that drops layers
  (:func:`refuse_groups_under_layer_drop`).
* collected outputs (:func:`outputs_not_collected`): see :mod:`remat.chains.model_state`.

Other libraries' checkpointing is checked here too (:func:`refuse_recomputed_blocks`, called by ``remat.profile``
and ``remat.apply``): blocks wrapped by torch's ``checkpoint_wrapper`` (``CheckpointWrapper``: torchtitan's
``FullAC``, ``apply_activation_checkpointing``), marked by torch's composable ``checkpoint(module)``, or recomputed
by Megatron-Core (``config.recompute_granularity``). A profile of them would measure recomputed blocks and a plan
would recompute them twice, so they are refused with the wrapper named and how to turn it off.
"""

from __future__ import annotations

import logging
import sys
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..core import Action

log = logging.getLogger("remat")

USE_CACHE_NOTE = (
    "remat: use_cache=True in a training step keeps every layer's keys and values alive through the step and "
    "cannot be recomputed; this model's training forwards run with use_cache=False (as with Hugging Face's own "
    "gradient checkpointing). Pass use_cache=False yourself to silence this note."
)


def cache_configs(model: nn.Module) -> list[Any]:
    """The distinct configs in ``model`` (a Hugging Face model, or one wrapping one) with a ``use_cache`` setting."""
    found: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and isinstance(getattr(config, "use_cache", None), bool):
            found.setdefault(id(config), config)
    return list(found.values())


def hf_checkpointing_modules(model: nn.Module) -> list[nn.Module]:
    """Modules with Hugging Face's gradient checkpointing switched on."""
    return [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]


_NOTED_MODELS: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models told about use_cache once


class _CacheOff:
    """Forward hooks on the model: a training forward runs with ``use_cache=False`` and the configs as before."""

    def __init__(self, model: nn.Module) -> None:
        self.configs = cache_configs(model)
        self._switched: list[list[Any]] = []

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not (module.training and torch.is_grad_enabled()):
            self._switched.append([])
            return None
        # Once per model, and not where the model's own config says use_cache=False: a sub-model's copy of the
        # config (T5's decoder stack) still saying True is switched off silently, as the user asked.
        user_off = getattr(getattr(module, "config", None), "use_cache", None) is False
        configs = [config for config in self.configs if config.use_cache is True]
        for config in configs:
            config.use_cache = False
        self._switched.append(configs)
        asked = kwargs.get("use_cache") is True
        if asked:
            kwargs = {**kwargs, "use_cache": False}
        if (asked or (configs and not user_off)) and module not in _NOTED_MODELS:
            _NOTED_MODELS.add(module)
            log.warning(USE_CACHE_NOTE)
        return (args, kwargs) if asked else None

    def after(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._switched:
            for config in self._switched.pop():
                config.use_cache = True


def training_forward_guards(model: nn.Module, wrap: Any = None) -> list[Any]:
    """Install the ``use_cache`` guard on ``model``'s forward; returns the hook handles (``.remove()`` them).

    ``wrap`` (optional) is applied to each hook function before it is registered.
    """
    guard = _CacheOff(model)
    before, after = guard.before, guard.after
    if wrap is not None:
        before, after = wrap(before), wrap(after)
    return [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True, always_call=True),
    ]


def layer_drop_settings(model: nn.Module) -> list[tuple[Any, str]]:
    """Every ``(holder, attribute)`` in ``model`` that sets a LayerDrop probability above 0: the configs'
    ``layerdrop``, ``encoder_layerdrop`` and ``decoder_layerdrop``, and the modules' ``layerdrop`` copied from
    them."""
    found: dict[tuple[int, str], tuple[Any, str]] = {}
    for module in model.modules():
        for holder in (module, getattr(module, "config", None)):
            if holder is None:
                continue
            names = [n for n in vars(holder) if n.endswith("layerdrop")] if hasattr(holder, "__dict__") else []
            for name in names:
                value = getattr(holder, name)
                if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
                    found.setdefault((id(holder), name), (holder, name))
    return list(found.values())


def drops_layers(model: nn.Module) -> bool:
    """Whether ``model``'s training forward may skip layers (LayerDrop above 0)."""
    return bool(layer_drop_settings(model))


def refuse_groups_under_layer_drop(model: nn.Module, actions: Iterator[str] | list[str],
                                   settings: list[tuple[Any, str]]) -> None:  # fmt: skip
    """Raise where ``actions`` hold a segment or memory-poor group and ``model`` drops layers in training (its
    :func:`layer_drop_settings`, ``settings``): a skipped layer breaks the group's chain of outputs in the middle
    of a step."""
    grouped = sorted({a for a in actions if Action.choice(a).is_group})
    if grouped and settings:
        named = ", ".join(f"{type(holder).__name__}.{name}={getattr(holder, name)}" for holder, name in settings[:3])
        raise ValueError(
            f"the plan groups blocks ({', '.join(grouped)}), and {type(model).__name__} skips layers in training "
            f"(LayerDrop: {named}): a group cannot span a skipped layer. Plan single-block actions (a profile of "
            "this model does so by itself), or set the LayerDrop probabilities to 0"
        )


@contextmanager
def every_layer_runs(model: nn.Module) -> Iterator[None]:
    """Within, ``model``'s LayerDrop probabilities are 0 (:func:`layer_drop_settings`); as they were afterwards."""
    dropping = [(holder, name, getattr(holder, name)) for holder, name in layer_drop_settings(model)]
    for holder, name, _ in dropping:
        setattr(holder, name, 0.0)
    try:
        yield
    finally:
        for holder, name, value in dropping:
            setattr(holder, name, value)


@contextmanager
def profiled_step(model: nn.Module) -> Iterator[None]:
    """Around ``remat.profile``'s step: ``use_cache`` off, Hugging Face's checkpointing off (with a warning),
    LayerDrop off (every layer runs and is measured); all as they were afterwards."""
    flagged = hf_checkpointing_modules(model)
    if flagged:
        warnings.warn(
            f"remat.profile: Hugging Face gradient checkpointing is on in {type(model).__name__}; it is switched "
            "off for the profiled step (so the costs are those of the layers themselves) and back on afterwards. "
            "Switch it off before remat.apply (model.gradient_checkpointing_disable()), or use "
            "remat.integrations.hf.enable, which does.",
            stacklevel=3,
        )
    hooks = training_forward_guards(model)
    for module in flagged:
        module.gradient_checkpointing = False
    try:
        with every_layer_runs(model):
            yield
    finally:
        for module in flagged:
            module.gradient_checkpointing = True
        for hook in hooks:
            hook.remove()


def refuse_hf_checkpointing(model: nn.Module) -> None:
    """Raise when Hugging Face's gradient checkpointing is on: a plan on top would recompute layers twice."""
    flagged = hf_checkpointing_modules(model)
    if flagged:
        raise RuntimeError(
            f"Hugging Face gradient checkpointing is on in {type(model).__name__} ({len(flagged)} modules): a remat "
            "plan on top of it would recompute the layers twice. Call model.gradient_checkpointing_disable() "
            "(and leave TrainingArguments(gradient_checkpointing=False)) before remat.apply, or use "
            "remat.integrations.hf.enable, which switches it off for you."
        )


def recomputed_by(module: nn.Module) -> str | None:
    """What other checkpointing recomputes ``module`` already, in words, or None."""
    if type(module).__name__ == "CheckpointWrapper" or hasattr(module, "_checkpoint_wrapped_module"):
        return (
            "torch's checkpoint_wrapper (CheckpointWrapper: torchtitan's FullAC, apply_activation_checkpointing); "
            "build the model without it (torchtitan: activation_checkpoint.mode 'none') and let remat plan the layers"
        )
    contract = sys.modules.get("torch.distributed._composable.contract")
    registry = getattr(contract, "_get_registry", None)
    if registry is not None and "checkpoint" in (registry(module) or {}):
        return "torch's composable checkpoint(module); leave it out where remat plans the blocks"
    config = getattr(module, "config", None)
    if megatron_recomputes(config):
        return (
            f"Megatron-Core's recompute (config.recompute_granularity={config.recompute_granularity!r}); set "
            "recompute_granularity=None where remat plans the layers"
        )
    return None


def megatron_recomputes(config: Any) -> bool:
    """Whether ``config`` is a Megatron-Core config with its own recompute on (``recompute_granularity``)."""
    return getattr(config, "recompute_granularity", None) is not None and hasattr(config, "recompute_method")


def refuse_recomputed_blocks(chain: list[tuple[str, nn.Module]]) -> None:
    """Raise where a block of ``chain`` is recomputed by other checkpointing already (:func:`recomputed_by`)."""
    for fqn, module in chain:
        why = recomputed_by(module)
        if why is not None:
            raise RuntimeError(
                f"block {fqn!r} is recomputed already by {why}. A remat profile would measure recomputed blocks and "
                "a plan would recompute them twice."
            )


def _hf_collector() -> Any:
    """Hugging Face's output collector (a context variable), when transformers is loaded and has one."""
    module = sys.modules.get("transformers.utils.output_capturing")
    return getattr(module, "_active_collector", None) if module is not None else None


def outputs_collected() -> bool:
    """Whether Hugging Face's layer hooks are collecting hidden states, attentions or router logits now."""
    collector = _hf_collector()
    return collector is not None and collector.get() is not None


@contextmanager
def outputs_not_collected() -> Iterator[None]:
    """Within this context, Hugging Face's layer hooks collect no hidden states, attentions or router logits."""
    collector = _hf_collector()
    if collector is None or collector.get() is None:
        yield
        return
    token = collector.set(None)
    try:
        yield
    finally:
        collector.reset(token)
