"""Predicted against measured peak activation memory in the precisions people train with.

Two models built from config (HF GPT-2 and Llama), each in four precisions: float32; bf16 and fp16 autocast
(``torch.autocast`` on the model's device, weight-cast cache on as torch's default); and parameters cast to
bfloat16. The profile is taken the way a training loop would take it: inside the loop's ``torch.autocast``
context. Each plan is then applied and one training step (forward and loss under autocast, backward outside
it) is measured with ``remat.measure()``. Strategies: ``none``, ``full``, ``every_k`` (k=2) and ``optimal`` at
25%, 50% and 75% of the predicted no-checkpoint activation memory.

One table: model, precision, strategy, budget, predicted, measured, measured/predicted, and whether the plan
is within its budget (+2%). The last lines count the rows whose prediction is within 5% and the plans over
budget.

    python -m benchmarks.autocast_budgets [--models gpt2,llama] [--precisions fp32,bf16-autocast,...]
        [--device cpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Any

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import remat
from remat.core import format_bytes
from remat.planning import no_checkpoint_peak

PRECISIONS = ("fp32", "bf16-autocast", "fp16-autocast", "bf16-params")
STRATEGIES: list[tuple[str, dict[str, Any], float | None]] = [
    ("none", {}, None),
    ("full", {}, None),
    ("every_k", {"k": 2}, None),
    ("optimal", {}, 0.25),
    ("optimal", {}, 0.5),
    ("optimal", {}, 0.75),
]


def build(name: str, device: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    if name == "gpt2":
        config = GPT2Config(n_layer=6, n_embd=512, n_head=8, vocab_size=1024, n_positions=128, use_cache=False)
        model: torch.nn.Module = GPT2LMHeadModel(config)
        shape = (2, 64)
    elif name == "llama":
        config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=1024, max_position_embeddings=256, use_cache=False)
        model = LlamaForCausalLM(config)
        shape = (2, 128)
    else:
        raise SystemExit(f"unknown model {name!r}; use gpt2 or llama")
    ids = torch.randint(0, 1024, shape, device=device)
    return model.to(device).train(), {"input_ids": ids, "labels": ids}


def autocast_context(precision: str, device: str) -> Any:
    dtype = {"bf16-autocast": torch.bfloat16, "fp16-autocast": torch.float16}.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def measured_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], precision: str, device: str) -> int:
    """Peak activation bytes of one training step as a mixed-precision loop writes it: the model's output is
    held until the backward is over (as in ``out = model(**batch); out.loss.backward()``)."""
    model.zero_grad(set_to_none=True)
    with remat.measure(device) as mem:
        with autocast_context(precision, device):
            output = model(**batch)
        output.loss.backward()
        del output
    return mem.activation_bytes


def run(name: str, precision: str, device: str) -> list[dict[str, Any]]:
    model, batch = build(name, device)
    if precision == "bf16-params":
        model.to(torch.bfloat16)
    with autocast_context(precision, device):
        costs = remat.profile(model, batch)
    rich = no_checkpoint_peak(costs)
    rows = []
    for strategy, options, fraction in STRATEGIES:
        budget = int(fraction * rich) if fraction else None
        label = strategy + (f"(k={options['k']})" if "k" in options else "")
        try:
            plan = remat.plan(costs, strategy, budget, **options) if budget else remat.plan(costs, strategy, **options)
        except remat.BudgetError as err:
            print(f"{name} {precision} {label} at {fraction:.0%}: {err}")
            continue
        handle = remat.apply(model, plan)
        try:
            measured_step(model, batch, precision, device)  # first step: lazy state (HF masks, caches) settles
            measured = measured_step(model, batch, precision, device)
        finally:
            handle.remove()
        predicted = plan.predicted_peak_bytes
        rows.append({
            "model": name, "precision": precision, "strategy": label, "fraction": fraction, "budget": budget,
            "predicted": predicted, "measured": measured, "ratio": measured / predicted,
            "within_budget": None if budget is None else measured <= budget * 1.02,
            "autocast": costs.autocast,
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {args.device}, "
          f"{torch.get_num_threads()} threads")
    header = f"{'model':<7}{'precision':<15}{'strategy':<13}{'budget':>17}{'predicted':>11}{'measured':>11}"
    print(header + f"{'meas/pred':>10}{'in budget':>10}")
    rows = []
    for name in args.models.split(","):
        for precision in args.precisions.split(","):
            if precision not in PRECISIONS:
                raise SystemExit(f"unknown precision {precision!r}; use some of {','.join(PRECISIONS)}")
            for row in run(name, precision, args.device):
                rows.append(row)
                budget = f"{row['fraction']:.0%} " + format_bytes(row["budget"]) if row["budget"] else "-"
                fits = "-" if row["within_budget"] is None else ("yes" if row["within_budget"] else "NO")
                print(f"{name:<7}{precision:<15}{row['strategy']:<13}{budget:>17}"
                      f"{format_bytes(row['predicted']):>11}{format_bytes(row['measured']):>11}"
                      f"{row['ratio']:>10.3f}{fits:>10}", flush=True)
    close = sum(abs(r["ratio"] - 1) <= 0.05 for r in rows)
    over = [r for r in rows if r["within_budget"] is False]
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    print(f"\nprediction within 5%: {close}/{len(rows)} rows (worst {worst['ratio']:.3f}: {worst['model']} "
          f"{worst['precision']} {worst['strategy']})")
    print(f"plans over budget +2%: {len(over)} of {sum(r['budget'] is not None for r in rows)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
