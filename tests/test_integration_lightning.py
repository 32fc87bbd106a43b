"""Lightning: RematCallback in ``Trainer.fit`` on CPU gives the weights of training without checkpointing
(dropout on), with the plan made from the profiled first step, or with PGAC. Skipped with the reason where
Lightning is not installed; the hook logic is also exercised without Lightning (a hand-written loop)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from toy_models import resident_bytes

import remat
from remat.integrations.lightning import LIGHTNING, RematCallback, forward_root

WIDTH, STEPS = 16, 3


class Block(nn.Module):
    def __init__(self, d: int = WIDTH) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(8, WIDTH), nn.Linear(WIDTH, 1)
        self.layers = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h).square().mean()


DATA = [torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(i)) for i in range(STEPS)]


def test_forward_root_is_the_module_that_runs_the_chain() -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

    fqns = [f"net.layers.{i}" for i in range(3)]
    assert forward_root(Wrapper(), fqns) == "net"  # net.layers is a ModuleList: no forward of its own
    assert forward_root(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), ["0", "1"]) == ""
    assert forward_root(Wrapper(), ["net.layers.1"]) == "net"


def test_callback_hooks_in_a_hand_written_loop() -> None:
    """The hooks Lightning would call, called by hand: works without Lightning installed."""
    torch.manual_seed(0)
    ref = Net()
    torch.manual_seed(0)
    model = Net()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    callback = RematCallback("every_k", k=2)
    callback.setup(None, model, "fit")
    assert callback.root == "" and callback.session is not None and callback.session.profiling
    for step, x in enumerate(DATA):
        for m, o in ((ref, opt_ref), (model, opt)):
            torch.manual_seed(step)
            m(x).backward()
            if m is model:
                callback.on_before_optimizer_step(None, model, o)
            o.step()
            o.zero_grad()
    callback.teardown(None, model, "fit")
    assert callback.session.removed and not callback.session.profiling
    assert list(callback.session.plan.actions.values()) == ["segment:0", "segment:0", "checkpoint"]
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


if LIGHTNING is not None:
    import importlib

    L = importlib.import_module(LIGHTNING)

    class LitNet(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            torch.manual_seed(batch_idx)  # this step's dropout masks, the same in every run
            return self.model(batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(DATA, batch_size=None, shuffle=False)


def fit(callbacks: list[Any]) -> nn.Module:
    torch.manual_seed(0)
    module = LitNet()
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module)
    return module


@pytest.mark.skipif(LIGHTNING is None, reason="lightning is not installed (pip install lightning)")
@pytest.mark.parametrize("strategy,options", [("optimal", {"budget": 0.6}), ("pgac", {"budget": 0.7, "alpha": 0.5})])
def test_trainer_fit_with_remat_callback_matches_plain_training(strategy: str, options: dict[str, Any]) -> None:
    reference = fit([])
    callback = RematCallback(strategy, **options)
    trained = fit([callback])
    for (name, p), q in zip(trained.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    session = callback.session
    assert callback.root == "model" and session is not None and session.removed
    assert not session.profiling and session.stats.total_calls >= 3  # the profiled step recomputed each block
    assert list(session.plan.actions) == [f"layers.{i}" for i in range(3)]
    if strategy == "pgac":
        assert isinstance(session.pgac, remat.PGAC) and session.pgac.step_count == STEPS
    else:
        assert session.plan.strategy == "optimal" and session.plan.fits


@pytest.mark.skipif(LIGHTNING is None, reason="lightning is not installed (pip install lightning)")
@pytest.mark.parametrize("remat_first", [True, False], ids=["remat-first", "averaging-first"])
def test_the_callback_beside_lightnings_weight_averaging_trains_and_averages_as_plain(remat_first: bool) -> None:
    """Lightning's WeightAveraging (EMA) deep-copies the module at setup, after or before the callback's plan: the
    copy is the plain model, and the weights trained and averaged are those of training without remat."""
    callbacks = pytest.importorskip("lightning.pytorch.callbacks")
    if not hasattr(callbacks, "WeightAveraging"):
        pytest.skip("this Lightning has no WeightAveraging (2.6 and later)")
    plain_average = callbacks.WeightAveraging()
    reference = fit([plain_average])
    average, callback = callbacks.WeightAveraging(), RematCallback("optimal", budget=0.6)
    trained = fit([callback, average] if remat_first else [average, callback])
    for got, expected in ((trained, reference), (average._average_model, plain_average._average_model)):
        for (name, p), q in zip(got.named_parameters(), expected.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert callback.session is not None and callback.session.stats.total_calls >= 3


@pytest.mark.skipif(LIGHTNING is None, reason="lightning is not installed (pip install lightning)")
def test_a_run_resumed_from_a_checkpoint_goes_on_with_pgacs_state(tmp_path: Any) -> None:
    """PGAC's state rides in Lightning's checkpoint: a run resumed from the end of its first epoch goes on with
    the step count, scores and costs it had (nothing profiled again), and trains the weights of two epochs of
    plain training."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(epochs: int, callbacks: list[Any], ckpt_path: Any = None) -> nn.Module:
        torch.manual_seed(0)
        module = LitNet()
        L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=callbacks, default_root_dir=tmp_path,
                  enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                  ).fit(module, ckpt_path=ckpt_path)  # fmt: skip
        return module

    reference = run(2, [])
    first = RematCallback("pgac", budget=0.7, alpha=0.5, total_steps=2 * STEPS)
    run(1, [first, ModelCheckpoint(dirpath=tmp_path, filename="first", save_top_k=-1)])
    saved = first.session.pgac
    resumed = RematCallback("pgac", budget=0.7, alpha=0.5, total_steps=2 * STEPS)
    trained = run(2, [resumed], ckpt_path=tmp_path / "first.ckpt")
    pgac = resumed.session.pgac
    assert saved.step_count == STEPS and pgac.step_count == 2 * STEPS
    assert pgac.costs.to_dict() == saved.costs.to_dict()  # the costs of the first run, not profiled again
    assert [r.step for r in pgac.history] == list(range(STEPS, 2 * STEPS))  # its updates past the first epoch
    for (name, p), q in zip(trained.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="holds PGAC's state.*resume with the strategy that saved it"):
        run(2, [RematCallback("optimal", budget=0.6)], ckpt_path=tmp_path / "first.ckpt")


class StepMeter(L.Callback if LIGHTNING is not None else object):  # type: ignore[misc]
    """Each training step's whole peak: what is resident when it starts (parameters, gradients, optimizer state)
    plus the live-tensor tracker's peak over the step, optimizer step included."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self._tracker: Any = None
        self._resident = 0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        from remat.meters import LiveTensorTracker

        self._resident = resident_bytes(module, *trainer.optimizers)
        self._tracker = LiveTensorTracker("cpu").__enter__()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._tracker.exit_anywhere()
        self._tracker.close()
        self.peaks.append(self._resident + self._tracker.peak(exclude_survivors=False))


WIDE_DATA = [torch.randn(512, 8, generator=torch.Generator().manual_seed(i)) for i in range(STEPS + 1)]


if LIGHTNING is not None:

    class WideNet(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(nn.Linear(8, 64), *[Block(64) for _ in range(6)], nn.Linear(64, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            torch.manual_seed(batch_idx)
            return self.model(batch).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(WIDE_DATA, batch_size=None, shuffle=False)


def fit_module(make: Any, callbacks: list[Any], **trainer_options: Any) -> nn.Module:
    """``make()``'s LightningModule trained for ``STEPS + 1`` steps on the CPU with ``callbacks`` (and the
    ``Trainer``'s ``trainer_options``)."""
    torch.manual_seed(0)
    module = make()
    trainer = L.Trainer(max_steps=STEPS + 1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                        **trainer_options)  # fmt: skip
    trainer.fit(module)
    return module


def fit_wide(callbacks: list[Any], **trainer_options: Any) -> nn.Module:
    return fit_module(WideNet, callbacks, **trainer_options)


def fitted_with_a_batch(first: int, **trainer_options: Any) -> tuple[Any, list[int], int]:
    """``WideNet`` trained under ``RematCallback(memory=..., batch=...)`` at 0.8 of the plain run's whole peak from
    its ``first``-th batch on: the session, the peaks from that batch on and the memory. Training is checked bitwise
    against the plain run's."""
    plain_meter = StepMeter()
    reference = fit_wide([plain_meter], **trainer_options)
    memory = int(max(plain_meter.peaks[first:]) * 0.8)
    meter = StepMeter()
    callback = RematCallback(memory=memory, batch=WIDE_DATA[0], loss_fn=lambda out: out.square().mean())
    trained = fit_wide([callback, meter], **trainer_options)
    for (name, p), q in zip(trained.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert callback.session is not None
    return callback.session, meter.peaks[first:], memory


@pytest.mark.skipif(LIGHTNING is None, reason="lightning is not installed (pip install lightning)")
def test_the_callback_keeps_lightnings_whole_step_within_memory() -> None:
    plain_meter = StepMeter()
    reference = fit_wide([plain_meter])
    memory = int(max(plain_meter.peaks[1:]) * 0.8)  # from the second step on, the optimizer's state is resident
    meter = StepMeter()
    callback = RematCallback(memory=memory)
    trained = fit_wide([callback, meter])
    session = callback.session
    assert session is not None and session.fitted is not None and session.optimizer is not None
    assert session.plan.action_counts() != "6 keep"
    assert max(meter.peaks[1:]) <= memory * 1.02, (meter.peaks, memory)  # the plan runs from the second step
    for (name, p), q in zip(trained.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.skipif(LIGHTNING is None, reason="lightning is not installed (pip install lightning)")
def test_the_callback_with_a_batch_counts_the_trainers_optimizer() -> None:
    """``memory=`` and ``batch=``: the fit runs at setup, before the trainer makes its optimizer; at the start of
    training the optimizer's state counts and the fit is measured again, so every step with the state resident is
    within the memory (it ran 1.25x over), and training is bitwise plain training's."""
    session, peaks, memory = fitted_with_a_batch(first=0)
    assert "optimizer state (AdamW)" in session.describe() and session.plan.action_counts() != "6 keep"
    assert max(peaks) <= memory * 1.02, (peaks, memory)


@pytest.mark.skipif(LIGHTNING is None, reason="lightning is not installed (pip install lightning)")
def test_the_callback_measures_the_trainers_gradient_accumulation() -> None:
    """``accumulate_grad_batches=2``: the callback tells the fit that the loop accumulates, so it measures a
    micro-step with the gradients there; every micro-step from the second optimizer step on is within the memory
    and training is bitwise plain training's."""
    session, peaks, memory = fitted_with_a_batch(first=2, accumulate_grad_batches=2)
    assert session.accumulates and session.plan.action_counts() != "6 keep"
    assert max(peaks) <= memory * 1.02, (peaks, memory)

COMPILE = {"backend": "aot_eager_decomp_partition", "budgets": (0.5,), "partition_budgets": (0.1,), "rounds": 2}
PLAIN_DATA = [torch.randn(256, 64, generator=torch.Generator().manual_seed(i)) for i in range(STEPS + 1)]


def square_mean(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


class AllocatorMeter(L.Callback if LIGHTNING is not None else object):  # type: ignore[misc]
    """Each training step's whole peak, read from the allocator's events (which see inside compiled code), plus
    what is resident when it starts."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self._measuring: Any = None
        self._report: Any = None
        self._resident = 0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self._resident = resident_bytes(module, *trainer.optimizers)
        self._measuring = remat.measure(allocations=True)
        self._report = self._measuring.__enter__()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._measuring.__exit__(None, None, None)
        self.peaks.append(self._resident + self._report.peak_bytes)


if LIGHTNING is not None:
    from toy_models import GeluBlock

    class GeluNet(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(*[GeluBlock() for _ in range(6)])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return square_mean(self.model(batch))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(PLAIN_DATA, batch_size=None, shuffle=False)


def fit_gelu(callbacks: list[Any]) -> nn.Module:
    return fit_module(GeluNet, callbacks)


class CompiledFaster:
    """A clock under which a step of any compiled route reads 1 s and one of the eager plan 2 s."""

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.now = 0.0

    def __call__(self) -> float:
        blocks = list(self.model) if self.model is not None else []
        compiled = self.model is not None and (
            self.model._compiled_call_impl is not None or any(b._compiled_call_impl is not None for b in blocks)
        )
        self.now += 1.0 if compiled else 2.0
        return self.now


@pytest.mark.skipif(LIGHTNING is None, reason="lightning is not installed (pip install lightning)")
def test_the_callback_takes_the_compiled_route_within_memory() -> None:
    plain_meter = AllocatorMeter()
    reference = fit_gelu([plain_meter])
    memory = int(max(plain_meter.peaks[1:]) * 0.9)
    clock = CompiledFaster()

    class Watch(L.Callback):  # the clock reads the model the callback fits
        def setup(self, trainer: Any, module: nn.Module, stage: str | None = None) -> None:
            clock.model = module.model

    meter = AllocatorMeter()
    callback = RematCallback(memory=memory, batch=PLAIN_DATA[0], loss_fn=square_mean, compile=COMPILE, clock=clock)
    trained = fit_gelu([Watch(), callback, meter])
    session = callback.session
    assert isinstance(session, remat.integrations.compiled_session.CompiledSession)
    assert session.route in {"whole model", "blocks"}, session.describe()
    assert max(meter.peaks) <= memory * 1.02, (meter.peaks, memory)
    assert session.removed and trained.model._compiled_call_impl is None
    assert not any(b._compiled_call_impl is not None for b in trained.model)
    for (name, p), q in zip(trained.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


def test_the_callbacks_compile_needs_memory_and_a_batch_and_one_device() -> None:
    with pytest.raises(ValueError, match=r"RematCallback\(memory='22GiB', batch=\.\.\., compile=True\)"):
        RematCallback(memory="1GiB", compile=True)
    with pytest.raises(ValueError, match=r"given: \['budget'\]"):
        RematCallback(budget=0.5, memory="1GiB", batch=PLAIN_DATA[0], compile=True)

    class TwoRanks:
        world_size = 2

    callback = RematCallback(memory="1GiB", batch=PLAIN_DATA[0], compile=True)
    with pytest.raises(ValueError, match="on one device; this trainer runs 2 processes"):
        callback.setup(TwoRanks(), Net(), "fit")
