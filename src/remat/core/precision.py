"""Mixed precision in the memory model: the autocast settings a step runs under, and blocks run with autocast's
weight-cast cache off.

Under ``torch.autocast`` every low-precision op casts its float32 weights to the autocast dtype. With the cast
cache on (autocast's default) a weight's cast is made once per autocast region and kept by the cache until the
outermost autocast context exits. Two consequences for remat:

* a block run a second time in the same region (the profiler's isolated runs, a recomputation) finds its casts
  in the cache and makes none, so measured bytes would miss them;
* a block whose activations are not kept (checkpoint, selective, segments, offload) would still leave its casts
  alive, in the cache, for the rest of the forward, although nothing in backward needs them.

So the profiler runs each block alone, and the runtime runs every block that is not ``keep``, with the cache
off (:func:`casts_uncached`: the flag a nested ``torch.autocast(..., cache_enabled=False)`` sets): every cast is
made, counted and freed where it happens. torch's checkpoint replays the autocast state of the forward,
``cache_enabled`` included, so the recomputation runs uncached too. ``keep`` blocks run under the caller's
settings: their casts are saved for backward either way, and the profiler counts them in the block's saved bytes.

:class:`AutocastSpec` is the setting itself (device type, dtype, enabled), as the profiler records it in a
:class:`~remat.core.costs.CostTable` (``costs.autocast``, plain data: :meth:`AutocastSpec.to_dict`) and as
``remat.profile(..., autocast=...)`` takes it (:func:`autocast_spec`).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

# Device types whose autocast state the runtime and the profiler look at (those torch offers autocast for).
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "hpu", "mps", "xla")

# torch's own check that any device type has autocast on (what torch.utils.checkpoint asks); absent in old torch.
_IS_ANY_AUTOCAST_ENABLED = getattr(torch._C, "_is_any_autocast_enabled", None)

# Spellings accepted for a dtype, beside torch.dtype itself.
_DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """A ``torch.dtype`` or one of its names (``"bfloat16"``, ``"bf16"``, ``"float16"``, ``"fp16"``...)."""
    if isinstance(value, torch.dtype):
        return value
    key = str(value).lower().removeprefix("torch.")
    if key not in _DTYPE_NAMES:
        raise ValueError(
            f"unknown autocast dtype {value!r}; use torch.bfloat16, torch.float16 or one of {sorted(_DTYPE_NAMES)}"
        )
    return _DTYPE_NAMES[key]


def _available(device_type: str) -> bool:
    try:
        return bool(torch.amp.is_autocast_available(device_type))
    except (RuntimeError, AttributeError):
        return False


@dataclass(frozen=True)
class AutocastSpec:
    """Autocast settings of a step: on ``device_type``, ops run in ``dtype`` when ``enabled``."""

    device_type: str
    dtype: torch.dtype
    enabled: bool = True

    @classmethod
    def current(cls, device_type: str) -> AutocastSpec:
        """The autocast state in force now for ``device_type`` (``enabled=False`` outside any autocast)."""
        if not _available(device_type):
            return cls(device_type, torch.float32, False)
        return cls(device_type, torch.get_autocast_dtype(device_type), bool(torch.is_autocast_enabled(device_type)))

    def to_dict(self) -> dict[str, Any]:
        """Plain data, as a CostTable stores it: ``{"device_type": "cpu", "dtype": "bfloat16", "enabled": True}``."""
        return {"device_type": self.device_type, "dtype": dtype_name(self.dtype), "enabled": self.enabled}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AutocastSpec:
        unknown = set(data) - {"device_type", "dtype", "enabled"}
        if unknown or "dtype" not in data:
            raise ValueError(
                f"an autocast setting needs 'dtype' and may have 'device_type' and 'enabled'; got keys {sorted(data)}"
            )
        return cls(str(data.get("device_type", "cpu")), parse_dtype(data["dtype"]), bool(data.get("enabled", True)))

    def context(self, *, cache_enabled: bool | None = None) -> Any:
        """A ``torch.autocast`` context with these settings (``cache_enabled`` as torch's default if None)."""
        if not self.enabled:
            return torch.autocast(self.device_type, enabled=False)
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=True, cache_enabled=cache_enabled)

    def describe(self) -> str:
        return f"{self.device_type} autocast to {dtype_name(self.dtype)}" if self.enabled else "no autocast"


AutocastArg = AutocastSpec | torch.dtype | str | Mapping[str, Any] | bool | None


def autocast_spec(value: AutocastArg, device_type: str) -> AutocastSpec | None:
    """The :class:`AutocastSpec` that ``value`` asks for on a step whose tensors are on ``device_type``:

    * ``None``: nothing asked (the step runs under whatever autocast context is open);
    * ``False``: no autocast; ``True``: autocast to torch's default dtype for the device;
    * a ``torch.dtype`` or its name (``torch.bfloat16``, ``"bf16"``, ``"float16"``): autocast to it;
    * a dict ``{"dtype": ..., "device_type": ..., "enabled": ...}`` or an :class:`AutocastSpec`.
    """
    if value is None or isinstance(value, AutocastSpec):
        return value
    if isinstance(value, bool):
        if not value:
            return AutocastSpec(device_type, torch.float32, False)
        return AutocastSpec(device_type, torch.get_autocast_dtype(device_type), True)
    if isinstance(value, Mapping):
        return AutocastSpec.from_dict({"device_type": device_type, **value})
    if isinstance(value, torch.dtype | str):
        return AutocastSpec(device_type, parse_dtype(value), True)
    raise TypeError(
        f"autocast={value!r} is not understood; pass a dtype (torch.bfloat16), a dict "
        "{'dtype': ..., 'device_type': ...}, a remat.core.precision.AutocastSpec, True/False or None"
    )


def precision_mismatch(recorded: Mapping[str, Any] | None, current: AutocastSpec) -> str | None:
    """Why costs recorded under ``recorded`` (``CostTable.autocast``) do not describe a step running under
    ``current``, or ``None`` when they do (or the table recorded nothing)."""
    spec = recorded_spec(recorded)
    if spec is None or (spec.enabled, spec.dtype if spec.enabled else None) == (
        current.enabled,
        current.dtype if current.enabled else None,
    ):
        return None
    return (
        f"remat: the plan was made from costs measured under {spec.describe()}, but the training step runs under "
        f"{current.describe()}; activation sizes differ between precisions, so the plan may not keep its budget. "
        "Profile in the training precision: call remat.profile inside the training loop's torch.autocast, pass "
        "autocast= (e.g. autocast=torch.bfloat16) with batch=, or give neither batch= nor costs= so the first "
        "training step is profiled"
    )


def recorded_spec(data: Mapping[str, Any] | None) -> AutocastSpec | None:
    """The spec a CostTable recorded (``costs.autocast``), or ``None`` for a table that recorded none."""
    return AutocastSpec.from_dict(data) if data else None


def active_device_types() -> list[str]:
    """Device types autocast is enabled for right now."""
    return [d for d in _DEVICE_TYPES if _available(d) and torch.is_autocast_enabled(d)]


def casts_uncached() -> AbstractContextManager[Any]:
    """A context that runs what is inside with autocast's weight-cast cache off, autocast's device types and dtypes
    unchanged; decided when called (enter it right away).

    Outside autocast, or where the cache is already off, it is a no-op context. The cache switch is one flag for
    every device type (what a nested ``torch.autocast(..., cache_enabled=False)`` sets, and torch's checkpoint
    records and replays), so the context sets that flag alone: this runs for every non-keep block of every step.
    """
    if not _any_autocast() or not torch.is_autocast_cache_enabled():
        return nullcontext()
    return _CastCacheOff()


class _CastCacheOff:
    """autocast's weight-cast cache off until exit, then on again (it was on: :func:`casts_uncached`)."""

    __slots__ = ()

    def __enter__(self) -> None:
        torch.set_autocast_cache_enabled(False)

    def __exit__(self, *exc: object) -> None:
        torch.set_autocast_cache_enabled(True)


def _any_autocast() -> bool:
    """Whether autocast is enabled for any device type now (one C call where torch has it)."""
    if _IS_ANY_AUTOCAST_ENABLED is not None:
        return bool(_IS_ANY_AUTOCAST_ENABLED())
    return bool(active_device_types())


def autocast_off() -> AbstractContextManager[Any]:
    """A context with autocast off on every device type it is on now; decided when called. A training loop
    runs its backward outside its forward's autocast context, and autocast left on there changes the
    backward's kernels (their dtypes, their time, their gradients): the profiler's backward runs under this,
    also when it is called inside the user's autocast context. A no-op outside autocast."""
    if not _any_autocast():
        return nullcontext()
    stack = ExitStack()
    for device_type in active_device_types():
        stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


def step_autocast(spec: AutocastSpec | None) -> Any:
    """The context a step asked to run under ``spec`` runs in: ``spec``'s autocast with the weight-cast cache
    off (so every cast is counted where it is made), or nothing for ``None``."""
    return nullcontext() if spec is None else spec.context(cache_enabled=False)


__all__ = [
    "AutocastArg",
    "AutocastSpec",
    "active_device_types",
    "autocast_off",
    "autocast_spec",
    "casts_uncached",
    "dtype_name",
    "parse_dtype",
    "precision_mismatch",
    "recorded_spec",
    "step_autocast",
]
