"""``remat.fit(engine, memory, batch=...)`` under DeepSpeed ZeRO-1, measured: the whole step's peak against the
memory given, the step time, and the losses against training without remat.

Hugging Face's GPT-2 (built from its config, random weights, dropout on) runs in a DeepSpeed engine (ZeRO stage 1,
AdamW through ``"torch_adam": true``, one gloo rank on the CPU, ``reduce_bucket_size`` 5M elements). The plain
engine's whole peak (every tensor the engine holds between steps, found through its attributes, plus the
live-tensor tracker's peak over forward, backward and ``engine.step()``) is measured at its third step. For each
share of it, a fresh engine is fitted with ``remat.fit(engine, share * plain, batch=..., step=StepSpec(holds_output=
False))`` (the loop keeps only the loss); three training steps
of it run, each measured whole, with the plain engine's seeds, and their losses are compared bitwise with the plain
engine's. Then the fitted engine's steps are timed against a plain engine's, interleaved round by round (order
reversed every other round), beside an A/A pair of two plain engines.

Rows are appended to ``--out`` (JSON lines) as they are measured; a rerun skips the shares already there.

    .venv/bin/python -m benchmarks.deepspeed_fit [--shares 0.9,0.75,0.6] [--rounds 5]
        [--out docs/results/deepspeed-fit.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import remat
from remat.chains import ratios_to_first
from remat.integrations.distributed import free_port
from remat.meters import held_bytes

os.environ.setdefault("REMAT_CACHE_DIR", "off")
BUCKET = 5_000_000


def engine(seed: int = 0) -> Any:
    import deepspeed
    import transformers

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=6, n_embd=256, n_head=4, vocab_size=8192, n_positions=256, use_cache=False,
                                     attn_implementation="eager", bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    ds_config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": BUCKET},
    }
    made, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    return made


def batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 8192, (8, 256), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def train_step(made: Any, step: int) -> tuple[int, float]:
    """One step measured whole: what the engine holds, plus the step's peak; and its loss."""
    torch.manual_seed(100 + step)
    resident = held_bytes(made, through=("deepspeed", "torch", "transformers"))
    with remat.measure() as meter:
        loss = made(**batch(step)).loss
        made.backward(loss)
        made.step()
    return resident + meter.peak_bytes, loss.item()


def timed(made: Any, step: int) -> float:
    torch.manual_seed(100 + step)
    start = time.perf_counter()
    made.backward(made(**batch(step)).loss)
    made.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shares", default="0.9,0.75,0.6")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("docs/results/deepspeed-fit.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import deepspeed

    os.environ.update(LOCAL_RANK="0")
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, init_method=f"tcp://127.0.0.1:{free_port()}",
                               rank=0, world_size=1, verbose=False)  # fmt: skip
    done = set()
    if args.out.exists():
        done = {json.loads(line)["share"] for line in args.out.read_text().splitlines() if line.strip()}
    plain = engine()
    plain_steps = [train_step(plain, step) for step in range(3)]
    plain_peak = plain_steps[-1][0]
    print(f"plain ZeRO-1 step: whole peak {plain_peak / 2**20:.2f} MiB", flush=True)
    for share in (float(s) for s in args.shares.split(",")):
        if share in done:
            continue
        memory = int(share * plain_peak)
        fitted = engine()
        begun = time.perf_counter()
        # The loop keeps only the loss (made(**batch).loss): the logits die before the backward, and the fit is told.
        handle = remat.fit(fitted, memory, batch=batch(99), step=remat.StepSpec(holds_output=False))
        fit_s = time.perf_counter() - begun
        runs = [train_step(fitted, step) for step in range(3)]
        other = engine()  # an A/A partner of the plain engine
        for step in range(3):
            train_step(other, step)
        engines = {"plain": plain, "plain again": other, "fitted": fitted}
        ratios = ratios_to_first(list(engines), lambda name, engines=engines: timed(engines[name], 10), args.rounds)
        row = {
            "share": share,
            "memory": memory,
            "plain_peak": plain_peak,
            "peaks": [peak for peak, _ in runs],
            "peak_over_memory": max(peak for peak, _ in runs) / memory,
            "plan": handle.plan.action_counts(),
            "losses_bitwise": [loss for _, loss in runs] == [loss for _, loss in plain_steps],
            "step_ratio": statistics.median(ratios["fitted"]),
            "step_ratio_range": [min(ratios["fitted"]), max(ratios["fitted"])],
            "aa_ratio": statistics.median(ratios["plain again"]),
            "aa_range": [min(ratios["plain again"]), max(ratios["plain again"])],
            "fit_s": fit_s,
            "fixed": handle.fitted.fixed.parts() if handle.fitted is not None else {},
        }
        with args.out.open("a") as out:
            out.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        handle.remove()


if __name__ == "__main__":
    main()
