"""The architectures people train, through remat's whole flow: Hugging Face models built from tiny configs
(random weights, CPU, dropout on, train mode; nothing downloaded), a LoRA fine-tune and plain PyTorch models.

The matrix (:mod:`remat.bench.arch_check`): ``find_chains`` finds every stack; ``profile -> plan("optimal", 0.5)
-> apply`` and the integration (``remat.integrations.hf.enable``, its first step profiled) give gradients
bitwise equal to a plain step, the same buffers, the same outputs (hidden states and router logits included),
and a measured activation peak within the budget, or a refusal naming the minimum (then the plan at that
minimum is measured). Then one test per known failure: the key/value cache, BatchNorm statistics, Hugging
Face's own checkpointing, collected outputs, applying twice and copying, mixture-of-experts layers, towers
and encoder-decoders.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import io
import itertools
import logging

import pytest
import torch
from torch import nn

import remat
from remat.chains import chain_name
from remat.chains.model_state import BufferSnapshot
from remat.meters import LiveTensorTracker
from remat.planning import minimum_peak_bytes
from remat.profiling import BlockProfiler
from remat.runtime.applied import COPY_WARNING, PICKLE_MESSAGE, HandleHook, inert_hook

transformers = pytest.importorskip("transformers")
from remat.bench.arch_check import (  # noqa: E402
    SEED,
    ArchResult,
    check,
    compare,
    plain_step,
    plan_peak,
    record_step,
)
from remat.bench.arch_zoo import (  # noqa: E402
    LAYERS,
    UserNet,  # noqa: E402
    architectures,
    by_name,
)
from remat.integrations import hf  # noqa: E402

NAMES = [a.name for a in architectures()]
# Where the simulator's prediction is below the measured peak at the minimum feasible budget (none now: ResNet and
# ConvNeXt were, by 1 KiB, until the outputs a model collects were counted through each unit's backward).
OVER_BUDGET: dict[str, str] = {}


def _needs(name: str) -> None:
    needs = by_name(name).needs
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{name} needs {needs}")


@functools.cache
def _result(name: str) -> ArchResult:
    return check(by_name(name))


# ---------------------------------------------------------------- the matrix


@pytest.mark.parametrize("name", NAMES)
def test_find_chains_finds_every_stack(name: str) -> None:
    _needs(name)
    arch = by_name(name)
    model = arch.build()
    chains = remat.find_chains(model)
    assert [chain_name(c) for c in chains] == list(arch.stacks)
    modules = dict(model.named_modules())
    for chain in chains:
        assert all(modules[fqn] is module for fqn, module in chain)
        assert len({type(m) for _, m in chain}) == 1 and len(chain) >= 2
    assert remat.find_blocks(model) in chains


@pytest.mark.parametrize("name", NAMES)
def test_exact_like_a_plain_step(name: str) -> None:
    _needs(name)
    result = _result(name)
    assert result.error == ""
    assert result.problems == []
    assert result.planned and set(result.actions) == set(result.planned)
    assert any(action != "keep" for action in result.actions.values()), "the plan must recompute something"
    if len(by_name(name).stacks) > 1:
        assert result.default_chains == len(by_name(name).stacks)  # no blocks=: every chain, one budget
        assert set(result.planned) == {fqn for chain in remat.find_chains(by_name(name).build()) for fqn, _ in chain}
    if result.plan_refusal:
        assert "minimum feasible peak" in result.plan_refusal


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=OVER_BUDGET[n])) if n in OVER_BUDGET else n
        for n in NAMES
    ],
)
def test_measured_peak_within_budget(name: str) -> None:
    _needs(name)
    result = _result(name)
    assert result.error == ""
    assert 0 < result.peak_bytes <= result.budget_bytes, (
        f"measured {result.peak_bytes} bytes, budget {result.budget_bytes}, predicted {result.predicted_bytes}"
    )
    # the prediction is close to the measurement, every chain planned together where there are several
    assert abs(result.predicted_bytes - result.peak_bytes) <= 0.05 * result.peak_bytes, (
        f"measured {result.peak_bytes} bytes, predicted {result.predicted_bytes}"
    )


# ---------------------------------------------------------------- (a) the key/value cache


def _llama() -> tuple[nn.Module, dict]:
    arch = by_name("llama")
    model = arch.build()
    assert model.config.use_cache is True  # Hugging Face's default for causal LMs
    return model, arch.batch()


def test_selective_blocks_with_the_default_use_cache(caplog: pytest.LogCaptureFixture) -> None:
    model, batch = _llama()
    arch = by_name("llama")
    reference = plain_step(arch, model, batch)
    model.zero_grad(set_to_none=True)
    plan = remat.Plan({fqn: "selective:dots_saveable" for fqn, _ in remat.find_blocks(model)})
    handle = remat.apply(model, plan)
    try:
        with caplog.at_level(logging.WARNING, logger="remat"):
            torch.manual_seed(1234)
            out = model(**batch, use_cache=True)  # asked for explicitly, too
            out.loss.backward()
        got = record_step(model, out)
    finally:
        handle.remove()
    assert "use_cache=False" in caplog.text
    assert compare(reference, got, "selective") == []
    assert model.config.use_cache is True  # the config is left as it was


def test_profile_with_the_default_use_cache_plans_selective_blocks() -> None:
    model, batch = _llama()
    costs = remat.profile(model, batch, repeats=1)
    assert model.config.use_cache is True
    plan = remat.Plan.from_actions(costs, ["selective:dots_saveable"] * len(costs))
    handle = remat.apply(model, plan)
    try:
        model(**batch).loss.backward()
    finally:
        handle.remove()
    assert all(p.grad is not None for p in model.parameters())


# ---------------------------------------------------------------- (f) BatchNorm statistics


def _user_net() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return UserNet().train(), torch.randn(32, 8, generator=torch.Generator().manual_seed(0))


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers()}


def test_profile_updates_batchnorm_statistics_once() -> None:
    model, x = _user_net()
    start = model.state_dict()
    start = {k: v.clone() for k, v in start.items()}
    torch.manual_seed(3)
    model(x).backward()
    plain = _buffers(model)
    model.load_state_dict(start)
    torch.manual_seed(3)
    remat.profile(model, x, repeats=1)
    after = _buffers(model)
    assert int(after["blocks.0.norm.num_batches_tracked"]) == 1
    for name, value in plain.items():
        assert torch.equal(after[name], value), name


@pytest.mark.parametrize("action", ["checkpoint", "selective:dots_saveable", "segment:0", "memory_poor:0"])
def test_recomputation_leaves_batchnorm_statistics_as_a_plain_step(action: str) -> None:
    model, x = _user_net()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(3)
    model(x).backward()
    plain = _buffers(model)
    model.load_state_dict(start)
    handle = remat.apply(model, remat.Plan({f"blocks.{i}": action for i in range(4)}))
    try:
        torch.manual_seed(3)
        model(x).backward()
    finally:
        handle.remove()
    assert handle.stats.total_calls > 0  # blocks were recomputed
    after = _buffers(model)
    for name, value in plain.items():
        assert torch.equal(after[name], value), name


def test_restored_statistics_leave_a_graph_that_saved_them_usable() -> None:
    """BatchNorm in training saves its running statistics for backward; putting their values back after an extra
    run must not move their versions, or that graph's backward fails as after an in-place change."""
    norm = nn.BatchNorm1d(8).train()
    before = {n: b.clone() for n, b in norm.named_buffers()}
    snapshot = BufferSnapshot(norm)
    x = torch.randn(16, 8, requires_grad=True)
    loss = norm(x).square().sum()
    assert not torch.equal(norm.running_mean, before["running_mean"])  # the run moved them
    snapshot.restore()
    loss.backward()
    assert x.grad is not None
    for name, value in norm.named_buffers():
        assert torch.equal(value, before[name]), name


def test_recomputation_sees_buffers_added_to_a_block_or_replaced_after_its_first_recompute() -> None:
    model, x = _user_net()
    handle = remat.apply(model, remat.Plan({f"blocks.{i}": "checkpoint" for i in range(4)}))
    try:
        model(x).backward()  # every block recomputed once: where its buffers live is known
        model.blocks[3].norm = nn.BatchNorm1d(64)  # block 3 had none
        model.double()  # every buffer becomes a new tensor
        x = x.double()
        start = {k: v.clone() for k, v in model.state_dict().items()}
        torch.manual_seed(3)
        model(x).backward()
        assert handle.stats.calls["blocks.3"] == 2
    finally:
        handle.remove()
    after = _buffers(model)
    model.load_state_dict(start)
    torch.manual_seed(3)
    model(x).backward()
    plain = _buffers(model)
    assert int(plain["blocks.3.norm.num_batches_tracked"]) == 1
    for name, value in plain.items():
        assert torch.equal(after[name], value), name


class _ComparedBlock(nn.Module):
    """A block class that defines equality, which makes it unhashable (``__hash__`` is None)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ComparedBlock) and other.fc.out_features == self.fc.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.fc(x))) + x


def test_remats_registration_hooks_leave_unhashable_module_classes_buildable() -> None:
    # remat.chains.model_state watches every buffer and submodule registration in the process (its Note [1]); a class
    # that torch itself lets you build and call must still build and run with remat imported.
    block = _ComparedBlock()
    block.extra = nn.Linear(8, 8)  # another registration into an unhashable module
    assert block(torch.randn(4, 8)).shape == (4, 8)


# ---------------------------------------------------------------- (g) Hugging Face's own checkpointing


def test_profile_switches_hugging_face_checkpointing_off_for_the_step() -> None:
    model, batch = _llama()
    plain = remat.profile(model, batch, repeats=1)
    model.activation_checkpointing_enable()
    assert model.is_activation_checkpointing
    with pytest.warns(UserWarning, match="gradient checkpointing is on in LlamaForCausalLM"):
        costs = remat.profile(model, batch, repeats=1)
    assert model.is_activation_checkpointing  # back on afterwards
    # The layers were measured as they are, not as Hugging Face's checkpoint leaves them.
    assert [b.saved_bytes["keep"] for b in costs.blocks] == [b.saved_bytes["keep"] for b in plain.blocks]
    assert costs.blocks[0].saved_bytes["keep"] > costs.blocks[0].saved_bytes["checkpoint"]
    with pytest.raises(RuntimeError, match=r"gradient checkpointing is on .*gradient_checkpointing_disable\(\)"):
        remat.apply(model, remat.plan(costs, "full"))
    assert not model._forward_pre_hooks  # the refusal installed nothing


# ---------------------------------------------------------------- (d) collected outputs


def test_a_profiled_step_collects_hidden_states_and_router_logits_once() -> None:
    arch = by_name("mixtral")
    model = arch.build()
    batch = arch.batch()
    reference = plain_step(arch, model, batch)
    model.zero_grad(set_to_none=True)
    with BlockProfiler(model, repeats=1) as profiler:
        torch.manual_seed(1234)
        out = model(**batch, use_cache=False)
        out.loss.backward()
    assert len(profiler.cost_table()) == LAYERS
    assert len(out.hidden_states) == LAYERS + 1 and len(out.router_logits) == LAYERS
    assert compare(reference, record_step(model, out), "profiled") == []


# ---------------------------------------------------------------- (h) applying twice, copying


def test_a_second_plan_on_a_part_of_the_model_is_refused() -> None:
    model, _ = _llama()
    handle = remat.apply(model, remat.Plan({f"model.layers.{i}": "checkpoint" for i in range(LAYERS)}))
    inner = remat.Plan({f"layers.{i}": "checkpoint" for i in range(LAYERS)})
    with pytest.raises(RuntimeError, match="already applied to the LlamaForCausalLM that contains it"):
        remat.apply(model.model, inner)
    with pytest.raises(RuntimeError, match="already applied to this model"):
        remat.apply(model, remat.Plan({f"model.layers.{i}": "keep" for i in range(LAYERS)}))
    handle.remove()
    handle = remat.apply(model.model, inner)  # the other way round
    with pytest.raises(RuntimeError, match="already applied to its submodule LlamaModel"):
        remat.apply(model, remat.Plan({f"model.layers.{i}": "checkpoint" for i in range(LAYERS)}))
    handle.remove()


def _remat_hooks(model: nn.Module) -> list[object]:
    """remat's hooks on ``model`` and its modules: live ones and the inert ones of a copy."""
    hooks = [h for m in model.modules() for d in (m._forward_pre_hooks, m._forward_hooks) for h in d.values()]
    return [h for h in hooks if isinstance(h, HandleHook) or h is inert_hook]


def test_a_copy_of_a_model_with_a_plan_is_the_plain_model_and_pickling_says_what_to_do() -> None:
    model, batch = _llama()
    arch = by_name("llama")
    reference = copy.deepcopy(model)
    plan = remat.Plan({f"model.layers.{i}": "checkpoint" for i in range(LAYERS)})
    handle = remat.apply(model, plan)
    with pytest.warns(UserWarning) as warned:
        twin = copy.deepcopy(model)
    assert [str(w.message) for w in warned] == [COPY_WARNING]  # once for the whole copy
    assert twin._remat_handle is None and remat.runtime.owner_of(twin) is None
    assert _remat_hooks(twin) and all(hook is inert_hook for hook in _remat_hooks(twin))
    assert compare(plain_step(arch, reference, batch), plain_step(arch, twin, batch), "copy") == []
    assert handle.stats.total_calls == 0  # the original's hooks did not run for the copy
    assert compare(plain_step(arch, reference, batch), plain_step(arch, model, batch), "original") == []
    assert handle.stats.total_calls == LAYERS  # the plan stays with the original
    with pytest.warns(UserWarning, match="the copy is the plain model"):
        copy.deepcopy(model.model.layers[0])
    with pytest.raises(TypeError) as info:
        torch.save(model, io.BytesIO())
    assert str(info.value) == PICKLE_MESSAGE
    torch.save(model.state_dict(), io.BytesIO())  # state dicts are fine
    own = remat.apply(twin, plan)  # a plan of its own: the inert hooks are taken off first
    assert _remat_hooks(twin) and inert_hook not in _remat_hooks(twin)
    twin.zero_grad(set_to_none=True)
    assert compare(plain_step(arch, reference, batch), plain_step(arch, twin, batch), "planned copy") == []
    assert own.stats.total_calls == LAYERS and handle.stats.total_calls == LAYERS
    own.remove()
    handle.remove()
    assert _remat_hooks(twin) == [] and _remat_hooks(model) == []


def test_a_copy_of_a_model_an_integration_holds_is_the_plain_model() -> None:
    model, batch = _llama()
    arch = by_name("llama")
    reference = copy.deepcopy(model)
    session = hf.enable(model, "full")
    with pytest.warns(UserWarning, match="the copy is the plain model"):
        twin = copy.deepcopy(model)
    assert twin._remat_session is None and twin._remat_handle is None
    assert compare(plain_step(arch, reference, batch), plain_step(arch, twin, batch), "copy") == []
    assert session.profiling and session.stats.total_calls == 0  # the session saw none of the copy's steps
    session.remove()
    copy.deepcopy(model)


# ---------------------------------------------------------------- (e) mixture of experts


class Expert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class MoELayer(nn.Module):
    """A router and eight experts (a longer list than the model has layers)."""

    def __init__(self, d: int = 16, n_experts: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(d, n_experts)
        self.experts = nn.ModuleList([Expert(d) for _ in range(n_experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.router(x).softmax(-1)
        return x + sum(weights[:, i : i + 1] * expert(x) for i, expert in enumerate(self.experts))


def test_the_chain_of_a_mixture_of_experts_model_is_its_layers() -> None:
    model = nn.Sequential(nn.Linear(4, 16), nn.Sequential(MoELayer(), MoELayer()), nn.Linear(16, 1))
    assert [fqn for fqn, _ in remat.find_blocks(model)] == ["1.0", "1.1"]
    assert [chain_name(c) for c in remat.find_chains(model)] == ["1"]
    mixtral = by_name("mixtral").build()
    assert [fqn for fqn, _ in remat.find_blocks(mixtral)] == [f"model.layers.{i}" for i in range(LAYERS)]


# ---------------------------------------------------------------- (c) towers, (b) encoder-decoders


def test_towers_are_separate_chains_and_the_integration_plans_both_by_default() -> None:
    model = by_name("clip").build()
    text, vision = remat.find_chains(model)
    assert [f for f, _ in text] == [f"text_model.encoder.layers.{i}" for i in range(LAYERS)]
    assert [f for f, _ in vision] == [f"vision_model.encoder.layers.{i}" for i in range(LAYERS)]
    session = hf.enable(model, "full")
    assert sorted(session.plan.actions) == sorted(f for f, _ in text + vision)
    session.remove()
    assert not model._forward_pre_hooks
    session = hf.enable(model, "full", blocks=vision)
    assert list(session.plan.actions) == [f for f, _ in vision]
    session.remove()


def test_an_encoder_decoder_is_profiled_whole_by_default_and_one_chain_when_named() -> None:
    arch = by_name("t5")
    model = arch.build()
    batch = arch.batch()
    encoder, decoder = remat.find_chains(model)
    costs = remat.profile(model, batch, repeats=1)  # no blocks=: both chains, under one budget
    assert sorted(costs.fqns) == sorted(f for f, _ in encoder + decoder) and len(costs.chain_lengths) == 2
    handle = remat.apply(model, remat.plan(costs, "optimal", 0.6))
    assert sorted(handle.plan.actions) == sorted(costs.fqns)
    handle.remove()
    for chain in (encoder, decoder):  # each takes the other's arguments (position bias, encoder states)
        costs = remat.profile(model, batch, blocks=chain, repeats=1)
        assert costs.fqns == [fqn for fqn, _ in chain]
    assert all(p.grad is None for p in model.parameters())  # the profile leaves gradients as they were


def test_towers_are_profiled_together_in_the_order_the_step_runs_them() -> None:
    arch = by_name("clip")
    model = arch.build()
    text, vision = remat.find_chains(model)
    costs = remat.profile(model, arch.batch(), blocks=[text, vision], repeats=1)
    # CLIPModel runs its vision tower first: the table follows the step, not module order.
    assert costs.fqns == [f for f, _ in vision] + [f for f, _ in text]
    assert costs.chain_lengths == [LAYERS, LAYERS] and costs.between_bytes[0] > 0
    plan = remat.plan(costs, "full")
    handle = remat.apply(model, plan, blocks=[text, vision])  # applied in module order all the same
    try:
        assert handle.fqns == [f for f, _ in text] + [f for f, _ in vision]
        assert handle.plan.actions == plan.actions
    finally:
        handle.remove()


def test_an_encoder_decoder_plan_that_recomputes_both_stacks_is_exact_and_within_budget() -> None:
    arch = by_name("t5")
    model = arch.build()
    batch = arch.batch()
    chains = remat.find_chains(model)
    reference = plain_step(arch, model, batch)
    model.zero_grad(set_to_none=True)
    costs = remat.profile(model, batch, blocks=chains, repeats=1)
    assert costs.fqns[:LAYERS] == [f for f, _ in chains[0]] and costs.chain_lengths == [LAYERS, LAYERS]
    budget = (minimum_peak_bytes(costs) + remat.plan(costs, "none").predicted_peak_bytes) // 3
    plan = remat.plan(costs, "optimal", budget)
    assert plan.options["exact"] and plan.options["chains"] == [LAYERS, LAYERS]
    encoder, decoder = list(plan.actions.values())[:LAYERS], list(plan.actions.values())[LAYERS:]
    assert any(a != "keep" for a in encoder) and any(a != "keep" for a in decoder), plan.actions
    handle = remat.apply(model, plan, blocks=chains)
    tracker = LiveTensorTracker()  # the step's output counts, as the simulator counts it: closed once dropped
    try:
        with tracker:
            torch.manual_seed(SEED)
            out = model(**batch)
            out.loss.backward()
    finally:
        handle.remove()
    got = record_step(model, out)
    del out
    tracker.close()
    peak = tracker.peak(exclude_survivors=True)
    assert handle.stats.total_calls > 0  # blocks of both stacks re-ran in backward
    assert {f for f, n in handle.stats.calls.items() if n} & {f for f, _ in chains[0]}
    assert {f for f, n in handle.stats.calls.items() if n} & {f for f, _ in chains[1]}
    assert compare(reference, got, "encoder-decoder plan") == []  # bitwise equal
    assert peak <= budget, (peak, plan.predicted_peak_bytes, budget)
    assert abs(plan.predicted_peak_bytes - peak) <= 0.05 * peak, (peak, plan.predicted_peak_bytes)


def test_arguments_a_block_makes_for_the_next_are_counted_where_a_recomputing_plan_holds_them() -> None:
    # T5's first block of each stack returns position biases the others take. A step keeping everything frees
    # them in the head; a plan that checkpoints a block holds them through it, so no such plan may be predicted
    # below its measured peak (it was, by 8 KiB, while they were counted in the stem only), and none far above
    # (`full` was 2.4% above while they were counted in every row, its stacks' first blocks included).
    arch = by_name("t5")
    model = arch.build()
    batch = arch.batch()
    chains = remat.find_chains(model)
    costs = remat.profile(model, batch, blocks=chains, repeats=1)
    # Each stack's biases are first passed to its second block: not alive in its first block's unit, which runs
    # its backward after the others freed them.
    held = costs.held_args_per_row()
    assert held[0] == 0 < held[1] and held[1:LAYERS] == [held[1]] * (LAYERS - 1), held
    assert held[1] <= held[LAYERS] < held[LAYERS + 1], held
    assert held[LAYERS + 1 :] == [costs.held_args_bytes] * (LAYERS - 1), held
    for actions in itertools.product(["keep", "checkpoint"], repeat=len(costs)):
        plan = remat.Plan.from_actions(costs, list(actions))
        peak = plan_peak(arch, model, batch, plan, chains)
        assert peak <= plan.predicted_peak_bytes <= 1.025 * peak, (actions, peak, plan.predicted_peak_bytes)
        if "keep" not in actions:  # every block holds its arguments, each freed after its stack's second block
            assert plan.predicted_peak_bytes <= 1.005 * peak, (peak, plan.predicted_peak_bytes)


def plans_of_three_blocks() -> list[list[str]]:
    """Every plan of a chain of three blocks: keep or checkpoint per block, or a segment or memory-poor group."""
    singles = [list(p) for p in itertools.product(["keep", "checkpoint"], repeat=3)]
    groups = []
    for kind in ("segment", "memory_poor"):
        groups.append([f"{kind}:0"] * 3)
        for single in ("keep", "checkpoint"):
            groups += [[f"{kind}:0"] * 2 + [single], [single] + [f"{kind}:0"] * 2]
    return singles + groups


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_every_plan_of_a_stack_is_predicted_at_or_just_above_its_measured_peak(name: str) -> None:
    # BERT's layers hold 256 bytes more in a recomputed backward than in a kept one (bwd_extra under checkpoint);
    # a group recomputes its blocks as checkpoints do, and was predicted that much below while it did not count it.
    arch = by_name(name)
    model, batch = arch.build(), arch.batch()
    costs = remat.profile(model, batch, repeats=1)
    plans = plans_of_three_blocks()
    assert len(costs) == LAYERS == 3 and len(plans) == 18
    for actions in plans:
        plan = remat.Plan.from_actions(costs, actions)
        peak = plan_peak(arch, model, batch, plan)
        assert peak <= plan.predicted_peak_bytes <= 1.01 * peak, (actions, peak, plan.predicted_peak_bytes)


def test_segments_on_two_towers_stay_inside_each_tower_and_are_exact() -> None:
    arch = by_name("clip")
    model = arch.build()
    batch = arch.batch()
    chains = remat.find_chains(model)
    reference = plain_step(arch, model, batch)
    model.zero_grad(set_to_none=True)
    costs = remat.profile(model, batch, blocks=chains, repeats=1, loss_fn=lambda out: out.loss)
    plan = remat.plan(costs, "every_k", k=2)  # a segment of LAYERS blocks would span the towers if it could
    groups = {a for a in plan.actions.values() if a.startswith("segment:")}
    for group in groups:
        towers = {fqn.rsplit(".", 1)[0] for fqn, a in plan.actions.items() if a == group}
        assert len(towers) == 1, (group, towers)
    handle = remat.apply(model, plan, blocks=chains)
    try:
        got = plain_step(arch, model, batch)
    finally:
        handle.remove()
    assert handle.stats.total_calls > 0
    assert compare(reference, got, "segments on two towers") == []
