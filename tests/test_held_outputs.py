"""Models that keep every block's output to the end of the step (Hugging Face's ``output_hidden_states``): a
unit's backward runs while the outputs of its last block and of the later blocks of its chain are alive, and
the simulator counts them, so no plan is predicted below its measured peak (segments starting at a chain's
first block were, by one hidden state)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import remat
from remat.core import BlockCost, CostTable
from remat.meters import LiveTensorTracker
from remat.planning import simulate


class _Block(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _CollectingNet(nn.Module):
    """Blocks of different widths; returns the loss and every block's output, as ``output_hidden_states`` does."""

    def __init__(self, widths: tuple[int, ...] = (64, 1024, 64, 64), d: int = 32) -> None:
        super().__init__()
        self.stem = nn.Linear(d, d)
        self.blocks = nn.ModuleList(_Block(d, h) for h in widths)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        x = self.stem(x)
        states = [x]
        for block in self.blocks:
            x = block(x)
            states.append(x)
        return self.head(x).pow(2).mean(), tuple(states)


def _measured_peak(model: nn.Module, run, plan: remat.Plan, blocks) -> int:  # noqa: ANN001
    handle = remat.apply(model, plan, blocks=blocks)
    tracker = LiveTensorTracker()
    try:
        with tracker:
            out = run()
            del out
    finally:
        handle.remove()
    tracker.close()
    model.zero_grad(set_to_none=True)
    return tracker.peak(exclude_survivors=True)


def test_held_outputs_run_from_a_row_to_its_chains_last_but_one() -> None:
    row = BlockCost("b", 0.0, 0.0, 3, 3, {"keep": 9, "checkpoint": 3}, {"keep": 0.0, "checkpoint": 0.0})
    rows = [BlockCost(**{**vars(row), "fqn": f"b{i}", "output_bytes": 10 * (i + 1)}) for i in range(5)]
    costs = CostTable(rows, chain_lengths=[3, 2], between_bytes=[0], outputs_kept=True)
    assert costs.held_outputs_per_row() == [30, 20, 0, 40, 0]
    assert [costs.held_outputs(i) for i in range(5)] == [30, 20, 0, 40, 0]
    assert CostTable(rows).held_outputs_per_row() == [0] * 5  # the model frees its blocks' outputs


def test_every_plan_of_a_model_that_collects_its_outputs_is_predicted_at_its_measured_peak() -> None:
    torch.manual_seed(0)
    model = _CollectingNet()
    x = torch.randn(64, 32)
    blocks = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]

    def step() -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        out = model(x)
        out[0].backward()
        return out

    costs = remat.profile(model, x, blocks=blocks, loss_fn=lambda out: out[0], repeats=1)
    assert costs.outputs_kept
    plans = [list(p) for p in itertools.product(["keep", "checkpoint"], repeat=4)]
    plans += [["segment:0"] * 2 + ["keep"] * 2, ["keep"] + ["segment:0"] * 2 + ["keep"]]
    plans += [["memory_poor:0"] * 3 + ["keep"]]
    for actions in plans:
        plan = remat.Plan.from_actions(costs, actions)
        peak = _measured_peak(model, step, plan, blocks)
        # Before the outputs held through a unit's backward were counted, every plan here was predicted two
        # outputs (16 KiB) below its measured peak.
        assert peak <= plan.predicted_peak_bytes <= 1.02 * peak, (actions, peak, plan.predicted_peak_bytes)


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_segments_from_a_chains_first_block_are_not_predicted_below_their_peak(name: str) -> None:
    pytest.importorskip("transformers")
    from remat.bench.arch_check import SEED
    from remat.bench.arch_zoo import by_name

    arch = by_name(name)
    model = arch.build()
    batch = {**arch.batch(), "use_cache": False}
    assert batch["output_hidden_states"]
    chains = remat.find_chains(model)
    costs = remat.profile(model, batch, blocks=chains, repeats=1)

    def step():  # noqa: ANN202
        torch.manual_seed(SEED)
        out = model(**batch)
        out.loss.backward()
        return out

    for first in (["segment:0", "segment:0", "keep"], ["segment:0", "segment:0", "segment:0"]):
        # the same shape on every chain, group ids numbered across the plan
        actions = [a.replace(":0", f":{k}") for k, chain in enumerate(costs.chains) for a in first[: len(chain)]]
        plan = remat.Plan.from_actions(costs, actions)
        peak = _measured_peak(model, step, plan, chains)
        # llama, segment, segment, keep: measured 241,288 bytes against 237,192 predicted before the fix
        assert peak <= plan.predicted_peak_bytes <= 1.05 * peak, (actions, peak, plan.predicted_peak_bytes)
    assert simulate(costs, ["keep"] * len(costs)).peak_bytes == remat.plan(costs, "none").predicted_peak_bytes
