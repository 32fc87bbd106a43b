"""``remat.fit(model, memory, batch=..., compile=True)``: the fastest route whose whole step fits, among remat's
eager plan, the whole model compiled under a fitted ``activation_memory_budget`` and remat's plan on compiled
blocks, set up on the model in place; every route's whole step measured within the memory (the allocator's
events, which see inside compiled code), gradients as the plain step's, ``remove()`` giving the plain model back.

The backend is ``aot_eager_decomp_partition`` (torch's min-cut partitioner, which reads the budgets, without code
generation), so each compilation takes a fraction of a second. Where a test needs one route to be the faster,
its clock makes it so (without one, this backend's steps, which run decomposed operators without code
generation, measure slower than the eager plan's, and the eager route is chosen)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from toy_models import GeluBlock, resident_bytes

import remat
from remat.fitting import MemoryFitError
from remat.runtime import owner_of

COMPILE = {"backend": "aot_eager_decomp_partition", "budgets": (0.5,), "partition_budgets": (0.1,), "rounds": 2}
X = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[GeluBlock() for _ in range(6)])
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, list[torch.Tensor]]:
    """One whole step, its peak read from the allocator's events plus what was resident, and its gradients."""
    resident = resident_bytes(model, optimizer)
    with remat.measure(allocations=True) as meter:
        loss_fn(model(X)).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
    return resident + meter.peak_bytes, grads


@pytest.fixture(scope="module")
def plain() -> tuple[int, list[list[torch.Tensor]]]:
    """The plain eager step's whole peak once the optimizer's state exists, and two steps' gradients."""
    model, optimizer = make()
    (_, first), (peak, second) = train_step(model, optimizer), train_step(model, optimizer)
    return peak, [first, second]


def is_compiled(model: nn.Module) -> bool:
    return model._compiled_call_impl is not None or any(b._compiled_call_impl is not None for b in model)


class EagerSteps:
    """Steps read 1 s, and ``eager_s`` while remat's plan runs on plain blocks (the eager route)."""

    def __init__(self, model: nn.Module, eager_s: float) -> None:
        self.model, self.eager_s, self.now = model, eager_s, 0.0

    def __call__(self) -> float:
        eager = owner_of(self.model) is not None and not any(b._compiled_call_impl is not None for b in self.model)
        self.now += self.eager_s if eager else 1.0
        return self.now


@pytest.mark.parametrize("share, routes", [(0.9, {"whole model", "blocks"}), (0.7, {"blocks"})])
def test_the_chosen_route_keeps_the_whole_step_within_memory(
    plain: tuple[int, list[list[torch.Tensor]]], share: float, routes: set[str]
) -> None:
    memory = int(plain[0] * share)
    model, optimizer = make()
    handle = remat.fit(model, memory, batch=X, optimizer=optimizer, loss_fn=loss_fn, compile=COMPILE,
                       clock=EagerSteps(model, 2.0))  # fmt: skip  # a compiled route measures faster
    assert handle.route in routes, handle.describe()
    assert is_compiled(model)  # set up in place: the loop keeps calling the model
    assert {t.name for t in handle.fitted.compiled.trials} >= {"eager", "whole model", "blocks"}
    for step in range(2):
        peak, grads = train_step(model, optimizer)
        assert peak <= memory * 1.02, (peak, memory, handle.describe())
        for got, expected in zip(grads, plain[1][step], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    handle.remove()
    assert not is_compiled(model) and owner_of(model) is None and not model[0]._forward_pre_hooks


def test_the_eager_plan_is_chosen_where_it_measures_faster_with_exact_gradients(
    plain: tuple[int, list[list[torch.Tensor]]],
) -> None:
    memory = int(plain[0] * 0.8)
    model, optimizer = make()
    handle = remat.fit(model, memory, batch=X, optimizer=optimizer, loss_fn=loss_fn, compile=COMPILE,
                       clock=EagerSteps(model, 0.5))  # fmt: skip
    assert handle.route == "eager" and handle.plan is not None, handle.describe()
    assert handle.plan.action_counts() != "6 keep"
    assert not is_compiled(model) and owner_of(model) is not None
    for step in range(2):
        peak, grads = train_step(model, optimizer)
        assert peak <= memory * 1.02
        assert all(torch.equal(a, b) for a, b in zip(grads, plain[1][step], strict=True))  # eager: bitwise
    assert sum(handle.stats.calls.values()) > 0
    handle.remove()
    assert owner_of(model) is None


def test_where_no_route_fits_the_error_names_both_and_the_least(plain: tuple[int, list[list[torch.Tensor]]]) -> None:
    model, optimizer = make()
    with pytest.raises(MemoryFitError, match=r"no route fits .* Eager: .* Compiled: ") as caught:
        remat.fit(model, int(plain[0] * 0.5), batch=X, optimizer=optimizer, loss_fn=loss_fn, compile=COMPILE)
    assert caught.value.floor is not None and caught.value.floor > plain[0] * 0.5
    assert not is_compiled(model) and owner_of(model) is None  # the model as it came


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"batch": None}, "with a sample batch"),
        ({"memory": None, "activations": 0.5}, "no activations="),
        ({"compile": {"bakend": "inductor"}}, r"compile= takes"),
    ],
)
def test_compile_needs_memory_and_a_batch(arguments: dict[str, Any], message: str) -> None:
    model, _ = make()
    given = {"memory": "10MiB", "batch": X, "compile": True, **arguments}
    memory = given.pop("memory")
    with pytest.raises((ValueError, TypeError), match=message):
        remat.fit(model, memory, **given)
    assert not is_compiled(model)


def test_a_model_compiled_whole_is_never_planned_as_if_eager() -> None:
    model, optimizer = make()
    with pytest.raises(ValueError, match=r"wrapper._orig_mod"):
        remat.fit(torch.compile(model, backend="aot_eager"), "10MiB", batch=X, compile=True)
    model.compile(backend="aot_eager")
    with pytest.raises(ValueError, match=r"compile=True"):
        remat.fit(model, "10MiB", batch=X, optimizer=optimizer, loss_fn=loss_fn)
    handle = remat.fit(model, "10MiB", batch=X, optimizer=optimizer, loss_fn=loss_fn, compile=COMPILE)
    assert handle.route in ("eager", "whole model", "blocks")
    handle.remove()
    for block in model:  # compiled blocks: refused without compile=True, fitted with it
        block.compile(backend="aot_eager")
    with pytest.raises(RuntimeError, match=r"compile=True"):
        remat.fit(model, "10MiB", batch=X, optimizer=optimizer, loss_fn=loss_fn)
    handle = remat.fit(model, "10MiB", batch=X, optimizer=optimizer, loss_fn=loss_fn, compile=COMPILE)
    assert handle.route in ("eager", "whole model", "blocks")
    handle.remove()


def test_compilations_are_one_per_whole_model_budget_and_one_per_block_structure_and_partition() -> None:
    """Six identical blocks share their graphs; each whole-model fraction and each partition budget adds one."""
    from torch._dynamo.utils import counters

    def graphs(budgets: tuple[float, ...], partitions: tuple[float, ...]) -> int:
        torch._dynamo.reset()
        counters.clear()
        model, optimizer = make()
        options = {**COMPILE, "budgets": budgets, "partition_budgets": partitions}
        handle = remat.fit(model, int(3.8e6), batch=X, optimizer=optimizer, loss_fn=loss_fn, compile=options,
                           clock=EagerSteps(model, 2.0))  # fmt: skip
        handle.remove()
        return counters["stats"]["unique_graphs"]

    base = graphs((0.5,), (0.1,))
    # the whole model unbudgeted and at 0.5; the blocks' own graph and their 0.1 partition, each once for the first
    # block (an input without grad) and once for the others; no graph per block
    assert base <= 2 + 2 * 2 + 1, base
    assert graphs((0.3, 0.5), (0.1,)) == base + 1
    assert graphs((0.5,), (0.1, 0.25)) == base + 1
    torch._dynamo.reset()


def test_a_hugging_face_model_trains_without_its_cache_and_flag_and_gets_them_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from toy_models import tiny_gpt2

    model = tiny_gpt2(n_layer=2, n_embd=32, seed=0)
    model.config.use_cache = True
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with caplog.at_level("WARNING", logger="remat"):
        handle = remat.fit(model, "64MiB", batch={"input_ids": ids, "labels": ids}, compile=COMPILE)
    assert model.config.use_cache is False and not model.transformer.gradient_checkpointing
    assert sum("gradient checkpointing was on" in r.message for r in caplog.records) == 1
    handle.remove()
    assert model.config.use_cache is True and model.transformer.gradient_checkpointing


def test_the_hugging_face_door_takes_compile_too() -> None:
    from toy_models import tiny_gpt2

    from remat.integrations import hf
    from remat.integrations.compiled_session import CompiledSession

    model = tiny_gpt2(n_layer=2, n_embd=32, seed=0)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    handle = hf.enable(model, memory="64MiB", batch={"input_ids": ids, "labels": ids}, compile=COMPILE)
    assert isinstance(handle, CompiledSession) and handle.route in ("eager", "whole model", "blocks")
    handle.remove()
    with pytest.raises(ValueError, match="with a sample batch"):
        hf.enable(model, memory="64MiB", compile=True)


def test_the_trainer_trains_on_the_compiled_route() -> None:
    """docs/hf.md's Trainer recipe with compile=: hf.enable sets the fastest route up in place before the Trainer
    is built, and the Trainer's steps run it (the compiled blocks' or the model's own compiled call), with the
    losses of a plain Trainer run (the backend computes what eager does, in other kernels)."""
    pytest.importorskip("accelerate")
    import tempfile

    from toy_models import tiny_gpt2
    from transformers import Trainer, TrainingArguments

    from remat.integrations import hf

    def train(model: nn.Module) -> list[float]:
        torch.manual_seed(0)
        data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, model.config.vocab_size, (8, 16))]
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=3, per_device_train_batch_size=2,
                                 use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1,
                                 seed=0)  # fmt: skip
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        return [r["loss"] for r in trainer.state.log_history if "loss" in r]

    expected = train(tiny_gpt2(n_layer=2, n_embd=32, seed=0, dropout=0.0))
    model = tiny_gpt2(n_layer=2, n_embd=32, seed=0, dropout=0.0)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    compiled_calls = []
    blocks = list(model.transformer.h)

    def compiled() -> bool:
        return model._compiled_call_impl is not None or any(b._compiled_call_impl is not None for b in blocks)

    class CompiledFaster:
        now = 0.0

        def __call__(self) -> float:
            self.now += 1.0 if compiled() else 2.0
            return self.now

    handle = hf.enable(model, memory="64MiB", batch={"input_ids": ids, "labels": ids}, compile=COMPILE,
                       clock=CompiledFaster())  # fmt: skip
    assert handle.route in ("whole model", "blocks"), handle.describe()
    model.register_forward_pre_hook(lambda *_: compiled_calls.append(compiled()))
    losses = train(model)
    assert compiled_calls and all(compiled_calls)  # every Trainer step ran the compiled route
    assert losses == pytest.approx(expected, rel=1e-4)
    handle.remove()
    assert not compiled()
