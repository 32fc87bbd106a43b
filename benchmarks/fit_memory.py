"""``remat.fit(model, memory)`` measured: the whole step's peak against the memory given, and its step time.

Hugging Face's GPT-2 and Llama (built from their configs, random weights, dropout on for GPT-2) train with AdamW.
The plain step's whole peak (parameters, gradients, AdamW's state, activations; the live-tensor tracker plus
what is resident when the step starts) is measured from the second step on. For each share of it, a fresh copy
of the model is fitted with ``remat.fit(model, share * plain, batch=..., optimizer=...)``; then three training
steps of it run, each measured whole, and its steps are timed against a plain copy's, interleaved round by
round (order reversed every other round), beside an A/A pair of two plain copies. The loop keeps only the loss
(``model(**batch).loss.backward()``), and the fit is told so (``StepSpec(holds_output=False)``). Gradients of the
fitted model are compared bitwise with the plain copy's on the same batch and seed.

Rows are appended to ``--out`` (JSON lines) as they are measured; a rerun skips the rows already there.

    .venv/bin/python -m benchmarks.fit_memory [--models gpt2,llama] [--shares 0.9,0.75,0.6,0.5] [--rounds 5]
        [--out docs/results/fit-memory.jsonl]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import remat
from remat.chains import ratios_to_first

os.environ.setdefault("REMAT_CACHE_DIR", "off")


def build(name: str) -> nn.Module:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=6, n_embd=256, n_head=4, vocab_size=8192, n_positions=256,
                                         use_cache=False, attn_implementation="eager")  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        num_hidden_layers=6, hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=8192, max_position_embeddings=256, use_cache=False, attn_implementation="eager",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def resident(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
    tensors += [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def whole_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> int:
    start = resident(model, optimizer)
    torch.manual_seed(1)
    with remat.measure() as meter:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return start + meter.peak_bytes


def timed(model: nn.Module, batch: dict[str, torch.Tensor]) -> float:
    torch.manual_seed(1)
    start = time.perf_counter()
    model(**batch).loss.backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds


def measure(name: str, share: float, plain_peak: int, batch: dict[str, torch.Tensor], rounds: int) -> dict[str, Any]:
    base = build(name)
    model, plain, twin = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    optimizer = torch.optim.AdamW(model.parameters())
    memory = int(share * plain_peak)
    plain_s = statistics.median(timed(plain, batch) for _ in range(4))
    began = time.perf_counter()
    try:
        # The loop below keeps only the loss, as the Trainer does: the step is profiled that way.
        session = remat.fit(model, memory, batch=batch, optimizer=optimizer, step=remat.StepSpec(holds_output=False))
    except remat.BudgetError as error:
        return {"model": name, "share": share, "memory": memory, "refused": str(error), "floor": error.floor}
    fit_s = time.perf_counter() - began
    torch.manual_seed(1)
    model(**batch).loss.backward()
    torch.manual_seed(1)
    plain(**batch).loss.backward()
    exact = all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters(), strict=True)
                if p.grad is not None)  # fmt: skip
    model.zero_grad(set_to_none=True)
    plain.zero_grad(set_to_none=True)
    peaks = [whole_step(model, optimizer, batch) for _ in range(3)]
    runs = {"plain": plain, "plain again": twin, "remat.fit": model}
    ratios = ratios_to_first(list(runs), lambda label: timed(runs[label], batch), rounds)
    row = {
        "model": name,
        "share": share,
        "memory": memory,
        "plan": session.plan.action_counts(),
        "peaks": peaks,
        "peak_over_memory": max(peaks) / memory,
        "step_ratio": statistics.median(ratios["remat.fit"]),
        "step_ratio_range": [min(ratios["remat.fit"]), max(ratios["remat.fit"])],
        "aa_ratio": statistics.median(ratios["plain again"]),
        "aa_range": [min(ratios["plain again"]), max(ratios["plain again"])],
        "exact": exact,
        "fit_s": fit_s,
        "plain_step_s": plain_s,
        "fit_parts_s": dict(session.fitted.seconds) if session.fitted is not None else {},
    }
    session.remove()
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | memory (share of the plain step) | plan | whole-step peak / memory | step / plain (median "
        "[range]) | A/A | gradients | fit, in plain steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['model']} | {r['share']:.2f} | refused: least {r['floor'] / 2**20:.1f} MiB | | | | | |")
            continue
        lines.append(
            f"| {r['model']} | {r['memory'] / 2**20:.1f} MiB ({r['share']:.2f}) | {r['plan']} | "
            f"{r['peak_over_memory']:.3f} | {r['step_ratio']:.3f} [{r['step_ratio_range'][0]:.3f}-"
            f"{r['step_ratio_range'][1]:.3f}] | {r['aa_ratio']:.3f} [{r['aa_range'][0]:.3f}-{r['aa_range'][1]:.3f}] | "
            f"{'bitwise' if r['exact'] else 'DIFFER'} | "
            + (f"{r['fit_s'] / r['plain_step_s']:.1f} |" if "plain_step_s" in r else "|")
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--shares", default="0.9,0.75,0.6,0.5")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("docs/results/fit-memory.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    done = [json.loads(line) for line in args.out.read_text().splitlines()] if args.out.exists() else []
    ids = torch.randint(0, 8192, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    for name in args.models.split(","):
        model = build(name)
        optimizer = torch.optim.AdamW(model.parameters())
        plain_peak = [whole_step(model, optimizer, batch) for _ in range(2)][-1]
        print(f"{name}: plain step {plain_peak / 2**20:.1f} MiB whole", flush=True)
        for share in [float(s) for s in args.shares.split(",")]:
            if any(r["model"] == name and r["share"] == share for r in done):
                continue
            row = measure(name, share, plain_peak, batch, args.rounds)
            row["plain_peak"] = plain_peak
            done.append(row)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(table([row]).splitlines()[-1], flush=True)
    print(table(done))


if __name__ == "__main__":
    main()
