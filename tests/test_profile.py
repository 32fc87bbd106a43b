"""Profiling and measuring: the simulator's predicted peak next to the measured one on a GPT-2 chain, what
``remat.profile`` leaves behind, and the CostTable as JSON. The meters themselves are tested in
test_memory.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from toy_models import MLPChain, assert_same_step, uniform_chain

import remat
from remat.core import CHECKPOINT, KEEP, CostTable
from remat.profiling import BlockProfiler

STRATEGIES = [
    ("none", {}),
    ("full", {}),
    ("every_k", {"k": 2}),
    ("every_k", {"k": 3}),
    ("sqrt", {}),
    ("memory_poor", {}),
    ("random", {"fraction": 0.5, "seed": 0}),
]


@pytest.fixture(scope="module")
def gpt2(make_gpt2) -> tuple[torch.nn.Module, dict[str, torch.Tensor], CostTable]:
    model = make_gpt2(n_layer=6, n_embd=64, dropout=0.1, seed=0)
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    costs = remat.profile(model, batch, repeats=1, policies="menu")
    return model, batch, costs


def _gpt2_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(5)
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("strategy", "options"), STRATEGIES, ids=[f"{s}{o.get('k', '')}" for s, o in STRATEGIES])
def test_predicted_peak_within_ten_percent_of_measured_on_gpt2(gpt2, strategy: str, options: dict) -> None:
    model, batch, costs = gpt2
    reference = _gpt2_step(model, batch)
    plan = remat.plan(costs, strategy, **options)
    handle = remat.apply(model, plan)
    try:
        with remat.measure() as measured:
            got = _gpt2_step(model, batch)
    finally:
        handle.remove()
    ratio = plan.predicted_peak_bytes / measured.activation_bytes
    assert 0.9 <= ratio <= 1.1, (
        f"{strategy}: predicted {remat.format_bytes(plan.predicted_peak_bytes)}, "
        f"measured {remat.format_bytes(measured.activation_bytes)} (ratio {ratio:.3f})"
    )
    assert_same_step(reference, got)  # a Hugging Face chain with dropout: exact gradients too


def test_gpt2_cost_table_describes_the_blocks(gpt2) -> None:
    model, _, costs = gpt2
    assert costs.fqns == [f"transformer.h.{i}" for i in range(6)]
    hidden_bytes = 4 * 64 * 64 * 4  # batch x tokens x width, float32
    for row in costs.blocks:
        assert row.input_bytes == row.output_bytes == hidden_bytes
        # A checkpointed block keeps nothing but its output (its input belongs to the block before).
        assert row.saved_bytes[CHECKPOINT] == row.output_bytes
        assert row.saved_bytes[CHECKPOINT] < row.saved_bytes["selective:dots_saveable"] < row.saved_bytes[KEEP]
        assert row.fwd_s > 0 and row.bwd_s > 0 and row.recompute_s[KEEP] == 0
        assert row.recompute_s[CHECKPOINT] > 0  # the block's forward timed alone, run again in backward
    assert costs.stem_bytes >= hidden_bytes and costs.head_bytes > 0
    # The causal mask (batch x 1 x tokens x tokens, float32) is passed to every block; a step keeping everything
    # frees it before the backward, a plan recomputing a block holds it for the recomputation.
    assert costs.held_args_bytes == 4 * 64 * 64 * 4
    assert costs.device == "cpu" and costs.source == "measured"
    # every block ran once per plain step: its keep times are those it took within the step
    assert costs.info["times_from"] == "plain steps" and costs.info["plain_step_s"] > 0


def test_gpt2_cost_table_times_every_action_and_the_step_outside_the_blocks(gpt2) -> None:
    _, _, costs = gpt2
    for row in costs.blocks:
        assert set(row.fwd_s_by_action) == set(row.bwd_s_by_action) == set(row.overhead_s) == set(row.actions)
        assert row.fwd_s_by_action[KEEP] == row.fwd_s and row.bwd_s_by_action[KEEP] == row.bwd_s
        assert row.overhead_s[KEEP] == 0.0 and min(row.time_cost(a) for a in row.actions) >= 0.0
        for action in row.actions:
            assert row.time_cost(action) == row.recompute_s[action] + row.overhead_s[action]
        # the forward a memory-poor group re-runs under no_grad, timed in the same rounds
        assert row.nograd_fwd_s is not None and 0.0 < row.nograd_fwd_s <= row.recompute_s[CHECKPOINT]
    assert isinstance(costs.outside_s, float)


def test_outside_s_is_the_time_of_the_step_outside_the_blocks() -> None:
    """A head that multiplies 20 times by a 256x256 matrix outweighs the chain's blocks many times over."""

    class HeavyHead(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.chain = uniform_chain(3, width=16, dropout=0.0)
            self.weight = torch.nn.Parameter(torch.randn(256, 256) / 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.chain.blocks(self.chain.inp(x)).sum() * torch.ones(256, 256)
            for _ in range(20):
                h = torch.tanh(h @ self.weight)
            return h.sum()

    torch.manual_seed(0)
    model = HeavyHead()
    costs = remat.profile(model, torch.randn(5, 8), blocks=[f"chain.blocks.{i}" for i in range(3)], repeats=1)
    blocks = sum(b.fwd_s + b.bwd_s for b in costs.blocks)
    assert costs.outside_s is not None and costs.outside_s > 2 * blocks
    assert remat.simulate(costs, ["keep"] * 3).step_s == pytest.approx(blocks + costs.outside_s)
    with BlockProfiler(model, [f"chain.blocks.{i}" for i in range(3)]) as prof:  # inside training
        model(torch.randn(5, 8)).backward()
    assert prof.cost_table().outside_s is None


def test_every_time_is_read_from_the_given_clock() -> None:
    """A clock that never moves: every time of the table, blocks and the step outside them, is 0; one that
    ticks one second per reading: every time is a whole number of seconds, and a block's forward takes some."""
    torch.manual_seed(0)
    model = MLPChain([16, 16, 16, 16])
    batch = torch.randn(4, 8)
    frozen = remat.profile(model, batch, repeats=1, clock=lambda: 0.0)
    for b in frozen.blocks:
        assert (b.fwd_s, b.bwd_s) == (0.0, 0.0)
        assert set(b.recompute_s.values()) == {0.0} and set((b.overhead_s or {0: 0.0}).values()) == {0.0}
        assert b.nograd_fwd_s == 0.0
    assert frozen.outside_s == 0.0

    readings = iter(range(10**6))
    ticking = remat.profile(model, batch, repeats=1, clock=lambda: float(next(readings)))
    times = [t for b in ticking.blocks for t in (b.fwd_s, b.bwd_s, b.nograd_fwd_s, *b.recompute_s.values())]
    assert all(t == int(t) for t in [*times, ticking.outside_s]), times
    assert all(b.fwd_s >= 1 for b in ticking.blocks)


def test_cost_table_json_round_trip(gpt2) -> None:
    costs = gpt2[2]
    back = CostTable.from_json(costs.to_json())
    assert back == costs
    assert remat.plan(back, "sqrt") == remat.plan(costs, "sqrt")


def test_cost_tables_written_before_step_times_load_with_none_and_zero_overheads(gpt2) -> None:
    data = gpt2[2].to_dict()
    del data["outside_s"]
    for row in data["blocks"]:
        del row["fwd_s_by_action"], row["bwd_s_by_action"], row["overhead_s"], row["nograd_fwd_s"]
    old = CostTable.from_dict(data)
    assert old.outside_s is None
    row = old.blocks[0]
    assert row.nograd_fwd_s is None
    assert row.overhead_s == {} and row.time_cost(CHECKPOINT) == row.recompute_s[CHECKPOINT]
    with pytest.raises(KeyError, match="no time cost for action 'offload'.*Profile with that action included"):
        row.time_cost("offload")


def test_profile_leaves_parameter_gradients_as_they_were() -> None:
    torch.manual_seed(0)
    model = uniform_chain(4, width=16)
    x = torch.randn(5, 8)
    params = list(model.parameters())
    for i, p in enumerate(params):
        p.grad = None if i % 3 == 0 else torch.full_like(p, float(i))
    before = [None if p.grad is None else p.grad.clone() for p in params]
    objects = [p.grad for p in params]
    costs = remat.profile(model, x, repeats=1)
    assert len(costs) == 4
    for p, old, obj in zip(params, before, objects, strict=True):
        assert p.grad is obj  # the very same tensor (or None) is back in place
        assert (old is None and p.grad is None) or torch.equal(p.grad, old)


def test_profile_does_not_disturb_the_step_or_an_applied_plan() -> None:
    model, x = uniform_chain(3, width=16, dropout=0.3), torch.randn(5, 8)
    torch.manual_seed(1)
    model(x).backward()
    after_a_step = torch.get_rng_state()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    costs = remat.profile(model, x, repeats=1)
    # The profiled step draws the random numbers of a plain step; the block measurements fork the RNG.
    assert torch.equal(torch.get_rng_state(), after_a_step)
    handle = remat.apply(model, remat.plan(costs, "full"))
    again = remat.profile(model, x, repeats=1)
    # With a plan applied the blocks are still measured under each action, the plan suspended meanwhile.
    bytes_of = [(r.saved_bytes, r.fwd_temp_bytes, r.bwd_temp_bytes) for r in costs.blocks]
    assert [(r.saved_bytes, r.fwd_temp_bytes, r.bwd_temp_bytes) for r in again.blocks] == bytes_of
    assert (again.stem_bytes, again.head_bytes) == (costs.stem_bytes, costs.head_bytes)
    assert handle.stats.total_calls == 3  # the profiled step itself ran under the plan
    handle.remove()


def test_profile_batch_forms_and_loss_fn() -> None:
    class TwoInputs(MLPChain):
        def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
            h = self.blocks(self.inp(x))
            return h if scale is None else h * scale

    model = TwoInputs([16] * 4)
    x = torch.randn(5, 8)
    by_tensor = remat.profile(model, x, repeats=1)
    by_tuple = remat.profile(model, (x, torch.tensor(2.0)), repeats=1)
    by_dict = remat.profile(model, {"x": x}, loss_fn=lambda out: out.square().mean(), repeats=1)
    for costs in (by_tensor, by_tuple, by_dict):
        assert costs.fqns == ["blocks.0", "blocks.1", "blocks.2"]
        assert [r.saved_bytes for r in costs.blocks] == [r.saved_bytes for r in by_tensor.blocks]


def test_a_step_with_nothing_to_train_is_refused_with_the_reason() -> None:
    model, x = MLPChain([16] * 4), torch.randn(5, 8)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"loss does not require grad.*torch\.no_grad\(\)"):
        remat.profile(model, x, repeats=1)
    with pytest.raises(RuntimeError, match="does not depend on a parameter"):
        remat.profile(model, x, loss_fn=lambda out: torch.zeros(()), repeats=1)
    model.requires_grad_(False)
    with pytest.raises(RuntimeError, match="no parameter of MLPChain requires grad"):
        remat.profile(model, x, repeats=1)


def test_a_model_in_eval_mode_is_profiled_as_it_is_with_a_warning() -> None:
    model, x = MLPChain([16] * 4, dropout=0.5), torch.randn(5, 8)
    model.eval()
    with pytest.warns(UserWarning, match=r"remat.profile: MLPChain is in eval mode .*model.train\(\)"):
        evaluating = remat.profile(model, x, repeats=1)
    assert not model.training
    model.train()
    training = remat.profile(model, x, repeats=1)
    # dropout's masks are saved only in training: what the eval-mode step keeps is less
    assert evaluating.blocks[0].saved_bytes[KEEP] < training.blocks[0].saved_bytes[KEEP]


def test_profile_on_named_blocks() -> None:
    model = uniform_chain(4, width=16)
    costs = remat.profile(model, torch.randn(5, 8), blocks=["blocks.1", "blocks.3"], repeats=1)
    assert costs.fqns == ["blocks.1", "blocks.3"]
    # blocks.2 runs between them, so they cannot share a segment: the profile does not try to price one
    assert costs.info["outputs_feed_next_block"] is False and costs.deferred_s_per_byte == 0.0
    assert costs.info["action_times_from"] == "steps"


def test_predictions_match_measurements_on_an_mlp_chain() -> None:
    torch.manual_seed(0)
    model = uniform_chain(5, width=32, dropout=0.1)
    x = torch.randn(16, 8)
    costs = remat.profile(model, x, repeats=1)
    handle = remat.apply(model, remat.plan(costs, "none"))
    for strategy in ("none", "full", "sqrt", "memory_poor"):
        plan = remat.plan(costs, strategy)
        handle.set_plan(plan)
        model.zero_grad(set_to_none=True)
        with remat.measure() as measured:
            model(x).backward()
        # Only the 4-byte scalar loss separates the two on this chain.
        assert abs(plan.predicted_peak_bytes - measured.activation_bytes) <= 64, strategy
    handle.remove()


def _measured_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], plan: remat.Plan) -> tuple[int, tuple]:
    """The activation bytes a step under ``plan`` measures (the output held through backward, as the profile's
    head is, and nothing left at the end, which the meter would count as a survivor), and the step's loss and
    gradients."""
    handle = remat.apply(model, plan)
    try:
        torch.manual_seed(5)
        model.zero_grad(set_to_none=True)
        with remat.measure() as measured:
            out = model(**batch)
            out.loss.backward()
            loss = torch.tensor(out.loss.item())  # a float32 loss read exactly; no tensor outlives the region
            del out
    finally:
        handle.remove()
    return measured.activation_bytes, (loss, {n: p.grad.clone() for n, p in model.named_parameters()})


@pytest.mark.parametrize("policy", remat.policies.MENU)
def test_a_selective_block_backward_holds_its_kept_draws(gpt2, policy: str) -> None:
    model, batch, costs = gpt2
    action = f"selective:{policy}"
    # Each selective policy keeps each dropout draw at one byte per element (two residual dropouts of
    # 4 x 64 x 64 and one attention dropout of 4 x 4 heads x 64 x 64) while it recomputes the rest in backward.
    draws = 2 * 4 * 64 * 64 + 4 * 4 * 64 * 64
    for row in costs.blocks:
        assert row.bwd_extra_bytes[action] == draws
    reference = _gpt2_step(model, batch)
    for actions in (["checkpoint"] * (len(costs) - 1) + [action], [action] * len(costs)):
        plan = remat.Plan.from_actions(costs, actions)
        measured, got = _measured_step(model, batch, plan)
        assert plan.predicted_peak_bytes == measured, actions
        assert_same_step(reference, got)


def test_menu_policies_keep_what_they_say_on_gpt2(gpt2) -> None:
    costs = gpt2[2]
    saved = costs.blocks[0].saved_bytes
    draws = 2 * 4 * 64 * 64 + 4 * 4 * 64 * 64
    # eager attention: no attention kernel to save, only the kept draws on top of the block's output
    assert saved["selective:attention_saveable"] == saved[CHECKPOINT] + draws
    assert saved[CHECKPOINT] < saved["selective:dots_every_other_saveable"] < saved["selective:dots_saveable"]
    assert saved["selective:dots_saveable"] < saved["selective:all_but_pointwise_saveable"] < saved[KEEP]


def test_a_plan_mixing_policies_is_exact_and_predicted(gpt2) -> None:
    model, batch, costs = gpt2
    mixed = ["selective:attention_saveable", "selective:dots_every_other_saveable", "selective:dots_saveable",
             "selective:all_but_pointwise_saveable", "checkpoint", "keep"]  # fmt: skip
    plan = remat.Plan.from_actions(costs, mixed)
    measured, got = _measured_step(model, batch, plan)
    assert plan.predicted_peak_bytes == measured
    assert_same_step(_gpt2_step(model, batch), got)
    # and optimal picks among every measured policy: with only selective actions allowed and a budget between
    # what two policies keep, its plan is at least as fast (predicted) as every one-policy plan that fits
    menu = [f"selective:{p}" for p in remat.policies.MENU]
    low = remat.simulate(costs, ["selective:dots_every_other_saveable"] * len(costs)).peak_bytes
    high = remat.simulate(costs, ["selective:all_but_pointwise_saveable"] * len(costs)).peak_bytes
    budget = (low + high) // 2
    chosen = remat.plan(costs, "optimal", budget=budget, actions=menu, time_noise_s=0.0)  # figures as measured
    assert chosen.predicted_peak_bytes <= budget
    chosen_time = remat.simulate(costs, list(chosen.actions.values())).time_cost_s
    # With the profile's noise, choices within it go to the fixed order: a block's action may be one up to twice
    # the noise slower (dominance), and a policy's figure is read one noise dearer, so at most three noises a block.
    noisy = remat.plan(costs, "optimal", budget=budget, actions=menu)
    slack = 3 * len(costs) * costs.info.get("time_noise_s", 0.0)
    noisy_time = remat.simulate(costs, list(noisy.actions.values())).time_cost_s
    for action in menu:
        uniform = remat.simulate(costs, [action] * len(costs))
        if uniform.peak_bytes <= budget:
            assert chosen_time <= uniform.time_cost_s + 1e-12, (action, chosen.actions)
            assert noisy_time <= uniform.time_cost_s + slack + 1e-12, (action, noisy.actions)
    measured, got = _measured_step(model, batch, chosen)
    assert chosen.predicted_peak_bytes == measured
    assert_same_step(_gpt2_step(model, batch), got)


@pytest.mark.parametrize("how", ["profile", "session", "pgac"])
def test_profiling_fires_each_parameter_gradient_hook_once(how: str) -> None:
    """Measuring blocks alone must not reach the step's parameters: DDP's reducer counts their gradient hooks,
    and with static_graph=True expects the first step's count in every later step."""
    from collections import Counter

    from remat.integrations.distributed import prepare

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
    fired: Counter[str] = Counter()
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.update([name]))
    x = torch.randn(4, 8)
    if how == "profile":
        remat.profile(model, x, repeats=1)
        assert fired == {name: 1 for name, _ in model.named_parameters()}  # its one real backward
        return
    owner = prepare(model, "memory_poor", auto_step=False) if how == "session" else remat.PGAC(model, None)
    try:
        for _ in range(2):
            fired.clear()
            model(x).sum().backward()
            owner.step()
            assert fired == {name: 1 for name, _ in model.named_parameters()}
    finally:
        owner.remove()


def test_the_warm_up_step_runs_only_where_no_step_of_the_model_on_such_a_batch_ran() -> None:
    from remat.chains import stepped_before

    model = uniform_chain(4, width=16)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(8, 8)
    assert not stepped_before(model, x)
    remat.profile(model, x)
    first = len(calls)
    assert stepped_before(model, x) and not stepped_before(model, torch.randn(4, 8))
    calls.clear()
    remat.profile(model, torch.randn(8, 8))  # other values, the same structure: warm already
    assert len(calls) == first - 1
    calls.clear()
    remat.profile(model, torch.randn(4, 8))  # another shape: warmed up again
    assert len(calls) == first


class InPlaceAfterMatmul(nn.Module):
    """A block that changes a matmul's output in place: a policy keeping matmul outputs cannot run on it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).relu_() + x


class StemThenBlocks(nn.Module):
    def __init__(self, width: int = 64, blocks: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.ModuleList(InPlaceAfterMatmul(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return h.square().mean()


def test_a_policy_a_block_refuses_leaves_the_profiled_steps_tensors_to_be_counted() -> None:
    """A policy that fails on the first block is caught while the block's arguments (the stem's output) sit in the
    failing frames; the profile must not keep them alive past its step, where its tracker would take them for
    survivors (as parameter gradients are) and leave them out of every figure. With the garbage collector off,
    nothing else would free them: the profile's stem and keep-all peak equal a plain step's."""
    import gc

    torch.manual_seed(0)
    model = StemThenBlocks()
    x = torch.randn(64, 8)
    enabled = gc.isenabled()
    gc.disable()
    try:
        with pytest.warns(UserWarning, match="cannot run on InPlaceAfterMatmul blocks"):
            costs = remat.profile(model, x, policies=["dots_saveable"])
    finally:
        if enabled:
            gc.enable()
    assert "selective:dots_saveable" in costs.blocks[0].unavailable
    tracker = remat.meters.LiveTensorTracker()
    marked = model.blocks[0].register_forward_pre_hook(lambda module, args: tracker.mark("stem"))
    with tracker:
        loss = model(x)
        loss.backward()  # the output held through the backward, as the profile's step holds it
    marked.remove()
    del loss
    tracker.close()
    assert costs.stem_bytes == tracker.bytes_at("stem") == 64 * 64 * 4
    # The 4-byte scalar loss is all that separates the two, as on the chain above.
    assert 0 <= remat.plan(costs, "none").predicted_peak_bytes - tracker.peak(exclude_survivors=True) <= 64


class LayerDropStack(nn.Module):
    """Layers skipped at random in training, as Hugging Face's LayerDrop does (``self.layerdrop``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
        self.layerdrop = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            x = layer(x).relu()
        return x.square().mean()


def test_a_stack_that_drops_layers_is_measured_whole_on_a_device_and_on_meta() -> None:
    """With half the layers skipped at random, a step would leave some unprofiled: the profile and the meta
    estimate run every layer, restore the setting, mark the table, and its plans hold no group."""
    from remat.profiling.estimate import meta_cost_table

    torch.manual_seed(0)
    model = LayerDropStack().train()
    x = torch.randn(4, 16)
    for costs in (remat.profile(model, x), meta_cost_table(lambda: LayerDropStack().train(), x)):
        assert len(costs) == 6 and costs.info["layer_drop"] is True and not costs.groups_allowed()
        assert model.layerdrop == 0.5
        plan = remat.plan(costs, "optimal", remat.planning.minimum_peak_bytes(costs))
        assert not any(remat.core.Action.choice(a).is_group for a in plan.actions.values())
        with pytest.raises(ValueError, match="skips layers in training"):
            remat.plan(costs, "memory_poor")
