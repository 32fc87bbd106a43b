"""Other libraries' recomputation. RNG streams beyond torch's (``remat.checkpointing.rng``): a block that draws
dropout inside a framework's tracker of named RNG states (Megatron-Core's ``get_cuda_rng_tracker().fork()``,
DeepSpeed's model-parallel tracker) is recomputed from the state its forward started from, so every exact action
gives the gradients of a plain step.

The tracker here follows Megatron-Core's pattern on the CPU (a named state swapped in by ``fork()`` and written back
when it ends). Megatron-Core's own tracker runs here where ``megatron-core`` is installed, with its CUDA state calls
mapped to the CPU's generator for the test alone (its users run on GPUs). Blocks that torch's checkpoint wrapper or
Megatron-Core's recompute re-run already are refused by ``remat.profile`` and ``remat.apply``, naming the wrapper.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.checkpointing import register_stream, unregister_stream


class Tracker:
    """Named RNG states, Megatron-Core's way: ``fork(name)`` runs with the named state and stores it advanced."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.states[name] = torch.get_rng_state()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


class Block(nn.Module):
    """Attention-like dropout drawn inside the tracker's fork, a residual dropout outside it."""

    def __init__(self, fork: Any) -> None:
        super().__init__()
        self.fork = fork
        self.up, self.down = nn.Linear(16, 48), nn.Linear(48, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        with self.fork():
            h = nn.functional.dropout(h, 0.3, self.training)
        return x + nn.functional.dropout(self.down(torch.tanh(h)), 0.1, self.training)


def _model(fork: Any) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(fork) for _ in range(4)])


def _grads(model: nn.Module, x: torch.Tensor, seed: int) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


PLANS = {
    "checkpoint": ["checkpoint"] * 4,
    "segments": ["segment:0", "segment:0", "segment:1", "segment:1"],
    "memory_poor": ["memory_poor:0"] * 4,
    "selective": ["selective:dots_saveable"] * 4,
    "offload": ["offload", "checkpoint", "offload", "keep"],
}


def _run(tracker: Any, actions: list[str], steps: int = 2) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Gradients of ``steps`` plain steps and of the same steps under ``actions``, each model with its own tracker
    seeded alike."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    plain_tracker, planned_tracker = tracker(), tracker()
    plain, planned = _model(plain_tracker.fork), _model(planned_tracker.fork)
    handle = remat.apply(planned, remat.Plan(dict(zip([f for f, _ in remat.find_blocks(planned)], actions,
                                                      strict=True))))  # fmt: skip
    want, got = [], []
    try:
        for step in range(steps):
            current.tracker = plain_tracker
            want.append(_grads(plain, x, step))
            current.tracker = planned_tracker
            got.append(_grads(planned, x, step))
    finally:
        handle.remove()
    return want, got


class _Current:
    tracker: Any = None


current = _Current()


def _seeded_tracker() -> Tracker:
    tracker = Tracker()
    tracker.add("model-parallel-rng", 1234)
    return tracker


@pytest.fixture
def registered() -> Iterator[None]:
    register_stream("test-tracker", lambda: current.tracker.get_states(), lambda s: current.tracker.set_states(s))
    yield
    unregister_stream("test-tracker")


def test_without_the_stream_a_recomputation_draws_other_masks() -> None:
    want, got = _run(_seeded_tracker, PLANS["checkpoint"])
    assert not all(torch.equal(a, b) for a, b in zip(want[0], got[0], strict=True))


@pytest.mark.parametrize("name", list(PLANS))
def test_every_exact_action_replays_a_registered_stream(registered, name: str) -> None:
    want, got = _run(_seeded_tracker, PLANS[name])
    for step_want, step_got in zip(want, got, strict=True):
        for a, b in zip(step_want, step_got, strict=True):
            assert torch.equal(a, b)


def test_megatron_cores_tracker_is_replayed_without_registering(monkeypatch) -> None:
    random = pytest.importorskip("megatron.core.tensor_parallel.random")
    # Megatron-Core's tracker keeps CUDA generator states; here they are the CPU generator's (the test's mapping).
    monkeypatch.setattr(random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state())
    monkeypatch.setattr(random, "_set_cuda_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state))

    def megatron_tracker() -> Any:
        tracker = random.CudaRNGStatesTracker()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1234)
            tracker.set_states({"model-parallel-rng": torch.get_rng_state()})
        return tracker

    trackers: list[Any] = []

    def tracker() -> Any:
        made = megatron_tracker()
        trackers.append(made)
        return made

    # The model's forks use the tracker the module-level getter returns, as Megatron's layers do.
    monkeypatch.setattr(random, "get_cuda_rng_tracker", lambda: current.tracker)
    want, got = _run(tracker, PLANS["checkpoint"])
    for step_want, step_got in zip(want, got, strict=True):
        for a, b in zip(step_want, step_got, strict=True):
            assert torch.equal(a, b)
    snapshot = remat.checkpointing.RngSnapshot.take()
    assert "megatron.core.tensor_parallel.random" in snapshot.streams


# ---------------------------------------------------------------- blocks another library recomputes already


def test_blocks_wrapped_by_torchs_checkpoint_wrapper_are_refused_naming_the_wrapper() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = nn.Sequential(*[checkpoint_wrapper(nn.Sequential(nn.Linear(8, 8), nn.Tanh())) for _ in range(3)])
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match=r"block '0' is recomputed already by torch's checkpoint_wrapper"):
        remat.profile(model, x)
    with pytest.raises(RuntimeError, match="CheckpointWrapper: torchtitan's FullAC"):
        remat.apply(model, remat.Plan({str(i): "keep" for i in range(3)}))
    unwrapped = nn.Sequential(*[m._checkpoint_wrapped_module for m in model])  # built without it: planned
    assert len(remat.profile(unwrapped, x, repeats=1)) == 3


def test_megatron_cores_own_recompute_is_refused() -> None:
    class Config:
        recompute_granularity = "full"
        recompute_method = "uniform"

    class Layer(nn.Linear):
        config = Config()

    model = nn.Sequential(*[Layer(8, 8) for _ in range(2)])
    with pytest.raises(RuntimeError, match="Megatron-Core's recompute .config.recompute_granularity='full'."):
        remat.apply(model, remat.Plan({"0": "keep", "1": "keep"}))
