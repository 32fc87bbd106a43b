"""``remat.fit(model, memory)``: the whole step's measured peak within the device memory given, gradients equal
to no checkpointing, a clear refusal where nothing fits, and the doors that share it."""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from toy_models import resident_bytes

import remat
from remat.fitting import MemoryFitError, device_memory, fixed_memory
from remat.integrations.session import RematSession


class Block(nn.Module):
    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def make_model(seed: int = 0, blocks: int = 6, width: int = 128) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, width), *[Block(width) for _ in range(blocks)], nn.Linear(width, 4))


BATCH = torch.randn(1024, 32, generator=torch.Generator().manual_seed(1))


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> tuple[int, list]:
    """One whole step measured by the live-tensor tracker (forward, backward, optimizer step, zero_grad): the
    peak of every tensor of the step, resident ones included, and the gradients it made."""
    resident = resident_bytes(model, optimizer)
    with remat.measure() as meter:
        model(batch).square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return resident + meter.peak_bytes, grads


def plain_peak() -> int:
    """The plain step's whole peak once the optimizer's state exists (from the second step on)."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    training_step(model, optimizer, BATCH)
    return training_step(model, optimizer, BATCH)[0]


@pytest.fixture(scope="module")
def plain() -> int:
    return plain_peak()


@pytest.mark.parametrize("share", [1.05, 0.85, 0.7])
def test_fit_keeps_the_whole_step_within_memory_with_exact_gradients(plain: int, share: float) -> None:
    memory = int(plain * share)
    model, reference = make_model(), make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    reference_optimizer = torch.optim.AdamW(reference.parameters())
    session = remat.fit(model, memory, batch=BATCH, optimizer=optimizer, loss_fn=lambda out: out.square().mean())
    kept = session.plan.action_counts()
    assert (kept == "6 keep") == (share > 1), kept
    for _ in range(2):  # the first step makes the optimizer's state; the second runs with it resident
        peak, grads = training_step(model, optimizer, BATCH)
        _, expected = training_step(reference, reference_optimizer, BATCH)
        assert peak <= memory * 1.02, (peak, memory, session.describe())
        assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
    assert session.fitted is not None and session.fitted.measured is not None
    assert abs(session.fitted.measured.whole - peak) <= 0.01 * peak  # what the fit measured is what the step takes
    session.remove()


def test_without_a_batch_the_first_step_is_profiled_and_the_second_fits(plain: int) -> None:
    memory = int(plain * 0.75)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    session = remat.fit(model, memory)  # the optimizer is the first one that steps the model
    assert session.profiling
    training_step(model, optimizer, BATCH)
    assert not session.profiling and session.optimizer is optimizer
    assert session.plan.action_counts() != "6 keep"
    peak, _ = training_step(model, optimizer, BATCH)
    assert peak <= memory * 1.02
    assert "optimizer state (AdamW)" in session.describe()
    session.remove()




def test_an_optimizer_not_given_to_a_fit_with_a_batch_counts_from_its_first_step(plain: int) -> None:
    """Fitted with a batch and no optimizer, at 0.8 of the plain step with its state: keeping every block fits
    without the state, not with it. The optimizer that first steps the model counts from then on (the plan made
    again in its step's pre-hook), so every later step is within the memory, where it ran 1.25x over."""
    memory = int(plain * 0.8)
    model, reference = make_model(), make_model()
    with pytest.warns(UserWarning, match="no optimizer given or seen yet"):
        session = remat.fit(model, memory, batch=BATCH, loss_fn=lambda out: out.square().mean())
    assert session.plan.action_counts() == "6 keep"
    optimizer, reference_optimizer = (torch.optim.AdamW(m.parameters()) for m in (model, reference))
    peaks = []
    for _ in range(3):
        peak, grads = training_step(model, optimizer, BATCH)
        _, expected = training_step(reference, reference_optimizer, BATCH)
        peaks.append(peak)
        assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
    assert session.optimizer is optimizer and "optimizer state (AdamW)" in session.describe()
    assert session.plan.action_counts() != "6 keep"
    assert max(peaks) <= memory * 1.02, (peaks, memory, session.describe())
    session.remove()

MICRO = [BATCH[i::4] for i in range(4)]


def accumulated(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, list]:
    """One optimizer step over four micro-batches measured whole: the larger of its forwards and backwards and its
    optimizer step, each over what is resident when it starts (the gradients' copies taken between them, which
    the step does not hold, left out)."""
    resident = resident_bytes(model, optimizer)
    with remat.measure() as passes:
        for part in MICRO:
            (model(part).square().mean() / 4).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    before_step = resident_bytes(model, optimizer)
    with remat.measure() as stepping:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return max(resident + passes.peak_bytes, before_step + stepping.peak_bytes), grads


@pytest.fixture(scope="module")
def accumulated_plain() -> int:
    """An accumulated plain step's whole peak, its optimizer state resident."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    accumulated(model, optimizer)
    return accumulated(model, optimizer)[0]


def test_with_gradient_accumulation_the_optimizer_seen_after_the_plan_counts_from_its_first_step(
    accumulated_plain: int,
) -> None:
    """Four backwards per optimizer step and no batch: the profiled first step ends at the second forward,
    before any optimizer is seen, so the plan counts no optimizer state, and says so. When the optimizer first
    steps the model its state counts and the plan is made again for the next steps, within the memory (every
    gradient counted covers adding into them here); training stays bitwise."""
    memory = int(accumulated_plain * 0.9)  # every block kept fits it without the optimizer's state, not with it
    model, reference = make_model(), make_model()
    optimizer, reference_optimizer = (torch.optim.AdamW(m.parameters()) for m in (model, reference))
    session = remat.fit(model, memory)
    with pytest.warns(UserWarning) as warned:
        _, grads = accumulated(model, optimizer)
    said = " ".join(str(w.message) for w in warned)
    assert "no optimizer given or seen yet" in said and "accumulates=True" in said
    fixed = fixed_memory(model, optimizer)
    assert session.optimizer is optimizer and "optimizer state (AdamW)" in session.describe()
    assert session.fitted.activation_budget == memory - fixed.total - fixed.optimizer_step_bytes
    assert session.plan.action_counts() != "6 keep"
    assert all(torch.equal(a, b) for a, b in zip(grads, accumulated(reference, reference_optimizer)[1], strict=True))
    for _ in range(2):
        peak, grads = accumulated(model, optimizer)
        assert peak <= memory * 1.02, (peak, memory, session.describe())
        assert all(torch.equal(a, b) for a, b in zip(grads, accumulated(reference, reference_optimizer)[1],
                                                     strict=True))  # fmt: skip
    session.remove()


def test_a_fit_told_the_loop_accumulates_measures_micro_steps_with_the_gradients_there(
    accumulated_plain: int,
) -> None:
    """With a micro-batch and ``accumulates=True`` the fit measures a micro-step that starts with the gradients
    there and adds into them: every accumulated step's whole peak is within the memory, and what the fit
    measured is what such a step takes. Measured as a step that starts with the gradients cleared, the same fit
    under-counts it."""
    memory = int(accumulated_plain * 0.9)
    peaks = {}
    for accumulates in (True, False):
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters())
        session = remat.fit(model, memory, batch=MICRO[0], optimizer=optimizer, loss_fn=lambda out: out.square().mean(),
                            step=remat.StepSpec(accumulates=accumulates))  # fmt: skip
        peaks[accumulates] = [accumulated(model, optimizer)[0] for _ in range(2)]
        if accumulates:
            assert max(peaks[True]) <= memory * 1.02, (peaks, memory, session.describe())
            assert abs(session.fitted.measured.whole - peaks[True][-1]) <= 0.02 * memory
        session.remove()
    assert max(peaks[False]) > memory * 1.02  # the transient a fit blind to accumulation leaves out


def test_an_infeasible_memory_is_refused_before_any_step_naming_the_least_and_what_is_fixed() -> None:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    fixed = fixed_memory(model, optimizer)
    memory = fixed.total + fixed.optimizer_step_bytes + 2**20
    with pytest.raises(MemoryFitError) as caught:
        remat.fit(model, memory, batch=BATCH, optimizer=optimizer)
    text = str(caught.value)
    assert "no plan fits" in text and "the least any plan reaches is" in text
    assert re.search(r"parameters [\d.]+ KiB|parameters [\d.]+ MiB", text) and "optimizer state (AdamW)" in text
    assert re.search(r"a batch of \d+", text) and "allow_lossy=True" in text
    assert caught.value.floor > memory
    assert not model[1]._forward_pre_hooks and all(p.grad is None for p in model.parameters())
    assert not optimizer.state  # no step was taken

    with pytest.raises(MemoryFitError, match="fixed memory of the step alone .* no checkpointing plan changes it"):
        remat.fit(model, fixed.parameters, batch=BATCH, optimizer=optimizer)


def test_the_optimizer_state_is_measured_before_its_first_step() -> None:
    for make in (
        lambda ps: torch.optim.AdamW(ps),
        lambda ps: torch.optim.Adam(ps, foreach=False),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.SGD(ps, lr=0.1),
    ):
        model = make_model(blocks=2)
        optimizer = make(model.parameters())
        before = fixed_memory(model, optimizer)
        training_step(model, optimizer, BATCH)
        made = resident_bytes(model, optimizer) - before.parameters
        assert before.optimizer_state == made == fixed_memory(model, optimizer).optimizer_state


def test_memory_is_bytes_a_size_or_a_share_of_free_memory() -> None:
    cpu = torch.device("cpu")
    assert device_memory("2GiB", cpu) == 2 * 2**30 and device_memory(1234, cpu) == 1234
    assert 0 < device_memory("50%", cpu) < device_memory("100%", cpu)
    with pytest.raises(TypeError, match="activations="):
        device_memory(0.5, cpu)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\(0, 100\]"):
        device_memory("0%", cpu)
    with pytest.raises(ValueError, match="memory.*or activations="):
        remat.fit(make_model())
    with pytest.raises(ValueError, match="not both"):
        remat.fit(make_model(), "1GiB", activations=0.5)


def test_set_memory_plans_again_for_less(plain: int) -> None:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    session = remat.fit(model, int(plain * 0.9), batch=BATCH, optimizer=optimizer)
    before = session.plan.action_counts()
    memory = int(plain * 0.65)
    session.set_memory(memory)
    assert session.plan.action_counts() != before
    peak, _ = training_step(model, optimizer, BATCH)
    assert peak <= memory * 1.02
    with pytest.raises(remat.BudgetError, match="least any plan reaches"):
        session.set_memory(int(plain * 0.5))
    session.remove()


def test_a_model_in_eval_mode_is_profiled_with_a_warning_not_left_profiling() -> None:
    model = make_model().eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    session = remat.fit(model, activations=0.5)
    with pytest.warns(UserWarning, match=r"eval mode.*model\.train\(\)"):
        model(BATCH).sum().backward()
    optimizer.step()
    assert not session.profiling and session.plan.action_counts() != "6 keep"
    session.remove()


class DropoutBlock(Block):
    def __init__(self, width: int = 128) -> None:
        super().__init__(width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.relu(self.up(x))))


def test_a_model_in_eval_mode_is_fitted_as_it_trains_in_train_mode_and_put_back() -> None:
    """``from_pretrained`` returns models in eval mode, and training runs them in train mode, where dropout saves
    its masks and outputs. A fit with a batch measures the training step in train mode (with a warning), puts
    every module's mode back, and the steps that follow in train mode are within memory, with the gradients of
    the plain model."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 128), *[DropoutBlock() for _ in range(6)], nn.Linear(128, 4))

    reference = make()
    reference_optimizer = torch.optim.AdamW(reference.parameters())
    torch.manual_seed(1)
    training_step(reference, reference_optimizer, BATCH)
    memory = int(training_step(reference, reference_optimizer, BATCH)[0] * 0.7)
    model = make().eval()
    model[2].train()  # a module's own mode, put back as it was
    modes = [m.training for m in model.modules()]
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.warns(UserWarning, match=r"eval mode.*measured in train mode"):
        session = remat.fit(model, memory, batch=BATCH, optimizer=optimizer)
    assert [m.training for m in model.modules()] == modes
    reference = make()
    reference_optimizer = torch.optim.AdamW(reference.parameters())
    model.train()
    for step in range(2):
        torch.manual_seed(10 + step)
        peak, grads = training_step(model, optimizer, BATCH)
        torch.manual_seed(10 + step)
        _, expected = training_step(reference, reference_optimizer, BATCH)
        assert peak <= memory * 1.02, (step, peak / memory)
        assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    session.remove()


def test_a_fit_of_a_model_left_on_the_cpu_beside_a_gpu_says_to_move_it_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """remat.fit(model, "22GiB") before model.to("cuda") would measure the host: said where a GPU is present (the
    CPU machine made to report one), and nothing said where none is."""
    model = make_model(blocks=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remat.fit(model, "1GiB", batch=BATCH[:64], optimizer=optimizer).remove()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.warns(UserWarning, match=r"on the CPU while a CUDA device is present.*model\.to\('cuda'\)"):
        remat.fit(model, "1GiB", batch=BATCH[:64], optimizer=optimizer).remove()


def test_hugging_face_models_go_through_the_hf_door_flag_off_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("transformers")
    from remat.integrations.hf import HFSession
    from tests.toy_models import tiny_gpt2

    model = tiny_gpt2(n_layer=4, seed=0)
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    with caplog.at_level(logging.WARNING, logger="remat"):
        session = remat.fit(model, "4GiB", batch=batch, optimizer=torch.optim.AdamW(model.parameters()))
    assert isinstance(session, HFSession)
    assert [r.message for r in caplog.records].count(
        "remat: Hugging Face gradient checkpointing was on; remat switched it off (its plan decides what is "
        "recomputed). remove() switches it back on."
    ) == 1
    assert session.plan.action_counts() == "4 keep"  # 4 GiB holds the plain step: nothing profiled
    assert session.costs is None
    session.remove()
    assert model.transformer.h[0].gradient_checkpointing


def test_the_handle_describes_the_plan_and_remove_gives_back_the_plain_model() -> None:
    model, reference = make_model(), make_model()
    session = remat.fit(model, activations=0.5, batch=BATCH)
    assert isinstance(session, RematSession) and session.costs is not None
    described = session.describe()
    assert all(re.search(rf"^{i}\s+(keep|checkpoint|selective)", described, re.MULTILINE) for i in range(1, 7))
    session.remove()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert torch.equal(model(BATCH), reference(BATCH))


def test_advise_measures_whether_it_fits_the_plan_and_the_largest_batch(plain: int) -> None:
    heard: list[str] = []
    model = make_model()
    step = remat.StepSpec(loss_fn=lambda out: out.square().mean())
    roomy = remat.advise(model, BATCH, int(plain * 1.2), optimizer=torch.optim.AdamW(model.parameters()),
                         step=step, progress=heard.append, rounds=1)  # fmt: skip
    assert roomy.fits_plain and roomy.fit is None and roomy.largest_plain_batch >= 1024
    assert roomy.whole_peaks[512] < roomy.whole_peaks[1024] == pytest.approx(plain, rel=0.01)
    assert any("plain steps at batches [512, 1024]" in h for h in heard)

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    tight = remat.advise(model, BATCH, int(plain * 0.75), optimizer=optimizer, progress=None, rounds=1)
    assert not tight.fits_plain and tight.fit is not None and tight.fit.measured is not None
    assert tight.fit.measured.whole <= int(plain * 0.75) and len(tight.planned_ratios) == 1
    assert tight.largest_plain_batch < 1024 < tight.largest_planned_batch
    assert "checkpointing is needed" in tight.text() and not optimizer.state
    assert not any(m._forward_pre_hooks for m in model.modules())

    fixed = fixed_memory(model, optimizer)
    refused = remat.advise(model, BATCH, fixed.parameters, optimizer=optimizer, progress=None, rounds=1)
    assert "fixed memory of the step alone" in refused.refusal and refused.largest_planned_batch == 0


def test_the_time_line_is_fitted_as_measured_never_clamped() -> None:
    from remat.fitting.advice import Line

    line = Line.through({2: 1.0, 4: 0.5})
    assert line.fixed == pytest.approx(1.5) and line.per_sample == pytest.approx(-0.25)
    assert Line.through({1: 1.0, 2: 2.0, 3: 3.0}).fixed == pytest.approx(0.0)


def test_a_restarted_run_reads_its_profile_from_the_machines_cache(
    plain: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from remat.profiling import cached_profile, profile_key

    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    memory = int(plain * 0.6)  # no optimizer: its state is not counted, so the plain step needs less than plain
    with pytest.warns(UserWarning, match="optimizer.*state is not counted"):
        first = remat.fit(make_model(), memory, batch=BATCH)
    assert first.costs is not None and "cached_from" not in first.costs.info
    assert len(list(tmp_path.glob("*.json"))) == 1
    first.remove()
    with pytest.warns(UserWarning, match="not counted"):
        again = remat.fit(make_model(seed=5), memory, batch=BATCH)  # other values, same shapes: the same profile
    assert again.costs is not None and again.costs.info["cached_from"].startswith(str(tmp_path))
    assert again.costs.to_dict()["blocks"] == first.costs.to_dict()["blocks"]
    assert again.plan.actions == first.plan.actions
    again.remove()

    step = remat.StepSpec()
    assert profile_key(make_model(), BATCH, step, "menu") != profile_key(make_model(), BATCH[:512], step, "menu")
    assert profile_key(make_model(), BATCH, step, "menu") != profile_key(make_model(width=64), BATCH, step, "menu")
    for path in tmp_path.glob("*.json"):
        path.write_text("{not json")
    costs = cached_profile(make_model(), BATCH, step=step, policies="menu")
    assert "cached_from" not in costs.info


def test_whisper_plans_its_encoder_and_decoder_under_one_budget_with_exact_gradients() -> None:
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    config = transformers.WhisperConfig(
        d_model=64, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=32, max_target_positions=32,
        vocab_size=256, use_cache=False, dropout=0.1, pad_token_id=0, decoder_start_token_id=1, eos_token_id=2,
        bos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config)
    torch.manual_seed(0)
    reference = transformers.WhisperForConditionalGeneration(config)
    generator = torch.Generator().manual_seed(0)
    batch = {"input_features": torch.randn(2, 16, 64, generator=generator),
             "labels": torch.randint(3, 256, (2, 16), generator=generator)}  # fmt: skip
    session = remat.fit(model, activations=0.5, batch=batch)  # no blocks=: both chains
    planned = set(session.plan.actions)
    assert planned == {f"model.{side}.layers.{i}" for side in ("encoder", "decoder") for i in range(3)}
    assert session.costs is not None and len(session.costs.chain_lengths) == 2
    for m in (model, reference):
        torch.manual_seed(1)  # dropout on: the recomputed blocks replay the same masks
        m(**batch).loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), name
    session.remove()


def test_advice_reads_its_lines_only_so_far_past_the_batches_measured() -> None:
    from remat.fitting import FixedMemory, ModelAdvice

    advice = ModelAdvice(memory=2**30, batch_size=8, fixed=FixedMemory(1, 1, 1, 1), whole_peaks={4: 10, 8: 20},
                         step_seconds={4: 0.1, 8: 0.2}, fit=None, largest_plain_batch=10**9,
                         largest_planned_batch=100)  # fmt: skip
    assert "largest batch that fits: more than 128 without checkpointing, 100 with a plan" in advice.text()
