"""The CostTable: plain data describing what each block of a chain costs in seconds and bytes.

Rows are produced by :func:`remat.profile` (measured on the real device) or by :mod:`remat.profiling.estimate`
(meta device / analytic). Planners and the simulator in :mod:`remat.planning.simulator` read them; nothing here touches
torch.

Memory terms, all in bytes, for block ``i`` run on its own with its input already alive:

* ``saved_bytes[action]``: bytes still alive after the block's forward under ``action`` (``"keep"``,
  ``"checkpoint"``, ``"selective:<policy>"``, ``"offload"``). This includes the block's output and what
  autograd saved for backward, but not the block's input (which belongs to the block before).
* ``fwd_temp_bytes``: extra bytes alive for a moment during the forward, above ``saved_bytes["keep"]``.
* ``bwd_temp_bytes``: extra bytes alive during the block's backward above what was saved (gradients in
  flight, workspace), measured under ``"keep"``.
* ``bwd_extra_bytes[action]``: how much higher the block's backward peaks under ``action`` than under
  ``"keep"`` (a selective region holds its cached outputs and kept dropout draws while it recomputes the
  rest); absent means 0. For a lossy action it is the higher of its forward and backward peaks against
  keep's backward peak, negative when both are lower (its backward restores one autograd node's tensors at
  a time; its forward holds full tensors and their compressed copies at once).

The transients are read from peaks (:func:`temp_terms`): ``fwd_temp_bytes`` from keep's forward peak,
``bwd_temp_bytes`` and ``bwd_extra_bytes`` from each action's backward peak. ``peak_summits`` keeps what the
peaks are the largest of: the live bytes at every local maximum of the block's run, keep's forward under
``"forward"`` and each action's backward under its name (for a lossy or partitioned action its forward's
summits too, as its peak is read). A peak is a maximum, and which moment reaches it changes with the input's
shape (a block's MLP backward at short sequences, its attention scores' at long ones); each summit is a sum of
tensors that grow with the shape, so :mod:`remat.core.shape_costs` predicts the summits at a new shape and
takes their largest. Empty where not recorded (estimates, older tables).

Lossy actions (``compress:<format>``, opt-in) also have ``grad_error[action]``, the relative error of the
block's parameter gradients against exact ones on the profiling batch, and ``grad_cosine[action]``, their
cosine similarity; exact actions have no entry (their error is 0).

Time terms, in seconds: ``fwd_s`` and ``bwd_s`` under ``"keep"``; ``recompute_s[action]`` is the extra time
spent in backward re-running work under that action (0 for ``"keep"``; for ``"offload"`` it is the copy
time). ``fwd_s_by_action[action]`` and ``bwd_s_by_action[action]`` are the block's measured forward and
backward seconds under each action, everything the action does included (for ``"checkpoint"`` the backward
holds the recomputation). ``overhead_s[action]`` is what the action adds to a step beyond its recomputation::

    overhead_s[a] = max(-recompute_a, fwd_a + bwd_a - recompute_a - (fwd_keep + bwd_keep))

the dispatch modes of a selective region, replayed dropout draws, a checkpoint frame's bookkeeping, an
offload's copies when they are not already its ``recompute_s`` (0 for ``"keep"``; absent means 0). It is
negative where the action saves forward or backward time (a checkpointed forward stores nothing), but never
so far that ``time_cost(a) = recompute_s[a] + overhead_s[a]`` falls below 0. The profiler times the actions
interleaved and takes the median of this difference over repeats (:mod:`remat.profiling.action_times`), so a step's
predicted time under ``a`` is ``fwd_s + bwd_s + time_cost(a)``. ``nograd_fwd_s`` is the block's forward
under ``torch.no_grad``, the way a memory-poor group re-runs the blocks before the one whose backward runs (no
autograd graph is recorded, so it is faster than ``recompute_s["checkpoint"]``, the more so where a device
waits on the host); None where it was not measured, read then as the checkpoint recomputation.

Table-wide: ``stem_bytes`` are activation bytes alive before the first block (embeddings and the like),
``head_bytes`` the peak above the chain while the part after the last block (final norm, logits, loss)
runs forward and backward, and ``head_retained_bytes`` what the head leaves alive while the chain's backward
runs, against what was alive when the chain's forward ended: the logits of an output the training loop still
holds and a tied weight's gradient waiting to be summed count in, and what the stem held only for the model's
forward (the embedding lookups a GPT-2 adds up, freed when its forward returns) counts out, so the figure is
negative where the stem frees more than the head leaves. It counts in the backward terms of every unit only: a
unit's forward runs before the head.
``held_args_bytes`` are the blocks' other tensor arguments (an attention mask, position embeddings) that a
step keeping everything frees before the chain's backward, but that a plan recomputing any block keeps for
that recomputation; ``held_args_rows`` says, row by row, which of them are alive while that row's unit runs
(:meth:`CostTable.held_args_per_row`). ``outside_s`` is the seconds of a step spent outside the chain's blocks
(the stem, the head, the loss and their backward): a plain step's time less every block's ``fwd_s + bwd_s``; None
when it was not measured. Since the blocks are timed alone, it also holds what they cost more or less inside a step
than alone, and it is negative where that exceeds the stem and head (small blocks timed alone run slower).
``deferred_s_per_byte`` prices what a segment's re-runs cost beyond checkpoints of the same blocks: a block that a
segment re-runs ahead of a later block's backward (each of its blocks but its last) adds this times its bytes
saved under keep, the recomputed activations that wait, cold, for its backward (:mod:`remat.planning.unit_terms`). The
profile measures it in whole steps where it can (:mod:`remat.profiling.action_steps`); 0 where not measured.
``outputs_kept`` says the model keeps every block's output to the end of the step (Hugging Face's
``output_hidden_states`` collects them), so a group's inner outputs are not freed, and a unit's backward runs
beside the outputs of its last block and the later blocks of its chain (:meth:`CostTable.held_outputs_per_row`).

Several chains (an encoder and a decoder, two towers) share one table: ``blocks`` holds every chain's rows, chain
after chain in the order the step runs them forward, and ``chain_lengths`` says how many rows each chain has
(empty for a table of one chain). The step runs the chains' backwards in the reverse order, the last chain's
first. ``between_bytes[k]`` are the bytes that become alive between the end of chain ``k``'s forward and the
start of chain ``k + 1``'s (an encoder's output after its final norm, a decoder's embeddings, gradients that
accumulate across the next chain's backward): they stay alive through the forward and backward of every later
chain. ``backward_bytes[k]`` are alive while chain ``k`` runs backward beside what its blocks and the head hold,
so they count in the peak of each of its units: the gradients of its block arguments (the encoder's output a
decoder attends to, a position bias the first block computes), which add up over its backward, and for a chain
before the last, what is alive when its backward starts beyond what was alive when its forward ended, less the
head's retained bytes (gradients on their way, a later chain's leftovers). ``stem_bytes`` is what is alive
before the first chain, the head terms are about what follows the last.

A block the step's forward calls more than once (a loop over shared layers) has a row per call, named
``<fqn>@<k>`` for the k-th (:mod:`remat.chains.block_calls`). Autograd sums its parameters' gradients from its calls
before storing them: the gradient of its last call waits, from that call's backward to its first call's, for
the others. ``call_grad_bytes`` are, per row, those waiting while the row runs backward (empty for a table
without such blocks); they count in the peak of a unit starting at the row, as ``backward_bytes`` do.

``copy_bytes_per_s`` is the measured bandwidth of copies between the device and pinned host memory, each way
(``"to_host"``, ``"to_device"``), where the table prices ``offload`` by what its copies leave exposed
(:mod:`remat.planning.offload_overlap`); empty where the copies were not measured (the CPU, estimates, older tables).

Tables written before a field existed load with it absent: 0 or empty for the byte and overhead terms and
``deferred_s_per_byte``, None for ``outside_s``, False for ``outputs_kept``.

``info`` holds plain facts about how the table was taken (torch version, device name; for a measured table
``profile_s``, the profile's wall time, ``blocks_measured`` / ``blocks_reused``, and ``same_costs_as``: each
reused row's name -> the measured row it copies).
``autocast``: the autocast settings the step was measured under, as plain data (``{"device_type": "cpu",
"dtype": "bfloat16", "enabled": True}``, see :class:`remat.core.precision.AutocastSpec`); ``None`` where the table
does not say (tables written before it was recorded, hand-made tables).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .actions import CHECKPOINT, GROUP_KINDS, KEEP, PARTITION, Action, kind_of


@dataclass
class BlockCost:
    """Measured or estimated costs of one block of the chain."""

    fqn: str
    fwd_s: float
    bwd_s: float
    input_bytes: int
    output_bytes: int
    saved_bytes: dict[str, int]
    recompute_s: dict[str, float]
    fwd_temp_bytes: int = 0
    bwd_temp_bytes: int = 0
    bwd_extra_bytes: dict[str, int] = field(default_factory=dict)
    grad_error: dict[str, float] = field(default_factory=dict)
    grad_cosine: dict[str, float] = field(default_factory=dict)
    fwd_s_by_action: dict[str, float] = field(default_factory=dict)
    bwd_s_by_action: dict[str, float] = field(default_factory=dict)
    overhead_s: dict[str, float] = field(default_factory=dict)
    nograd_fwd_s: float | None = None
    unavailable: dict[str, str] = field(default_factory=dict)  # action -> why it cannot run on this block
    peak_summits: dict[str, list[int]] = field(default_factory=dict)

    def times_scaled(self, factor: float) -> BlockCost:
        """A copy with every time term times ``factor`` (bytes as they are)."""
        scaled = {name: {a: v * factor for a, v in getattr(self, name).items()}
                  for name in ("recompute_s", "fwd_s_by_action", "bwd_s_by_action", "overhead_s")}  # fmt: skip
        nograd = None if self.nograd_fwd_s is None else self.nograd_fwd_s * factor
        return replace(self, fwd_s=self.fwd_s * factor, bwd_s=self.bwd_s * factor, nograd_fwd_s=nograd, **scaled)

    def time_cost(self, action: str) -> float:
        """Seconds ``action`` adds to a step over keeping: its recomputation plus its overhead."""
        try:
            recompute = self.recompute_s[action]
        except KeyError:
            raise KeyError(self._missing(action, "time cost", self.recompute_s)) from None
        return recompute + self.overhead_s.get(action, 0.0)

    def bytes_freed_per_second(self, action: str = CHECKPOINT) -> float:
        """Stored bytes ``action`` frees over keeping, per second it adds to a step (a greedy ranking's key)."""
        freed = self.saved(KEEP) - self.saved(action)
        return freed / max(self.time_cost(action), 1e-12)

    @property
    def actions(self) -> list[str]:
        """Single-block actions this row has costs for."""
        return [a for a in self.saved_bytes if a in self.recompute_s]

    def saved(self, action: str) -> int:
        try:
            return self.saved_bytes[action]
        except KeyError:
            raise KeyError(self._missing(action, "cost", self.saved_bytes)) from None

    def _missing(self, action: str, what: str, present: dict[str, Any]) -> str:
        """Why this row has no ``what`` for ``action``, and what to do."""
        message = f"block {self.fqn!r} has no {what} for action {action!r}; it has {sorted(present)}."
        if action in self.unavailable:
            return f"{message} The action cannot run on this block: {self.unavailable[action]}. Choose another."
        return f"{message} Profile with that action included (remat.profile(..., policies=...))."


def reads_own_peaks(action: str) -> bool:
    """Whether the simulator reads ``action``'s own forward and backward peaks, lower than keep's included:
    lossy actions and compiled partitions (see :func:`temp_terms`)."""
    return Action.parse(action).is_lossy or kind_of(action) == PARTITION


def temp_terms(saved_keep: int, forward_peak: int, backward_peaks: dict[str, int]) -> tuple[int, int, dict[str, int]]:
    """``fwd_temp_bytes``, ``bwd_temp_bytes`` and ``bwd_extra_bytes`` of a block from keep's bytes saved, keep's
    forward peak and each action's backward peak (for a lossy or partitioned action, the higher of its forward
    and backward peaks: a lossy forward holds full tensors and their compressed copies at once, and a partitioned
    one computes what keep's does while saving less, so keep's forward transient describes neither)."""
    keep = backward_peaks[KEEP]
    extra = {
        # only the positive ones, but also the negative ones of lossy and partitioned actions: their backward
        # restores one node's tensors at a time, or recomputes only what the compiled backward needs next
        action: peak - keep
        for action, peak in backward_peaks.items()
        if action != KEEP and (peak > keep or (reads_own_peaks(action) and peak < keep))
    }
    return max(0, forward_peak - saved_keep), max(0, keep - saved_keep), extra


@dataclass
class CostTable:
    """One row per block, in chain order, plus the chain-independent stem and head terms."""

    blocks: list[BlockCost]
    stem_bytes: int = 0
    head_bytes: int = 0
    head_retained_bytes: int = 0
    held_args_bytes: int = 0
    device: str = "cpu"
    source: str = "measured"
    info: dict[str, Any] = field(default_factory=dict)
    autocast: dict[str, Any] | None = None
    outside_s: float | None = None
    deferred_s_per_byte: float = 0.0
    chain_lengths: list[int] = field(default_factory=list)
    between_bytes: list[int] = field(default_factory=list)
    backward_bytes: list[int] = field(default_factory=list)
    outputs_kept: bool = False
    call_grad_bytes: list[int] = field(default_factory=list)
    copy_bytes_per_s: dict[str, float] = field(default_factory=dict)
    held_args_rows: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("call_grad_bytes", "held_args_rows"):
            if getattr(self, name) and len(getattr(self, name)) != len(self.blocks):
                raise ValueError(
                    f"{name} has {len(getattr(self, name))} entries for {len(self.blocks)} rows; give one per row "
                    "(or none)"
                )
        if not self.chain_lengths:
            if self.between_bytes or self.backward_bytes:
                raise ValueError(
                    "between_bytes and backward_bytes need chain_lengths: give the number of blocks of each chain"
                )
            return
        if self.backward_bytes and len(self.backward_bytes) != len(self.chain_lengths):
            raise ValueError(
                f"backward_bytes has {len(self.backward_bytes)} entries for {len(self.chain_lengths)} chains; give "
                "one per chain (or none)"
            )
        if sum(self.chain_lengths) != len(self.blocks) or min(self.chain_lengths) < 1:
            raise ValueError(
                f"chain_lengths {self.chain_lengths} must be positive and sum to the {len(self.blocks)} blocks "
                "of the table"
            )
        if len(self.between_bytes) != len(self.chain_lengths) - 1:
            raise ValueError(
                f"between_bytes has {len(self.between_bytes)} entries for {len(self.chain_lengths)} chains; give "
                "one per pair of consecutive chains"
            )

    @property
    def chains(self) -> list[range]:
        """The row indices of each chain, in the order the step runs them forward (one range for one chain)."""
        lengths = self.chain_lengths or [len(self.blocks)]
        starts = [sum(lengths[:k]) for k in range(len(lengths))]
        return [range(start, start + length) for start, length in zip(starts, lengths, strict=True)]

    def between_after(self) -> dict[int, int]:
        """Row index of each chain's last block (but the last chain's) -> the bytes that become alive after it."""
        return {chain[-1]: gap for chain, gap in zip(self.chains, self.between_bytes, strict=False)}

    def chain_index(self) -> list[int]:
        """The chain each row belongs to."""
        return [k for k, chain in enumerate(self.chains) for _ in chain]

    def backward_bytes_per_row(self) -> list[int]:
        """``backward_bytes`` of each row's chain (0 for every row when there are none), plus the row's
        ``call_grad_bytes``."""
        grads = self.backward_bytes or [0] * len(self.chains)
        calls = self.call_grad_bytes or [0] * len(self.blocks)
        return [grads[k] + extra for k, extra in zip(self.chain_index(), calls, strict=True)]

    def held_args_per_row(self) -> list[int]:
        """Per row, the held arguments (``held_args_bytes``) alive while a unit holding the row runs forward or
        backward under a plan that recomputes: every argument of the chains run before the row's, and those of
        its own chain first passed to the row or an earlier one. An argument that only later blocks take (a
        position bias the chain's first block computes for the others, as T5's does) is freed with their
        recomputation state before the earlier rows' backward, and does not exist yet in their forward.
        ``held_args_rows`` where the profile recorded them; else ``held_args_bytes`` at every row."""
        return list(self.held_args_rows) if self.held_args_rows else [self.held_args_bytes] * len(self.blocks)

    def held_outputs_per_row(self) -> list[int]:
        """Per row ``m``: with ``outputs_kept``, the outputs of blocks ``m`` to the last but one of ``m``'s chain,
        which the model holds while the backward of a unit ending at ``m`` runs (0 for every row without
        ``outputs_kept``). A chain's last output is left out: the model either replaces it (a final norm) and it
        dies in the head, or holds it, and then its gradient, alive in ``head_retained_bytes`` (or the chain's
        ``backward_bytes``) when the head's backward ends, is gone by the time an earlier unit runs backward."""
        held = [0] * len(self.blocks)
        if self.outputs_kept:
            for chain in self.chains:
                for m in reversed(chain[:-1]):
                    held[m] = self.blocks[m].output_bytes + held[m + 1]
        return held

    def held_outputs(self, row: int) -> int:
        """:meth:`held_outputs_per_row` of one row."""
        if not self.outputs_kept:
            return 0
        chain = next(c for c in self.chains if row in c)
        return sum(self.blocks[m].output_bytes for m in range(row, chain[-1]))

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def fqns(self) -> list[str]:
        return [b.fqn for b in self.blocks]

    def index(self, fqn: str) -> int:
        for i, block in enumerate(self.blocks):
            if block.fqn == fqn:
                return i
        raise KeyError(f"no block named {fqn!r}; the chain has {self.fqns}")

    def common_actions(self) -> list[str]:
        """Single-block actions every row has costs for, in a stable order."""
        if not self.blocks:
            return []
        common = set(self.blocks[0].actions)
        for block in self.blocks[1:]:
            common &= set(block.actions)
        return [a for a in self.blocks[0].actions if a in common]

    def groups_allowed(self) -> bool:
        """Whether a plan may group blocks (segments, memory-poor groups): every row has checkpoint costs (a group
        recomputes its blocks from its input), and the model does not skip layers in training
        (``info["layer_drop"]``, :mod:`remat.chains.hf_guards`; :data:`LAYER_DROP_GROUPS` says why)."""
        return CHECKPOINT in self.common_actions() and not self.info.get("layer_drop")

    def plannable_actions(self) -> list[str]:
        """Single-block actions a plan may choose among: those every row either has costs for or cannot run
        (``BlockCost.unavailable``), and at least one row has costs for; a plan uses each only on the rows
        that have it. In the order rows first list them."""
        rows = [(block.actions, set(block.actions) | set(block.unavailable)) for block in self.blocks]
        covered = set.intersection(*(known for _, known in rows)) if rows else set()
        ordered = dict.fromkeys(action for actions, _ in rows for action in actions)
        return [action for action in ordered if action in covered]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostTable:
        blocks = [BlockCost(**row) for row in data["blocks"]]
        return cls(
            blocks=blocks,
            stem_bytes=data.get("stem_bytes", 0),
            head_bytes=data.get("head_bytes", 0),
            head_retained_bytes=data.get("head_retained_bytes", 0),
            held_args_bytes=data.get("held_args_bytes", 0),
            outside_s=data.get("outside_s"),
            deferred_s_per_byte=data.get("deferred_s_per_byte", 0.0),
            device=data.get("device", "cpu"),
            source=data.get("source", "measured"),
            info=data.get("info", {}),
            autocast=data.get("autocast"),
            chain_lengths=list(data.get("chain_lengths", [])),
            between_bytes=list(data.get("between_bytes", [])),
            backward_bytes=list(data.get("backward_bytes", [])),
            outputs_kept=bool(data.get("outputs_kept", False)),
            call_grad_bytes=list(data.get("call_grad_bytes", [])),
            copy_bytes_per_s=dict(data.get("copy_bytes_per_s", {})),
            held_args_rows=list(data.get("held_args_rows", [])),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> CostTable:
        return cls.from_dict(json.loads(text))


def profile_summary(costs: CostTable) -> str:
    """How long a measured table took, in seconds and in the model's plain steps, and where its action times come
    from: ``"12.3 s, 7.6 plain steps (2 blocks measured, 10 reused; action times from steps)"``, from its
    ``info``."""
    info = costs.info
    text = f"{info.get('profile_s', 0.0):.1f} s"
    if info.get("plain_step_s"):
        text += f", {info.get('profile_s', 0.0) / info['plain_step_s']:.1f} plain steps"
    details = []
    if "blocks_measured" in info:
        details.append(f"{info['blocks_measured']} blocks measured, {info.get('blocks_reused', 0)} reused")
    if "action_times_from" in info:
        details.append(f"action times from {info['action_times_from']}")
    return f"{text} ({'; '.join(details)})" if details else text


# Why a table marked ``info["layer_drop"]`` takes no group, in the words of every refusal of one.
LAYER_DROP_GROUPS = (
    "the profiled model skips layers in training (LayerDrop, costs.info['layer_drop']): a group cannot span a "
    "skipped layer"
)


def plan_choices(costs: CostTable) -> list[str]:
    """What a plan on ``costs`` may choose among when not told: every plannable single-block action
    (:meth:`CostTable.plannable_actions`, each on the blocks that run it), then both group kinds where groups are
    allowed (:meth:`CostTable.groups_allowed`)."""
    return [*costs.plannable_actions(), *(GROUP_KINDS if costs.groups_allowed() else ())]
