"""Blocks of unusual shape: a hidden state that is not the first output, blocks called with keywords only, blocks
that change their input in place; and the user naming the main input and output where the guess is wrong."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.planning import Plan

N_BLOCKS = 4
PLANS = {
    "keep": ["keep"] * N_BLOCKS,
    "checkpoint": ["checkpoint"] * N_BLOCKS,
    "selective": ["selective:dots_saveable"] * N_BLOCKS,
    "segment": ["segment:0"] * N_BLOCKS,
    "memory_poor": ["memory_poor:0"] * N_BLOCKS,
    "mixed": ["keep", "segment:0", "segment:0", "memory_poor:1"],
}


class AuxFirst(nn.Module):
    """Returns ``(aux, hidden)``; ``aux`` has the hidden state's shape when ``same_shape``, else one per row."""

    def __init__(self, same_shape: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.same_shape = same_shape

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.lin(x))
        aux = h * 0.5 if self.same_shape else h.pow(2).mean(-1)
        return aux, h + x


class KeywordBlock(nn.Module):
    """Called as ``block(mask=m, hidden=x)``; ``forward``'s first parameter is ``first``."""

    def __init__(self, first: str = "hidden") -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.first = first

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden, mask = kwargs["hidden"], kwargs["mask"]
        return torch.tanh(self.lin(hidden)) * mask + hidden


class HiddenFirst(KeywordBlock):
    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(hidden=hidden, mask=mask)


class MaskFirst(KeywordBlock):
    def forward(self, mask: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(hidden=hidden, mask=mask)


class InPlace(nn.Module):
    """Adds one to its input in place (its output is a Linear's, which nothing saves, so this trains plainly)."""

    def __init__(self, clone: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.clone = clone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clone:
            x = x.clone()
        x.add_(1.0)
        return self.lin(x)


class Chain(nn.Module):
    def __init__(self, make: Any, call: str = "positional") -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([make() for _ in range(N_BLOCKS)])
        self.call = call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        mask = torch.linspace(0.5, 1.0, 8)
        extra = h.new_zeros(())
        for block in self.blocks:
            if self.call == "keywords":
                h = block(mask=mask, hidden=h)
            else:
                out = block(h)
                if isinstance(out, tuple):
                    aux, h = out
                    extra = extra + aux.mean()
                else:
                    h = out
        return (h.pow(2).sum() + extra) if self.call != "keywords" else h.pow(2).sum()


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).backward()
    return [p.grad.clone() for p in model.parameters()]


def _plan(kind: str) -> Plan:
    return Plan({f"blocks.{i}": a for i, a in enumerate(PLANS[kind])})


def _check_exact(model: nn.Module, kind: str, **names: Any) -> None:
    torch.manual_seed(1)
    x = torch.randn(3, 8)
    reference = _grads(copy.deepcopy(model), x)
    handle = remat.apply(model, _plan(kind), **names)
    try:
        got = _grads(model, x)
    finally:
        handle.remove()
    for r, g in zip(reference, got, strict=True):
        assert torch.equal(r, g)


# ----- (a) the hidden state is not the first output -----
@pytest.mark.parametrize("kind", list(PLANS))
def test_aux_first_output_is_passed_over_by_its_shape(kind: str) -> None:
    torch.manual_seed(0)
    _check_exact(Chain(AuxFirst), kind)


@pytest.mark.parametrize("kind", ["segment", "memory_poor"])
def test_aux_of_the_same_shape_is_diagnosed_with_main_output(kind: str) -> None:
    torch.manual_seed(0)
    model = Chain(lambda: AuxFirst(same_shape=True))
    handle = remat.apply(model, _plan(kind))
    try:
        with pytest.raises(RuntimeError, match=r"receives output 1 of block 'blocks.0'.*main_output=1"):
            model(torch.randn(3, 8))
    finally:
        handle.remove()
    a = torch.randn(2, requires_grad=True)
    a.exp().sum().backward()  # nothing of the failed forward is left in the thread


@pytest.mark.parametrize("kind", list(PLANS))
def test_main_output_names_the_hidden_state(kind: str) -> None:
    torch.manual_seed(0)
    _check_exact(Chain(lambda: AuxFirst(same_shape=True)), kind, main_output=1)


def test_profile_measures_the_hidden_output_not_the_aux() -> None:
    torch.manual_seed(0)
    model = Chain(AuxFirst)
    costs = remat.profile(model, torch.randn(3, 8), repeats=1)
    hidden_bytes = 3 * 8 * 4
    assert [row.output_bytes for row in costs.blocks] == [hidden_bytes] * N_BLOCKS
    named = remat.profile(Chain(lambda: AuxFirst(same_shape=True)), torch.randn(3, 8), repeats=1, main_output=1)
    assert [row.output_bytes for row in named.blocks] == [hidden_bytes] * N_BLOCKS


def test_main_output_that_is_no_tensor_is_refused() -> None:
    model = Chain(AuxFirst)
    handle = remat.apply(model, _plan("checkpoint"), main_output=5)
    try:
        with pytest.raises(ValueError, match=r"main_output=5 does not name a tensor in the output of block 'blocks.0'"):
            model(torch.randn(3, 8))
    finally:
        handle.remove()


# ----- (b) a block that changes its input in place -----
@pytest.mark.parametrize("kind", ["checkpoint", "selective", "segment", "memory_poor", "mixed"])
def test_in_place_input_change_names_the_block(kind: str) -> None:
    torch.manual_seed(0)
    model = Chain(InPlace)
    handle = remat.apply(model, _plan(kind))
    first_recomputed = f"blocks.{PLANS[kind].index(next(a for a in PLANS[kind] if a != 'keep'))}"
    try:
        with pytest.raises(RuntimeError, match=rf"block '{first_recomputed}' modifies its input in place") as info:
            model(torch.randn(3, 8)).backward()
        assert "x = x.clone()" in str(info.value) and "action 'keep'" in str(info.value)
        handle.set_plan(_plan("keep"))
        model(torch.randn(3, 8)).backward()  # the model trains again once the block is kept
    finally:
        handle.remove()
    a = torch.randn(2, requires_grad=True)
    a.exp().sum().backward()


@pytest.mark.parametrize("kind", ["keep"])
def test_in_place_block_kept_is_exact(kind: str) -> None:
    torch.manual_seed(0)
    _check_exact(Chain(InPlace), kind)


@pytest.mark.parametrize("kind", list(PLANS))
def test_in_place_block_that_clones_is_exact(kind: str) -> None:
    torch.manual_seed(0)
    _check_exact(Chain(lambda: InPlace(clone=True)), kind)


def test_profile_names_the_in_place_block() -> None:
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match=r"block 'blocks.0' modifies its input in place.*profiles it alone"):
        remat.profile(Chain(InPlace), torch.randn(3, 8), repeats=1)


# ----- (c) blocks called with keyword arguments only -----
@pytest.mark.parametrize("kind", list(PLANS))
def test_keyword_call_takes_forwards_first_parameter(kind: str) -> None:
    torch.manual_seed(0)
    _check_exact(Chain(HiddenFirst, call="keywords"), kind)


def test_keyword_call_that_cannot_be_told_apart_is_refused_with_how_to_name() -> None:
    model = Chain(KeywordBlock, call="keywords")
    handle = remat.apply(model, _plan("checkpoint"))
    try:
        with pytest.raises(ValueError, match=r"block 'blocks.0' was called with keyword arguments only") as info:
            model(torch.randn(3, 8))
        assert "main_input=" in str(info.value)
    finally:
        handle.remove()


@pytest.mark.parametrize("kind", list(PLANS))
@pytest.mark.parametrize("make", [KeywordBlock, MaskFirst], ids=["var_keywords", "mask_first"])
def test_main_input_names_the_hidden_state(kind: str, make: Any) -> None:
    torch.manual_seed(0)
    _check_exact(Chain(make, call="keywords"), kind, main_input="hidden")


def test_main_input_per_block() -> None:
    torch.manual_seed(0)
    names = {f"blocks.{i}": "hidden" for i in range(N_BLOCKS)}
    _check_exact(Chain(KeywordBlock, call="keywords"), "segment", main_input=names)
    with pytest.raises(ValueError, match=r"main_input names blocks not in the chain: \['nope'\]"):
        remat.apply(Chain(KeywordBlock, call="keywords"), _plan("keep"), main_input={"nope": "hidden"})


def test_mask_taken_as_main_input_is_diagnosed_in_a_segment() -> None:
    model = Chain(MaskFirst, call="keywords")
    handle = remat.apply(model, _plan("segment"))
    try:
        with pytest.raises(RuntimeError, match=r"cannot share a segment.*main_input="):
            model(torch.randn(3, 8))
    finally:
        handle.remove()


def test_profile_and_pgac_take_main_input() -> None:
    torch.manual_seed(0)
    model = Chain(KeywordBlock, call="keywords")
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="main_input="):
        remat.profile(model, x, repeats=1)
    costs = remat.profile(model, x, repeats=1, main_input="hidden")
    assert [row.input_bytes for row in costs.blocks] == [3 * 8 * 4] * N_BLOCKS
    reference = copy.deepcopy(model)
    pgac = remat.PGAC(model, 0.75, main_input="hidden")  # costs measured in the first step
    try:
        for step in range(3):
            xs = torch.randn(64, 8)
            for r, g in zip(_grads(reference, xs), _grads(model, xs), strict=True):
                assert torch.equal(r, g), step
            pgac.step()
        assert pgac.costs is not None and any(not kept for kept in pgac.mask.values())
    finally:
        pgac.remove()


def test_session_profiles_its_first_step_with_main_input() -> None:
    from remat.integrations.distributed import prepare

    torch.manual_seed(0)
    model = Chain(KeywordBlock, call="keywords")
    reference = copy.deepcopy(model)
    session = prepare(model, "memory_poor", main_input="hidden", auto_step=False)
    try:
        for _ in range(3):  # the profiled step (every block checkpointed), then the memory-poor plan
            xs = torch.randn(3, 8)
            for r, g in zip(_grads(reference, xs), _grads(model, xs), strict=True):
                assert torch.equal(r, g)
            session.step()
        assert session.costs is not None and "memory_poor:0" in session.plan.actions.values()
    finally:
        session.remove()


def test_meta_estimate_takes_main_output() -> None:
    from remat.profiling import meta_cost_table

    hidden_bytes = 3 * 8 * 4
    named = meta_cost_table(lambda: Chain(lambda: AuxFirst(same_shape=True)), torch.randn(3, 8), main_output=1)
    assert [row.output_bytes for row in named.blocks] == [hidden_bytes] * N_BLOCKS
    guessed = meta_cost_table(lambda: Chain(AuxFirst), torch.randn(3, 8))
    assert [row.output_bytes for row in guessed.blocks] == [hidden_bytes] * N_BLOCKS


def test_hf_enable_passes_main_input_on() -> None:
    pytest.importorskip("transformers")
    from remat.integrations import hf

    torch.manual_seed(0)
    model = Chain(KeywordBlock, call="keywords")
    reference = copy.deepcopy(model)
    session = hf.enable(model, "full", main_input="hidden", blocks=remat.find_blocks(model), auto_step=False)
    try:
        for _ in range(3):
            xs = torch.randn(3, 8)
            for r, g in zip(_grads(reference, xs), _grads(model, xs), strict=True):
                assert torch.equal(r, g)
            session.step()
        assert session.stats.calls == {f"blocks.{i}": 3 for i in range(N_BLOCKS)}
    finally:
        session.remove()
