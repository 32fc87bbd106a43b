"""How a training step of a model runs, described once: :class:`StepSpec`, and the types it is written in.

Every entry point that runs or plans a model's step (``remat.profile``, ``remat.apply``, the fits, ``PGAC``,
``hf.enable``, the integrations, the bench) takes ``step=StepSpec(...)``; the same fields as keyword arguments
are a convenience (``remat.profile(model, batch, loss_fn=f)`` is ``remat.profile(model, batch,
step=StepSpec(loss_fn=f))``), so a new property of a step is added here and read everywhere.

Rules, enforced here:

1. A field is given once: as a keyword argument or in ``step=``, not as both with different values
   (:meth:`StepSpec.merged` refuses that, naming the field).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import nn

from .precision import AutocastArg

Batch = torch.Tensor | tuple[Any, ...] | list[Any] | dict[str, Any]
"""What a training loop passes to the model: a tensor, a tuple or list of positional arguments, or a dict of
keyword arguments."""

BlocksArg = Sequence[str] | Sequence[tuple[str, nn.Module]] | Sequence[Sequence[Any]] | None
"""The blocks a plan acts on: ``None`` (the chain ``remat.find_blocks`` finds), FQNs, ``(fqn, module)`` pairs, or
a list of such chains (``remat.find_chains(model)``)."""

InputName = str | int | None
"""A main input named by the user: a keyword, a position, or ``None`` to let remat guess."""
OutputName = int | str | None
"""A main output named by the user: an index into a tuple/list output, a key of a dict/dataclass, or ``None``."""

LossFn = Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class StepSpec:
    """One training step of a model, as remat runs, measures and plans it.

    * ``loss_fn(output) -> scalar``: default ``output.loss`` when the model returns one, else the sum of its
      (first) output tensor.
    * ``blocks``: the blocks plans act on (:data:`BlocksArg`); ``None``: the ones remat finds.
    * ``main_input`` / ``main_output``: the hidden state a block takes and returns, where remat's guess is wrong
      (one value for every block, or ``{fqn: value}``).
    * ``autocast``: the autocast setting the forward and the loss run under (``torch.bfloat16``, ``"fp16"``, a
      dict, an ``AutocastSpec``, ``False`` for none); ``None``: the one active where the step runs.
    * ``holds_output``: whether the loop holds the model's output through the backward (``out = model(x);
      loss_fn(out).backward()``, the default) or keeps only the loss (Hugging Face's Trainer, Lightning).
    * ``accumulates``: whether the loop runs several forwards and backwards before each optimizer step (gradient
      accumulation): after the first, each one starts with the gradients there and adds its own into them, which
      a whole step's measurement must see (:func:`remat.fitting.whole_step_peak`).
    """

    loss_fn: LossFn | None = None
    blocks: BlocksArg = None
    main_input: InputName | Mapping[str, InputName] = None
    main_output: OutputName | Mapping[str, OutputName] = None
    autocast: AutocastArg = None
    holds_output: bool = True
    accumulates: bool = False

    def merged(self, **given: Any) -> StepSpec:
        """This step with the keyword arguments a caller was given on top: a value of ``None`` means not given
        (rule 1: a field given both here and there with different values is refused)."""
        changes = {}
        for name, value in given.items():
            if value is None:
                continue
            mine = getattr(self, name)
            if not _same(mine, _DEFAULTS[name]) and not _same(mine, value):
                raise ValueError(
                    f"{name} is given twice, as {name}={value!r} and in step=StepSpec({name}={mine!r}): give it once"
                )
            changes[name] = value
        return replace(self, **changes) if changes else self

    @classmethod
    def of(cls, step: StepSpec | None = None, **given: Any) -> StepSpec:
        """The step an entry point runs: ``step`` (default: a plain one) with its keyword arguments on top."""
        if step is not None and not isinstance(step, StepSpec):
            raise TypeError(f"step= takes a remat.StepSpec, got {type(step).__name__}")
        return (step or _PLAIN).merged(**given)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a is b or a == b)
    except Exception:  # tensors or other values without a plain truth value
        return False


_DEFAULTS = {f.name: f.default for f in fields(StepSpec)}
_PLAIN = StepSpec()
