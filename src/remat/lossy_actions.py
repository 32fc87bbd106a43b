"""The vocabulary of lossy storage: ``compress:<format>[:<policy>]`` actions, read without torch.

A ``compress`` action runs its block normally but stores the tensors the block saves for backward in a smaller
number format, restoring them when backward uses them (:mod:`remat.compression` does the work). Formats:

* ``int8``: 8-bit integers with one float32 absmax scale per block of 128 consecutive elements;
* ``int8_channel``: 8-bit integers with one scale per channel (the last dimension);
* ``fp8``: float8 e4m3 with one float32 scale per block of 128 elements;
* ``fp8_tensor``: float8 e4m3 with one scale for the whole tensor.

Policies say which saved tensors may be compressed: ``float`` (the default: every floating-point tensor the
block creates) or ``matmul`` (only those saved by matrix products: linear layers, ``matmul``, ``bmm``...).
A ``checkpoint+compress:<format>`` action checkpoints its block but stores the block's main input (the hidden
state a checkpoint keeps to recompute from) compressed in ``<format>``, and recomputes in backward from the
restored input (:mod:`remat.input_compression`). The forward is exact; the recomputation, and so the block's
gradients, see the rounded input. It saves what the input costs beyond its compressed copy, once nothing else
holds the input (the block before does not keep its own output; a model that collects hidden states does).

A ``recompute+compress:<format>[:<policy>]`` action checkpoints its block with its input exact, but stores
what the block's re-run in backward saves compressed, as ``compress:`` stores its forward's
(:mod:`remat.recompute_compression`): the backward of a recomputed block then holds what a compressed one
holds, not all its activations at full precision.

Lossy actions are never planned unless the user asks (``allow_lossy=True`` or ``max_grad_error=``).
"""

from __future__ import annotations

from collections.abc import Iterable

COMPRESS_PREFIX = "compress:"
COMPRESS_FORMATS = ("int8", "int8_channel", "fp8", "fp8_tensor")
COMPRESS_POLICIES = ("float", "matmul")
DEFAULT_POLICY = "float"
INPUT_COMPRESS_PREFIX = "checkpoint+compress:"
RECOMPUTE_COMPRESS_PREFIX = "recompute+compress:"


def is_lossy(action: str) -> bool:
    """Whether ``action`` stores anything inexactly (``compress:``, ``checkpoint+compress:`` or
    ``recompute+compress:``)."""
    return action.startswith((COMPRESS_PREFIX, INPUT_COMPRESS_PREFIX, RECOMPUTE_COMPRESS_PREFIX))


def compresses_recompute(action: str) -> bool:
    """Whether ``action`` is a ``recompute+compress:<format>[:<policy>]`` action (a checkpoint whose re-run is
    stored compressed)."""
    return action.startswith(RECOMPUTE_COMPRESS_PREFIX)


def compresses_input(action: str) -> bool:
    """Whether ``action`` is a ``checkpoint+compress:<format>`` action (a checkpoint with a compressed input)."""
    return action.startswith(INPUT_COMPRESS_PREFIX)


def parse_input_compress(action: str) -> str:
    """The format of a ``checkpoint+compress:<format>`` action; ValueError naming the choices if unknown."""
    if not compresses_input(action):
        raise ValueError(f"{action!r} is not a checkpoint+compress action; write 'checkpoint+compress:<format>'")
    fmt = action[len(INPUT_COMPRESS_PREFIX) :]
    if fmt not in COMPRESS_FORMATS:
        raise ValueError(
            f"unknown compression format {fmt!r} in {action!r}; use one of {', '.join(COMPRESS_FORMATS)} "
            "(checkpoint+compress takes no policy: it compresses the block's main input only)"
        )
    return fmt


def input_compress_action(fmt: str) -> str:
    """The action checkpointing a block with its input stored in ``fmt`` (checked), e.g.
    ``checkpoint+compress:int8``."""
    action = INPUT_COMPRESS_PREFIX + fmt
    parse_input_compress(action)
    return action


def validate_lossy(action: str) -> None:
    """Raise ValueError unless ``action`` is a well-formed lossy action."""
    if compresses_input(action):
        parse_input_compress(action)
    elif compresses_recompute(action):
        parse_compress(COMPRESS_PREFIX + action[len(RECOMPUTE_COMPRESS_PREFIX) :])
    else:
        parse_compress(action)


def parse_compress(action: str) -> tuple[str, str]:
    """The ``(format, policy)`` of a ``compress:<format>[:<policy>]`` action; ValueError naming the choices if
    the format or the policy is unknown."""
    if not action.startswith(COMPRESS_PREFIX):
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


def lossy_actions(lossy: Iterable[str]) -> list[str]:
    """Lossy actions from formats or actions, checked: a format (``"int8"``) gives ``compress:int8``,
    ``recompute+compress:int8`` and ``checkpoint+compress:int8``, a format with a policy (``"int8:matmul"``)
    its ``compress:`` and ``recompute+compress:`` actions, and an action (``"checkpoint+compress:fp8"``) itself."""
    if isinstance(lossy, str):
        lossy = (lossy,)
    actions: list[str] = []
    for f in lossy:
        if is_lossy(f):
            actions.append(f)
        else:
            actions += [COMPRESS_PREFIX + f, RECOMPUTE_COMPRESS_PREFIX + f]
            if ":" not in f:
                actions.append(INPUT_COMPRESS_PREFIX + f)
    for action in actions:
        validate_lossy(action)
    return list(dict.fromkeys(actions))


__all__ = [
    "COMPRESS_FORMATS",
    "COMPRESS_POLICIES",
    "COMPRESS_PREFIX",
    "INPUT_COMPRESS_PREFIX",
    "RECOMPUTE_COMPRESS_PREFIX",
    "compress_action",
    "compresses_input",
    "compresses_recompute",
    "input_compress_action",
    "is_lossy",
    "lossy_actions",
    "parse_compress",
    "parse_input_compress",
    "validate_lossy",
]
