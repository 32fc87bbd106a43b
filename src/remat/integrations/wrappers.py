"""Whether a model was already wrapped for data parallelism (DDP, FSDP, DeepSpeed) or sharded with FSDP2.

Remat's hooks go on the blocks before the model is wrapped or sharded; the session and the distributed helpers
ask here to refuse the wrong order with a message that says which order works.
"""

from __future__ import annotations

from torch import nn


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` or one of its modules was sharded with FSDP2's ``fully_shard``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def is_wrapped(model: nn.Module) -> bool:
    """Whether ``model`` itself is a DDP, FSDP (version 1) or DeepSpeed wrapper around the model."""
    return isinstance(model, nn.parallel.DistributedDataParallel) or type(model).__name__ in (
        "FullyShardedDataParallel",
        "DeepSpeedEngine",
    )
