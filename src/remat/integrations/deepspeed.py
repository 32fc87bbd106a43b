"""DeepSpeed: remat's checkpoint function where DeepSpeed takes one.

* ``PipelineModule(..., activation_checkpoint_func=remat.integrations.deepspeed.activation_checkpoint_func())``:
  DeepSpeed calls ``func(run_layers, *inputs)`` every ``activation_checkpoint_interval`` layers; remat's
  function checkpoints them (non-reentrant, RNG state preserved, an optional per-op ``policy``).
* :func:`patched`: inside ``with patched():`` the name ``deepspeed.checkpointing.checkpoint``, which
  Megatron-DeepSpeed-style model code calls, is remat's function (code that imported the function itself
  with ``from deepspeed.checkpointing import checkpoint`` before keeps DeepSpeed's).
* A remat plan on a model trained by ``deepspeed.initialize``: :func:`remat.apply` (or
  :func:`remat.integrations.distributed.prepare`) on the model before ``deepspeed.initialize``, as for DDP.

What differs from DeepSpeed's own function: remat always uses torch's non-reentrant checkpoint, which needs no
``deepspeed.checkpointing.configure`` call and accepts inputs that do not require grad. DeepSpeed's options
``partition_activations``, ``cpu_checkpointing`` and ``contiguous_memory_optimization`` are DeepSpeed's
own and are not applied (remat's ``offload`` plan action keeps saved tensors in host memory instead).
remat restores the CPU and default accelerator RNG states when it recomputes, not the model-parallel RNG
tracker of Megatron-style tensor parallelism (``get_cuda_rng_tracker``): with tensor-parallel dropout, keep
DeepSpeed's function for those layers.

``import remat`` never imports DeepSpeed; this module imports it only in :func:`patched`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

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
