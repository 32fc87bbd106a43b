"""One training run: a (strategy, seed) pair trained for the bench's fixed number of steps.

:func:`execute_run` builds the model from the seed, loads the seed's batches, installs the strategy's
controller (:mod:`remat.bench.strategies`), trains with AdamW while timing the forward, backward and optimizer
of every step, measures memory on the designated steps only, evaluates on the fixed validation batches and
returns the run's record. The ``compile_budget`` child process runs the same loop with the whole-process
meter (:mod:`remat.bench.compile_child`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..core import CostTable
from ..planning import ShapeBudgetError
from .controllers import SHAPE_TABLES, Controller

Emit = Callable[[dict[str, Any]], None]


def load_data(job: dict[str, Any]) -> Any:
    from .data import load_dataset

    kwargs: dict[str, Any] = {"seq_len": job["seq_len"], "batch_size": job["batch_size"], "seed": job["seed"]}
    if job.get("dynamic_padding"):
        from .text_data import PaddedText

        return PaddedText(split="train", tokenizer=job["tokenizer"], max_bytes=job["max_bytes"], **kwargs)
    if job["model"] in ("gpt2", "bert"):
        kwargs.update(tokenizer=job["tokenizer"], max_bytes=job["max_bytes"])
    else:
        from .models import model_config

        cfg = model_config(job["model"], job["preset"])
        kwargs.update(image_size=cfg["image_size"], num_channels=cfg["num_channels"], dataset=job["dataset"])
    return load_dataset(job["model"], **kwargs)


def build(job: dict[str, Any], data: Any) -> Any:
    """The model of ``job``, built from its seed (the same weights for every strategy)."""
    from .models import build_model

    overrides = dict(data.model_overrides())
    if job["layers"] is not None:
        overrides["num_layers"] = job["layers"]
    spec = build_model(job["model"], job["preset"], seed=job["seed"], dropout=job["dropout"], **overrides)
    spec.module.to(job["device"])
    return spec


def profile_costs(
    job: dict[str, Any], repeats: int, lossy: list[str] | None = None
) -> tuple[CostTable, dict[str, Any]]:
    """``remat.profile`` of the seed's model on its first training batch (with the compression formats
    ``lossy``, for the lossy strategies); also returns data/model facts. With dynamic padding the profile is of the
    largest batch the run can see, and the model is profiled at three smaller shapes cut from it as well: the
    costs at every shape (:func:`~remat.bench.controllers.shape_costs_of` reads them back from ``costs.info``)."""
    import remat

    torch.set_num_threads(job["threads"])
    data = load_data(job)
    spec = build(job, data)
    first = data.largest_batch() if job.get("dynamic_padding") else next(data.train_batches())
    batch = data.batch_kwargs(first, job["device"])
    options: dict[str, Any] = {"step": remat.StepSpec(loss_fn=spec.loss_fn), "repeats": repeats,
                               "clock": profile_clock(job)}  # fmt: skip  # the chain remat finds
    costs = remat.profile(spec.module, batch, lossy=tuple(lossy or ()), **options)
    if job.get("dynamic_padding"):
        shapes = remat.profile_shapes(spec.module, batch, reference=costs, **options)
        costs.info[SHAPE_TABLES] = {"shapes": [list(s) for s in shapes.shapes[1:]],
                                    "tables": [t.to_dict() for t in shapes.tables[1:]]}  # fmt: skip
    facts = {
        "data": data.describe(),
        "model": spec.config,
        "num_params": spec.num_params,
        "unit": spec.unit,
        "kind": spec.kind,
        "items_per_step": spec.count_items(batch),
    }
    return costs, facts


def step_clock(job: dict[str, Any]) -> str:
    """The clock the profile's times and the predicted step are read on: ``"cpu"`` (the process's CPU
    seconds) on a CPU with one intra-op thread, where it is the step's time on a machine of its own however
    busy this one is; ``"wall"`` otherwise (CUDA, or several threads, whose CPU seconds add up)."""
    return "cpu" if job["device"] == "cpu" and job["threads"] == 1 else "wall"


def profile_clock(job: dict[str, Any]) -> Callable[[], float]:
    """The clock function of :func:`step_clock` (``remat.profile`` records its ``__name__`` in ``info``)."""
    return time.process_time if step_clock(job) == "cpu" else time.perf_counter


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tracker_meter(device: torch.device) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    import remat

    return lambda: remat.measure(device)


class _EnergySteps:
    """Energy of the timed steps only: a meter started and stopped around each (if counters can be read)."""

    def __init__(self, device: torch.device) -> None:
        from .energy import EnergyMeter, energy_available

        self._cls = EnergyMeter
        ok, why = energy_available("auto")
        self.available = ok
        self.reason = "" if ok else why
        self.source = why if ok else None
        self.joules = 0.0

    @contextlib.contextmanager
    def step(self, timed: bool) -> Iterator[dict[str, Any]]:
        box: dict[str, Any] = {"joules": None}
        if not (self.available and timed):
            yield box
            return
        meter = self._cls("auto").start()
        try:
            yield box
        finally:
            reading = meter.stop()
            if reading.joules is not None:
                box["joules"] = reading.joules
                self.joules += reading.joules


def execute_run(
    job: dict[str, Any],
    controller: Controller,
    emit: Emit,
    *,
    meter_factory: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    memory_method: str = "tracker",
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Train one (strategy, seed) run; ``emit`` gets each step record; returns the run record."""
    started = time.perf_counter()
    torch.set_num_threads(job["threads"])
    device = torch.device(job["device"])
    data = load_data(job)
    spec = build(job, data)
    model = spec.module
    optimizer = torch.optim.AdamW(model.parameters(), lr=job["lr"])
    torch.manual_seed(job["seed"])  # the dropout stream: the same for every strategy of this seed
    meter_factory = meter_factory or _tracker_meter(device)
    controller.attach(model, optimizer)
    forward = controller.forward_fn(model)
    energy = _EnergySteps(device)
    measured_steps = set(job["measure_steps"])
    batches = data.train_batches()
    base = {"strategy": job["label"], "strategy_name": job["strategy"], "seed": job["seed"]}
    records: list[dict[str, Any]] = []
    dynamic = bool(job.get("dynamic_padding"))

    def publish(record: dict[str, Any]) -> None:
        records.append(record)
        emit(record)
        if on_step is not None:
            on_step(record)

    try:
        for step in range(job["steps"]):
            batch = data.batch_kwargs(next(batches), device)
            items = spec.count_items(batch)
            shape = list(next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape)  # the main input
            measured = step in measured_steps
            # with dynamic padding every step is measured, and timed under the meter (the run says so)
            timed = step >= job["warmup"] and (dynamic or not measured)
            meter = meter_factory() if measured else contextlib.nullcontext()
            with energy.step(timed) as joules:
                _sync(device)
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    with meter as mem, controller.step_context():
                        output = forward(**batch)
                        loss = spec.loss_fn(output)
                        _sync(device)
                        t1, c1 = time.perf_counter(), time.process_time()
                        loss.backward()
                        del output
                        _sync(device)
                except ShapeBudgetError as refusal:  # before the first block: the batch is skipped, as a loop would
                    optimizer.zero_grad(set_to_none=True)
                    record = {**base, "step": step, "shape": shape, "refused": str(refusal),
                              "budget_bytes": job["budget_bytes"], "memory_measured": False, "timed": False,
                              "warmup": step < job["warmup"], "t": time.time()}  # fmt: skip
                    publish(record)
                    continue
                t2, c2 = time.perf_counter(), time.process_time()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                _sync(device)
                t3 = time.perf_counter()
            step_time = t3 - t0
            record = {
                **base,
                "step": step,
                "shape": shape,
                "budget_bytes": job["budget_bytes"],
                "loss": float(loss.detach()),
                "step_time_s": step_time,
                "forward_s": t1 - t0,
                "backward_s": t2 - t1,
                "optimizer_s": t3 - t2,
                "forward_cpu_s": c1 - c0,
                "backward_cpu_s": c2 - c1,
                **controller.take_step_stats(),
                "peak_activation_bytes": int(mem.activation_bytes) if measured else None,
                "peak_bytes": int(mem.peak_bytes) if measured else None,
                "memory_method": memory_method if measured else None,
                "memory_measured": measured,
                "warmup": step < job["warmup"],
                "timed": timed,
                "items": items,
                "throughput": items / step_time,
                "energy_j": joules["joules"],
                "t": time.time(),
            }
            publish(record)
        info = controller.run_info()
    finally:
        controller.remove()
    evaluation = evaluate(model, spec, data, job["eval_batches"], device)
    return summarize_run(job, records, info, evaluation, energy, time.perf_counter() - started, spec)


@torch.no_grad()
def evaluate(model: torch.nn.Module, spec: Any, data: Any, n: int, device: torch.device) -> dict[str, Any]:
    """Validation loss, and perplexity (text) or accuracy (images), on a fixed set of batches."""
    n = min(n, data.num_batches("val"))
    if n == 0:
        return {"val_loss": None, "val_perplexity": None, "val_accuracy": None, "val_batches": 0}
    model.eval()
    losses, correct, count = [], 0, 0
    try:
        for batch in data.val_batches(n):
            kwargs = data.batch_kwargs(batch, device)
            output = model(**kwargs)
            losses.append(float(spec.loss_fn(output)))
            if spec.kind == "image":
                correct += int((output.logits.argmax(-1) == kwargs["labels"]).sum())
                count += int(kwargs["labels"].numel())
    finally:
        model.train()
    val_loss = sum(losses) / len(losses)
    text = spec.kind in ("lm", "mlm")
    return {
        "val_loss": val_loss,
        "val_perplexity": math.exp(min(val_loss, 700.0)) if text else None,
        "val_accuracy": correct / count if count else None,
        "val_batches": n,
    }


OVER_BUDGET = 1.02  # a step's peak over the budget by more than 2% counts as over


def shape_summary(records: list[dict[str, Any]], budget: int) -> dict[str, Any]:
    """Of a run whose batches change shape: every measured step's peak against the budget, the steps refused
    before their forward, and the sequence lengths seen (least, median, most)."""
    ratios = [r["peak_activation_bytes"] / budget for r in records if r.get("peak_activation_bytes") is not None]
    lengths = sorted(r["shape"][1] for r in records if "shape" in r)
    return {
        "steps_measured": len(ratios),
        "steps_over_budget": sum(ratio > OVER_BUDGET for ratio in ratios),
        "worst_peak_over_budget": max(ratios) if ratios else None,
        "steps_refused": sum("refused" in r for r in records),
        "sequence_lengths": [lengths[0], lengths[len(lengths) // 2], lengths[-1]] if lengths else None,
        "timed_under_meter": True,
    }


def _sum_or_none(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def summarize_run(
    job: dict[str, Any],
    records: list[dict[str, Any]],
    info: dict[str, Any],
    evaluation: dict[str, Any],
    energy: _EnergySteps,
    wall_s: float,
    spec: Any,
) -> dict[str, Any]:
    """The run's line of runs.jsonl: means over the timed steps, the measured memory, validation, energy."""
    timed = [r for r in records if r["timed"]]
    measured = [r for r in records if r["memory_measured"]]

    def mean(key: str) -> float | None:
        values = [r[key] for r in timed if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    total_time = sum(r["step_time_s"] for r in timed)
    recompute = [r["recompute_time_s"] for r in timed]
    peaks = [r["peak_activation_bytes"] for r in measured if r["peak_activation_bytes"] is not None]
    budget = job["budget_bytes"]
    peak = max(peaks) if peaks else None
    plan = info.get("plan") or {}
    run = {
        "strategy": job["label"],
        "strategy_name": job["strategy"],
        "options": dict(map(tuple, job["options"])),
        "seed": job["seed"],
        "status": "ok",
        "steps": job["steps"],
        "warmup": job["warmup"],
        "timed_steps": len(timed),
        "measured_steps": [r["step"] for r in measured],
        "budget_bytes": budget,
        "budget_fraction": job["budget_fraction"],
        "predicted_peak_bytes": plan.get("predicted_peak_bytes"),
        "predicted_recompute_s": plan.get("predicted_recompute_s"),
        "predicted_step_s": plan.get("predicted_step_s"),
        "pgac_scoring_s": plan.get("pgac_scoring_s"),  # PGAC: its scoring hooks, inside predicted_step_s
        "plan_fits": plan.get("fits"),
        "plan": plan.get("actions"),
        "plan_options": plan.get("options"),
        "peak_activation_bytes": peak,
        "memory_method": measured[0]["memory_method"] if measured else None,
        "within_budget": (peak <= budget) if peak is not None else None,
        "step_time_s": mean("step_time_s"),
        "forward_s": mean("forward_s"),
        "backward_s": mean("backward_s"),
        "optimizer_s": mean("optimizer_s"),
        # forward + backward on the clock the profile read (see step_clock): what predicted_step_s predicts
        "step_clock": step_clock(job),
        "measured_fwd_bwd_s": _sum_or_none(mean("forward_cpu_s"), mean("backward_cpu_s"))
        if step_clock(job) == "cpu"
        else _sum_or_none(mean("forward_s"), mean("backward_s")),
        "recompute_time_s": mean("recompute_time_s"),
        "recompute_overhead": (sum(recompute) / total_time) if timed and None not in recompute and total_time else None,
        "throughput": sum(r["items"] for r in timed) / total_time if total_time else None,
        "unit": spec.unit,
        "final_loss": next((r["loss"] for r in reversed(records) if "loss" in r), None),
        "mean_stored_blocks": mean("stored_blocks"),
        **evaluation,
        "energy_j": energy.joules if energy.available else None,
        "energy_kwh": energy.joules / 3.6e6 if energy.available else None,
        "energy_source": energy.source,
        "energy_note": energy.reason,
        "wall_s": wall_s,
        "t": time.time(),
    }
    if job.get("dynamic_padding"):
        run.update(shape_summary(records, budget))
    for key in ("dtr", "activation_memory_budget"):
        if key in info:
            run[key] = info[key]
    run["_info"] = info
    return run
