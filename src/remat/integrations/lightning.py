"""Lightning: ``RematCallback`` puts a remat plan (or PGAC) on a LightningModule for ``Trainer.fit``.

>>> trainer = lightning.Trainer(callbacks=[RematCallback("optimal", budget=0.5)], ...)

The hooks it uses, in the order Lightning calls them:

* ``setup(stage="fit")``: before the strategy moves or wraps the model (DDP, FSDP), the session is made:
  the chain of blocks is found in the LightningModule (or named with ``blocks=``), and the plan goes on the
  module whose forward runs them (see :func:`forward_root`), because Lightning calls ``training_step``, not
  the LightningModule's ``forward``;
* ``on_train_start``: with ``strategy="pgac"``, PGAC is attached to the first optimizer;
* the first training step runs with every block checkpointed and is profiled (from the forward of that
  module on); ``on_before_optimizer_step`` ends it, before the optimizer runs, and makes the plan used from
  the second step;
* ``teardown``: the hooks are removed; ``callback.session`` keeps the plan, the costs and the statistics;
* ``state_dict``/``load_state_dict``: a Lightning checkpoint keeps PGAC's state (scores, step, schedule, costs,
  budget, plan), and a run resumed from it (``trainer.fit(..., ckpt_path=...)``) goes on with it, after
  ``setup`` and before the first step: nothing profiled again, the schedule where it was.

With ``compile=True`` (and ``memory=``, ``batch=``) the route is :func:`remat.fit`'s compiled one: at
``on_train_start``, once the strategy has put the model on its device and the trainer's optimizer exists (its state
counts in ``memory``), the eager plan, the whole model compiled under a fitted budget and compiled blocks are
measured head to head and the fastest whose whole step fits is set up in place (``callback.session`` is then a
:class:`~remat.integrations.compiled_session.CompiledSession`). It runs on one device.

Plans made from a ``batch=`` or from ``costs=`` apply from the first step. A ``batch=`` is profiled under the
trainer's precision (``precision="bf16-mixed"`` or ``"16-mixed"``: autocast, see :func:`precision_autocast`); the
profiled first step runs inside Lightning's autocast and is measured under it. Under DDP every rank uses rank 0's
measurements. Lightning's ``FSDPStrategy`` shards in its setup, after the callback's: give ``batch=`` or
``costs=`` there (see :mod:`remat.integrations.distributed`).

The base class is ``lightning.pytorch.Callback`` (or ``pytorch_lightning.Callback``) when one is installed;
without Lightning the class still imports, with the same hook methods, for use in a hand-written loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..chains import resolve_blocks
from ..core import AutocastSpec, CostTable, StepSpec
from ..planning import Plan
from .compiled_session import CompiledSession, check_compile_arguments, compiled_route
from .session import RematSession, check_strategy

try:
    from lightning.pytorch import Callback as _Base

    LIGHTNING = "lightning.pytorch"
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        from pytorch_lightning import Callback as _Base

        LIGHTNING = "pytorch_lightning"
    except ImportError:
        _Base = object
        LIGHTNING = None

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def forward_root(model: nn.Module, fqns: Sequence[str]) -> str:
    """The name of the deepest module of ``model`` that contains every block in ``fqns`` and has a forward of
    its own (a ``ModuleList`` has none): the module whose forward runs the chain. ``""`` is ``model`` itself."""
    parts = [f.split(".") for f in fqns]
    common: list[str] = []
    for pieces in zip(*parts, strict=False):
        if len(set(pieces)) != 1:
            break
        common.append(pieces[0])
    if len(fqns) == 1:
        common = common[:-1]  # a single block: its parent runs it
    modules = dict(model.named_modules())
    while common and (".".join(common) not in modules or isinstance(modules[".".join(common)], _CONTAINERS)):
        common.pop()
    return ".".join(common)


def precision_autocast(trainer: Any) -> AutocastSpec:
    """The autocast setting of a Lightning ``Trainer``'s training step: bf16 autocast for
    ``precision="bf16-mixed"``, fp16 for ``"16-mixed"``, none otherwise (``"bf16-true"`` casts the parameters
    instead, which a profile sees as it is), on the device of the trainer's strategy."""
    strategy = getattr(trainer, "strategy", None)
    device = getattr(getattr(strategy, "root_device", None), "type", "cpu")
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(getattr(trainer, "precision", "")))
    return AutocastSpec(device, dtype) if dtype is not None else AutocastSpec(device, torch.float32, enabled=False)


class RematCallback(_Base):  # type: ignore[misc, valid-type]
    """Apply a remat plan or PGAC during ``Trainer.fit``. Arguments as for
    :class:`~remat.integrations.session.RematSession`: ``strategy`` (a :data:`remat.STRATEGIES` name or
    ``"pgac"``), ``budget`` (bytes, "2GiB" or a fraction), ``blocks`` (FQNs in the LightningModule), ``costs``,
    ``batch``, ``plan``, ``sync`` and planner or PGAC ``options``; ``step`` (a :class:`remat.StepSpec`), or its
    fields ``loss_fn`` and ``blocks`` as keywords. Lightning's own precision setting is the step's autocast.
    ``compile=True`` (or a dict of :func:`remat.fit`'s compile options) with ``memory=`` and ``batch=``: the
    fastest route, eager or compiled, whose whole step fits ``memory`` (the module docstring)."""

    def __init__(
        self,
        strategy: str = "optimal",
        budget: int | float | str | None = None,
        *,
        blocks: Sequence[str] | None = None,
        costs: CostTable | None = None,
        batch: Any = None,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        plan: Plan | None = None,
        sync: str | None = None,
        step: StepSpec | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        self.compile = options.pop("compile", False)
        if self.compile:  # checked now, before the trainer runs anything
            given = {"budget": budget, "costs": costs, "plan": plan, "sync": sync, **options}
            given.pop("memory", None), given.pop("clock", None)
            check_compile_arguments(options.get("memory"), batch, strategy, given,
                                    "RematCallback(memory='22GiB', batch=..., compile=True)")  # fmt: skip
        elif options.get("memory") is None:  # memory= (the whole step) is checked by the session
            check_strategy(strategy, budget)
        spec = StepSpec.of(step, loss_fn=loss_fn, blocks=blocks)
        self.accumulates = spec.accumulates
        self.strategy, self.budget = strategy, budget
        self.blocks = list(spec.blocks) if spec.blocks is not None else None
        self.costs, self.batch, self.loss_fn, self.plan, self.sync = costs, batch, spec.loss_fn, plan, sync
        self.options = options
        self.session: RematSession | CompiledSession | None = None
        self.root: str | None = None
        self._relative: list[tuple[str, nn.Module]] = []

    # ----- Lightning hooks -----
    def setup(self, trainer: Any, pl_module: nn.Module, stage: str | None = None) -> None:
        if stage not in (None, "fit") or (self.session is not None and not self.session.removed):
            return
        chain = resolve_blocks(pl_module, self.blocks)
        self.root = forward_root(pl_module, [f for f, _ in chain])
        root = pl_module.get_submodule(self.root) if self.root else pl_module
        prefix = self.root + "." if self.root else ""
        relative = [(f[len(prefix) :], m) for f, m in chain]
        if self.compile:  # fitted at on_train_start, on the device, with the trainer's optimizer
            world = int(getattr(trainer, "world_size", 1) or 1)
            if world > 1:
                raise ValueError(
                    f"RematCallback(compile=True) fits the compiled route on one device; this trainer runs {world} "
                    "processes, whose measured routes could differ. Use RematCallback(memory=..., batch=...) (the "
                    "eager plan, rank 0's measurements shared), or train on one device"
                )
            self._relative = relative
            return
        self.session = RematSession(
            root,
            self.strategy,
            self.budget,
            blocks=relative,
            costs=self.costs,
            batch=self.batch,
            loss_fn=self.loss_fn,
            plan=self.plan,
            sync=self.sync,
            auto_step=False,
            autocast=precision_autocast(trainer) if self.batch is not None else None,
            # the trainer's gradient accumulation: micro-steps after the first run with the gradients there
            step=StepSpec(accumulates=self.accumulates or int(getattr(trainer, "accumulate_grad_batches", 1)) > 1),
            **self.options,
        )

    def on_train_start(self, trainer: Any, pl_module: nn.Module) -> None:
        optimizers = list(getattr(trainer, "optimizers", []) or [])
        if self.compile and self.session is None:
            self._fit_compiled(trainer, pl_module, optimizers)
            return
        session = self.session
        if not isinstance(session, RematSession):
            return
        if session.optimizer is None and optimizers:
            session.count_optimizer(optimizers[0], measure=True)  # its state counts in memory=, the plan fitted again
        if session.pgac is not None and not session.attached:
            if not optimizers:
                raise RuntimeError(
                    "RematCallback(strategy='pgac') needs the trainer's optimizer; configure_optimizers returned none"
                )
            session.attach(optimizers[0])

    def on_before_optimizer_step(self, trainer: Any, pl_module: nn.Module, optimizer: Any) -> None:
        session = self.session
        if isinstance(session, RematSession) and session.pgac is None and session.profiling:
            session.step()  # the profiled first step ends here, before the optimizer allocates its state

    def state_dict(self) -> dict[str, Any]:
        """What a Lightning checkpoint keeps of the callback: PGAC's state (:meth:`remat.PGAC.state_dict`), or
        nothing for a plan (made again, or read from the profile cache, when a run resumes)."""
        session = self.session
        if isinstance(session, RematSession) and session.pgac is not None:
            return {"pgac": session.pgac.state_dict()}
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume PGAC from a checkpoint's :meth:`state_dict`; Lightning calls it after ``setup``, so the session
        exists."""
        if "pgac" not in state:
            return
        session = self.session
        if not isinstance(session, RematSession) or session.pgac is None:
            raise ValueError(
                "this checkpoint holds PGAC's state from RematCallback('pgac', ...), and this callback runs "
                f"strategy {self.strategy!r}: resume with the strategy that saved it, or drop the callback's state "
                "from the checkpoint (checkpoint['callbacks'])"
            )
        session.load_pgac_state(state["pgac"])

    def teardown(self, trainer: Any, pl_module: nn.Module, stage: str | None = None) -> None:
        if self.session is not None and stage in (None, "fit"):
            self.session.remove()

    def _fit_compiled(self, trainer: Any, pl_module: nn.Module, optimizers: list[Any]) -> None:
        """``compile=``'s route, fitted on the device the strategy chose, with its optimizer and precision."""
        root = pl_module.get_submodule(self.root) if self.root else pl_module
        strategy = getattr(trainer, "strategy", None)
        batch = strategy.batch_to_device(self.batch) if hasattr(strategy, "batch_to_device") else self.batch
        step = StepSpec(loss_fn=self.loss_fn, blocks=self._relative, autocast=precision_autocast(trainer))
        optimizer = optimizers[0] if optimizers else None
        clock = self.options.get("clock", time.perf_counter)
        self.session = compiled_route(root, self.options.get("memory"), batch=batch, optimizer=optimizer, step=step,
                                      compile=self.compile, clock=clock)  # fmt: skip
