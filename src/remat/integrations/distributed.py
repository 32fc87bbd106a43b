"""DDP and FSDP2: the plan goes on the model first, then the model is wrapped or sharded, on every rank alike.

The order is the one PyTorch's own recipes use (torchtitan applies activation checkpointing, then
``fully_shard``): remat's hooks are on the blocks before DDP wraps the model or ``fully_shard`` turns the
blocks into FSDP modules. FSDP2's pre-forward hook is registered first in line (``prepend=True``) and its
post-forward hook after remat's, so every checkpoint region opens after the block's parameters were
all-gathered and closes before they are freed; in backward, recomputation calls the blocks again and FSDP2
skips its forward hooks while backward runs (unsharding in its pre-backward hook instead). Every exact plan
(checkpoint, segments, memory-poor groups, keep) gives the gradients of the unsharded model without
checkpointing; ``tests/test_integration_distributed.py`` checks it on two CPU processes.

>>> session = prepare(model, "optimal", 0.5, batch=sample)     # each rank; rank 0's costs are used by all
>>> fully_shard_blocks(model, session, mesh=mesh)               # or: model = DistributedDataParallel(model)

Every rank must run the same plan (a rank recomputing a block the others keep would all-gather alone under
FSDP2), so with more than one rank the session broadcasts rank 0's cost table (``sync="global"``).

Profiling: under DDP the first training step can be the profiled one (no batch needed). Under FSDP2 it
cannot, because profiling runs each block on its own, outside the step, and FSDP2 frees the block's
parameters after every forward: pass ``batch=`` (profiled before sharding) or ``costs=`` to :func:`prepare`.
The same holds for ``strategy="pgac"``.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..core import CostTable
from ..planning import Plan
from .session import ALREADY_SHARDED, RematSession, is_sharded, is_wrapped


def free_port() -> int:
    """A TCP port free on this host now, for ``MASTER_PORT`` in tests and examples."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_backend() -> str:
    """``"nccl"`` when CUDA is available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def prepare(
    model: nn.Module,
    strategy: str = "optimal",
    budget: int | float | str | None = None,
    *,
    batch: Any = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    costs: CostTable | None = None,
    plan: Plan | None = None,
    blocks: Sequence[str] | Sequence[tuple[str, nn.Module]] | None = None,
    sync: str | None = None,
    process_group: Any = None,
    **options: Any,
) -> RematSession:
    """Put a remat plan (or PGAC) on ``model`` before it is wrapped in DDP or sharded with ``fully_shard``.

    Arguments as for :class:`~remat.integrations.session.RematSession`. Call it on every rank, after
    ``init_process_group``; with ``batch=`` each rank profiles its sample and rank 0's table is used by all.
    """
    if is_wrapped(model):
        raise ValueError(
            f"the model is already wrapped ({type(model).__name__}); put the plan on the inner model first, then "
            "wrap it: session = prepare(model, ...); model = DistributedDataParallel(model)"
        )
    if is_sharded(model):
        raise ValueError(ALREADY_SHARDED)
    return RematSession(
        model,
        strategy,
        budget,
        batch=batch,
        loss_fn=loss_fn,
        costs=costs,
        plan=plan,
        blocks=blocks,
        sync=sync,
        process_group=process_group,
        **options,
    )


def fully_shard_blocks(model: nn.Module, session: RematSession, **fsdp_options: Any) -> nn.Module:
    """FSDP2's recipe after the plan: ``fully_shard`` each block of the session's chain, then the root.

    ``fsdp_options`` go to ``fully_shard`` (``mesh=``, ``reshard_after_forward=``, ``mp_policy=``...).
    Returns ``model`` (sharded in place).
    """
    from torch.distributed.fsdp import fully_shard

    pgac = session.pgac
    if session.profiling or (pgac is not None and pgac.costs is None):
        raise RuntimeError(
            "FSDP2 needs the plan before the first step: remat cannot profile blocks whose parameters fully_shard "
            "frees after each forward. Pass batch=<a sample batch> (profiled now, before sharding) or costs= to "
            "prepare()"
        )
    for _, block in session.handle.blocks:
        fully_shard(block, **fsdp_options)
    fully_shard(model, **fsdp_options)
    return model


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole (FSDP2 shards gathered), by the unwrapped model's parameter names.

    A collective under FSDP2: call it on every rank.
    """
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    grads: dict[str, torch.Tensor] = {}
    for name, param in inner.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        full = getattr(grad, "full_tensor", None)
        grads[name] = (full() if full is not None else grad).detach().clone()
    return grads
