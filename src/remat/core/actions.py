"""The action grammar: what a plan may do with a block, parsed, written and asked about in this one module.

A block's action is written as text (plans, plan files and cost tables keep the text, so old files load) and
read as an :class:`Action`, whose ``kind`` and ``arg`` say what it is:

* ``keep``: run normally, keep what autograd saves.
* ``checkpoint``: keep only the block's input; re-run the block in backward.
* ``offload``: saved tensors go to host memory and come back in backward.
* ``selective:<policy>``: per-operator policy (:mod:`remat.policies`): the operators the policy names are
  kept, the rest recomputed.
* ``partition:<budget>``: a compiled block whose compiled variant was partitioned by torch.compile under that
  activation memory budget, in [0, 1) (:mod:`remat.checkpointing.compiled_partitions`).
* ``segment:<id>``: consecutive blocks with the same id form one segment, recomputed in backward from the
  segment's stored input (the input of its first block).
* ``memory_poor:<id>``: consecutive blocks with the same id form a memory-poor group: during backward every
  block's input is recomputed from the group's input, so nothing inside the group is ever stored.

And the lossy actions, never planned unless the user asks (``allow_lossy=True`` or ``max_grad_error=``):

* ``compress:<format>[:<policy>]``: the block runs normally but the tensors it saves for backward are stored in
  a smaller number format and restored when backward uses them (:mod:`remat.checkpointing.compression`).
  Formats: ``int8`` (8-bit integers, one float32 absmax scale per block of 128 consecutive elements),
  ``int8_channel`` (one scale per channel, the last dimension), ``fp8`` (float8 e4m3, one float32 scale per
  block of 128 elements), ``fp8_tensor`` (one scale for the whole tensor). Policies say which saved tensors may
  be compressed: ``float`` (the default: every floating-point tensor the block creates) or ``matmul`` (only
  those saved by matrix products: linear layers, ``matmul``, ``bmm``...).
* ``checkpoint+compress:<format>``: a checkpoint that keeps the block's main input (the hidden state a
  checkpoint keeps to recompute from) compressed, and recomputes in backward from the restored input. The
  forward is exact; the recomputation, and so the block's gradients, see the rounded input. It saves what the
  input costs beyond its compressed copy, once nothing else holds the input.
* ``recompute+compress:<format>[:<policy>]``: a checkpoint with its input exact, whose re-run in backward is
  stored compressed, as ``compress:`` stores its forward's.

The runtime handles a chain as units (:class:`Unit`): a single block, a segment or a memory-poor group
(:func:`units_from_actions`).

Memory-poor groups were once spelled ``"nested:<id>"`` (and the group kind ``"nested"`` in
``optimal(actions=...)``). :func:`current_action` is the one place that reads the old spelling: plans, plan
files, action lists and ``actions=`` options pass through it and come out as ``"memory_poor:<id>"`` (and
``"memory_poor"``); :class:`remat.Plan` and the optimal planner warn with a DeprecationWarning when they convert.

Rules, enforced here:

1. An action's text is the one form that is stored and compared: ``Action.parse(text).text == text`` for every
   text that parses (a lossy action's policy is kept as written), but the old memory-poor spelling, which reads
   as the new one.
2. Every exact action gives the gradients of keeping everything; an action is lossy exactly when its kind is a
   compress kind, and nothing lossy is planned unless the user allows it.
3. A ``selective`` action whose policy saves operator outputs on the device allows one backward pass per
   forward (torch hands each saved output out once); every other action allows a second one.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

# Kinds. The three without an argument are also their own text, and the keys of a cost table's rows.
KEEP = "keep"
CHECKPOINT = "checkpoint"
OFFLOAD = "offload"
SELECTIVE = "selective"
PARTITION = "partition"
COMPRESS = "compress"
INPUT_COMPRESS = "checkpoint+compress"
RECOMPUTE_COMPRESS = "recompute+compress"
SEGMENT = "segment"
MEMORY_POOR = "memory_poor"

SINGLE = "single"  # the unit kind of one block
GROUP_KINDS = (SEGMENT, MEMORY_POOR)
PLAIN_KINDS = (KEEP, CHECKPOINT, OFFLOAD)
LOSSY_KINDS = (COMPRESS, INPUT_COMPRESS, RECOMPUTE_COMPRESS)

COMPRESS_FORMATS = ("int8", "int8_channel", "fp8", "fp8_tensor")
COMPRESS_POLICIES = ("float", "matmul")
DEFAULT_COMPRESS_POLICY = "float"

# Selective policies that save no operator output on the device (offload_dots keeps host copies, which serve
# every recompute), so their regions can be passed through more than once (rule 3).
SAVES_NOTHING = frozenset({"nothing_saveable", "offload_dots"})

LEGACY_MEMORY_POOR = "nested"  # the old name of MEMORY_POOR, read by current_action
_ARGUMENT_KINDS = (SELECTIVE, PARTITION, COMPRESS, INPUT_COMPRESS, RECOMPUTE_COMPRESS, SEGMENT, MEMORY_POOR)


@dataclass(frozen=True)
class Action:
    """A block's action: its ``kind`` (one of the constants above) and the argument after the first ``:``
    (a policy, a budget, a format, a group id; empty for ``keep``, ``checkpoint`` and ``offload``)."""

    kind: str
    arg: str = ""

    @staticmethod
    def parse(text: str) -> Action:
        """The action ``text`` writes (in the old memory-poor spelling too); ValueError naming the choices for
        anything else."""
        return _parse(text)

    @staticmethod
    def choice(text: str) -> Action:
        """A planner's choice: a block action, or a group kind on its own (``"segment"``, ``"memory_poor"``,
        ``"nested"``), which lets the planner form groups of that kind (the action's ``arg`` is then empty)."""
        kind = current_action(text)
        return Action(kind) if kind in GROUP_KINDS else _parse(text)

    @property
    def text(self) -> str:
        """The action as plans and cost tables store it (rule 1)."""
        return f"{self.kind}:{self.arg}" if self.arg else self.kind

    def __str__(self) -> str:
        return self.text

    # -------------------------------------------------------------------------------------- constructors

    @classmethod
    def selective(cls, policy: str) -> Action:
        return cls(SELECTIVE, policy)

    @classmethod
    def partition(cls, budget: float) -> Action:
        """``partition:<budget>``, the budget written as ``f"{budget:g}"`` (``partition:0.5``)."""
        return _parse(f"{PARTITION}:{float(budget):g}")

    @classmethod
    def compress(cls, fmt: str, policy: str = DEFAULT_COMPRESS_POLICY) -> Action:
        """``compress:<fmt>[:<policy>]`` (checked), the default policy left out."""
        return _parse(f"{COMPRESS}:{fmt}" + ("" if policy == DEFAULT_COMPRESS_POLICY else f":{policy}"))

    @classmethod
    def input_compress(cls, fmt: str) -> Action:
        """``checkpoint+compress:<fmt>`` (checked)."""
        return _parse(f"{INPUT_COMPRESS}:{fmt}")

    @classmethod
    def group(cls, kind: str, group_id: object) -> Action:
        """A ``segment`` or ``memory_poor`` group's action for blocks with id ``group_id``."""
        if kind not in GROUP_KINDS:
            raise ValueError(f"unknown group kind {kind!r}; use {SEGMENT!r} or {MEMORY_POOR!r}")
        return cls(kind, str(group_id))

    # ---------------------------------------------------------------------------------------- what it is

    @property
    def is_group(self) -> bool:
        """A segment or memory-poor group member (consecutive blocks with the same action form one unit)."""
        return self.kind in GROUP_KINDS

    @property
    def is_lossy(self) -> bool:
        """Whether the action stores anything inexactly (rule 2)."""
        return self.kind in LOSSY_KINDS

    @property
    def is_exact(self) -> bool:
        return not self.is_lossy

    @property
    def policy(self) -> str:
        """The per-operator policy of a ``selective`` action."""
        self.expect(SELECTIVE)
        return self.arg

    @property
    def budget(self) -> float:
        """The budget of a ``partition`` action, in [0, 1)."""
        self.expect(PARTITION)
        return float(self.arg)

    @property
    def compress_format(self) -> str:
        """The number format of a lossy action."""
        return self._compression()[0]

    @property
    def compress_policy(self) -> str:
        """Which saved tensors a ``compress`` or ``recompute+compress`` action compresses (``float`` or
        ``matmul``)."""
        return self._compression()[1]

    @property
    def stores(self) -> str:
        """What a block under this action keeps from its forward for its backward, in words."""
        return {
            KEEP: "everything autograd saves",
            CHECKPOINT: "its input; the rest is recomputed in backward",
            OFFLOAD: "everything autograd saves, in host memory",
            SELECTIVE: f"the operator outputs policy {self.arg!r} saves; the rest is recomputed",
            PARTITION: f"what torch.compile's partitioner saves under budget {self.arg}",
            COMPRESS: f"everything autograd saves, compressed as {self.arg}",
            INPUT_COMPRESS: f"its input compressed as {self.arg}; the rest is recomputed from it",
            RECOMPUTE_COMPRESS: f"its input; its recomputation is stored compressed as {self.arg}",
            SEGMENT: "the segment's input; the segment is recomputed in backward",
            MEMORY_POOR: "the group's input; every block's input is recomputed from it",
        }[self.kind]

    @property
    def allows_double_backward(self) -> bool:
        """Whether a block under this action can be passed through by more than one backward (rule 3)."""
        return self.kind != SELECTIVE or self.arg in SAVES_NOTHING

    def expect(self, kind: str) -> Action:
        """This action, checked to be of ``kind`` (ValueError naming the kind otherwise)."""
        if self.kind != kind:
            raise ValueError(f"{self.text!r} is not a {kind} action; write '{kind}:...'")
        return self

    def _compression(self) -> tuple[str, str]:
        if not self.is_lossy:
            raise ValueError(f"{self.text!r} is not a lossy action")
        fmt, _, policy = self.arg.partition(":")
        return fmt, policy or DEFAULT_COMPRESS_POLICY


@functools.lru_cache(maxsize=4096)
def _parse(text: str) -> Action:
    if not isinstance(text, str):
        raise TypeError(f"an action is a string such as 'keep' or 'selective:dots_saveable', got {text!r}")
    current = current_action(text)
    if current in PLAIN_KINDS:
        return Action(current)
    kind, sep, arg = current.partition(":")
    # "checkpoint+compress:int8": the kind holds no ':', so the first one ends it.
    if sep and arg and kind in _ARGUMENT_KINDS:
        action = Action(kind, arg)
        if action.is_lossy:
            _check_compression(action, text)
        elif kind == PARTITION:
            _check_budget(arg, text)
        return action
    if kind in LOSSY_KINDS:
        _check_compression(Action(kind, arg), text)
    raise ValueError(
        f"unknown action {text!r}; use 'keep', 'checkpoint', 'offload', 'selective:<policy>', "
        "'partition:<budget>', 'compress:<format>', 'checkpoint+compress:<format>', 'segment:<id>' or "
        "'memory_poor:<id>'"
    )


def _check_compression(action: Action, text: str) -> None:
    fmt, _, policy = action.arg.partition(":")
    if action.kind == INPUT_COMPRESS:
        if fmt not in COMPRESS_FORMATS or policy:
            raise ValueError(
                f"unknown compression format {action.arg!r} in {text!r}; use one of {', '.join(COMPRESS_FORMATS)} "
                "(checkpoint+compress takes no policy: it compresses the block's main input only)"
            )
        return
    policy = policy or DEFAULT_COMPRESS_POLICY
    if fmt not in COMPRESS_FORMATS:
        raise ValueError(f"unknown compression format {fmt!r} in {text!r}; use one of {', '.join(COMPRESS_FORMATS)}")
    if policy not in COMPRESS_POLICIES:
        raise ValueError(
            f"unknown compression policy {policy!r} in {text!r}; use one of {', '.join(COMPRESS_POLICIES)} "
            "('float': every floating-point tensor, 'matmul': only the inputs of matrix products)"
        )


def _check_budget(arg: str, text: str) -> None:
    try:
        budget = float(arg)
    except ValueError:
        budget = -1.0
    if not 0.0 <= budget < 1.0:
        raise ValueError(
            f"action {text!r}: a partition action names a budget in [0, 1) (a fraction of what the compiled "
            "block saves without one), like 'partition:0.5'"
        )


def validate_action(action: str) -> None:
    """Raise ValueError unless ``action`` is a block action (in the old spelling too, see :func:`current_action`)."""
    Action.parse(action)


def kind_of(action: str) -> str:
    """The kind of the action ``action`` writes."""
    return Action.parse(action).kind


# ------------------------------------------------------------------------------------------ the old spelling


def is_legacy(action: str) -> bool:
    """Whether ``action`` uses the old spelling of memory-poor groups (``"nested:<id>"`` or ``"nested"``)."""
    return action == LEGACY_MEMORY_POOR or action.startswith(LEGACY_MEMORY_POOR + ":")


def current_action(action: str) -> str:
    """``action`` in the current vocabulary: ``"nested:<id>"`` becomes ``"memory_poor:<id>"`` and the group kind
    ``"nested"`` becomes ``"memory_poor"``; every other action is returned as it is."""
    if is_legacy(action):
        return MEMORY_POOR + action[len(LEGACY_MEMORY_POOR) :]
    return action


def warn_legacy(where: str, stacklevel: int) -> None:
    """The DeprecationWarning of reading the old spelling in ``where`` (``stacklevel`` as for warnings.warn,
    counted from the caller)."""
    warnings.warn(
        f"{where} spells memory-poor groups the old way ('{LEGACY_MEMORY_POOR}:<id>', group kind "
        f"'{LEGACY_MEMORY_POOR}'); it was read as '{MEMORY_POOR}:<id>' ('{MEMORY_POOR}'). Write the new "
        "spelling: the old one will stop being read.",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


# ------------------------------------------------------------------------------------------------ units


@dataclass(frozen=True)
class Unit:
    """A run of blocks ``start..end`` (inclusive) handled as one piece by the runtime."""

    kind: str  # SINGLE, SEGMENT or MEMORY_POOR
    start: int
    end: int
    action: str  # the block action for SINGLE; "checkpoint" for the groups

    @property
    def size(self) -> int:
        return self.end - self.start + 1


def units_from_actions(actions: list[str]) -> list[Unit]:
    """Group a chain-ordered list of block actions into runtime units."""
    units: list[Unit] = []
    actions = [current_action(a) for a in actions]
    i = 0
    while i < len(actions):
        action = actions[i]
        parsed = Action.parse(action)
        if not parsed.is_group:
            units.append(Unit(SINGLE, i, i, action))
            i += 1
            continue
        j = i
        while j + 1 < len(actions) and actions[j + 1] == action:
            j += 1
        units.append(Unit(parsed.kind, i, j, CHECKPOINT))
        i = j + 1
    return units


def regroup(actions: Sequence[str], new_id: Callable[[str, str, int], object]) -> list[str]:
    """``actions`` with every group given the id ``new_id(kind, old_id, groups_so_far)`` returns, each distinct
    group renamed once; other actions as they are."""
    renamed: dict[str, str] = {}
    out = []
    for action in actions:
        parsed = Action.parse(action)
        if parsed.is_group:
            if action not in renamed:
                renamed[action] = Action(parsed.kind, str(new_id(parsed.kind, parsed.arg, len(renamed)))).text
            action = renamed[action]
        out.append(action)
    return out


# ----------------------------------------------------------------------------------------- lossy choices


def lossy_actions(lossy: Iterable[str]) -> list[str]:
    """Lossy actions from formats or actions, checked: a format (``"int8"``) gives ``compress:int8``,
    ``recompute+compress:int8`` and ``checkpoint+compress:int8``, a format with a policy (``"int8:matmul"``)
    its ``compress:`` and ``recompute+compress:`` actions, and an action (``"checkpoint+compress:fp8"``) itself."""
    if isinstance(lossy, str):
        lossy = (lossy,)
    actions: list[str] = []
    for f in lossy:
        kind = f.partition(":")[0]
        if kind in LOSSY_KINDS:
            actions.append(f)
        else:
            actions += [f"{COMPRESS}:{f}", f"{RECOMPUTE_COMPRESS}:{f}"]
            if ":" not in f:
                actions.append(f"{INPUT_COMPRESS}:{f}")
    for action in actions:
        Action.parse(action)
    return list(dict.fromkeys(actions))


def compress_action_of(compress: str) -> str:
    """``"int8"``, ``"int8:matmul"`` or ``"compress:int8"`` -> the ``compress:`` action (ValueError naming the
    choices)."""
    if compress.partition(":")[0] in LOSSY_KINDS:
        action = Action.parse(compress)
    else:
        action = Action.parse(f"{COMPRESS}:{compress}")
    if action.kind != COMPRESS:
        raise ValueError(f"{compress!r} is not a compress action; write 'compress:<format>[:<policy>]'")
    return action.text
