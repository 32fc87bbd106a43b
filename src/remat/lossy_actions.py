"""The vocabulary of lossy storage: ``compress:<format>[:<policy>]`` actions, read without torch.

A ``compress`` action runs its block normally but stores the tensors the block saves for backward in a smaller
number format, restoring them when backward uses them (:mod:`remat.compression` does the work). Formats:

* ``int8``: 8-bit integers with one float32 absmax scale per block of 128 consecutive elements;
* ``int8_channel``: 8-bit integers with one scale per channel (the last dimension);
* ``fp8``: float8 e4m3 with one float32 scale per block of 128 elements;
* ``fp8_tensor``: float8 e4m3 with one scale for the whole tensor.

Policies say which saved tensors may be compressed: ``float`` (the default: every floating-point tensor the
block creates) or ``matmul`` (only those saved by matrix products: linear layers, ``matmul``, ``bmm``...).
Lossy actions are never planned unless the user asks (``allow_lossy=True`` or ``max_grad_error=``).
"""

from __future__ import annotations

COMPRESS_PREFIX = "compress:"
COMPRESS_FORMATS = ("int8", "int8_channel", "fp8", "fp8_tensor")
COMPRESS_POLICIES = ("float", "matmul")
DEFAULT_POLICY = "float"


def is_lossy(action: str) -> bool:
    """Whether ``action`` stores anything inexactly (a ``compress:`` action)."""
    return action.startswith(COMPRESS_PREFIX)


def parse_compress(action: str) -> tuple[str, str]:
    """The ``(format, policy)`` of a ``compress:<format>[:<policy>]`` action; ValueError naming the choices if
    the format or the policy is unknown."""
    if not is_lossy(action):
        raise ValueError(f"{action!r} is not a compress action; write 'compress:<format>[:<policy>]'")
    fmt, _, policy = action[len(COMPRESS_PREFIX) :].partition(":")
    policy = policy or DEFAULT_POLICY
    if fmt not in COMPRESS_FORMATS:
        raise ValueError(f"unknown compression format {fmt!r} in {action!r}; use one of {', '.join(COMPRESS_FORMATS)}")
    if policy not in COMPRESS_POLICIES:
        raise ValueError(
            f"unknown compression policy {policy!r} in {action!r}; use one of {', '.join(COMPRESS_POLICIES)} "
            "('float': every floating-point tensor, 'matmul': only the inputs of matrix products)"
        )
    return fmt, policy


def compress_action(fmt: str, policy: str = DEFAULT_POLICY) -> str:
    """The action string of ``fmt`` under ``policy`` (checked), e.g. ``compress:int8``."""
    action = COMPRESS_PREFIX + fmt + ("" if policy == DEFAULT_POLICY else ":" + policy)
    parse_compress(action)
    return action


__all__ = [
    "COMPRESS_FORMATS",
    "COMPRESS_POLICIES",
    "COMPRESS_PREFIX",
    "compress_action",
    "is_lossy",
    "parse_compress",
]
