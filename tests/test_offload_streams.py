"""The ``offload`` action's copies (``remat.checkpointing.offload_streams``) and their price
(``remat.planning.offload_overlap``).

On the CPU host and device are one memory, so the copies run synchronously; :class:`LateCopies`, a copy engine
whose copies really copy but end only when the compute side waits for them (as a copy engine that lags behind the
compute stream), checks the queue's bounds: at most two offloaded block calls hold device memory for their copies
to the host (invariant 1), and at most two hold copies back on the device, every block but the forward's last
copied back ahead of its backward (invariant 2). Gradients, outputs and buffers equal a plain step's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat
from remat.checkpointing import MAX_CALLS_IN_FLIGHT
from remat.core import BlockCost, CostTable
from remat.planning import Plan, exposed_copy_s, make_plan, overlap_priced, simulate


class LateCopies:
    """Copies that end only when waited for: the most a lagging copy engine can hold back."""

    def __init__(self) -> None:
        self.pending: set[int] = set()
        self.copies_to_host = 0
        self.copies_to_device = 0
        self.sources: list[int] = []  # data pointers of the tensors copied to the host

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        self.copies_to_host += 1
        self.sources.append(tensor.data_ptr())
        token = id(object()) + self.copies_to_host
        self.pending.add(token)
        return tensor.detach().clone(memory_format=torch.contiguous_format), token

    def to_device(self, host: torch.Tensor, saved) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        self.copies_to_device += 1
        back = torch.empty_strided(saved.size, saved.stride, dtype=host.dtype)
        back.copy_(host)
        return back, None

    def finished(self, token: int | None) -> bool:
        return token is None or token not in self.pending

    def wait(self, token: int | None) -> None:
        self.pending.discard(token)

    def adopt(self, tensor: torch.Tensor) -> None:
        return None


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 3 * width), nn.Linear(3 * width, width)
        self.drop = nn.Dropout(0.2)
        self.norm = nn.BatchNorm1d(width)  # a buffer the step updates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.nn.functional.gelu(self.up(x)))
        y = self.down(h).transpose(0, 1).contiguous().transpose(0, 1)  # saved with strides of its own
        return x + self.norm(y)


def _model(n: int = 6, width: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(n)])


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = model(x)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()], [b.clone() for b in model.buffers()]


def _plan(model: nn.Module, actions: list[str]) -> Plan:
    return Plan({fqn: a for (fqn, _), a in zip(remat.find_blocks(model), actions, strict=True)})


def _applied_with_late_copies(model: nn.Module, actions: list[str]) -> tuple[remat.RematHandle, LateCopies]:
    """``actions`` applied to ``model``, its offloaded blocks copied by a :class:`LateCopies`."""
    handle = remat.apply(model, _plan(model, actions))
    engine = LateCopies()
    handle._offload.engine_for = lambda device: engine
    return handle, engine


@pytest.mark.parametrize("late", [False, True])
def test_offloaded_blocks_give_the_outputs_gradients_and_buffers_of_a_plain_step(late: bool) -> None:
    plain, model = _model(), _model()
    x = torch.randn(32, 16, requires_grad=False)
    reference = _step(plain, x)
    actions = ["offload", "offload", "keep", "offload", "checkpoint", "offload"]
    handle = remat.apply(model, _plan(model, actions))
    engine = LateCopies()
    if late:
        handle._offload.engine_for = lambda device: engine
    got = _step(model, x)
    for want, have in zip(reference, got, strict=True):
        if isinstance(want, torch.Tensor):
            assert torch.equal(want, have)
        else:
            assert all(torch.equal(a, b) for a, b in zip(want, have, strict=True))
    stats = handle.offload_stats
    assert stats.most_calls_in_flight <= MAX_CALLS_IN_FLIGHT
    if late:
        assert engine.copies_to_host > 0 and engine.copies_to_device > 0  # values went through real copies
    handle.remove()


def test_at_most_two_block_calls_hold_device_memory_for_copies_that_lag() -> None:
    model = _model(n=6)
    handle, _ = _applied_with_late_copies(model, ["offload"] * 6)
    _step(model, torch.randn(32, 16))
    stats = handle.offload_stats
    # Copies that never end by themselves: without invariant 1 all six calls would hold their device tensors.
    assert stats.most_calls_in_flight == MAX_CALLS_IN_FLIGHT
    assert stats.released_waiting >= 4  # each later block waited for the copies of the call two before it
    largest = max(call.nbytes for call in handle._offload._calls)
    assert largest < stats.most_bytes_in_flight <= MAX_CALLS_IN_FLIGHT * largest
    handle.remove()


def test_every_block_but_the_last_is_copied_back_ahead_of_its_backward() -> None:
    model = _model(n=5)
    handle, _ = _applied_with_late_copies(model, ["offload"] * 5)
    _step(model, torch.randn(32, 16))
    stats = handle.offload_stats
    calls = handle._offload._calls
    unpacks = [sum(saved.packs for saved in call.saved) for call in calls]
    assert len(calls) == 5 and min(unpacks) > 0
    # The forward's last block: its backward comes first, nothing runs before it to hide a copy.
    assert stats.copied_back_late == unpacks[-1]
    assert stats.copied_back_ahead == sum(unpacks[:-1])  # the other four, copied back one block ahead
    assert stats.most_calls_copied_back == 2  # the block whose backward runs and the one before it (invariant 2)
    handle.remove()


def test_parameters_and_block_inputs_are_not_copied() -> None:
    model = _model(n=2)
    x = torch.randn(32, 16, requires_grad=True)
    handle, engine = _applied_with_late_copies(model, ["offload", "offload"])
    inputs: list[int] = []
    model[1].register_forward_pre_hook(lambda module, args: inputs.append(args[0].data_ptr()))
    model(x).sum().backward()
    alive_anyway = {p.data_ptr() for p in model.parameters()} | {x.data_ptr(), *inputs}
    assert engine.sources and not alive_anyway & set(engine.sources)
    handle.remove()


def test_a_retained_graph_runs_backward_twice_with_equal_gradients() -> None:
    plain, model = _model(n=3), _model(n=3)
    x = torch.randn(32, 16)
    handle = remat.apply(model, _plan(model, ["offload"] * 3))
    for m in (plain, model):
        m.eval()  # no dropout: both backwards must agree with one plain step's
    loss_plain = plain(x).square().mean()
    loss_plain.backward()
    want = [p.grad.clone() for p in plain.parameters()]
    loss = model(x).square().mean()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss.backward()
    second = [p.grad.clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(want, first, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    handle.remove()


# ---------------------------------------------------------------- the price of an overlapped copy


def _row(fqn: str, keep: int, fwd: float, bwd: float, offload_s: float) -> BlockCost:
    return BlockCost(
        fqn=fqn, fwd_s=fwd, bwd_s=bwd, input_bytes=keep // 8, output_bytes=keep // 8,
        saved_bytes={"keep": keep, "checkpoint": keep // 8, "offload": keep // 8},
        recompute_s={"keep": 0.0, "checkpoint": fwd, "offload": offload_s},
        fwd_temp_bytes=keep // 4, bwd_temp_bytes=keep // 4,
    )  # fmt: skip


def _table(n: int, keep: int, fwd: float, bwd: float, bandwidth: float | None) -> CostTable:
    rows = [_row(f"b{i}", keep, fwd, bwd, offload_s=2 * (keep - keep // 8) / 1e9) for i in range(n)]
    table = CostTable(rows, device="cuda")
    if bandwidth is not None:
        table.copy_bytes_per_s = {"to_host": bandwidth, "to_device": bandwidth}
    return table


def test_a_hidden_copy_costs_nothing_and_an_exposed_one_its_exposed_part() -> None:
    assert exposed_copy_s(1e9, 1e10, window_s=0.2) == 0.0  # 0.1 s of copy under 0.2 s of compute
    assert exposed_copy_s(1e9, 1e10, window_s=0.04) == pytest.approx(0.06)
    with pytest.raises(ValueError, match="positive"):
        exposed_copy_s(1, 0, 0)
    moved = 7 * 2**20
    hidden = overlap_priced(_table(3, 8 * 2**20, fwd=0.01, bwd=0.02, bandwidth=1e10))  # 0.73 ms per copy
    assert [r.time_cost("offload") for r in hidden.blocks[:2]] == [0.0, 0.0]
    last = hidden.blocks[2]  # nothing after it to hide its copies
    assert last.time_cost("offload") == pytest.approx(2 * moved / 1e10)
    exposed = overlap_priced(_table(3, 8 * 2**20, fwd=0.0002, bwd=0.0005, bandwidth=1e10))
    first = exposed.blocks[0]
    assert first.overhead_s["offload"] == pytest.approx(moved / 1e10 - 0.0002)
    assert first.recompute_s["offload"] == pytest.approx(moved / 1e10 - 0.0005)
    # in flight: the next block's keep bytes and temporaries beside the moved ones
    assert first.bwd_extra_bytes["offload"] == 8 * 2**20 + 2 * 2**20 - 2 * 2**20
    assert overlap_priced(_table(3, 8, 0.1, 0.1, None)).blocks[0].time_cost("offload") > 0  # no bandwidth: as is


def test_the_planner_offloads_where_the_copies_hide_and_not_where_they_do_not() -> None:
    keep = 64 * 2**20
    budget = 0.5
    hidden = overlap_priced(_table(8, keep, fwd=0.02, bwd=0.04, bandwidth=2e10))  # copies of 3 ms under 20 ms
    plan = make_plan(hidden, "optimal", budget=budget)
    assert "offload" in plan.actions.values()
    assert "checkpoint" not in plan.actions.values()  # recomputing costs 20 ms a block, a hidden copy nothing
    sim = simulate(hidden, plan.actions)
    assert sim.peak_bytes <= plan.budget_bytes and sim.time_cost_s == 0.0
    slow = overlap_priced(_table(8, keep, fwd=0.002, bwd=0.004, bandwidth=2e9))  # copies of 29 ms, 2 ms windows
    assert "offload" not in make_plan(slow, "optimal", budget=budget).actions.values()


def test_a_profile_copied_as_is_keeps_its_bandwidth() -> None:
    table = _table(2, 2**20, 0.01, 0.01, bandwidth=3e10)
    again = CostTable.from_json(table.to_json())
    assert again.copy_bytes_per_s == {"to_host": 3e10, "to_device": 3e10}
    assert copy.deepcopy(again).copy_bytes_per_s == again.copy_bytes_per_s
