"""``remat.measure()`` around each of the first training steps under every integration reads the step: never
zero, and close to the same measurement of a plain step. The integrations profile the first step with a
tracker of their own (and PGAC measures steps with one), entered and left at step boundaries that may fall
inside the user's measurement; the two must not take each other's place."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import remat

transformers = pytest.importorskip("transformers")


def _bert() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128
    )
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    return transformers.BertForMaskedLM(config).train(), {"input_ids": ids, "labels": ids}


def _measured_steps(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer | None, n: int) -> list:
    reports = []
    for _ in range(n):
        with remat.measure() as report:
            model(**batch).loss.backward()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
        reports.append(report)
    return reports


def _hf_without_optimizer(model: torch.nn.Module) -> tuple[Callable[[], None], None]:
    from remat.integrations import hf

    session = hf.enable(model, budget=0.5)
    return session.remove, None


def _hf_with_optimizer(model: torch.nn.Module) -> tuple[Callable[[], None], torch.optim.Optimizer]:
    from remat.integrations import hf

    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    session = hf.enable(model, budget=0.5)
    return session.remove, optimizer


def _pgac(model: torch.nn.Module) -> tuple[Callable[[], None], torch.optim.Optimizer]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    pgac = remat.PGAC(model, 0.5, measure=1).attach(optimizer)
    return pgac.remove, optimizer


@pytest.mark.parametrize("integrate", [_hf_without_optimizer, _hf_with_optimizer, _pgac], ids=lambda f: f.__name__)
def test_the_first_steps_are_measured(integrate: Callable) -> None:
    model, batch = _bert()
    plain = _measured_steps(model, batch, None, 1)[0]
    model.zero_grad(set_to_none=True)
    remove, optimizer = integrate(model)
    try:
        reports = _measured_steps(model, batch, optimizer, 3)
    finally:
        remove()
    for i, report in enumerate(reports):
        assert report.activation_bytes > 0 and report.peak_bytes > 0, f"step {i} read zero"
        # every step holds at least its parameter gradients' worth of transient memory and at most the profiling
        # step's extra (the profiler runs each block alone on top of the step)
        assert 0.2 * plain.peak_bytes < report.peak_bytes < 3 * plain.peak_bytes, (i, report, plain)
    _after = _measured_steps(model, batch, None, 1)[0]
    assert _after.peak_bytes == pytest.approx(plain.peak_bytes, rel=0.05)  # nothing left installed


def test_held_bytes_counts_each_storage_an_object_holds_once() -> None:
    from torch import nn

    from remat.meters import held_bytes

    class Holder:  # a class of this module: its attributes are followed only when asked
        def __init__(self) -> None:
            self.weights = nn.Linear(4, 4)  # 16 + 4 floats, and a gradient of 16 below
            self.flat = torch.zeros(10)
            self.views = {"a": self.flat[:5], "b": [self.flat[5:]]}  # the same storage: counted once
            self.meta = torch.empty(1000, device="meta")  # not on the CPU

    holder = Holder()
    holder.weights.weight.grad = torch.ones(4, 4)
    assert held_bytes(holder) == 0  # Holder's own attributes are not followed by default
    assert held_bytes(holder, through=("test_meters", "torch")) == (16 + 4 + 16 + 10) * 4


def test_summits_are_the_moments_before_each_free_and_the_last() -> None:
    from remat.meters import LiveTensorTracker

    tracker = LiveTensorTracker("cpu")
    with tracker:
        tracker.mark("start")
        a = torch.empty(100, dtype=torch.uint8)  # 100
        b = torch.empty(50, dtype=torch.uint8)  # 150: a summit, b is freed next
        del b
        c = torch.empty(400, dtype=torch.uint8)  # 500: a summit, a is freed next
        del a
        d = torch.empty(10, dtype=torch.uint8)  # 410, the last
        tracker.mark("end")
        del c, d  # freed before the region closes: not survivors, which the series leaves out
    tracker.close()
    assert tracker.summits_between("start", "end") == [150, 500, 410]
    assert max(tracker.summits_between("start", "end")) == tracker.peak_between("start", "end")
