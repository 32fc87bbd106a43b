"""The gradient error a lossy action introduces in one block, measured on the block's real inputs.

:func:`block_grad_error` runs the block's forward and backward twice from the same RNG state and the same
output gradient, once exactly (``keep``) and once under a lossy action (``compress:<format>``), and compares
the block's parameter gradients (its input gradient when it has no parameters): relative error
``||g_lossy - g|| / ||g||`` and cosine similarity. The output gradient is a seeded standard normal draw:
the true upstream gradient does not exist yet when the block is profiled during the forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..chains import main_tensor
from ..checkpointing import RngSnapshot
from ..core import KEEP, autocast_off
from .block_run import clear_grads, run_action

OUTPUT_GRAD_SEED = 1234


@dataclass(frozen=True)
class GradError:
    """How far a block's gradients under a lossy action are from the exact ones."""

    relative: float
    cosine: float


def compare(exact: list[torch.Tensor], lossy: list[torch.Tensor]) -> GradError:
    """Relative error and cosine of the concatenated ``lossy`` gradients against ``exact``."""
    if not exact:
        return GradError(0.0, 1.0)
    a = torch.cat([g.detach().reshape(-1).double() for g in exact])
    b = torch.cat([g.detach().reshape(-1).double() for g in lossy])
    norm = a.norm()
    relative = float((b - a).norm() / norm) if norm > 0 else float((b - a).norm())
    denom = norm * b.norm()
    cosine = float(a.dot(b) / denom) if denom > 0 else 1.0
    return GradError(relative, cosine)


def _gradients(
    module: nn.Module, action: str, args: tuple[Any, ...], kwargs: dict[str, Any], main: torch.Tensor,
    rng: RngSnapshot,
) -> list[torch.Tensor]:  # fmt: skip
    clear_grads(module)
    main.grad = None
    rng.restore()
    out = main_tensor(run_action(module, action, args, kwargs))
    generator = torch.Generator(device=out.device).manual_seed(OUTPUT_GRAD_SEED)
    grad = torch.randn(out.shape, dtype=out.dtype, device=out.device, generator=generator)
    with autocast_off():
        torch.autograd.backward(out, grad)
    params = [p for p in module.parameters() if p.requires_grad and p.grad is not None]
    grads = [p.grad.clone() for p in params] if params else [main.grad.clone()] if main.grad is not None else []
    clear_grads(module)
    main.grad = None
    return grads


def block_grad_error(
    module: nn.Module, action: str, args: tuple[Any, ...], kwargs: dict[str, Any], main: torch.Tensor
) -> GradError:
    """The error ``action`` introduces in ``module``'s gradients on these inputs (``main`` is the block's main
    input, a leaf requiring grad, inside ``args``/``kwargs``). The caller forks the RNG and sets gradients
    aside (as :func:`remat.profiling.block_measure.measure_block` does)."""
    rng = RngSnapshot.take(main)
    exact = _gradients(module, KEEP, args, kwargs, main, rng)
    lossy = _gradients(module, action, args, kwargs, main, rng)
    return compare(exact, lossy)


__all__ = ["GradError", "block_grad_error", "compare"]
