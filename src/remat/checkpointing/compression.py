"""Storing a block's saved tensors compressed: the codecs of the ``compress:`` formats and the saved-tensor hooks.

:func:`compressed_saving` returns a context manager that, while a block's forward runs, packs every tensor
autograd saves for backward through ``torch.autograd.graph.saved_tensors_hooks``: tensors the policy allows
are replaced by a :class:`Packed` copy (8-bit codes and float32 scales, see :mod:`remat.core.actions` for the
formats) and restored to their dtype and shape when backward unpacks them. What stays exact:

* integer, boolean and other non-floating tensors (indices, masks), and tensors that are not strided;
* tensors smaller than ``min_bytes`` (scales would cost more than they save);
* tensors that existed before the block ran (its parameters, buffers and arguments): they stay alive
  anyway, so a compressed copy would add memory instead of saving it;
* under the ``matmul`` policy, every tensor not saved by a matrix product.

A tensor saved twice in one forward (the input of three projections) is packed once.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..core import COMPRESS, Action
from .host_copies import saved_on_host
from .offload_streams import block_tensors

BLOCK = 128  # elements per scale in the block-scaled formats
MIN_BYTES = 4096
INT8_MAX = 127.0
FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0


@dataclass
class Packed:
    """A saved tensor in compressed form: codes, scales, and what restores it."""

    codes: torch.Tensor
    scale: torch.Tensor
    fmt: str
    shape: torch.Size
    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scale.numel() * self.scale.element_size()

    def restore(self) -> torch.Tensor:
        values = self.codes.float() * self.scale
        return values.reshape(-1)[: self.numel].reshape(self.shape).to(self.dtype)


def fp8_supported(device: torch.device) -> bool:
    """Whether tensors on ``device`` can be cast to and from float8 e4m3 with this torch."""
    if FP8_DTYPE is None:
        return False
    key = str(device)
    if key not in _FP8_PROBED:
        try:
            probe = torch.ones(4, device=device).to(FP8_DTYPE).float()
            _FP8_PROBED[key] = bool(probe.eq(1).all())
        except (RuntimeError, TypeError):
            _FP8_PROBED[key] = False
    return _FP8_PROBED[key]


_FP8_PROBED: dict[str, bool] = {}


def pack(t: torch.Tensor, fmt: str) -> Packed:
    """``t`` compressed in format ``fmt`` (one of :data:`remat.core.COMPRESS_FORMATS`)."""
    x = t.detach()
    numel = x.numel()
    if fmt == "int8_channel":
        rows = x.reshape(-1, x.shape[-1]).float()
        scale = rows.abs().amax(0, keepdim=True).clamp_min(1e-30) / INT8_MAX
        codes = torch.round(rows / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return Packed(codes, scale, fmt, x.shape, x.dtype, numel)
    flat = x.reshape(-1)
    if fmt == "fp8_tensor":
        rows = flat.float().reshape(1, -1)
    else:
        pad = (-numel) % BLOCK
        rows = torch.nn.functional.pad(flat, (0, pad)).float().reshape(-1, BLOCK)
    absmax = rows.abs().amax(1, keepdim=True).clamp_min(1e-30)
    if fmt == "int8":
        scale = absmax / INT8_MAX
        codes = torch.round(rows / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    elif fmt in ("fp8", "fp8_tensor"):
        if not fp8_supported(x.device):
            raise RuntimeError(
                f"float8 e4m3 is not supported on {x.device} with torch {torch.__version__}; use 'compress:int8'"
            )
        scale = absmax / FP8_MAX
        codes = (rows / scale).to(FP8_DTYPE)
    else:
        raise ValueError(f"unknown compression format {fmt!r}")
    return Packed(codes, scale, fmt, x.shape, x.dtype, numel)


class _InMatmul(TorchFunctionMode):
    """Marks, per thread, the calls of matrix products, so the pack hook knows who saves a tensor."""

    NAMES = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "__matmul__", "__rmatmul__"})

    def __init__(self, flag: threading.local) -> None:
        super().__init__()
        self.flag = flag

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "__name__", "") not in self.NAMES:
            return func(*args, **(kwargs or {}))
        self.flag.depth = getattr(self.flag, "depth", 0) + 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.flag.depth -= 1


class CompressingHooks:
    """The pack and unpack hooks of one block's forward under one ``compress:`` action."""

    def __init__(self, action: str, existing: Iterable[Any], min_bytes: int = MIN_BYTES) -> None:
        parsed = Action.parse(action).expect(COMPRESS)
        self.fmt, self.policy = parsed.compress_format, parsed.compress_policy
        self.min_bytes = min_bytes
        self.existing = {_storage_ptr(t) for t in existing if isinstance(t, torch.Tensor)}
        self.flag = threading.local()
        self.seen: dict[int, tuple[weakref.ref, int, Packed]] = {}
        self.packed_bytes = 0

    def compressible(self, t: torch.Tensor) -> bool:
        if not t.is_floating_point() or t.layout != torch.strided or t.dtype == FP8_DTYPE:
            return False
        if t.numel() * t.element_size() < self.min_bytes or t.dim() == 0:
            return False
        if self.policy == "matmul" and getattr(self.flag, "depth", 0) == 0:
            return False
        return _storage_ptr(t) not in self.existing

    def pack_hook(self, t: torch.Tensor) -> Any:
        if not self.compressible(t):
            return t
        entry = self.seen.get(id(t))
        if entry is not None and entry[0]() is t and entry[1] == t._version:
            return entry[2]
        packed = pack(t, self.fmt)
        self.packed_bytes += packed.nbytes
        with suppress(TypeError):  # a tensor type without weak references is packed each time it is saved
            self.seen[id(t)] = (weakref.ref(t), t._version, packed)
        return packed

    @staticmethod
    def unpack_hook(saved: Any) -> torch.Tensor:
        return saved.restore() if isinstance(saved, Packed) else saved

    @contextmanager
    def active(self) -> Iterator[CompressingHooks]:
        with ExitStack() as stack:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.pack_hook, self.unpack_hook))
            if self.policy == "matmul":
                stack.enter_context(_InMatmul(self.flag))
            try:
                yield self
            finally:
                self.seen.clear()


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -1


def compressed_saving(action: str, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A context manager storing what ``module`` saves for backward under ``action`` (``compress:...``)
    compressed, while it runs on ``args``/``kwargs``."""
    return CompressingHooks(action, block_tensors(module, args, kwargs)).active()


def saving_context(action: str, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The context storing what ``module`` saves under ``action`` elsewhere than as is: compressed for a
    ``compress:`` action, on the host for ``offload`` (pinned for CUDA tensors)."""
    if Action.parse(action).is_lossy:
        return compressed_saving(action, module, args, kwargs)
    return saved_on_host()


__all__ = [
    "CompressingHooks",
    "Packed",
    "compressed_saving",
    "fp8_supported",
    "pack",
    "saving_context",
]
