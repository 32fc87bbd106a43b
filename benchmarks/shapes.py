"""Budgets across input shapes: the shape-aware costs' predictions at shapes not profiled, and a run of random
shapes under one byte budget with a plan per shape bucket.

    .venv/bin/python -m benchmarks.shapes [--models gpt2,llama,bert,t5] [--steps 200] [--out docs/results/shapes.jsonl]

Part 1, predictions: each model (Hugging Face, built from its config, random weights, 4 blocks of width 64; GPT-2
with eager attention, so its ``s x s`` scores exist) is profiled at batch 4 x 128 tokens with
``remat.profile_shapes`` (four profiles: that shape, half its sequence, half its batch, half of both). At sequence
lengths 32, 64, 256 and 512 (batch 4) and batch sizes 2 and 8 (sequence 128), for keep-all, ``full`` and ``optimal``
at half of keep-all's predicted peak, one step's activation peak is measured (``remat.measure``) and its step timed
(median of ``--repeats`` steps after one untimed), against the plan's predictions for that shape. With ``--direct``
each of those shapes is also profiled itself and the same plans predicted from its costs: the extrapolated step over
that one is the extrapolation's error, the measured step's noise left out; and ``optimal`` plans from those costs
under the same budget: where it chooses other actions, both plans' steps are timed interleaved, so the table shows
what choosing from extrapolated costs loses. Plain steps are also timed at the profiled shapes and at every case,
interleaved, and the form fitted exactly through their medians is read at each case: the error of the form itself on
the machine, which no profile at the profiled shapes can remove. ``--profiles N`` profiles each model N times and
gives, for every row, the predicted over measured step from each profile: how far an extrapolated step moves from
one profile of the same model to the next. ``--device cuda`` runs part 1 on a GPU, on models of
width 768 profiled at 4 x 512 and predicted at 128-2048 tokens and batches 2 and 8 (``SIZES``).

Part 2, a run: GPT-2 trains ``--steps`` steps on random batches (batch 1 to 8, sequence 32 to 512) under a byte
budget, keep-all's predicted peak at batch 4 x 256, through each of ``--doors``: ``remat.apply`` with
``handle.plan_per_shape(remat.ShapePlans(...))`` (sequence buckets of 64), ``remat.fit(model, memory, batch=...,
shapes=True)`` (memory: parameters, gradients and keep-all's measured activations at 8 x 256; the largest batch,
8 x 512, profiled; the budget is the activation bytes the fit leaves), PGAC with ``plan_per_shape`` (its
update after every step), and Lightning's ``RematCallback(memory=..., batch=..., shapes=True)`` in ``Trainer.fit``
(the front door's memory). Every step's measured peak is compared with the budget; a step whose shape no plan fits is
refused before its first block (counted, with the error's largest fitting sizes); every step's gradients are compared
bitwise with a plain copy's on the same batch and seed; the time spent choosing and setting plans is summed
against the steps' time.

Part 3, real text with dynamic padding: Shakespeare's paragraphs (UTF-8 bytes, at most 512), batches of 8 drawn at
random and padded to their longest paragraph (``attention_mask``, padding left out of the loss), every tenth batch
short (3 paragraphs, an epoch's last batch); GPT-2 profiled at the largest batch (8 paragraphs of 512 bytes) and
run ``--text-steps`` steps under keep-all's predicted peak at 8 x 256, each step's peak and gradients measured as in
part 2.

Records go to ``--out`` (JSON lines) as they are measured; a markdown summary to ``--markdown``. A rerun keeps the
units ``--out`` holds from a run of the same setting (a model's predictions, a door's run, the text run: each closed
by a ``unit_done`` record) and measures the others, so an interrupted run resumes; ``--fresh`` starts over.

Step times on a CPU: glibc's allocator hands tensors above its mmap threshold back to the system when they are
freed, and every step faults them in again, a cost that grows with the tensors (a BERT step at 4 x 512: 339 ms,
214 ms with the memory kept), which no profile at a smaller shape sees. ``MALLOC_MMAP_THRESHOLD_=4294967296
MALLOC_TRIM_THRESHOLD_=68719476736`` keeps freed memory for the next tensors, as a GPU's caching allocator does;
the command recorded in the summary names them when they are set.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import remat
from remat.chains import interleaved_rounds

os.environ.setdefault("REMAT_CACHE_DIR", "off")
VOCAB = 256
REFERENCE = (4, 128)
SEQUENCES = (32, 64, 256, 512)
BATCHES = (2, 8)


@dataclass(frozen=True)
class Size:
    """The models' width and the shapes of part 1: the profiled one, and the sequences and batch sizes predicted."""

    hidden: int
    heads: int
    reference: tuple[int, int]
    sequences: tuple[int, ...]
    batches: tuple[int, ...]


SIZES = {
    "cpu": Size(64, 4, REFERENCE, SEQUENCES, BATCHES),
    # A GPU runs the CPU's models in kernel launches; these are wide enough for the shape to show in the time.
    "gpu": Size(768, 12, (4, 512), (128, 256, 1024, 2048), (2, 8)),
}


def build(name: str, seed: int = 0, size: Size = SIZES["cpu"]) -> nn.Module:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(seed)
    hidden, heads = size.hidden, size.heads
    positions = 2 * max(size.sequences)
    width = dict(num_hidden_layers=4, hidden_size=hidden, num_attention_heads=heads, intermediate_size=2 * hidden,
                 vocab_size=VOCAB)  # fmt: skip
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=4, n_embd=hidden, n_head=heads, vocab_size=VOCAB,
                                         n_positions=max(1024, positions), bos_token_id=0, eos_token_id=0,
                                         use_cache=False, attn_implementation="eager")  # fmt: skip
        return transformers.GPT2LMHeadModel(config).train()
    if name == "llama":
        config = transformers.LlamaConfig(**width, num_key_value_heads=heads // 2,
                                          max_position_embeddings=max(1024, positions), bos_token_id=0,
                                          eos_token_id=0, pad_token_id=0, use_cache=False)  # fmt: skip
        return transformers.LlamaForCausalLM(config).train()
    if name == "bert":
        config = transformers.BertConfig(**width, max_position_embeddings=max(1024, positions))
        return transformers.BertForMaskedLM(config).train()
    if name == "t5":
        config = transformers.T5Config(vocab_size=VOCAB, d_model=hidden, d_kv=hidden // heads, d_ff=2 * hidden,
                                       num_layers=4, num_heads=heads, decoder_start_token_id=0, pad_token_id=0)
        return transformers.T5ForConditionalGeneration(config).train()
    raise ValueError(f"unknown model {name!r}: gpt2, llama, bert or t5")


def make_batch(rows: int, positions: int, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (rows, positions), generator=torch.Generator().manual_seed(seed)).to(device)
    return {"input_ids": ids, "labels": ids}


def step(model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    model(**batch).loss.backward()


def peak_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> int:
    step(model, batch)
    model.zero_grad(set_to_none=True)
    with remat.measure() as measured:
        step(model, batch)
    model.zero_grad(set_to_none=True)
    return measured.activation_bytes


def step_time(model: nn.Module, batch: dict[str, torch.Tensor], repeats: int) -> float:
    times = []
    cuda = batch["input_ids"].is_cuda
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        step(model, batch)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def predictions(name: str, repeats: int, emit: Any, device: str = "cpu", direct: bool = False,
                profiles: int = 1) -> None:  # fmt: skip
    size = SIZES["gpu" if device.startswith("cuda") else "cpu"]
    model = build(name, size=size).to(device)
    started = time.perf_counter()
    shapes = remat.profile_shapes(model, make_batch(*size.reference, seed=0, device=device), holds_output=False)
    emit({"part": "profile", "model": name, "device": device, "shapes": [list(s) for s in shapes.shapes],
          "seconds": round(time.perf_counter() - started, 2)})
    cases = [(size.reference[0], s) for s in size.sequences] + [(b, size.reference[1]) for b in size.batches]
    if len(shapes.shapes) == 4:
        form_ceiling(name, model, [tuple(s) for s in shapes.shapes], cases, repeats, emit, device)
    # The same model profiled again: how far the extrapolated steps move from one profile to the next.
    others = [remat.profile_shapes(model, make_batch(*size.reference, seed=0, device=device), holds_output=False)
              for _ in range(profiles - 1)]  # fmt: skip
    for rows, positions in cases:
        costs = shapes.at(rows, positions)
        keep = remat.plan(costs, "none")
        plans = {"none": keep, "full": remat.plan(costs, "full"),
                 "optimal": remat.plan(costs, "optimal", budget=keep.predicted_peak_bytes // 2)}
        batch = make_batch(rows, positions, seed=1, device=device)
        there = remat.profile(model, make_batch(rows, positions, seed=0, device=device), holds_output=False) \
            if direct else None  # fmt: skip
        for strategy, plan in plans.items():
            profiled = {}
            if there is not None:  # the same actions on the costs profiled at this shape: the form's own error
                alike = remat.Plan.from_actions(there, plan.actions, strategy=strategy)
                profiled = {"profiled_there_peak": alike.predicted_peak_bytes,
                            "profiled_there_step_s": alike.predicted_step_s,
                            "step_over_profiled_there": round(plan.predicted_step_s / alike.predicted_step_s, 3)}
            handle = remat.apply(model, plan)
            try:
                measured = peak_of(model, batch)
                seconds = step_time(model, batch, repeats)
            finally:
                handle.remove()
            if there is not None and strategy == "optimal":
                profiled.update(choice_against_there(model, batch, plan, there, repeats))
            if others:  # the first profile's plan is this one
                steps = [plan.predicted_step_s] + [
                    remat.plan(o.at(rows, positions), strategy, budget=plan.budget_bytes).predicted_step_s
                    for o in others]  # fmt: skip
                profiled["step_ratio_by_profile"] = [round(step / seconds, 3) for step in steps]
            emit({"part": "prediction", "model": name, "shape": [rows, positions], "strategy": strategy,
                  "predicted_peak": plan.predicted_peak_bytes, "measured_peak": measured,
                  "peak_ratio": round(plan.predicted_peak_bytes / measured, 4),
                  "predicted_step_s": plan.predicted_step_s, "measured_step_s": seconds,
                  "step_ratio": round(plan.predicted_step_s / seconds, 3) if plan.predicted_step_s else None,
                  **profiled})


def choice_against_there(model: nn.Module, batch: dict[str, torch.Tensor], plan: remat.Plan,
                         there: remat.CostTable, repeats: int) -> dict[str, Any]:
    """What choosing from extrapolated costs loses: the plan ``optimal`` chooses from the profile at the batch's own
    shape under the same budget, and where its actions differ, both plans' steps timed interleaved (medians) and the
    other's peak measured."""
    chosen = remat.plan(there, "optimal", budget=plan.budget_bytes)
    record: dict[str, Any] = {"same_choice_as_there": chosen.actions == plan.actions}
    if record["same_choice_as_there"]:
        return record
    candidates = {"extrapolated": plan, "there": chosen}
    handle = remat.apply(model, plan)

    def timed(name: str) -> float:
        handle.set_plan(candidates[name])
        return step_time(model, batch, 1)

    try:
        times = interleaved_rounds(list(candidates), timed, repeats)
        handle.set_plan(chosen)
        record["chosen_there_peak"] = peak_of(model, batch)
    finally:
        handle.remove()
    record["step_over_chosen_there"] = round(statistics.median(times["extrapolated"])
                                             / statistics.median(times["there"]), 3)
    return record


def form_ceiling(name: str, model: nn.Module, measured: list[tuple[int, int]], cases: list[tuple[int, int]],
                 repeats: int, emit: Any, device: str) -> None:
    """Plain steps (no remat) timed at the profiled shapes and at every case, the shapes interleaved round by round
    so that the machine's drift falls on all alike; the cost form fitted exactly through the medians at the
    profiled shapes and read at each case. Its error is the form's own on this machine, free of any profile's."""
    shapes = list(dict.fromkeys([*measured, *cases]))
    batches = {shape: make_batch(*shape, seed=0, device=device) for shape in shapes}
    for shape in shapes:
        step_time(model, batches[shape], 1)  # the first step of a shape: allocations and kernels chosen
    times = interleaved_rounds(shapes, lambda shape: step_time(model, batches[shape], 1), max(7, 2 * repeats + 1))
    b0, s0 = measured[0]

    def features(batch: int, seq: int) -> list[float]:
        b, s = batch / b0, seq / s0
        return [1.0, s * s, b * s, b * s * s]

    medians = {shape: statistics.median(v) for shape, v in times.items()}
    coefficients = np.linalg.solve(np.array([features(*s) for s in measured]), [medians[s] for s in measured])
    for shape in cases:
        quartiles = statistics.quantiles(times[shape], n=4)
        emit({"part": "form", "model": name, "device": device, "shape": list(shape),
              "plain_step_s": medians[shape],
              "spread": [round(quartiles[0] / medians[shape], 3), round(quartiles[2] / medians[shape], 3)],
              "form_over_plain": round(float(np.dot(features(*shape), coefficients)) / medians[shape], 3)})


@dataclass
class Tally:
    """Steps run under a byte budget: each one's peak measured and its gradients compared with a plain copy's on
    the same batch and seed, or the step refused before its first block."""

    budget: int
    ran: int = 0
    refused: int = 0
    over: int = 0  # steps over the budget by more than 2%
    not_bitwise: int = 0
    worst: float = 0.0
    seconds: float = 0.0  # the steps that ran, timed with their peak meter

    def step(self, model: nn.Module, plain: nn.Module, batch: dict[str, torch.Tensor], seed: int) -> dict[str, Any]:
        """One step of ``model`` and of ``plain``: the record's fields. The gradients of a step that ran are left
        for the caller to read and clear; a refused step's are cleared here."""
        shape = list(batch["input_ids"].shape)
        torch.manual_seed(seed)
        started = time.perf_counter()
        try:
            with remat.measure() as measured:
                step(model, batch)
        except remat.ShapeBudgetError as err:
            self.refused += 1
            model.zero_grad(set_to_none=True)
            return {"shape": shape, "refused": True, "fitting_seq": err.fitting_seq,
                    "fitting_batch": err.fitting_batch, "floor": err.floor}
        self.seconds += time.perf_counter() - started
        return self.ran_step(model, plain, batch, measured.activation_bytes, seed)

    def ran_step(self, model: nn.Module, plain: nn.Module, batch: dict[str, torch.Tensor], peak: int,
                 seed: int) -> dict[str, Any]:  # fmt: skip
        """A step of ``model`` that ran with activation peak ``peak``: counted against the budget, and ``plain``
        stepped on the same batch and seed to compare gradients (``plain``'s left for the caller to clear)."""
        self.ran += 1
        ratio = peak / self.budget
        self.worst, self.over = max(self.worst, ratio), self.over + (ratio > 1.02)
        torch.manual_seed(seed)
        step(plain, batch)
        bitwise = all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters(),
                                                                  strict=True))
        self.not_bitwise += not bitwise
        return {"shape": list(batch["input_ids"].shape), "refused": False, "peak_over_budget": round(ratio, 4),
                "bitwise": bitwise}  # fmt: skip

    def summary(self, door: str, steps: int, plans: Any) -> dict[str, Any]:
        """The run's summary record: the totals, and the plannings and plan switches of ``plans``."""
        seconds = self.seconds
        return {"part": "run_summary", "door": door, "steps": steps, **self.totals(),
                "buckets_planned": plans.planned, "switch_s": plans.switch_s, "planning_s": plans.planning_s,
                "step_s": seconds, "switch_share": round(plans.switch_s / seconds, 5) if seconds else None,
                "switch_without_planning_share": round((plans.switch_s - plans.planning_s) / seconds, 6)
                if seconds else None,
                "plans": plans.describe()}  # fmt: skip

    def totals(self) -> dict[str, Any]:
        return {"ran": self.ran, "refused": self.refused, "over_budget": self.over,
                "worst_peak_over_budget": round(self.worst, 4), "not_bitwise": self.not_bitwise,
                "budget": self.budget}


DOORS = ("apply", "fit", "fit-first-step", "pgac", "lightning")


def fit_memory_for(model: nn.Module) -> int:
    """The whole step's memory of part 2's front door and Lightning runs: parameters, gradients (SGD: no state)
    and keep-all's measured activations at 8 x 256."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with remat.measure() as keep_all:
        step(model, make_batch(8, 256, seed=0))
    model.zero_grad(set_to_none=True)
    return 2 * weights + keep_all.activation_bytes


def run(steps: int, emit: Any, door: str = "apply") -> None:
    """Part 2 through one door: ``remat.apply`` with ``handle.plan_per_shape``, ``remat.fit(..., shapes=True)``
    (the whole step's memory, with the largest batch, 8 x 512, profiled; ``fit-first-step``: with no batch, the
    run's first batch profiled in its step and cut to smaller shapes as it ends), PGAC's ``plan_per_shape``, or
    Lightning's ``RematCallback(memory=..., shapes=True)`` in ``Trainer.fit`` (:func:`lightning_run`)."""
    if door == "lightning":
        lightning_run(steps, emit)
        return
    model = build("gpt2")
    plain = copy.deepcopy(model)
    pgac = optimizer = None
    rng = random.Random(0)
    if door in ("fit", "fit-first-step"):
        largest = make_batch(8, 512, seed=0) if door == "fit" else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # no state; the weights stay as they are
        memory = fit_memory_for(model)
        handle = remat.fit(model, memory, batch=largest, optimizer=optimizer, shapes=True,
                           step=remat.StepSpec(holds_output=False))  # fmt: skip
        if largest is None:  # the first step is profiled; its plans per shape are made as its optimizer steps
            first = make_batch(rng.randint(1, 8), rng.randint(32, 512), seed=100)
            torch.manual_seed(0)
            with remat.measure() as measured:
                step(model, first)
            optimizer.step()
        plans = handle.shape_plans
        budget = plans.budget_bytes
    else:
        shapes = remat.profile_shapes(model, make_batch(*REFERENCE, seed=0), holds_output=False)
        budget = remat.plan(shapes.at(4, 256), "none").predicted_peak_bytes
        if door == "pgac":
            pgac = remat.PGAC(model, budget, costs=shapes.reference)
            plans = pgac.plan_per_shape(shapes, buckets=remat.Buckets(seq_multiple=64))
            handle = pgac.handle
        else:
            handle = remat.apply(model, remat.plan(shapes.reference, "none"))
            plans = remat.ShapePlans(shapes, budget, buckets=remat.Buckets(seq_multiple=64))
            handle.plan_per_shape(plans)
    tally = Tally(budget)
    for k in range(steps):
        if k == 0 and door == "fit-first-step":
            fields = tally.ran_step(model, plain, first, measured.activation_bytes, seed=0)
        else:
            rows, positions = rng.randint(1, 8), rng.randint(32, 512)
            fields = tally.step(model, plain, make_batch(rows, positions, seed=100 + k), seed=k)
        if not fields["refused"]:
            fields["plan"] = "".join(a[0].upper() for a in handle.plan.actions.values())
            if pgac is not None:
                pgac.step()  # scores from this step's gradients; the next forward fits the mask to its shape
            if optimizer is not None:
                optimizer.step()
            model.zero_grad(set_to_none=True)
            plain.zero_grad(set_to_none=True)
        emit({"part": "run", "door": door, "step": k, **fields})
    (pgac or handle).remove()
    emit(tally.summary(door, steps, plans))


def lightning_run(steps: int, emit: Any) -> None:
    """Part 2 through Lightning: GPT-2 in a ``LightningModule`` trained by ``Trainer.fit`` on ``steps`` random
    batches (SGD, learning rate 0: the weights stay, so a plain copy checks every step's gradients), with
    ``RematCallback(memory=..., batch=largest, shapes=True)``. A callback measures each step's activations from
    the batch's start to the end of its backward, and there steps the plain copy on the same batch and seed."""
    import lightning as L

    from remat.integrations.lightning import RematCallback

    rng = random.Random(0)
    batches = [make_batch(rng.randint(1, 8), rng.randint(32, 512), seed=100 + k) for k in range(steps)]
    model = build("gpt2")
    plain = copy.deepcopy(model)
    memory = fit_memory_for(model)

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)

    callback = RematCallback(memory=memory, batch=make_batch(8, 512, seed=0), shapes=True,
                             step=remat.StepSpec(holds_output=False))  # fmt: skip
    tally = Tally(0)

    class Check(L.Callback):
        """Each step: seeded, measured to the end of its backward, its gradients against the plain copy's."""

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            torch.manual_seed(batch_idx)
            self.measuring = remat.measure()
            self.report = self.measuring.__enter__()
            self.started = time.perf_counter()

        def on_after_backward(self, trainer: Any, module: Any) -> None:
            self.measuring.__exit__(None, None, None)
            tally.seconds += time.perf_counter() - self.started
            tally.budget = tally.budget or callback.session.shape_plans.budget_bytes
            k = trainer.global_step
            fields = tally.ran_step(model, plain, batches[k], self.report.activation_bytes, seed=k)
            plain.zero_grad(set_to_none=True)
            fields["plan"] = "".join(a[0].upper() for a in callback.session.plan.actions.values())
            emit({"part": "run", "door": "lightning", "step": k, **fields})

    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback, Check()])
    trainer.fit(Net())
    emit(tally.summary("lightning", steps, callback.session.shape_plans))


def paragraphs(limit: int = 4000) -> list[list[int]]:
    """Shakespeare's paragraphs (blank-line separated) as UTF-8 bytes, 16 to 512 of them each."""
    from remat.bench import get_tokenizer, shakespeare_files

    tokenizer = get_tokenizer("bytes")
    found: list[list[int]] = []
    for path in shakespeare_files():
        for paragraph in path.read_text(errors="replace").split("\n\n"):
            ids = tokenizer.encode(paragraph.strip())[:512]
            if len(ids) >= 16:
                found.append(ids)
        if len(found) >= limit:
            break
    return found


def padded(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Rows padded to the longest (dynamic padding): the pad id 256, masked, and left out of the loss."""
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), 256, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def text_run(steps: int, emit: Any) -> None:
    import transformers

    texts = paragraphs()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=257, n_positions=512, bos_token_id=256,
                                     eos_token_id=256, use_cache=False, attn_implementation="eager")  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).train()
    plain = copy.deepcopy(model)
    longest = sorted(texts, key=len)[-8:]
    shapes = remat.profile_shapes(model, padded(longest), holds_output=False)
    budget = remat.plan(shapes.at(8, 256), "none").predicted_peak_bytes
    handle = remat.apply(model, remat.plan(shapes.reference, "none"))
    plans = remat.ShapePlans(shapes, budget)
    handle.plan_per_shape(plans)
    rng = random.Random(1)
    tally = Tally(budget)
    lengths = []
    for k in range(steps):
        batch = padded(rng.sample(texts, 3 if k % 10 == 9 else 8))
        lengths.append(batch["input_ids"].shape[1])
        fields = tally.step(model, plain, batch, seed=k)
        if not fields["refused"]:
            model.zero_grad(set_to_none=True)
            plain.zero_grad(set_to_none=True)
        emit({"part": "text", "step": k, **fields})
    handle.remove()
    emit({"part": "text_summary", "steps": steps, **tally.totals(), "paragraphs": len(texts),
          "padded_lengths": [min(lengths), int(statistics.median(lengths)), max(lengths)],
          "buckets_planned": plans.planned, "switch_s": plans.switch_s, "planning_s": plans.planning_s,
          "step_s": tally.seconds})


def finished(out: Path, setting: dict[str, Any]) -> list[dict[str, Any]]:
    """The records in ``out`` of the units a run with the same ``setting`` finished (each a model's predictions, a
    door's run or the text run, closed by its ``unit_done`` record); those of an unfinished unit are dropped."""
    if not out.exists():
        return []
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    done = {r.get("unit") for r in records if r["part"] == "unit_done" and r.get("setting") == setting}
    return [r for r in records if r.get("unit") in done]


def summary(records: list[dict[str, Any]], command: str) -> str:
    direct = any("step_over_profiled_there" in r for r in records)
    spread = any("step_ratio_by_profile" in r for r in records)

    def over_profiles(r: dict[str, Any]) -> str:
        ratios = r.get("step_ratio_by_profile")
        return f" {min(ratios)}-{max(ratios)} ({len(ratios)}) |" if ratios else " - |"

    lines = ["# Budgets across input shapes", "", f"Command: `{command}`", "",
             "| model | shape | strategy | predicted / measured peak | predicted / measured step |"
             + (" predicted / profiled-there step | plan chosen there: step of this one / that one |"
                if direct else "")
             + (" predicted / measured step, each profile (least-most) |" if spread else ""),
             "|---|---|---|---|---|" + ("---|---|" if direct else "") + ("---|" if spread else "")]

    def chosen_there(r: dict[str, Any]) -> str:
        if "same_choice_as_there" not in r:
            return "-"
        return "the same plan" if r["same_choice_as_there"] else str(r["step_over_chosen_there"])

    for r in records:
        if r["part"] == "prediction":
            lines.append(f"| {r['model']} | {r['shape'][0]}x{r['shape'][1]} | {r['strategy']} | {r['peak_ratio']:.3f} "
                         f"| {r['step_ratio'] if r['step_ratio'] is not None else '-'} |"
                         + (f" {r.get('step_over_profiled_there', '-')} | {chosen_there(r)} |" if direct else "")
                         + (over_profiles(r) if spread else ""))
    forms = [r for r in records if r["part"] == "form"]
    if forms:
        lines += ["", "Plain steps (no remat) against the cost form fitted exactly through the medians of plain "
                  "steps at the four profiled shapes: the form's own error on this machine, no profile involved.", "",
                  "| model | shape | plain step, median (quartiles / median) | form / plain step |",
                  "|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['shape'][0]}x{r['shape'][1]} | {1e3 * r['plain_step_s']:.1f} ms "
                  f"({r['spread'][0]:.2f}-{r['spread'][1]:.2f}) | {r['form_over_plain']:.3f} |" for r in forms]
    run_rows = [r for r in records if r["part"] == "run_summary"]
    doors = {"apply": "remat.apply + handle.plan_per_shape", "fit": "remat.fit(..., batch=largest, shapes=True)",
             "fit-first-step": "remat.fit(..., shapes=True) without a batch (the first batch profiled)",
             "pgac": "PGAC + plan_per_shape", "lightning": "Lightning RematCallback(memory=..., shapes=True)"}
    for r in run_rows:
        lines += ["", f"{doors[r.get('door', 'apply')]}: run of {r['steps']} random shapes (batch 1-8, sequence "
                  f"32-512) on GPT-2 under "
                  f"{remat.format_bytes(r['budget'])}: {r['ran']} ran, {r['refused']} refused before their first "
                  f"block; {r['over_budget']} over the budget by more than 2% (worst {r['worst_peak_over_budget']}x); "
                  f"{r['not_bitwise']} steps whose gradients differ from a plain step's; {r['buckets_planned']} "
                  f"plannings; choosing and setting plans took {r['switch_s'] * 1e3:.1f} ms of "
                  f"{r['step_s']:.1f} s of steps ({100 * r['switch_share']:.3f}%), of which planning the new shapes "
                  f"{r['planning_s'] * 1e3:.1f} ms: {100 * r['switch_without_planning_share']:.4f}% a step without "
                  "it.", "", "```", r["plans"], "```"]
    for r in [r for r in records if r["part"] == "text_summary"]:
        low, middle, high = r["padded_lengths"]
        lines += ["", f"Shakespeare with dynamic padding: {r['steps']} batches of 8 paragraphs (3 every tenth) padded "
                  f"to their longest, {low}-{high} bytes (median {middle}), on GPT-2 under "
                  f"{remat.format_bytes(r['budget'])}: {r['ran']} ran, {r['refused']} refused before their first "
                  f"block; {r['over_budget']} over the budget by more than 2% (worst {r['worst_peak_over_budget']}x); "
                  f"{r['not_bitwise']} steps whose gradients differ from a plain step's; {r['buckets_planned']} "
                  f"plannings; choosing and setting plans {1e3 * (r['switch_s'] - r['planning_s']):.1f} ms of "
                  f"{r['step_s']:.1f} s of steps without planning, planning {1e3 * r['planning_s']:.1f} ms."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama,bert,t5")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--doors", default=",".join(DOORS),
                        help="the doors of part 2: apply, fit, fit-first-step, pgac, lightning")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--text-steps", type=int, default=200, help="steps of the dynamic-padding run (0: none)")
    parser.add_argument("--direct", action="store_true",
                        help="also profile each shape of part 1 and predict the same plans from its own costs")
    parser.add_argument("--profiles", type=int, default=1,
                        help="profile each model this many times: the extrapolated steps' spread over profiles")
    parser.add_argument("--device", default="cpu", help="cuda: part 1 only, on wider models (SIZES['gpu'])")
    parser.add_argument("--out", default="docs/results/shapes.jsonl")
    parser.add_argument("--markdown", default="docs/results/shapes.md")
    parser.add_argument("--fresh", action="store_true",
                        help="measure every unit again (default: keep those --out holds from a run of this setting)")
    args = parser.parse_args()
    if args.device != "cpu" and (args.steps or args.text_steps):
        parser.error("parts 2 and 3 run on the CPU: pass --steps 0 --text-steps 0 with --device")
    torch.set_num_threads(1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    setting = {k: v for k, v in vars(args).items() if k not in ("models", "doors", "out", "markdown", "fresh")}
    records = [] if args.fresh else finished(out, setting)
    done = {r["unit"] for r in records if r["part"] == "unit_done"}
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    unit = ""

    def emit(record: dict[str, Any]) -> None:
        record = {**record, "unit": unit}
        records.append(record)
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record)[:300], flush=True)

    units: list[tuple[str, Callable[[], None]]] = [
        (f"model {name}", partial(predictions, name, args.repeats, emit, args.device, args.direct, args.profiles))
        for name in args.models.split(",") if name]  # fmt: skip
    if args.steps:
        units += [(f"door {door}", partial(run, args.steps, emit, door)) for door in args.doors.split(",") if door]
    if args.text_steps:
        units.append(("text", partial(text_run, args.text_steps, emit)))
    for unit, measure in units:
        if unit in done:
            print(f"{unit}: in {out} already (--fresh measures it again)", flush=True)
            continue
        measure()
        emit({"part": "unit_done", "setting": setting})
    allocator = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_"))
    options = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items()
               if v is not False]  # fmt: skip
    command = (f"{allocator} " if allocator else "") + "python -m benchmarks.shapes " + " ".join(options)
    Path(args.markdown).write_text(summary(records, command))


if __name__ == "__main__":
    main()
