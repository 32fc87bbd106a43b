"""Hugging Face integration: remat plans on GPT-2 and BERT built from tiny configs, with dropout on.

Every exact strategy must give the gradients of training without checkpointing, step after step, including
the first step (profiled, every layer checkpointed) and the later ones (the plan made from that profile).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from toy_models import resident_bytes, tiny_gpt2

import remat

transformers = pytest.importorskip("transformers")
from remat.integrations import hf  # noqa: E402

VOCAB, SEQ, BATCH = 64, 8, 2


def gpt2(n_layer: int = 3) -> torch.nn.Module:
    """GPT-2 as the library configures it by default (KV cache on, default attention), dropout on: RNG replay is
    part of every gradient check."""
    model = tiny_gpt2(n_layer, n_embd=32, vocab=VOCAB, n_positions=SEQ * 2, use_cache=True, attn_implementation=None)
    assert model.config.resid_pdrop > 0 and model.config.attn_pdrop > 0
    return model


def bert(n_layer: int = 3) -> torch.nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=n_layer,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ * 2,
    )
    assert config.hidden_dropout_prob > 0
    return transformers.BertForMaskedLM(config)


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def train(
    make: Callable[[], torch.nn.Module], steps: int, setup: Callable[[torch.nn.Module], Any] | None = None
) -> tuple[list[float], list[dict[str, torch.Tensor]], Any]:
    """Train ``steps`` SGD steps from seed 0; return the losses, each step's gradients and what setup returned."""
    torch.manual_seed(0)
    model = make()
    model.train()
    extra = setup(model) if setup is not None else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(steps):
        torch.manual_seed(step)  # the dropout masks of this step
        loss = model(**batch(step)).loss
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, extra


def assert_same_training(ref: tuple, got: tuple) -> None:
    assert got[0] == pytest.approx(ref[0], rel=1e-6, abs=1e-6)
    for step, (g_ref, g_got) in enumerate(zip(ref[1], got[1], strict=True)):
        assert g_ref.keys() == g_got.keys()
        for name in g_ref:
            torch.testing.assert_close(g_got[name], g_ref[name], rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")


def test_gpt2_plan_from_profiled_first_step_gives_exact_gradients() -> None:
    ref = train(gpt2, 3)
    got = train(gpt2, 3, lambda m: hf.enable(m, "optimal", 0.6))
    assert_same_training(ref, got)
    session = got[2]
    assert not session.profiling
    assert session.costs is not None and session.costs.fqns == [f"transformer.h.{i}" for i in range(3)]
    assert session.plan.strategy == "optimal" and session.plan.fits
    # step 1 recomputed every layer once; steps 2 and 3 re-ran what the plan recomputes
    reexec = remat.simulate(session.costs, session.plan.actions).reexecutions
    assert [session.stats.calls[f] for f in session.plan.actions] == [1 + 2 * r for r in reexec]
    session.remove()
    assert not hasattr(session.model, "_remat_handle")


def test_bert_every_k_segments_give_exact_gradients() -> None:
    ref = train(bert, 2)
    got = train(bert, 2, lambda m: hf.enable(m, "every_k", k=2))
    assert_same_training(ref, got)
    session = got[2]
    assert [f for f, _ in session.handle.blocks] == [f"bert.encoder.layer.{i}" for i in range(3)]
    assert list(session.plan.actions.values()) == ["segment:0", "segment:0", "checkpoint"]
    assert session.stats.total_calls == 2 * 3  # every layer re-run once per step


def test_sample_batch_plans_before_the_first_step() -> None:
    torch.manual_seed(0)
    model = gpt2(2).train()
    session = hf.enable(model, "full", batch=batch(0))
    assert not session.profiling and session.costs is not None
    assert set(session.plan.actions.values()) == {"checkpoint"}
    session.remove()


def test_use_cache_is_off_in_training_and_restored_by_remove(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = gpt2(2).train()
    assert model.config.use_cache is True
    session = hf.enable(model, "full", auto_step=False)
    assert model.config.use_cache is False
    ids = batch(0)["input_ids"]
    with caplog.at_level(logging.WARNING, logger="remat.integrations.hf"):
        out = model(input_ids=ids, use_cache=True)
    assert out.past_key_values is None  # no cache object that recomputation would append to a second time
    assert "use_cache=False" in caplog.text
    out.logits.sum().backward()
    assert session.stats.total_calls == 2
    model.eval()
    with torch.no_grad():
        assert model(input_ids=ids, use_cache=True).past_key_values is not None  # inference keeps its cache
    session.remove()
    assert model.config.use_cache is True


def test_hugging_face_checkpointing_is_switched_off_and_restored() -> None:
    torch.manual_seed(0)
    model = gpt2(2).train()
    model._set_gradient_checkpointing(enable=True)
    assert model.transformer.h[0].gradient_checkpointing
    session = hf.enable(model, "full", auto_step=False)
    assert not any(layer.gradient_checkpointing for layer in model.transformer.h)
    # a Trainer with gradient_checkpointing=True switches it on after enable(): the next training forward undoes it
    model._set_gradient_checkpointing(enable=True)
    model(**batch(0)).loss.backward()
    assert not any(layer.gradient_checkpointing for layer in model.transformer.h)
    assert session.stats.total_calls == 2  # recomputed once, by remat only
    session.remove()
    assert all(layer.gradient_checkpointing for layer in model.transformer.h)


def test_remat_checkpoint_fn_as_hugging_face_gradient_checkpointing_func() -> None:
    ref = train(gpt2, 2)
    got = train(gpt2, 2, lambda m: hf.use_remat_checkpoint(m, policy="dots_saveable"))
    assert_same_training(ref, got)
    plain = train(gpt2, 1, lambda m: hf.use_remat_checkpoint(m))
    assert_same_training((ref[0][:1], ref[1][:1]), plain)
    torch.manual_seed(0)
    model = gpt2(2)
    hf.use_remat_checkpoint(model, policy="dots_saveable")
    func = model.transformer.h[0]._gradient_checkpointing_func
    assert isinstance(func, functools.partial) and func.func is remat.checkpoint_fn


def test_pgac_strategy_attaches_to_the_optimizer_that_steps() -> None:
    ref = train(gpt2, 3)
    got = train(gpt2, 3, lambda m: hf.enable(m, "pgac", 0.7, alpha=0.5))
    assert_same_training(ref, got)
    session = got[2]
    pgac = session.pgac
    assert isinstance(pgac, remat.PGAC)
    assert pgac.step_count == 3 and pgac.costs is not None
    assert set(pgac.scores) == {f"transformer.h.{i}" for i in range(3)} and any(s > 0 for s in pgac.scores.values())
    assert pgac.plan.fits
    session.remove()


def test_import_remat_imports_no_integration_library() -> None:
    import subprocess
    import sys

    script = (
        "import sys, remat, remat.integrations\n"
        "from remat.integrations import session, distributed, compile, deepspeed, hf\n"
        "loaded = [m for m in ('transformers', 'lightning', 'pytorch_lightning', 'deepspeed') if m in sys.modules]\n"
        "print(','.join(loaded))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""  # transformers is imported by hf.layers()/enable(), not by importing hf


def test_errors_say_what_to_do() -> None:
    model = gpt2(2)
    with pytest.raises(ValueError, match="needs a budget"):
        hf.enable(model, "optimal")
    with pytest.raises(ValueError, match="known strategies"):
        hf.enable(model, "fastest")
    with pytest.raises(ValueError, match="fraction"):
        hf.enable(model, "optimal", 1.5)
    with pytest.raises(ValueError, match="GradientCheckpointingLayer"):
        hf.enable(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)), "full")
    assert model.config.use_cache is True and not hasattr(model, "_remat_handle")  # failed calls change nothing
    session = hf.enable(model, "full")
    with pytest.raises(RuntimeError, match="already applied"):
        hf.enable(model, "full")
    session.remove()


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="the HF Trainer needs accelerate")
def test_trainer_profiles_first_step_then_runs_the_plan(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = gpt2(2)
    session = hf.enable(model, "optimal", 0.7)
    data = [batch(i) for i in range(6)]
    data = [{k: v[0] for k, v in item.items()} for item in data]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    result = transformers.Trainer(model=model, args=args, train_dataset=data).train()
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    assert not session.profiling and session.plan.strategy == "optimal" and session.plan.fits
    assert session.stats.total_calls >= 2  # the profiled step recomputed both layers
    session.remove()


class TrainerStepMeter(transformers.TrainerCallback):
    """Each optimizer step's whole peak in a ``Trainer`` (its micro-batches included): what is resident when it
    starts plus the live-tensor tracker's peak over it."""

    def __init__(self) -> None:
        self.peaks: list[int] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                      **kwargs: Any) -> None:  # fmt: skip
        from remat.meters import LiveTensorTracker

        self.resident = resident_bytes(model, optimizer)
        self.tracker = LiveTensorTracker("cpu").__enter__()

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.tracker.exit_anywhere()
        self.tracker.close()
        self.peaks.append(self.resident + self.tracker.peak(exclude_survivors=False))


def trainer_run(tmp_path: Any, fit: Callable[[torch.nn.Module, Any], Any] | None, seq_copies: int = 8,
                data: list[dict[str, torch.Tensor]] | None = None, data_collator: Any = None,
                **arguments: Any) -> tuple[torch.nn.Module, list[int], Any]:  # fmt: skip
    """A 4-layer GPT-2 trained by a ``Trainer`` (4 steps unless ``max_steps=`` says otherwise; batches of 2 of
    ``data``, by default sequences of ``seq_copies * SEQ``), after ``fit(model, training_arguments)`` where given:
    the model, each step's whole peak and what ``fit`` returned."""
    torch.manual_seed(0)
    model = tiny_gpt2(4, n_embd=64, vocab=VOCAB, n_positions=128, use_cache=False)
    if data is None:
        data = [{k: v[0] for k, v in batch(i).items()} for i in range(16)]
        data = [{k: torch.cat([v] * seq_copies) for k, v in item.items()} for item in data]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, use_cpu=True, report_to=[], save_strategy="no",
        disable_tqdm=True, **{"max_steps": 4, **arguments},
    )  # fmt: skip
    session = fit(model, args) if fit is not None else None
    meter = TrainerStepMeter()
    transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=data_collator,
                         callbacks=[meter]).train()  # fmt: skip
    return model, meter.peaks, session


def same_weights(trained: torch.nn.Module, reference: torch.nn.Module) -> None:
    for (name, p), q in zip(trained.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="the HF Trainer needs accelerate")
def test_remat_fit_keeps_the_trainers_whole_step_within_memory(tmp_path: Any) -> None:
    """``remat.fit(model, memory)`` before ``Trainer.train()``: the first step is profiled, and from the second
    on every step's whole peak (parameters, gradients, AdamW's state, activations) is within ``memory``; the
    weights are those of training without checkpointing."""
    reference, plain_peaks, _ = trainer_run(tmp_path, None)
    memory = int(max(plain_peaks[1:]) * 0.85)
    trained, peaks, session = trainer_run(tmp_path, lambda model, args: remat.fit(model, memory))
    assert not session.profiling and session.plan.action_counts() != "4 keep", session.describe()
    assert "AdamW" in session.fitted.fixed.optimizer
    assert max(peaks[1:]) <= memory * 1.02, (peaks, memory)
    same_weights(trained, reference)
    session.remove()


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="the HF Trainer needs accelerate")
def test_the_trainers_gradient_accumulation_is_measured_through_its_step(tmp_path: Any) -> None:
    """``gradient_accumulation_steps=2`` and a sample micro-batch: with ``step=hf.trainer_step(args)`` the fit
    measures a micro-step that adds into the gradients there, and every step, the first included, is within
    ``memory``; fitted as a step of one backward the first step ran over it (1.09x), and remat says so at the
    second micro-batch. Training is bitwise plain training's either way."""
    sample = {k: torch.cat([v] * 8, dim=1) for k, v in batch(100).items()}
    reference, plain_peaks, _ = trainer_run(tmp_path, None, gradient_accumulation_steps=2)
    memory = int(max(plain_peaks[1:]) * 0.75)
    with pytest.warns(UserWarning) as warned:
        trained, peaks, session = trainer_run(
            tmp_path, lambda model, args: remat.fit(model, memory, batch=sample, step=hf.trainer_step(args)),
            gradient_accumulation_steps=2,
        )  # fmt: skip
    assert not any("gradient accumulation" in str(w.message) for w in warned)
    assert session.accumulates and session.plan.action_counts() != "4 keep", session.describe()
    assert max(peaks) <= memory * 1.02, (peaks, memory, session.describe())
    same_weights(trained, reference)
    session.remove()

    with pytest.warns(UserWarning, match=r"gradient accumulation.*hf.trainer_step\(args\)"):
        trained, peaks, session = trainer_run(
            tmp_path, lambda model, args: remat.fit(model, memory, batch=sample), gradient_accumulation_steps=2
        )
    assert not session.accumulates and peaks[0] > memory * 1.02, (peaks, memory)
    same_weights(trained, reference)
    session.remove()


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate")
def test_remat_fit_before_accelerate_keeps_the_whole_step_within_memory() -> None:
    """``remat.fit(model, memory, batch=..., optimizer=...)`` then ``accelerator.prepare``: every step's whole
    peak is within ``memory`` from the first step on, and the weights are those of training without
    checkpointing."""
    from accelerate import Accelerator

    samples = [{k: torch.cat([v] * 4, dim=1) for k, v in batch(i).items()} for i in range(3)]

    def train(memory: int | None) -> tuple[torch.nn.Module, list[int], Any]:
        torch.manual_seed(0)
        model = tiny_gpt2(4, n_embd=64, vocab=VOCAB, n_positions=128, use_cache=False)
        optimizer = torch.optim.AdamW(model.parameters())
        session = remat.fit(model, memory, batch=samples[0], optimizer=optimizer) if memory else None
        prepared, optimizer = Accelerator(cpu=True).prepare(model, optimizer)
        peaks = []
        for step, sample in enumerate(samples):
            start = resident_bytes(model, optimizer)
            torch.manual_seed(step)
            with remat.measure() as meter:
                prepared(**sample).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            peaks.append(start + meter.peak_bytes)
        return model, peaks, session

    reference, plain_peaks, _ = train(None)
    memory = int(max(plain_peaks[1:]) * 0.85)
    trained, peaks, session = train(memory)
    assert session.plan.action_counts() != "4 keep" and session.fitted.measured.whole <= memory
    assert max(peaks) <= memory * 1.02, (peaks, memory)
    for (name, p), q in zip(trained.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name
    session.remove()


def test_a_model_in_eval_mode_is_profiled_with_a_warning_naming_train() -> None:
    """What ``from_pretrained`` returns is in eval mode: the first step that records gradients is profiled as
    the training step (with a warning naming ``model.train()``), and the plan follows; no silent stall."""
    torch.manual_seed(0)
    model = gpt2(2).eval()
    session = hf.enable(model, "optimal", 0.9)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"eval mode.*model\.train\(\)"):
        model(**batch(0)).loss.backward()
    optimizer.step()
    assert not session.profiling and session.costs is not None and session.plan.strategy == "optimal"
    session.remove()


def convnext() -> torch.nn.Module:
    """ConvNeXt with stochastic depth: its stages are plain modules, no ``GradientCheckpointingLayer``."""
    config = transformers.ConvNextConfig(depths=[2, 2, 2, 2], hidden_sizes=[16, 32, 64, 128], num_labels=10,
                                         drop_path_rate=0.1)  # fmt: skip
    return transformers.ConvNextForImageClassification(config).train()


def resnet() -> torch.nn.Module:
    """ResNet: BatchNorm buffers in every stage, which a recomputed stage must not update twice."""
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                                       layer_type="basic", num_labels=10)  # fmt: skip
    return transformers.ResNetForImageClassification(config).train()


def image_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return {"pixel_values": torch.randn(8, 3, 64, 64, generator=g), "labels": torch.randint(0, 10, (8,), generator=g)}


def trained_images(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> list[dict]:
    """Each step's gradients and buffers after it, from the step's seed (stochastic depth draws from it)."""
    records = []
    for step in range(steps):
        torch.manual_seed(step)
        model(**image_batch(step)).loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        records.append({**grads, **{n: b.clone() for n, b in model.named_buffers()}})
    return records


@pytest.mark.parametrize("make", [convnext, resnet])
def test_a_model_without_checkpointing_layers_is_planned_on_the_chains_remat_finds(make: Callable) -> None:
    """ConvNeXt's and ResNet's stages are not ``GradientCheckpointingLayer``s: the Hugging Face door (and so
    ``remat.fit``) plans the stages ``remat.find_chains`` finds, and training is bitwise a plain model's."""
    torch.manual_seed(0)
    model, reference = make(), make()
    reference.load_state_dict(model.state_dict())
    optimizer, plain_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    stages = [fqn for fqn, _ in remat.find_chains(model)[0]]
    if make is convnext:  # the whole step within memory: 0.8 of the plain step's, which keeping every stage exceeds
        plain = remat.fit(make(), "1GiB", batch=image_batch(0)).fitted.plain.whole
        session = remat.fit(model, int(0.8 * plain), batch=image_batch(0), optimizer=optimizer)
        assert session.fitted.measured.whole <= int(0.8 * plain)
    else:
        session = hf.enable(model, "full")
    assert list(session.plan.actions) == stages and "checkpoint" in session.plan.actions.values()
    got, expected = trained_images(model, optimizer), trained_images(reference, plain_optimizer)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), f"step {step} {name}"
    assert session.stats.total_calls > 0  # stages were recomputed
    session.remove()


def wav2vec2() -> torch.nn.Module:
    """wav2vec 2.0 with LayerDrop at 0.5: a training forward skips each encoder layer with that probability."""
    config = transformers.Wav2Vec2Config(vocab_size=32, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                         intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                                         conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                         num_conv_pos_embedding_groups=4, mask_time_prob=0.0,
                                         layerdrop=0.5)  # fmt: skip
    return transformers.Wav2Vec2ForCTC(config).train()


def test_a_model_that_drops_layers_is_profiled_whole_and_planned_without_groups() -> None:
    """LayerDrop skips layers at random in training: the profile runs every layer (LayerDrop off for its step,
    put back after), plans keep to single blocks (a group cannot span a skipped layer), a grouping plan is
    refused with the reason, and training under the plan is bitwise a plain copy's, steps that skip layers
    included, each within the predicted peak."""
    torch.manual_seed(0)
    model, reference = wav2vec2(), wav2vec2()
    reference.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(0)
    batches = [{"input_values": torch.randn(2, 1600, generator=g), "labels": torch.randint(1, 32, (2, 8), generator=g)}
               for _ in range(4)]  # fmt: skip
    layers = [m for _, m in remat.find_chains(model)[-1]]
    session = remat.fit(model, activations=0.6, batch=batches[0])
    assert model.config.layerdrop == 0.5 and session.costs.info["layer_drop"] is True
    assert all(not a.startswith(("segment", "memory_poor")) for a in session.plan.actions.values())
    assert "checkpoint" in session.plan.actions.values()
    with pytest.raises(ValueError, match="skips layers in training"):
        remat.plan(session.costs, "sqrt")
    calls = []  # the encoder layers' forward calls (not their recomputations in backward)
    forward = lambda module, args: calls.append(module) if torch._C._current_graph_task_id() == -1 else None  # noqa: E731
    counting = [layer.register_forward_pre_hook(forward) for layer in layers]
    for step, sample in enumerate(batches):
        torch.manual_seed(step)  # LayerDrop and dropout draw from it
        with remat.measure() as measured:
            out = model(**sample)
            out.loss.backward()
            del out
        torch.manual_seed(step)
        reference(**sample).loss.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name
        assert measured.activation_bytes <= session.plan.predicted_peak_bytes
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    for hook in counting:
        hook.remove()
    assert len(calls) < len(batches) * len(layers)  # layers were skipped
    session.remove()
    plan = remat.Plan({fqn: "segment:0" for fqn, _ in remat.find_chains(model)[-1]})
    with pytest.raises(ValueError, match="LayerDrop"):
        remat.apply(model, plan, blocks=remat.find_chains(model)[-1])


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="the HF Trainer needs accelerate")
def test_pgac_goes_on_from_a_trainer_checkpoint_with_its_state(tmp_path: Any) -> None:
    """``hf.pgac_checkpoints(session)`` saves PGAC's state beside the Trainer's checkpoint-2, and a run resumed from
    it goes on at step 2 with the scores, schedule and costs it had (nothing profiled again); a resume that finds
    no state says PGAC starts afresh."""

    def run(max_steps: int, resume: bool, folder: str) -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = tiny_gpt2(4, n_embd=64, vocab=VOCAB, n_positions=128, use_cache=False)
        data = [{k: v[0] for k, v in batch(i).items()} for i in range(16)]
        session = remat.fit(model, strategy="pgac", activations=0.6, alpha=0.5)
        callback = hf.pgac_checkpoints(session)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / folder), max_steps=max_steps, per_device_train_batch_size=2, use_cpu=True,
            report_to=[], save_strategy="steps", save_steps=2, disable_tqdm=True,
        )  # fmt: skip
        transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train(
            resume_from_checkpoint=resume or None
        )
        return session, callback

    first, _ = run(2, False, "run")
    saved = first.pgac
    assert saved.step_count == 2 and (tmp_path / "run" / "checkpoint-2" / "remat_pgac_0.pt").exists()
    second, callback = run(4, True, "run")
    pgac = second.pgac
    assert callback.resumed_from == str(tmp_path / "run" / "checkpoint-2" / "remat_pgac_0.pt")
    assert pgac.step_count == 4 and pgac.costs.to_dict() == saved.costs.to_dict()
    assert [r.step for r in pgac.history] == [2, 3]  # its updates past the checkpoint
    (tmp_path / "run" / "checkpoint-4" / "remat_pgac_0.pt").unlink()
    with pytest.warns(UserWarning, match="PGAC's state is not at .*PGAC starts afresh"):
        run(6, True, "run")
    with pytest.raises(ValueError, match="pgac_checkpoints keeps PGAC's state"):
        hf.pgac_checkpoints(remat.fit(tiny_gpt2(2), activations=0.5))


def padded_to_longest(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A data collator padding each batch to its longest sequence (as ``DataCollatorWithPadding`` does), the pad
    masked and left out of the loss."""
    longest = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    labels, mask = torch.full_like(ids, -100), torch.zeros_like(ids)
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = item["input_ids"], item["input_ids"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="the HF Trainer needs accelerate")
def test_remat_fit_with_shapes_holds_the_memory_over_the_trainers_padded_batches(tmp_path: Any) -> None:
    """``remat.fit(model, memory, shapes=True)`` with no batch before a ``Trainer`` whose batches are padded to
    their longest (16 to 120 tokens): the first batch is profiled and cut to smaller shapes, every step's whole
    peak is within the memory, and the weights are those of training without checkpointing."""
    lengths = [64, *(16 + (37 * i) % 105 for i in range(1, 24))]
    data = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(i))}
            for i, n in enumerate(lengths)]  # fmt: skip

    padded = {"data": data, "data_collator": padded_to_longest, "max_steps": 12}
    reference, plain_peaks, _ = trainer_run(tmp_path, None, **padded)
    memory = int(max(plain_peaks) * 0.8)
    trained, peaks, session = trainer_run(tmp_path, lambda model, args: remat.fit(model, memory, shapes=True),
                                          **padded)  # fmt: skip
    assert max(peaks) <= memory * 1.02, [round(p / memory, 3) for p in peaks]
    assert session.shape_plans is not None and len(session.shape_plans.plans) >= 2
    same_weights(trained, reference)
    session.remove()
