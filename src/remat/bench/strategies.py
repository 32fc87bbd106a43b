"""The strategies the harness compares, written ``name`` or ``name:key=value,key=value``: their names and
options, the parsing of ``--strategies`` and ``--sweep``, and the checks of their options before any training.

Static strategies (``none``, ``full``, ``every_k``, ``sqrt``, ``memory_poor``, ``random``, ``optimal``) get one
plan from the run's CostTable through ``remat.plan(..., strict=False)``; the plan's prediction and whether it
fits the budget are recorded. ``pgac`` is :class:`remat.PGAC` attached to the optimizer, ``dtr`` is
:class:`remat.DTR` around each step, and ``compile_budget`` is ``torch.compile`` with
``torch._functorch.config.activation_memory_budget`` set to the budget's fraction of the no-checkpoint
activation memory (the outside reference; it runs in a child process, see :mod:`remat.bench.compile_child`).
Lossy strategies (their gradients are not exact; the report labels them so): ``compress`` stores every block
compressed (``format=int8`` by default), ``optimal_lossy`` is the optimal plan with ``allow_lossy=True`` (or
``max_grad_error=``), and ``pgac_q`` is :class:`remat.PGACQ`. Their formats are profiled with the run.
:mod:`remat.bench.static_plans` makes the static plans and :mod:`remat.bench.controllers` runs every strategy
in a training loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core import COMPRESS, Action

STATIC = ("none", "full", "every_k", "sqrt", "memory_poor", "random", "optimal")
DYNAMIC = ("pgac", "dtr")
COMPILED = ("compile_budget",)
LOSSY = ("compress", "optimal_lossy", "pgac_q")
KNOWN = STATIC + DYNAMIC + COMPILED + LOSSY
DEFAULT_FORMAT = "int8"
# Everything except the compiled reference runs the model's own eager kernels, so its losses must equal the
# no-checkpoint run's exactly; compiled kernels may differ by floating-point rounding.
EXACT = STATIC + DYNAMIC

OPTIONS: dict[str, tuple[str, ...]] = {
    "none": (),
    "full": (),
    "every_k": ("k",),
    "sqrt": (),
    "memory_poor": (),
    "random": ("fraction", "seed"),
    "optimal": ("resolution", "max_segment"),
    "pgac": ("alpha", "q", "gamma", "sync", "every"),
    "dtr": ("heuristic",),
    "compile_budget": ("fraction",),
    "compress": ("format",),
    "optimal_lossy": ("format", "max_grad_error"),
    "pgac_q": ("format", "rank", "alpha", "q", "gamma", "every"),
}
DEFAULT_STRATEGIES = "none,full,every_k,sqrt,random,optimal,pgac,dtr"
SWEEPABLE = ("q", "alpha", "gamma", "sync", "stage_sync")
# Sweeps run under torchrun by their own modules, not as PGAC variants of the main loop: sync (DDP,
# remat.bench.ddp_sweep) and stage_sync (a two-stage pipeline, remat.bench.pipeline_sweep).
DISTRIBUTED_SWEEPS = ("sync", "stage_sync")


class StrategyError(ValueError):
    """A strategy string names an unknown strategy or option."""


def parse_value(text: str) -> Any:
    """``"3"`` -> 3, ``"0.5"`` -> 0.5, ``"true"`` -> True, ``"none"`` -> None, anything else stays a string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


@dataclass(frozen=True)
class StrategySpec:
    """One strategy to run: its name and options. ``label`` names it in every result file."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def opts(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def label(self) -> str:
        if not self.options:
            return self.name
        return f"{self.name}[{','.join(f'{k}={v}' for k, v in self.options)}]"

    @property
    def exact(self) -> bool:
        return self.name in EXACT

    @property
    def lossy(self) -> bool:
        return self.name in LOSSY

    @property
    def compress_format(self) -> str | None:
        """The compression format of a lossy strategy (None for the others)."""
        return str(self.opts.get("format", DEFAULT_FORMAT)) if self.lossy else None

    def with_option(self, key: str, value: Any) -> StrategySpec:
        opts = self.opts
        opts[key] = value
        return StrategySpec(self.name, tuple(opts.items()))


def make_spec(name: str, options: dict[str, Any] | None = None) -> StrategySpec:
    """A checked :class:`StrategySpec`."""
    if name not in KNOWN:
        raise StrategyError(f"unknown strategy {name!r}; known strategies: {', '.join(KNOWN)}")
    options = dict(options or {})
    bad = [k for k in options if k not in OPTIONS[name]]
    if bad:
        allowed = ", ".join(OPTIONS[name]) or "none"
        raise StrategyError(f"strategy {name!r} has no option {', '.join(bad)}; its options: {allowed}")
    return StrategySpec(name, tuple(options.items()))


def parse_strategies(text: str) -> list[StrategySpec]:
    """Parse ``"none,full,pgac:q=0.3,alpha=0.8,gamma=linear,dtr"``.

    Strategies are separated by commas; ``name:key=value`` starts a strategy's options and each following
    ``key=value`` item adds one more to the same strategy.
    """
    specs: list[tuple[str, dict[str, Any]]] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        if "=" in item and ":" not in item:
            if not specs:
                raise StrategyError(f"option {item!r} comes before any strategy in {text!r}")
            key, value = item.split("=", 1)
            specs[-1][1][key.strip()] = parse_value(value)
            continue
        name, _, option = item.partition(":")
        options: dict[str, Any] = {}
        if option:
            if "=" not in option:
                raise StrategyError(f"cannot read {item!r}: write options as {name}:key=value")
            key, value = option.split("=", 1)
            options[key.strip()] = parse_value(value)
        specs.append((name.strip(), options))
    if not specs:
        raise StrategyError(f"no strategies in {text!r}; known strategies: {', '.join(KNOWN)}")
    result = [make_spec(name, options) for name, options in specs]
    labels = [s.label for s in result]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise StrategyError(f"strategy {', '.join(dupes)} is listed twice; give each once")
    return result


def parse_sweep(text: str) -> tuple[str, list[Any]]:
    """``"q=0.25,0.5,0.75"`` -> ``("q", [0.25, 0.5, 0.75])``: an ablation of one PGAC option."""
    key, sep, values = text.partition("=")
    key = key.strip()
    if not sep or key not in SWEEPABLE:
        raise StrategyError(f"cannot read sweep {text!r}: write KEY=V1,V2,... with KEY one of {', '.join(SWEEPABLE)}")
    parsed = [parse_value(v) for v in values.split(",") if v.strip()]
    if len(parsed) < 2:
        raise StrategyError(f"sweep {text!r} needs at least two values to compare")
    if key in DISTRIBUTED_SWEEPS:
        bad = [v for v in parsed if v not in ("local", "global")]
        if bad:
            raise StrategyError(f"{key} takes 'local' or 'global', got {bad}")
    return key, parsed


def check_available(specs: list[StrategySpec]) -> None:
    """Import what the strategies need, so a missing piece fails before any training."""
    names = {s.name for s in specs}
    needs = {"pgac": "remat.dynamic", "dtr": "remat.dynamic", "optimal": "remat.planning"}
    import importlib

    for name, module in needs.items():
        if name in names:
            try:
                importlib.import_module(module)
            except ImportError as err:
                raise StrategyError(f"strategy {name!r} needs {module}, which cannot be imported: {err}") from err
    for spec in specs:
        if spec.lossy:
            try:
                Action.parse(Action(COMPRESS, str(spec.compress_format)).text)
            except ValueError as err:
                raise StrategyError(f"{spec.name}:format: {err}") from err
            if spec.name == "pgac_q" and spec.opts.get("rank", "score") not in ("score", "error"):
                raise StrategyError(f"pgac_q:rank must be 'score' or 'error', got {spec.opts['rank']!r}")
        if spec.name in ("pgac", "pgac_q"):
            opts = spec.opts
            alpha, q, every = opts.get("alpha", 0.9), opts.get("q", 0.5), opts.get("every", 1)
            if not (isinstance(alpha, int | float) and 0.0 <= alpha < 1.0):
                raise StrategyError(f"{spec.name}:alpha is the EMA decay and must be in [0, 1), got {alpha!r}")
            if not (isinstance(q, int | float) and 0.0 <= q <= 1.0):
                raise StrategyError(f"{spec.name}:q is the quantile of the scores and must be in [0, 1], got {q!r}")
            if not (isinstance(every, int) and every >= 1):
                raise StrategyError(f"{spec.name}:every (score every that many steps) must be an int >= 1: {every!r}")
            if opts.get("sync", "local") not in ("local", "global"):
                raise StrategyError(f"pgac:sync must be 'local' or 'global', got {opts['sync']!r}")
            if "gamma" in opts:
                from ..dynamic import make_schedule

                make_schedule(opts["gamma"])
        if spec.name == "dtr" and "heuristic" in spec.opts:
            from ..dynamic import HEURISTICS

            if spec.opts["heuristic"] not in HEURISTICS:
                raise StrategyError(
                    f"unknown DTR heuristic {spec.opts['heuristic']!r}; choose one of {', '.join(HEURISTICS)}"
                )
        if spec.name == "compile_budget" and "fraction" in spec.opts:
            f = spec.opts["fraction"]
            if not isinstance(f, int | float) or not 0.0 <= f <= 1.0:
                raise StrategyError(f"compile_budget:fraction must be in [0, 1], got {f!r}")


def lossy_formats(specs: list[StrategySpec]) -> list[str]:
    """The compression formats the lossy strategies among ``specs`` need profiled, in order of appearance."""
    return list(dict.fromkeys(str(s.compress_format) for s in specs if s.lossy))
