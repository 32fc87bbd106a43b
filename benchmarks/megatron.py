"""remat next to Megatron-Core's own recompute modes on a Megatron-Core ``GPTModel``: the activation peak, the step
against no recompute and the gradients, at half the no-recompute activations.

Contenders (one gloo rank, tensor and pipeline parallel size 1, attention and hidden dropout 0.1, RoPE):

* no recompute (twice: an A/A pair);
* Megatron ``recompute_granularity="full"``, ``recompute_method="uniform"``, one layer a unit: every layer;
* Megatron ``"full"`` with ``recompute_method="block"``: the first ``k`` layers, the least ``k`` whose measured peak
  fits the budget (Megatron's knob for a memory target);
* Megatron ``"selective"`` (``recompute_modules=["core_attn"]``, its default);
* remat ``full`` (every layer checkpointed) and remat's ``optimal`` plan for the budget (``remat.fit(activations=
  budget)``, the budget in bytes).

The activation peak is ``remat.measure().activation_bytes`` around one training step (forward and backward; what
outlives the step, the gradients, left out). Gradients of one step from the same seeds are compared with no
recompute's, bitwise. Steps are timed in CPU seconds with one intra-op thread, in interleaved rounds (order reversed
every other round), as ratios to no recompute's step of the same round.

Megatron-Core targets GPUs; :func:`megatron_on_cpu` maps the three CUDA calls a CPU run of its ``GPTModel`` needs
(``torch.cuda.current_device``, the RNG tracker's ``_get_cuda_rng_state``/``_set_cuda_rng_state``) for the
benchmark and the tests (``tests/test_integration_megatron.py``): on a GPU nothing is mapped.

    .venv/bin/python -m benchmarks.megatron [--rounds 9] [--out docs/results/megatron.jsonl]
        [--markdown docs/results/megatron.md]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import remat
from remat.chains import ratios_to_first
from remat.integrations.distributed import free_port

os.environ.setdefault("REMAT_CACHE_DIR", "off")
LAYERS, HIDDEN, HEADS, SEQ, BATCH, VOCAB = 8, 256, 8, 256, 4, 1024


@contextlib.contextmanager
def megatron_on_cpu(tensor_parallel: int = 1, *, rank: int = 0, world: int = 1, port: int | None = None
                    ) -> Iterator[None]:  # fmt: skip
    """A gloo process group and Megatron's model-parallel state, with the CUDA calls a CPU run needs mapped to the
    CPU (module docstring); all undone on exit."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random

    saved = (torch.cuda.current_device, megatron_random._get_cuda_rng_state, megatron_random._set_cuda_rng_state)
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]  # where RoPE moves its frequencies
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port or free_port()}", rank=rank,
                            world_size=world)  # fmt: skip
    parallel_state.initialize_model_parallel(tensor_parallel, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        torch.cuda.current_device, megatron_random._get_cuda_rng_state, megatron_random._set_cuda_rng_state = saved


def seed_tracker(seed: int) -> None:
    """Megatron's RNG tracker with its model-parallel stream seeded (``model_parallel_cuda_manual_seed``'s work,
    on the CPU generator the mapping reads)."""
    from megatron.core.tensor_parallel import random as megatron_random

    tracker = megatron_random.get_cuda_rng_tracker()
    tracker.reset()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tracker.set_states({"model-parallel-rng": torch.get_rng_state()})


def gpt(**recompute: Any) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               use_cpu_initialization=True, attention_dropout=0.1, hidden_dropout=0.1,
                               **recompute)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Apex is not installed": Megatron falls back to torch's norm
        spec = get_gpt_layer_local_spec()
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def batch(step: int, rows: int = BATCH, seq: int = SEQ, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """A ``GPTModel`` batch of random tokens (``step`` seeds them) with its causal mask and positions."""
    ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(step))
    causal = torch.ones(rows, 1, seq, seq, dtype=torch.bool).tril().logical_not()
    return {"input_ids": ids, "position_ids": torch.arange(seq).expand(rows, -1), "attention_mask": causal,
            "labels": ids}  # fmt: skip


def loss_fn(per_token: torch.Tensor) -> torch.Tensor:
    """``GPTModel`` returns per-token losses: their mean."""
    return per_token.float().mean()


def step(model: Any, seed: int = 0) -> None:
    torch.manual_seed(seed)
    seed_tracker(77 + seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron: "CPU RNG state changed within GPU RNG context" (the mapping)
        loss_fn(model(**batch(seed))).backward()


def measured(model: Any) -> tuple[int, list[torch.Tensor]]:
    """One step's activation peak (after a warm-up step) and its gradients."""
    step(model)
    model.zero_grad(set_to_none=True)
    with remat.measure() as meter:
        step(model)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return meter.activation_bytes, grads


def contenders(budget: int) -> tuple[dict[str, Any], dict[str, str]]:
    """Every contender's model, set up, and what each runs."""
    models: dict[str, Any] = {"no recompute": gpt(), "no recompute (A/A)": gpt()}
    detail = {"no recompute": "", "no recompute (A/A)": ""}
    models["Megatron full"] = gpt(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    detail["Megatron full"] = f"uniform, every one of {LAYERS} layers"
    for k in range(1, LAYERS + 1):  # the least k that fits
        model = gpt(recompute_granularity="full", recompute_method="block", recompute_num_layers=k)
        if measured(model)[0] <= budget or k == LAYERS:
            models["Megatron full, first k layers"], detail["Megatron full, first k layers"] = model, f"block, k={k}"
            break
    models["Megatron selective"] = gpt(recompute_granularity="selective")
    detail["Megatron selective"] = "core_attn of every layer"
    layers = [f"decoder.layers.{i}" for i in range(LAYERS)]
    full = gpt()
    remat.apply(full, remat.Plan(dict.fromkeys(layers, "checkpoint")))
    models["remat full"], detail["remat full"] = full, "every layer checkpointed"
    optimal = gpt()
    seed_tracker(99)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = remat.fit(optimal, activations=budget, batch=batch(99), loss_fn=loss_fn)
    models["remat optimal"], detail["remat optimal"] = optimal, handle.plan.action_counts()
    return models, detail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--share", type=float, default=0.5, help="the budget: this share of no recompute's peak")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", type=Path, default=Path("docs/results/megatron.jsonl"))
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    with megatron_on_cpu():
        plain_peak, expected = measured(gpt())
        budget = int(args.share * plain_peak)
        models, detail = contenders(budget)
        rows = []
        for name, model in models.items():
            peak, grads = measured(model)
            exact = all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
            rows.append({"contender": name, "detail": detail[name], "peak_bytes": peak, "peak_share": peak / plain_peak,
                         "fits": peak <= budget, "bitwise": exact})  # fmt: skip

        def timed(name: str) -> float:
            begun = time.process_time()
            step(models[name], seed=1)
            models[name].zero_grad(set_to_none=True)
            return time.process_time() - begun

        ratios = ratios_to_first(list(models), timed, args.rounds)
    for row in rows:
        r = ratios[row["contender"]]
        row.update(step_ratio=statistics.median(r), step_low=min(r), step_high=max(r), ratios=list(r))
    record = {"share": args.share, "budget_bytes": budget, "plain_peak_bytes": plain_peak, "rounds": args.rounds,
              "model": {"layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "seq": SEQ, "batch": BATCH},
              "torch": torch.__version__, "seconds": time.perf_counter() - started, "rows": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps(record) + "\n")
    text = markdown(record)
    print(text)
    if args.markdown is not None:
        args.markdown.write_text(text)


def markdown(record: dict[str, Any]) -> str:
    m = record["model"]
    lines = [
        "# remat next to Megatron-Core's recompute",
        "",
        f"Command: `python -m benchmarks.megatron --rounds {record['rounds']} --markdown docs/results/megatron.md`",
        "",
        f"Megatron-Core `GPTModel` ({m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, batch "
        f"{m['batch']} x {m['seq']}, attention and hidden dropout 0.1, RoPE), one gloo rank on the CPU, torch "
        f"{record['torch']}, one intra-op thread; budget {record['share']:.0%} of no recompute's activation peak "
        f"({record['budget_bytes'] / 2**20:.2f} MiB); steps in CPU seconds over {record['rounds']} interleaved "
        f"rounds ({record['seconds']:.0f} s in all).",
        "",
        "| contender | what it recomputes | activation peak / no recompute | fits | step / no recompute, median "
        "[range] | gradients |",
        "|---|---|---|---|---|---|",
    ]
    rows = {r["contender"]: r for r in record["rows"]}
    megatron = [r for r in record["rows"] if r["contender"].startswith("Megatron") and r["fits"]]
    fastest = min(megatron, key=lambda r: r["step_ratio"]) if megatron else None
    for r in record["rows"]:
        lines.append(f"| {r['contender']} | {r['detail']} | {r['peak_share']:.3f} | {'yes' if r['fits'] else 'no'} | "
                     f"{r['step_ratio']:.3f} [{r['step_low']:.3f}-{r['step_high']:.3f}] | "
                     f"{'bitwise' if r['bitwise'] else 'differ'} |")  # fmt: skip
    mine = rows["remat optimal"]
    if fastest is not None and mine["fits"]:
        paired = [a / b for a, b in zip(mine["ratios"], fastest["ratios"], strict=True)]
        aa = rows["no recompute (A/A)"]["ratios"]
        lines += ["", f"remat optimal over the fastest fitting Megatron mode ({fastest['contender']}, "
                  f"{fastest['detail']}), paired by round: {statistics.median(paired):.3f} "
                  f"[{min(paired):.3f}-{max(paired):.3f}]; A/A {statistics.median(aa):.3f} "
                  f"[{min(aa):.3f}-{max(aa):.3f}]."]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
