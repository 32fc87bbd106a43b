"""Costs as functions of the input's shape: a :class:`CostTable` for any batch size and sequence length, from
tables measured at three shapes.

A training step's activations and times grow with the batch ``b`` and the sequence ``s`` (the first block's main
input is ``(b, s, ...)``; a 2-D input ``(b, width)`` has ``s = 1``). Every term of a table is read as::

    q(b, s) = c + u * s**2 + b * (l * s + r * s**2)

``c``: what does not grow with the input (parameter gradients in flight, a kernel's launch); ``l``: what grows with
the tokens (hidden states, MLP activations, per-token times); ``r``: what grows with the square of the sequence per
sequence (eager attention's ``s x s`` scores); ``u``: what grows with the square of the sequence once for the whole
batch (T5's relative position bias, a mask shared by the batch's rows). Four shapes determine the four coefficients:
the profiled one, half its sequence, half its batch and half of both, all measured
(:func:`remat.profiling.profile_shapes`). A profiled batch of one row cannot tell ``u`` from ``r``: the form is then
``c + b * (l * s + r * s**2)`` through the profiled shape, half and a quarter of its sequence. Where the input's
second dimension is not a sequence the batch can be cut along (an image model: the patches of a ViT, the channels
of a convolution's feature map are set by the model, not by the batch), the costs vary with the batch size alone:
``c + b * l`` through the profiled batch and half of it, at the profiled second dimension only.
:meth:`ShapeCosts.at` evaluates every term at a shape and returns a table the planners read like any other. Bytes
are measured exactly, and their form passes through the measured points (rounded to whole bytes). Seconds carry the
machine's noise (on a shared CPU a small block's forward can read 4x from one profile to the next), which an exact
fit through the points turns into negative or shrinking times: a time term's coefficients are fitted by least
squares with none negative (a time that grows with the shape), and a term measured negative somewhere (an action's
overhead that saves time) scales with the tokens from the reference.
Terms that do not depend on the input by their meaning (``deferred_s_per_byte``, a rate; ``call_grad_bytes``,
parameter gradients) are the reference table's.

A block's transients are peaks, and a peak is the largest of several moments of its run (the summits its table
records, ``BlockCost.peak_summits``), of which the largest changes with the shape: a BERT layer's backward peaks
in its MLP below 192 tokens and in its attention's ``s x s`` scores beyond. Each summit is on the form, the peak
between them is not, so each summit is fitted and the transients at a new shape are read from the largest
predicted (:func:`remat.core.costs.temp_terms`). A block whose runs at the measured shapes recorded other moments
(another count of summits: a kernel that took another course) has its transients fitted whole, and
``info["peaks_fitted_whole"]`` names it.

Invariant 1: at each measured shape, :meth:`ShapeCosts.at` returns that shape's table itself; elsewhere its bytes
are on the form through the measured points, its seconds on a form with no negative coefficient. Under the batch
form, a shape of another second dimension is refused (:attr:`ShapeCosts.fixed_second`). The coefficients
are fitted once per :class:`ShapeCosts`; a table at a new shape is a product per term.

Invariant 2: where a block's summits line up at every measured shape, its ``fwd_temp_bytes``, ``bwd_temp_bytes``
and ``bwd_extra_bytes`` at a new shape are :func:`~remat.core.costs.temp_terms` of its summits predicted there,
as a profile at that shape reads them from the summits it measures.

Invariant 3: at a new shape an action's ``overhead_s`` is never below minus its ``recompute_s``, as the profiler
keeps it (:mod:`remat.core.costs`): a saving measured at the reference and scaled with the tokens, beside a
recomputation fitted on the form, would otherwise make the action cheaper than keeping (a step predicted faster
than keep-all's, and the planner choosing recomputation for nothing).

Where a model's terms do not follow the form (the fit is checked at no fourth shape by itself), the tests and
``benchmarks/shapes.py`` compare predicted with measured peaks at shapes not profiled; ``info["shape_form"]`` names
the form, and a table outside it is profiled at its own shape (:func:`remat.profile` on that batch).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from .actions import KEEP
from .costs import BlockCost, CostTable, temp_terms

Shape = tuple[int, int]  # (batch, sequence)
FORM = "c + u*s^2 + b*(l*s + r*s^2)"
FORM_ONE_ROW = "c + b*(l*s + r*s^2)"
FORM_BATCH = "c + b*l"

# Table terms that hold whatever the input's shape (rates, parameter gradients, flags): the reference's.
_FIXED_TABLE_FIELDS = frozenset({"deferred_s_per_byte", "call_grad_bytes", "chain_lengths", "outputs_kept",
                                 "device", "source", "info", "autocast", "copy_bytes_per_s", "blocks"})
_FIXED_BLOCK_FIELDS = frozenset({"fqn", "grad_error", "grad_cosine", "unavailable"})
_SUMMITS = "peak_summits"  # fitted summit by summit, and the transients read from them (see _Summits)


def shape_of(input_shape: Sequence[int]) -> Shape:
    """(batch, sequence) of a block's main input: ``(b, s, ...)`` for three or more dimensions, ``(b, 1)`` for
    ``(b, width)``."""
    dims = list(input_shape)
    if not dims:
        raise ValueError("a scalar block input has no batch dimension")
    return (int(dims[0]), int(dims[1]) if len(dims) >= 3 else 1)


@dataclasses.dataclass
class ShapeCosts:
    """Tables measured at four shapes (three for a batch of one row), and every term on the form through them."""

    tables: list[CostTable]
    shapes: list[Shape]

    def __post_init__(self) -> None:
        if len(self.tables) != len(self.shapes):
            raise ValueError(f"{len(self.tables)} tables for {len(self.shapes)} shapes")
        one_row = len({b for b, _ in self.shapes}) == 1
        one_second = len({s for _, s in self.shapes}) == 1
        self.form = FORM_BATCH if one_second and not one_row else FORM_ONE_ROW if one_row else FORM
        wanted = {FORM_BATCH: 2, FORM_ONE_ROW: 3, FORM: 4}[self.form]
        if len(self.shapes) != wanted:
            raise ValueError(f"the form {self.form} needs {wanted} measured shapes, got {self.shapes}")
        self._design = np.array([self._features(b, s) for b, s in self.shapes])
        if abs(np.linalg.det(self._design)) < 1e-9:
            raise ValueError(f"the shapes {self.shapes} do not determine {self.form}: vary the batch and the sequence")
        self._inverse = np.linalg.inv(self._design)
        names = [t.fqns for t in self.tables]
        if any(n != names[0] for n in names):
            raise ValueError("the tables measured at the shapes name different blocks")
        self._fitted: dict[str, Any] | None = None

    def _features(self, batch: int, seq: int) -> list[float]:
        b0, s0 = self.shapes[0]
        b, s = batch / b0, seq / s0  # in units of the reference: a well-conditioned design
        if self.form == FORM_BATCH:
            return [1.0, b]
        if self.form == FORM_ONE_ROW:
            return [1.0, b * s, b * s * s]
        return [1.0, s * s, b * s, b * s * s]

    @property
    def fixed_second(self) -> int | None:
        """Under the batch form, the second dimension every shape has (None: it varies as a sequence)."""
        return self.shapes[0][1] if self.form == FORM_BATCH else None

    @property
    def past_second(self) -> tuple[int, ...]:
        """The first block's input dimensions past the second at the profiled shape: a hidden size, or the height
        and width of an image model's feature map (which the batch form does not vary)."""
        first = (self.reference.info.get("input_shapes") or {}).get(self.reference.fqns[0])
        return tuple(int(d) for d in first[2:]) if first else ()

    @property
    def largest(self) -> Shape:
        """The largest batch size and the longest sequence measured (beyond them, costs are extrapolated)."""
        return max(b for b, _ in self.shapes), max(s for _, s in self.shapes)

    @property
    def reference(self) -> CostTable:
        """The table of the profiled shape (the first)."""
        return self.tables[0]

    @property
    def reference_shape(self) -> Shape:
        return self.shapes[0]

    def at(self, batch: int, seq: int) -> CostTable:
        """The table at ``(batch, seq)`` (invariant 1)."""
        if batch < 1 or seq < 1:
            raise ValueError(f"a shape has a positive batch and sequence, got ({batch}, {seq})")
        fixed = self.fixed_second
        if fixed is not None and seq != fixed:
            raise ValueError(
                f"these costs vary with the batch size alone, at {fixed} in the input's second dimension (the "
                f"profile could not cut the batch along it: an image model's patches or channels); a batch of "
                f"({batch}, {seq}) needs remat.profile_shapes on a batch of that shape"
            )
        for table, shape in zip(self.tables, self.shapes, strict=True):
            if shape == (batch, seq):
                return table
        if self._fitted is None:
            self._fitted = self._fit()
        row = np.array(self._features(batch, seq))
        tokens = batch * seq / (self.shapes[0][0] * self.shapes[0][1])
        ref = self.reference
        values = {name: _evaluate(term, row, tokens) for name, term in self._fitted["table"].items()}
        blocks = []
        for reference_row, terms, summits in zip(ref.blocks, self._fitted["blocks"], self._fitted["summits"],
                                                 strict=True):  # fmt: skip
            fields = {name: getattr(reference_row, name) for name in _FIXED_BLOCK_FIELDS}
            fields.update({name: _evaluate(term, row, tokens) for name, term in terms.items()})
            recompute = fields.get("recompute_s") or {}
            fields["overhead_s"] = {action: max(seconds, -recompute.get(action, 0.0))  # invariant 3
                                    for action, seconds in (fields.get("overhead_s") or {}).items()}  # fmt: skip
            if summits is not None:
                fields.update(summits.fields_at(row, fields["saved_bytes"][KEEP]))  # invariant 2
            blocks.append(BlockCost(**fields))
        shapes = ref.info.get("input_shapes") or {}
        info = {**ref.info, "shape": [batch, seq], "shape_form": self.form,
                "peaks_fitted_whole": list(self._fitted["peaks_fitted_whole"]),
                "measured_shapes": [list(s) for s in self.shapes],
                "input_shapes": {k: _scaled(v, batch, seq) for k, v in shapes.items()}}
        return dataclasses.replace(ref, blocks=blocks, info=info, **values)

    def _fit(self) -> dict[str, Any]:
        """Every term's coefficients, fitted once (bytes exactly, seconds with none negative)."""
        table = {field.name: _fit_term([getattr(t, field.name) for t in self.tables], self._design, self._inverse)
                 for field in dataclasses.fields(CostTable) if field.name not in _FIXED_TABLE_FIELDS}
        if not all(t.held_args_rows for t in self.tables):  # a shape without them: all held at every row
            table["held_args_rows"] = ("as is", [])
        blocks, summits = [], []
        fitted = [f.name for f in dataclasses.fields(BlockCost) if f.name not in _FIXED_BLOCK_FIELDS | {_SUMMITS}]
        for rows in zip(*(t.blocks for t in self.tables), strict=True):
            blocks.append({name: _fit_term([getattr(r, name) for r in rows], self._design, self._inverse)
                           for name in fitted})  # fmt: skip
            summits.append(_Summits.fitted([r.peak_summits for r in rows], self._inverse))
        whole = [t.fqn for t, fit in zip(self.reference.blocks, summits, strict=True) if fit is None]
        return {"table": table, "blocks": blocks, "summits": summits, "peaks_fitted_whole": whole}

    def to_dict(self) -> dict[str, Any]:
        return {"shapes": [list(s) for s in self.shapes], "tables": [t.to_dict() for t in self.tables]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShapeCosts:
        return cls([CostTable.from_dict(t) for t in data["tables"]], [tuple(s) for s in data["shapes"]])


@dataclasses.dataclass(frozen=True)
class _Summits:
    """A block's peak summits (``BlockCost.peak_summits``) fitted one by one on the form, so that its transients at
    a new shape are read from the largest summits predicted there (invariant 2)."""

    keys: list[str]  # "forward" and each action, in the order of their rows in ``coefficients``
    starts: np.ndarray  # the first row of each key's summits
    coefficients: np.ndarray  # one row of coefficients per summit, every key's after the other

    @classmethod
    def fitted(cls, per_shape: list[dict[str, list[int]]], inverse: np.ndarray) -> _Summits | None:
        """The fit through the summits of every measured shape; None where a shape recorded none, or other
        moments than the reference (another count of summits under some action: its run took another course)."""
        first = per_shape[0]
        if "forward" not in first or KEEP not in first:
            return None
        if any(set(s) != set(first) or any(len(s[k]) != len(first[k]) for k in first) for s in per_shape):
            return None
        keys = list(first)
        values = np.array([[v for k in keys for v in s[k]] for s in per_shape], dtype=float)  # shapes x summits
        starts = np.cumsum([0] + [len(first[k]) for k in keys[:-1]])
        return cls(keys, starts, values.T @ inverse.T)

    def fields_at(self, row: np.ndarray, saved_keep: int) -> dict[str, Any]:
        """``fwd_temp_bytes``, ``bwd_temp_bytes``, ``bwd_extra_bytes`` and ``peak_summits`` at the shape of
        feature ``row``, ``saved_keep`` being keep's bytes saved there."""
        predicted = np.rint(self.coefficients @ row).astype(np.int64)
        peaks = dict(zip(self.keys, np.maximum.reduceat(predicted, self.starts).tolist(), strict=True))
        forward = peaks.pop("forward")
        fwd_temp, bwd_temp, bwd_extra = temp_terms(saved_keep, forward, peaks)
        ends = [*self.starts[1:].tolist(), len(predicted)]
        summits = {k: predicted[a:b].tolist() for k, a, b in zip(self.keys, self.starts.tolist(), ends, strict=True)}
        return {"fwd_temp_bytes": fwd_temp, "bwd_temp_bytes": bwd_temp, "bwd_extra_bytes": bwd_extra,
                "peak_summits": summits}  # fmt: skip


def _scaled(shape: list[int], batch: int, seq: int) -> list[int]:
    if len(shape) >= 3:
        return [batch, seq, *shape[2:]]
    return [batch, *shape[1:]] if shape else shape


@dataclasses.dataclass(frozen=True)
class _Term:
    """One fitted term: ``coefficients`` on the form (``kind`` "bytes" rounds), or the reference's ``value`` scaled
    with the tokens (``kind`` "scaled": a figure measured negative somewhere)."""

    kind: str
    coefficients: np.ndarray | None = None
    value: float = 0.0


def _fit_term(values: list[Any], design: np.ndarray, inverse: np.ndarray) -> Any:
    """The term's fit from its values at the measured shapes: numbers, and dicts and lists of numbers term by
    term; None wherever one is None; anything else (a flag) as the reference's."""
    first = values[0]
    if any(v is None for v in values):
        return None
    if isinstance(first, bool) or not isinstance(first, (int, float, dict, list)):
        return ("as is", first)
    if isinstance(first, dict):
        keys = [k for k in first if all(k in v for v in values)]
        return {k: _fit_term([v[k] for v in values], design, inverse) for k in keys}
    if isinstance(first, list):
        if any(len(v) != len(first) for v in values):
            return ("as is", list(first))
        return [_fit_term([v[i] for v in values], design, inverse) for i in range(len(first))]
    numbers = np.array([float(v) for v in values])
    if isinstance(first, int):
        return _Term("bytes", inverse @ numbers)
    if numbers.min() < 0:  # a saving or a signed figure: scaled with the tokens from the reference
        return _Term("scaled", value=float(numbers[0]))
    return _Term("seconds", _nonnegative_fit(design, numbers))


def _evaluate(term: Any, row: np.ndarray, tokens: float) -> Any:
    if term is None:
        return None
    if isinstance(term, tuple):
        return term[1]
    if isinstance(term, dict):
        return {k: _evaluate(v, row, tokens) for k, v in term.items()}
    if isinstance(term, list):
        return [_evaluate(v, row, tokens) for v in term]
    if term.kind == "bytes":
        return int(round(float(row @ term.coefficients)))
    if term.kind == "scaled":
        return term.value * tokens
    return float(row @ term.coefficients)


def _nonnegative_fit(design: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The coefficients, none negative, of least squared error (every subset of the columns tried: few enough)."""
    n = design.shape[1]
    best, best_error = np.zeros(n), float(np.sum(values**2))
    for size in range(n, 0, -1):
        for columns in itertools.combinations(range(n), size):
            picked = list(columns)
            coefficients, *_ = np.linalg.lstsq(design[:, picked], values, rcond=None)
            if np.any(coefficients < 0):
                continue
            error = float(np.sum((design[:, picked] @ coefficients - values) ** 2))
            if error < best_error - 1e-30:
                best, best_error = np.zeros(n), error
                best[picked] = coefficients
    return best


__all__ = ["FORM", "FORM_ONE_ROW", "Shape", "ShapeCosts", "shape_of"]
