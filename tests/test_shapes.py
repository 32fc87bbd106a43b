"""Budgets that hold for every input shape: the shape-aware costs (``remat.profile_shapes``,
``remat.core.ShapeCosts``) predict the peak at shapes not profiled, and plans per shape bucket
(``remat.ShapePlans``, ``handle.plan_per_shape``) keep every step within the byte budget or refuse the batch before
its first block, naming what fits."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import remat
from remat.core import ShapeCosts
from remat.planning import Buckets

pytest.importorskip("transformers")

VOCAB = 256
REFERENCE = (4, 64)  # (batch, sequence) profiled


def _batch(rows: int, positions: int, seed: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, positions), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _step_or_refusal(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                     seed: int) -> tuple[int, remat.ShapeBudgetError | None]:  # fmt: skip
    """One training step (dropout drawn from ``seed``) under the model's plans per shape: its measured activation
    bytes, or the refusal of its shape (the gradients then cleared)."""
    torch.manual_seed(seed)
    try:
        with remat.measure() as measured:
            model(**batch).loss.backward()
    except remat.ShapeBudgetError as err:
        model.zero_grad(set_to_none=True)
        return 0, err
    return measured.activation_bytes, None


def _llama(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=512, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0, use_cache=False)  # fmt: skip
    return LlamaForCausalLM(config).train()


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def shaped(request, make_gpt2) -> tuple[torch.nn.Module, ShapeCosts]:
    if request.param == "gpt2":  # eager attention: the s x s scores, the form's square term
        model = make_gpt2(n_layer=3, n_embd=64, dropout=0.0, seed=0, n_positions=512)
    else:
        model = _llama()
    return model, remat.profile_shapes(model, _batch(*REFERENCE), holds_output=False)


def _measured(model: torch.nn.Module, batch: dict[str, torch.Tensor], plan: remat.Plan) -> int:
    handle = remat.apply(model, plan)
    try:
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)
        with remat.measure() as measured:
            model(**batch).loss.backward()
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    return measured.activation_bytes


def test_the_form_passes_through_the_measured_shapes(shaped) -> None:
    _, shapes = shaped
    assert shapes.shapes == [(4, 64), (4, 32), (2, 64), (2, 32)]
    for table, shape in zip(shapes.tables, shapes.shapes, strict=True):
        assert shapes.at(*shape) is table  # invariant 1
    between = shapes.at(3, 48)
    assert between.info["shape"] == [3, 48] and between.info["input_shapes"][between.fqns[0]][:2] == [3, 48]


@pytest.mark.parametrize("shape", [(4, 16), (4, 32), (4, 128), (4, 256), (2, 64), (8, 64), (1, 100)])
def test_predicted_peaks_hold_at_shapes_not_profiled(shaped, shape: tuple[int, int]) -> None:
    model, shapes = shaped
    costs = shapes.at(*shape)
    batch = _batch(*shape)
    for plan in (remat.plan(costs, "none"), remat.plan(costs, "full"), remat.plan(costs, "optimal", budget=0.5)):
        measured = _measured(model, batch, plan)
        assert abs(plan.predicted_peak_bytes / measured - 1) <= 0.05, (shape, plan.strategy, measured)


def test_a_bucket_is_planned_once_and_serves_every_shape_in_it(shaped) -> None:
    _, shapes = shaped
    budget = remat.plan(shapes.at(4, 192), "none").predicted_peak_bytes  # keep-all at (4, 192)
    plans = remat.ShapePlans(shapes, budget, buckets=Buckets(seq_multiple=64))
    with pytest.warns(UserWarning, match=r"beyond the profiled \[4, 64\]: its costs are extrapolated"):
        first = plans.plan_for(4, 100)
    assert plans.plan_for(4, 120) is first and plans.plan_for(4, 128) is first  # all in the bucket (4, 128)
    assert plans.planned == 1
    assert first.options["shape"] == [4, 128] and first.predicted_peak_bytes <= budget
    plans.plan_for(4, 129)
    assert plans.planned == 2 and plans.seen[(4, 129)] == (4, 192)
    assert "[4, 128] for [[4, 100], [4, 120], [4, 128]]" in plans.describe()
    pow2 = Buckets(seq_multiple="pow2", batch_multiple="pow2")
    assert pow2.of(3, 100) == (4, 128) and pow2.of(8, 64) == (8, 64)
    with pytest.raises(ValueError, match="positive integer or 'pow2'"):
        Buckets(seq_multiple=0).of(1, 10)
    with pytest.raises(ValueError, match="a fraction means a different number of bytes"):
        remat.ShapePlans(shapes, 0.5)


def test_a_shape_no_plan_fits_is_refused_naming_what_fits(shaped) -> None:
    _, shapes = shaped
    budget = remat.plan(shapes.at(4, 128), "none").predicted_peak_bytes  # keep-all at (4, 128)
    plans = remat.ShapePlans(shapes, budget, buckets=Buckets(seq_multiple=16))
    with pytest.raises(remat.ShapeBudgetError) as refused:
        plans.plan_for(8, 512)
    err = refused.value
    assert err.shape == (8, 512) and err.floor > budget
    assert 128 <= err.fitting_seq < 512 and 1 <= err.fitting_batch < 8
    text = str(err)
    assert "[8, 512]" in text and f"sequences up to {err.fitting_seq} fit" in text
    assert f"batches up to {err.fitting_batch} fit" in text and "on_overflow='least'" in text
    # what the error names fits, one more does not
    least = remat.planning.minimum_peak_bytes
    assert least(shapes.at(8, err.fitting_seq)) <= budget < least(shapes.at(8, err.fitting_seq + 1))
    assert least(shapes.at(err.fitting_batch, 512)) <= budget < least(shapes.at(err.fitting_batch + 1, 512))
    with pytest.warns(UserWarning, match="Running the plan of the least peak"):
        plan = remat.ShapePlans(shapes, budget, on_overflow="least").plan_for(8, 512)
    assert plan.predicted_peak_bytes == err.floor


def test_a_run_of_random_shapes_stays_within_its_budget_with_exact_gradients(make_gpt2) -> None:
    torch.manual_seed(0)
    model = make_gpt2(n_layer=3, n_embd=64, dropout=0.1, seed=0, n_positions=512)
    plain = make_gpt2(n_layer=3, n_embd=64, dropout=0.1, seed=0, n_positions=512)
    shapes = remat.profile_shapes(model, _batch(*REFERENCE), holds_output=False)
    budget = remat.plan(shapes.at(4, 160), "none").predicted_peak_bytes  # keep-all at (4, 160)
    handle = remat.apply(model, remat.plan(shapes.reference, "none"))
    plans = remat.ShapePlans(shapes, budget, buckets=Buckets(seq_multiple=32))
    handle.plan_per_shape(plans)
    blocks_run = []
    model.transformer.h[0].register_forward_pre_hook(lambda *_: blocks_run.append(1))
    rng = random.Random(0)
    refused = ran = 0
    for step in range(30):
        rows, positions = rng.randint(1, 8), rng.randint(32, 384)
        batch = _batch(rows, positions, seed=step)
        before = len(blocks_run)
        torch.manual_seed(step)
        try:
            with remat.measure() as measured:
                loss = model(**batch).loss
                loss.backward()
        except remat.ShapeBudgetError as err:
            refused += 1
            assert len(blocks_run) == before  # refused before its first block ran
            assert err.shape == (rows, positions)
            model.zero_grad(set_to_none=True)
            continue
        ran += 1
        assert measured.activation_bytes <= budget * 1.02, (rows, positions, measured.activation_bytes, budget)
        grads = {n: p.grad for n, p in model.named_parameters()}
        torch.manual_seed(step)
        plain(**batch).loss.backward()
        for name, p in plain.named_parameters():
            assert torch.equal(p.grad, grads[name]), (rows, positions, name)
        model.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
    assert ran >= 10 and refused >= 3, (ran, refused)  # both kinds of step were seen
    assert plans.planned == len(plans.plans) + len(plans.refused) < ran + refused  # every bucket planned once
    assert "plans per shape" in plans.describe()
    handle.remove()


def test_the_front_door_plans_each_shape_within_the_same_memory(make_gpt2) -> None:
    model = make_gpt2(n_layer=3, n_embd=64, dropout=0.0, seed=0, n_positions=512)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # no state; the weights stay as they are
    largest = _batch(4, 128)
    plain_whole = None
    with remat.measure() as plain:
        model(**largest).loss.backward()
    model.zero_grad(set_to_none=True)
    plain_whole = plain.activation_bytes
    handle = remat.fit(model, int(plain_whole * 0.9), batch=largest, optimizer=optimizer, shapes=True,
                       step=remat.StepSpec(holds_output=False))  # fmt: skip
    plans = handle.shape_plans
    assert plans is not None and plans.costs.shapes[0] == (4, 128)
    budget = plans.budget_bytes
    rng = random.Random(1)
    refused = 0
    for step in range(12):
        rows, positions = rng.randint(1, 8), rng.randint(16, 256)
        batch = _batch(rows, positions, seed=step)
        try:
            with remat.measure() as measured:
                model(**batch).loss.backward()
        except remat.ShapeBudgetError:
            refused += 1
            continue
        finally:
            model.zero_grad(set_to_none=True)
        assert measured.activation_bytes <= budget * 1.02, (rows, positions)
    assert refused < 12 and "plans per shape" in handle.describe()
    handle.remove()
    with pytest.raises(ValueError, match="shapes=True plans each input shape within memory="):
        remat.fit(model, activations=0.5, shapes=True)


def test_the_front_door_without_a_batch_plans_each_shape_from_the_first_training_batch(make_gpt2) -> None:
    """``remat.fit(model, memory, shapes=True)`` with no batch: the first training step is profiled, its batch is
    cut to the smaller shapes then (the step's gradients left as they were), and from the second step each shape
    runs its own plan within the memory, or is refused before its first block; gradients bitwise a plain step's."""
    model = make_gpt2(n_layer=3, n_embd=64, dropout=0.1, seed=0, n_positions=512)
    plain = make_gpt2(n_layer=3, n_embd=64, dropout=0.1, seed=0, n_positions=512)
    with remat.measure() as measured:
        plain(**_batch(4, 128)).loss.backward()
    plain.zero_grad(set_to_none=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    session = remat.fit(model, int(measured.activation_bytes * 0.9), optimizer=optimizer, shapes=True,
                        step=remat.StepSpec(holds_output=False))  # fmt: skip
    blocks = [m for _, m in remat.find_blocks(model)]
    calls: list[int] = []
    hooks = [b.register_forward_pre_hook(lambda *_: calls.append(1)) for b in blocks]
    ran, refused = 0, 0
    for step, (rows, positions) in enumerate([(4, 64), (3, 161), (2, 81), (8, 136), (7, 217), (4, 40), (1, 194)]):
        batch = _batch(rows, positions, seed=step)
        before = len(calls)
        activations, refusal = _step_or_refusal(model, batch, step)
        if refusal is not None:
            refused += 1
            assert step > 0 and len(calls) == before and refusal.shape == (rows, positions)
            continue
        ran += 1
        if step == 0:
            assert session.shape_plans is None  # made at the end of the first step, from its batch
        else:
            assert activations <= session.shape_plans.budget_bytes * 1.02, (rows, positions)
        torch.manual_seed(step)
        plain(**batch).loss.backward()
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), (rows, positions, name)
        optimizer.step()
        plain_optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        plain_optimizer.zero_grad(set_to_none=True)
        if step == 0:
            assert session.shape_plans is not None and session.shape_plans.costs.shapes[0] == (4, 64)
    assert ran >= 5 and refused >= 1, (ran, refused)
    assert "plans per shape" in session.describe()
    for hook in hooks:
        hook.remove()
    session.remove()


def test_a_first_batch_given_positionally_and_by_keyword_is_cut_to_shapes(make_gpt2) -> None:
    """A loop calling ``model(ids, labels=ids)``: the first batch is kept with ``ids`` bound to ``input_ids``, so
    its shapes are profiled as ``model(input_ids=..., labels=...)`` runs them; a ``*args`` forward called so is
    planned for its first shape alone, with a warning saying what to give."""
    from remat.profiling import batch_of_call

    model = make_gpt2(n_layer=2, n_embd=32, dropout=0.0, seed=0, n_positions=128)
    plain = make_gpt2(n_layer=2, n_embd=32, dropout=0.0, seed=0, n_positions=128)
    ids = _batch(4, 64)["input_ids"]
    assert batch_of_call(model, (ids,), {"labels": ids}).keys() == {"input_ids", "labels"}
    session = remat.fit(model, "1GiB", optimizer=torch.optim.SGD(model.parameters(), lr=0.0), shapes=True)
    for rows, positions in [(4, 64), (2, 48), (3, 64)]:
        ids = _batch(rows, positions, seed=rows)["input_ids"]
        model(ids, labels=ids).loss.backward()
        plain(ids, labels=ids).loss.backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters(), strict=True))
        session.optimizer.step()
        model.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
    assert session.shape_plans is not None and set(session.shape_plans.seen) == {(2, 48), (3, 64)}
    session.remove()

    class Star(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])

        def forward(self, *inputs: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            h = inputs[0]
            for block in self.blocks:
                h = block(h)
            return h.sum() * scale

    star = Star()
    assert batch_of_call(star, (torch.ones(2, 4, 8),), {"scale": 2.0}) is None
    session = remat.fit(star, "1GiB", optimizer=torch.optim.SGD(star.parameters(), lr=0.0), shapes=True)
    with pytest.warns(UserWarning, match=r"takes its positional arguments as \*args.*batch=\.\.\."):
        star(torch.ones(2, 4, 8), scale=2.0).backward()
    session.optimizer.step()
    assert session.shape_plans is None and not session.profiling
    session.remove()


def test_pgac_fits_its_mask_to_each_shape_within_the_budget(make_gpt2) -> None:
    model = make_gpt2(n_layer=4, n_embd=64, dropout=0.1, seed=0, n_positions=512)
    plain = make_gpt2(n_layer=4, n_embd=64, dropout=0.1, seed=0, n_positions=512)
    shapes = remat.profile_shapes(model, _batch(*REFERENCE), holds_output=False)
    budget = remat.plan(shapes.at(4, 128), "none").predicted_peak_bytes
    pgac = remat.PGAC(model, budget, costs=shapes.reference)
    per_shape = pgac.plan_per_shape(shapes, buckets=Buckets(seq_multiple=32))
    rng = random.Random(2)
    ran = refused = 0
    for step in range(16):
        rows, positions = rng.randint(1, 8), rng.randint(16, 320)
        batch = _batch(rows, positions, seed=step)
        activations, refusal = _step_or_refusal(model, batch, step)
        if refusal is not None:
            refused += 1
            assert refusal.shape == (rows, positions)
            continue
        ran += 1
        assert activations <= budget * 1.02, (rows, positions, activations, budget)
        assert pgac.handle.plan.options["shape"] == list(per_shape.seen[(rows, positions)])
        torch.manual_seed(step)
        plain(**batch).loss.backward()
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name
        pgac.step()  # scores from this step's gradients; the next forward fits the new mask to its shape
        model.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
    assert ran >= 8 and refused >= 1, (ran, refused)
    assert pgac.step_count == ran and len(per_shape.fitters) >= 4  # one mask fitter per bucket seen
    pgac.remove()


@pytest.mark.parametrize("with_batch", [True, False], ids=["batch", "first-step"])
def test_the_lightning_callback_plans_each_shape_within_memory(with_batch: bool) -> None:
    """With a sample batch the plans per shape are made at setup; without, from the first training step's
    batch (profiled, then cut to the smaller shapes). The largest shape comes again last, under its own plan."""
    from remat.integrations.lightning import LIGHTNING, RematCallback

    if LIGHTNING is None:
        pytest.skip("lightning is not installed (pip install lightning)")
    import lightning as L

    shapes = [(4, 32), (2, 24), (3, 32), (1, 8), (4, 16), (2, 32), (4, 32)]
    data = [torch.randn(b, s, 8, generator=torch.Generator().manual_seed(i)) for i, (b, s) in enumerate(shapes)]

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Sequential(torch.nn.Linear(8, 64), *[Block() for _ in range(4)],
                                             torch.nn.Linear(64, 1))  # fmt: skip

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(batch).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(data, batch_size=None, shuffle=False)

    def train(callbacks: list[Any]) -> torch.nn.Module:
        torch.manual_seed(0)
        module = Net()
        trainer = L.Trainer(max_steps=len(data), accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=callbacks)  # fmt: skip
        trainer.fit(module)
        return module

    reference = train([])
    with remat.measure() as plain:
        reference.model(data[0]).square().mean().backward()
    weights = sum(p.numel() * p.element_size() for p in reference.parameters())
    # parameters and gradients, and 70% of the activations of the largest batch: between the least plan and none
    callback = RematCallback(memory=int(2 * weights + 0.7 * plain.activation_bytes),
                             batch=data[0] if with_batch else None, shapes=True)  # fmt: skip
    trained = train([callback])
    for (name, p), q in zip(trained.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    plans = callback.session.shape_plans
    assert plans is not None and set(plans.seen) == set(shapes)
    assert plans.planned == len(set(plans.seen.values()))  # each bucket planned once
    assert plans.plans[plans.seen[(4, 32)]].action_counts() != "4 keep"  # the largest batch checkpoints
    assert plans.plans[plans.seen[(1, 8)]].action_counts() == "4 keep"  # the smallest keeps everything


def _vision(name: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if name == "vit":
        config = transformers.ViTConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                        intermediate_size=128, image_size=32, patch_size=4, num_channels=3,
                                        num_labels=5, hidden_dropout_prob=0.1)  # fmt: skip
        return transformers.ViTForImageClassification(config).train()
    config = transformers.ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[16, 32], depths=[3, 3],
                                         num_labels=5, image_size=32)  # fmt: skip
    return transformers.ConvNextForImageClassification(config).train()


def _images(rows: int, seed: int = 1, size: int = 32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    images, labels = torch.randn(rows, 3, size, size, generator=g), torch.randint(0, 5, (rows,), generator=g)
    return {"pixel_values": images, "labels": labels}


@pytest.mark.parametrize("name", ["vit", "convnext"])
def test_an_image_models_costs_vary_with_its_batch_size(name: str) -> None:
    """pixel_values carry no sequence: the costs are on c + b*l through the profiled batch and half of it, hold at
    batch sizes not profiled (0.25x to 2x), and a shape of another second dimension is refused with the reason."""
    model = _vision(name)
    shapes = remat.profile_shapes(model, _images(8), holds_output=False)
    second = shapes.reference_shape[1]
    assert shapes.form == "c + b*l" and shapes.shapes == [(8, second), (4, second)]
    assert shapes.fixed_second == second
    for rows in (2, 6, 16):
        costs = shapes.at(rows, second)
        keep_all, full = remat.plan(costs, "none"), remat.plan(costs, "full")
        between = (keep_all.predicted_peak_bytes + full.predicted_peak_bytes) // 2
        for plan in (keep_all, full, remat.plan(costs, "optimal", budget=between)):
            measured = _measured(model, _images(rows), plan)
            assert abs(plan.predicted_peak_bytes / measured - 1) <= 0.05, (rows, plan.strategy, measured)
    with pytest.raises(ValueError, match="vary with the batch size alone"):
        shapes.at(4, second + 1)


def test_an_image_model_keeps_one_budget_over_changing_batch_sizes_with_exact_gradients() -> None:
    model, plain = _vision("vit"), _vision("vit")
    shapes = remat.profile_shapes(model, _images(8), holds_output=False)
    second = shapes.reference_shape[1]
    budget = remat.plan(shapes.at(5, second), "none").predicted_peak_bytes  # keep-all at 5 images
    handle = remat.apply(model, remat.plan(shapes.reference, "none"))
    plans = remat.ShapePlans(shapes, budget, buckets=Buckets(seq_multiple=64, batch_multiple=2))
    handle.plan_per_shape(plans)
    kept = set()
    for step, rows in enumerate((8, 1, 5, 3, 8, 2, 7)):
        batch = _images(rows, seed=step)
        torch.manual_seed(step)
        with remat.measure() as measured:
            model(**batch).loss.backward()
        assert measured.activation_bytes <= budget * 1.02, (rows, measured.activation_bytes, budget)
        kept.add(handle.plan.action_counts())
        torch.manual_seed(step)
        plain(**batch).loss.backward()
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), (rows, name)
        model.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
    assert len(kept) > 1, kept  # small batches kept more than large ones
    assert all(s[1] == second for s in plans.seen.values())  # the second dimension is not bucketed
    assert plans.largest_fitting(8, None) == second
    handle.remove()


@pytest.mark.parametrize("name", ["vit", "convnext"])
def test_smaller_images_run_within_the_budget_and_a_larger_one_is_refused_before_its_forward(name: str) -> None:
    """Profiled at 32 x 32 images: 16 and 24 run under the plans of the profiled size (within the budget, gradients
    bitwise those of a plain step); 48 is refused before any block runs, with the reason: for ViT, more patches in
    the second dimension; for ConvNeXt, a larger feature map past it, which the (batch, channels) key hid."""

    def images(rows: int, size: int, seed: int) -> dict[str, Any]:
        # Hugging Face's ViT takes other image sizes with interpolate_pos_encoding
        return {**_images(rows, seed, size), **({"interpolate_pos_encoding": True} if name == "vit" else {})}

    model, plain = _vision(name), _vision(name)
    shapes = remat.profile_shapes(model, images(8, 32, 0), holds_output=False)
    second = shapes.reference_shape[1]
    budget = remat.plan(shapes.at(5, second), "none").predicted_peak_bytes
    handle = remat.apply(model, remat.plan(shapes.reference, "none"))
    plans = remat.ShapePlans(shapes, budget)
    handle.plan_per_shape(plans)
    for step, (rows, size) in enumerate([(5, 32), (5, 16), (4, 24), (5, 48), (2, 24)]):
        batch = images(rows, size, step)
        calls = handle.stats.total_calls
        if size > 32:
            with pytest.raises(ValueError, match="beyond the|vary with the batch size alone"):
                model(**batch)
            assert handle.stats.total_calls == calls and all(p.grad is None for p in model.parameters())
            continue
        torch.manual_seed(step)
        with remat.measure() as measured:
            model(**batch).loss.backward()
        assert measured.activation_bytes <= budget * 1.02, (rows, size, measured.activation_bytes, budget)
        torch.manual_seed(step)
        plain(**batch).loss.backward()
        for (parameter, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), (rows, size, parameter)
        model.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
    assert {key[1] for key in plans.seen.values()} == {second}  # smaller images planned at the profiled size
    handle.remove()


def test_pgac_fits_its_mask_per_batch_size_on_an_image_model() -> None:
    """PGAC's plans per shape on ViT, whose second dimension (65 patches) is the model's: each batch size is
    planned at that second dimension (rounding it up as a sequence length gave a shape its costs refuse), every
    step within the budget and gradients bitwise those of a plain step."""
    model, plain = _vision("vit"), _vision("vit")
    shapes = remat.profile_shapes(model, _images(8), holds_output=False)
    second = shapes.reference_shape[1]
    budget = remat.plan(shapes.at(5, second), "none").predicted_peak_bytes
    pgac = remat.PGAC(model, budget, costs=shapes.reference)
    pgac.plan_per_shape(shapes)
    for step, rows in enumerate((4, 2, 5, 3)):
        batch = _images(rows, seed=step)
        torch.manual_seed(step)
        with remat.measure() as measured:
            model(**batch).loss.backward()
        assert measured.activation_bytes <= budget * 1.02, (rows, measured.activation_bytes, budget)
        torch.manual_seed(step)
        plain(**batch).loss.backward()
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), (rows, name)
        pgac.step()
        model.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
    assert {key[1] for key in pgac.shape_plans.seen.values()} == {second}
    pgac.remove()


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_a_batch_beyond_the_measured_shapes_is_measured_before_its_forward(name: str, make_gpt2) -> None:
    from benchmarks.shapes import build

    model = make_gpt2(n_layer=3, n_embd=64, dropout=0.1, seed=0, n_positions=512) if name == "gpt2" else build(name)
    plain = build(name) if name == "bert" else make_gpt2(n_layer=3, n_embd=64, dropout=0.1, seed=0, n_positions=512)
    plain.load_state_dict(model.state_dict())
    shapes = remat.profile_shapes(model, _batch(4, 32), holds_output=False)
    handle = remat.apply(model, remat.plan(shapes.reference, "none"))
    budget = int(remat.plan(shapes.at(4, 128), "none").predicted_peak_bytes * 0.6)
    plans = remat.ShapePlans(shapes, budget)
    handle.plan_per_shape(plans)
    hook = remat.profiling.measure_beyond(model, plans, holds_output=False)
    big = _batch(4, 128, seed=3)
    for seed in (4, 5):  # the first forward measures the costs at 4 x 128 first; the second is measured here
        torch.manual_seed(seed)
        with remat.measure() as measured:
            loss = model(**big).loss
            loss.backward()
        torch.manual_seed(seed)
        plain(**big).loss.backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters(), strict=True))
    assert plans.remeasured == 1 and plans.costs.reference_shape == (4, 128)
    assert plans.costs.reference.info["measured_for"] == [4, 128]
    assert measured.activation_bytes <= budget * 1.02
    assert abs(handle.plan.predicted_peak_bytes - measured.activation_bytes) <= 0.05 * measured.activation_bytes
    model(**_batch(2, 96)).loss.backward()  # within the measured shapes now: planned, not measured
    assert plans.remeasured == 1
    hook.remove()
    handle.remove()


def _bert(seed: int = 0) -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                        vocab_size=VOCAB, max_position_embeddings=512)  # fmt: skip
    return BertForMaskedLM(config).train()


def test_a_peak_that_moves_to_another_moment_at_longer_sequences_is_predicted() -> None:
    """BERT's attention under dropout runs torch's math kernel: its backward peaks in the MLP at the profiled
    sequences and in the ``s x s`` scores at 256, a moment that is not the peak at any measured shape. Its summits
    are fitted one by one (invariant 2 of remat.core.shape_costs); fitted whole, the backward transient misses the
    scores."""
    model = _bert()
    shapes = remat.profile_shapes(model, _batch(*REFERENCE), holds_output=False)
    costs = shapes.at(4, 256)
    assert costs.info["peaks_fitted_whole"] == []
    full = remat.plan(costs, "full")
    measured = _measured(model, _batch(4, 256), full)
    assert abs(full.predicted_peak_bytes / measured - 1) <= 0.05, (full.predicted_peak_bytes, measured)

    without = ShapeCosts([_without_summits(t) for t in shapes.tables], shapes.shapes)
    whole = without.at(4, 256)
    assert whole.info["peaks_fitted_whole"] == whole.fqns
    assert remat.plan(whole, "full").predicted_peak_bytes < 0.95 * measured  # outside the tolerance above
    profiled = remat.profile(model, _batch(4, 256), holds_output=False)  # what a profile at that shape reads
    for predicted, fitted_whole, read in zip(costs.blocks, whole.blocks, profiled.blocks, strict=True):
        assert predicted.bwd_temp_bytes == pytest.approx(read.bwd_temp_bytes, rel=0.01)
        assert fitted_whole.bwd_temp_bytes < 0.5 * read.bwd_temp_bytes


def test_an_extrapolated_action_never_costs_less_than_keeping() -> None:
    """Invariant 3 of remat.core.shape_costs: a checkpoint measured to save 0.9 ms of its 1 ms recomputation at the
    reference (its overhead scaled with the tokens), whose recomputation grows with the square of the sequence, is
    read at 8 x 16 as costing nothing rather than -0.33 ms, and at the measured shapes as measured."""
    import dataclasses

    from toy_models import uniform_costs

    shapes = [(4, 64), (4, 32), (2, 64), (2, 32)]
    tables = []
    for rows, positions in shapes:
        recompute = 1e-3 * (rows / 4) * (positions / 64) ** 2
        overhead = -0.9e-3 if (rows, positions) == (4, 64) else 1e-4
        table = uniform_costs(["a", "b"])
        blocks = [dataclasses.replace(b, recompute_s={**b.recompute_s, "checkpoint": recompute},
                                      overhead_s={"checkpoint": overhead}) for b in table.blocks]  # fmt: skip
        tables.append(dataclasses.replace(table, blocks=blocks))
    costs = ShapeCosts(tables, shapes)
    assert costs.at(4, 64).blocks[0].time_cost("checkpoint") == pytest.approx(1e-4)
    far = costs.at(8, 16).blocks[0]
    assert far.recompute_s["checkpoint"] == pytest.approx(1.25e-4)  # on the form
    assert far.time_cost("checkpoint") == 0.0


def _without_summits(table: remat.CostTable) -> remat.CostTable:
    import dataclasses

    return dataclasses.replace(table, blocks=[dataclasses.replace(b, peak_summits={}) for b in table.blocks])
