"""remat.DTR: exact gradients under a byte budget, measured memory within it, stats, errors, attach mode."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _len_torch_dispatch_stack
from toy_models import tiny_gpt2

import remat
from remat.meters import measure

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

Step = Callable[[], list[torch.Tensor]]


def _mlp() -> tuple[nn.Module, Step]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(24) for m in (nn.Linear(64, 64), nn.ReLU())])
    x = torch.randn(512, 64)
    return model, _stepper(model, lambda: model(x).square().mean())


def _gpt2() -> tuple[nn.Module, Step]:
    model = tiny_gpt2(n_layer=4, n_embd=64, vocab=128, n_positions=64, seed=0)
    ids = torch.randint(0, 128, (4, 64))
    return model, _stepper(model, lambda: model(input_ids=ids, labels=ids).loss)


def _vit() -> tuple[nn.Module, Step]:
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=28, patch_size=7, num_channels=1, hidden_size=64, num_hidden_layers=3,
        num_attention_heads=4, intermediate_size=128, num_labels=10, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.ViTForImageClassification(config).train()
    images, labels = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    return model, _stepper(model, lambda: model(pixel_values=images, labels=labels).loss)


def _stepper(model: nn.Module, loss_fn: Callable[[], torch.Tensor]) -> Step:
    """One training step; returns the gradients. The seed is fixed so dropout draws the same masks."""

    def step() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1234)
        loss_fn().backward()
        return [p.grad.clone() for p in model.parameters()]

    return step


MODELS = {"mlp": _mlp, "gpt2": _gpt2, "vit": _vit}


def _assert_same(expected: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    assert len(expected) == len(got)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=0.0, atol=1e-6)


@pytest.fixture(scope="module", params=list(MODELS))
def case(request: pytest.FixtureRequest) -> tuple[nn.Module, Step, list[torch.Tensor], int]:
    model, step = MODELS[request.param]()
    with measure() as m:
        expected = step()
    return model, step, expected, m.activation_bytes


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
def test_exact_gradients_and_memory_within_budget(case, fraction: float) -> None:
    model, step, expected, baseline = case
    dtr = remat.DTR(model, fraction, baseline_bytes=baseline)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cannot keep within the budget" warning either
        with measure() as m, dtr:
            got = step()
    _assert_same(expected, got)
    budget = dtr.budget_bytes
    assert budget == int(fraction * baseline)
    assert m.activation_bytes <= 1.1 * budget
    last = dtr.stats.last_step
    assert last.peak_tracked_bytes <= 1.1 * budget
    assert last.over_budget_ops == 0
    if fraction == 1.0:
        assert last.evictions == 0 and last.rematerializations == 0
    if fraction == 0.25:
        assert last.evictions > 0 and last.rematerializations > 0 and last.recompute_s > 0
        assert m.activation_bytes < 0.3 * baseline


def test_budget_below_one_operator_names_it() -> None:
    model, step = _mlp()
    pattern = r"operator aten\.\w+.* needs: 128\.00 KiB"
    with pytest.raises(remat.BudgetError, match=pattern) as info, remat.DTR(model, "32KiB"):
        step()
    assert "32.00 KiB" in str(info.value)
    assert _len_torch_dispatch_stack() == 0


def test_unknown_heuristic_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="dtr, dtr_local, lru, size"):
        remat.DTR(nn.Linear(2, 2), "1MiB", heuristic="random")


@pytest.mark.parametrize("budget", [1.5, 0.0, -3])
def test_budget_out_of_range(budget: float) -> None:
    with pytest.raises(ValueError):
        remat.DTR(nn.Linear(2, 2), budget)


def test_budget_forms() -> None:
    layer = nn.Linear(2, 2)
    assert remat.DTR(layer, 1 << 20).budget_bytes == 1 << 20
    assert remat.DTR(layer, "1.5GiB").budget_bytes == 3 * 2**29
    assert remat.DTR(layer, 0.5, baseline_bytes=1000).budget_bytes == 500
    assert remat.DTR(layer, 0.5).budget_bytes is None  # known after the measuring step
    with pytest.raises(TypeError):
        remat.DTR(layer, True)


def test_fraction_is_calibrated_on_the_first_step() -> None:
    model, step = _mlp()
    with measure() as m:
        expected = step()
    dtr = remat.DTR(model, 0.25)
    with dtr:
        _assert_same(expected, step())
    assert dtr.stats.calibration_steps == 1 and dtr.stats.steps == 0
    assert dtr.baseline_bytes == m.activation_bytes
    with measure() as m2, dtr:
        _assert_same(expected, step())
    assert dtr.stats.steps == 1 and dtr.stats.evictions > 0
    assert m2.activation_bytes <= 1.1 * dtr.budget_bytes


@pytest.mark.parametrize("heuristic", ["dtr", "dtr_local", "lru", "size"])
def test_every_heuristic_is_exact(heuristic: str) -> None:
    model, step = _gpt2()
    with measure() as m:
        expected = step()
    dtr = remat.DTR(model, 0.3, heuristic=heuristic, baseline_bytes=m.activation_bytes)
    with measure() as m2, dtr:
        _assert_same(expected, step())
    assert dtr.stats.evictions > 0
    assert m2.activation_bytes <= 1.1 * dtr.budget_bytes


def test_stats_accumulate_and_reset() -> None:
    model, step = _mlp()
    with measure() as m:
        step()
    dtr = remat.DTR(model, 0.3, baseline_bytes=m.activation_bytes)
    per_step = []
    for _ in range(2):
        with dtr:
            step()
        per_step.append(dtr.stats.last_step)
    stats = dtr.stats
    assert stats.steps == 2
    assert stats.evictions == sum(s.evictions for s in per_step) and per_step[0].evictions > 0
    assert stats.rematerializations == sum(s.rematerializations for s in per_step) > 0
    assert stats.peak_tracked_bytes == max(s.peak_tracked_bytes for s in per_step) > 0
    assert 0 < stats.recompute_s < stats.step_s and 0 < stats.recompute_fraction < 1
    dtr.reset_stats()
    assert dtr.stats.steps == 0 and dtr.stats.evictions == 0 and dtr.stats.peak_tracked_bytes == 0


def test_attach_runs_every_step_under_dtr() -> None:
    model, step = _gpt2()
    with measure() as m:
        expected = step()
    original = model.forward
    dtr = remat.DTR(model, 0.25, baseline_bytes=m.activation_bytes).attach()
    for _ in range(2):
        with measure() as m2:  # a mode entered around the attached step exits cleanly
            _assert_same(expected, step())
        assert m2.activation_bytes <= 1.1 * dtr.budget_bytes
    assert dtr.stats.steps == 2 and dtr.stats.last_step.evictions > 0
    with torch.no_grad():  # evaluation passes are not tracked
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    dtr.detach()
    assert model.forward == original and "forward" not in model.__dict__
    assert _len_torch_dispatch_stack() == 0


class _Block(nn.Module):
    """In-place operators (on fresh tensors and on tensors already read), views and dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(64), nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a = self.up(self.norm(h)).relu_()
        w = a.view(-1, 64, 2).transpose(1, 2).contiguous().view(a.shape)
        g = nn.functional.dropout(nn.functional.gelu(w), 0.2, True) * a.sigmoid()
        h = h + self.down(g)
        h.mul_(0.5)
        return h + 0.01 * h.pow(2)


def test_in_place_views_and_user_held_tensors() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[_Block() for _ in range(6)])
    x = torch.randn(256, 64, requires_grad=True)
    held: dict[str, torch.Tensor] = {}

    def step() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(5)
        h = model[0](x)
        held["view"] = h[:, :32]  # user code keeps a view of an intermediate tensor
        held["copy"] = held["view"].clone()
        for block in model[1:]:
            h = block(h)
        (h.square().mean() + held["view"].sum() * 1e-3).backward()
        return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]

    with measure() as m:
        expected = step()
    for fraction in (0.5, 0.2):
        dtr = remat.DTR(model, fraction, baseline_bytes=m.activation_bytes)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with dtr:
                got = step()
        _assert_same(expected, got)
        assert dtr.stats.evictions > 0
        assert torch.equal(held["view"], held["copy"])  # never evicted nor overwritten


def test_backward_after_the_region_still_works() -> None:
    model, _ = _mlp()
    x = torch.randn(512, 64)
    with measure() as m:
        model(x).square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with remat.DTR(model, 0.3, baseline_bytes=m.activation_bytes) as dtr:
        loss = model(x).square().mean()
    assert dtr.stats.last_step.evictions > 0  # some saved tensors were evicted in forward
    loss.backward()  # they are rebuilt without a budget
    _assert_same(expected, [p.grad for p in model.parameters()])


def test_batch_norm_running_statistics_are_updated_once() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU())])
    twin = copy.deepcopy(model)
    x = torch.randn(512, 64)

    def step(net: nn.Module) -> list[torch.Tensor]:
        net.zero_grad(set_to_none=True)
        net(x).square().mean().backward()
        return [p.grad.clone() for p in net.parameters()] + [b.clone() for b in net.buffers()]

    with measure() as m:
        expected = step(model)
    dtr = remat.DTR(twin, 0.3, baseline_bytes=m.activation_bytes)
    with dtr:
        got = step(twin)
    _assert_same(expected, got)  # gradients, and running statistics updated by the forward only
    assert dtr.stats.rematerializations > 0


def test_tensors_held_by_user_code_are_never_evicted() -> None:
    model, step = _mlp()
    with measure() as m:
        expected = step()
    held: list[torch.Tensor] = []
    hooks = [module.register_forward_hook(lambda mod, args, out: held.append(out)) for module in model]
    try:
        step()
        reference = [t.clone() for t in held]
        held.clear()
        dtr = remat.DTR(model, 0.3, baseline_bytes=m.activation_bytes)
        with pytest.warns(RuntimeWarning, match="no resident tensor can be evicted"), dtr:
            _assert_same(expected, step())
        assert dtr.stats.last_step.evictions == 0 and dtr.stats.last_step.over_budget_ops > 0
        _assert_same(reference, held)
        held.clear()
        strict = remat.DTR(model, 0.3, baseline_bytes=m.activation_bytes, strict=True)
        with pytest.raises(remat.BudgetError, match="no resident tensor can be evicted"), strict:
            step()
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("heuristic", ["dtr", "size"])
def test_mixture_of_experts_within_budget_and_exact(heuristic: str) -> None:
    """Mixtral's experts run as ``_grouped_mm``, whose meta kernel refuses float32 (its outputs are learned
    from the calibration step), and their outputs feed records whose parents get rematerialized by one another
    (each stays locked until the record that needs it has replayed)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        use_cache=False, attn_implementation="eager", max_position_embeddings=128,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config).train()
    ids = torch.randint(0, 256, (4, 64))

    def step() -> list[torch.Tensor]:
        torch.manual_seed(1)
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    expected = step()
    dtr = remat.DTR(model, 0.25, heuristic)
    with dtr:
        step()  # calibration: measures the no-checkpoint memory
    with measure() as m, dtr:
        got = step()
    _assert_same(expected, got)
    assert dtr.stats.last_step.evictions > 0
    assert m.activation_bytes <= dtr.budget_bytes
    assert dtr.stats.last_step.over_budget_ops == 0
