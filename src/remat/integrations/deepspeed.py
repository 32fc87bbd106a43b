"""DeepSpeed: remat's checkpoint function where DeepSpeed takes one.

* ``PipelineModule(..., activation_checkpoint_func=remat.integrations.deepspeed.activation_checkpoint_func())``:
  DeepSpeed calls ``func(run_layers, *inputs)`` every ``activation_checkpoint_interval`` layers; remat's
  function checkpoints them (non-reentrant, RNG state preserved, an optional per-op ``policy``).
* :func:`patched`: inside ``with patched():`` the name ``deepspeed.checkpointing.checkpoint``, which
  Megatron-DeepSpeed-style model code calls, is remat's function (code that imported the function itself
  with ``from deepspeed.checkpointing import checkpoint`` before keeps DeepSpeed's).
* ``remat.fit(engine, "22GiB", batch=sample)`` after ``deepspeed.initialize`` (ZeRO stages 1 and 2): the plan goes
  on the model the engine holds, and whole steps are measured through the engine (:class:`EngineSteps`), so its
  reduce bucket, gradient partitions, float32 parameter copies and optimizer state count in the memory. A plan
  made otherwise (:func:`remat.apply`, ``activations=``) goes on the model before ``deepspeed.initialize``.

What differs from DeepSpeed's own function: remat always uses torch's non-reentrant checkpoint, which needs no
``deepspeed.checkpointing.configure`` call and accepts inputs that do not require grad. DeepSpeed's options
``partition_activations``, ``cpu_checkpointing`` and ``contiguous_memory_optimization`` are DeepSpeed's
own and are not applied (remat's ``offload`` plan action keeps saved tensors in host memory instead).
remat replays DeepSpeed's model-parallel RNG tracker as it replays the CPU and accelerator RNG states
(:mod:`remat.checkpointing.rng`).

``import remat`` never imports DeepSpeed; this module imports it only in :func:`patched`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from ..checkpointing import PolicyLike, checkpoint_fn

#: ``checkpoint(function, *args)``: the signature of ``deepspeed.checkpointing.checkpoint``.
checkpoint = checkpoint_fn


def activation_checkpoint_func(policy: PolicyLike = None) -> Callable[..., Any]:
    """A function for DeepSpeed's ``activation_checkpoint_func=``: remat's checkpoint, with per-op ``policy``
    (e.g. ``"dots_saveable"``: matmul outputs kept, the rest recomputed) when given."""
    if policy is None:
        return checkpoint_fn
    fn = functools.partial(checkpoint_fn, policy=policy)
    functools.update_wrapper(fn, checkpoint_fn)
    return fn


def _checkpointing_module() -> Any:
    try:
        import deepspeed
    except Exception as err:  # deepspeed raises more than ImportError when its accelerator setup fails
        raise ImportError(
            f"deepspeed could not be imported ({type(err).__name__}: {err}); install it with "
            "DS_BUILD_OPS=0 pip install deepspeed"
        ) from err
    return deepspeed.checkpointing


@contextmanager
def patched(policy: PolicyLike = None) -> Iterator[Callable[..., Any]]:
    """Within the block, ``deepspeed.checkpointing.checkpoint`` is remat's checkpoint function (yielded);
    DeepSpeed's is put back on exit."""
    module = _checkpointing_module()
    original = module.checkpoint
    module.checkpoint = activation_checkpoint_func(policy)
    try:
        yield module.checkpoint
    finally:
        module.checkpoint = original


class EngineSteps:
    """A DeepSpeed engine as the wrapper a memory fit measures whole steps through
    (:class:`remat.fitting.StepWrapper`).

    ZeRO stages 1 and 2 hook every parameter's gradient: the first one of a backward allocates the reduce bucket
    (``reduce_bucket_size`` elements) and the backward counts as one of the engine's steps. While the fit runs
    the model on its own (profiles, trials) those hooks are held off (DeepSpeed's own flag for coalescing
    reductions, which makes them return at once), so no bucket is allocated and no step is left half done; each
    run through the engine ends back between steps (the state its next forward would reset).
    """

    def __init__(self, engine: nn.Module) -> None:
        self.module = engine
        self._zero = engine.optimizer if hasattr(engine.optimizer, "_coalesce_grad_reduction") else None

    @property
    def zero(self) -> bool:
        """Whether the engine runs a ZeRO optimizer (stages 1 and 2), whose steps the fit can run."""
        return self._zero is not None

    def allocate_bucket(self) -> None:
        """Allocate ZeRO's reduce bucket now, before a first training step is profiled, so that the profile does
        not count it as the step's activations (ZeRO allocates it at the backward's first gradient, as this does,
        and frees it when the backward's reduction ends)."""
        if self._zero is not None and hasattr(self._zero, "setup_buckets"):
            self._zero.setup_buckets()

    @contextmanager
    def held_off(self) -> Iterator[None]:
        zero = self._zero
        if zero is None:  # no ZeRO gradient hooks (stage 0)
            yield
            return
        before = zero._coalesce_grad_reduction
        zero.clear_backward_seen_flag()
        zero._coalesce_grad_reduction = True
        try:
            yield
        finally:
            zero._coalesce_grad_reduction = before
            zero.clear_backward_seen_flag()

    @contextmanager
    def step(self) -> Iterator[None]:
        zero = self._zero
        if zero is None:
            yield
            return
        held = zero._coalesce_grad_reduction
        zero._coalesce_grad_reduction = False
        try:
            yield
        finally:
            zero._coalesce_grad_reduction = held
            zero.clear_backward_seen_flag()
