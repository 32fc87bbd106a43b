"""DTR on three small models: measured activation memory against the budget, recompute overhead,
evictions and rematerializations, for each eviction heuristic and budgets of 25/50/75/100 % of the
no-checkpoint activation memory.

    .venv/bin/python -m benchmarks.dtr                      # MLP, GPT-2-style, ViT-style; dtr, lru, size
    .venv/bin/python -m benchmarks.dtr --models gpt2 --heuristics dtr,lru --steps 5 --json dtr.json

"measured" is ``remat.measure().activation_bytes`` of one step under DTR (measure outermost), "DTR peak"
is the peak of the memory DTR itself tracks. The other figures are medians over ``--steps`` steps after
one warm-up step, without the memory meter: evictions and rematerializations per step, recompute and step
wall-clock milliseconds as DTR counts them, and their ratio. "cpu vs none" is the CPU time of a step over
that of a step without DTR (CPU time, so that other load on the machine does not blur it); it holds both
the recomputation and the cost of intercepting every operator in Python.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import remat
from remat.meters import measure

Step = Callable[[], None]
FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def _mlp() -> tuple[nn.Module, Step]:
    model = nn.Sequential(*[m for _ in range(32) for m in (nn.Linear(256, 256), nn.ReLU())])
    x = torch.randn(1024, 256)
    return model, lambda: model(x).square().mean().backward()


def _gpt2() -> tuple[nn.Module, Step]:
    import transformers

    config = transformers.GPT2Config(
        n_layer=6, n_embd=128, n_head=4, vocab_size=512, n_positions=128, bos_token_id=0, eos_token_id=0,
        use_cache=False, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 512, (8, 128))
    return model, lambda: model(input_ids=ids, labels=ids).loss.backward()


def _vit() -> tuple[nn.Module, Step]:
    import transformers

    config = transformers.ViTConfig(
        image_size=28, patch_size=7, num_channels=1, hidden_size=128, num_hidden_layers=6,
        num_attention_heads=4, intermediate_size=512, num_labels=10, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.ViTForImageClassification(config).train()
    images, labels = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    return model, lambda: model(pixel_values=images, labels=labels).loss.backward()


MODELS: dict[str, Callable[[], tuple[nn.Module, Step]]] = {"mlp": _mlp, "gpt2": _gpt2, "vit": _vit}


def _timed(model: nn.Module, step: Step, steps: int, dtr: remat.DTR | None) -> dict[str, float]:
    """Medians over ``steps`` steps after a warm-up: wall and CPU seconds, and DTR's own figures."""
    wall, cpu, per_step = [], [], []
    for i in range(steps + 1):
        model.zero_grad(set_to_none=True)
        start, start_cpu = time.perf_counter(), time.process_time()
        if dtr is None:
            step()
        else:
            with dtr:
                step()
        if i:
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            if dtr is not None:
                per_step.append(dtr.stats.last_step)
    out = {"step_s": statistics.median(wall), "cpu_s": statistics.median(cpu)}
    if per_step:
        for key in ("evictions", "rematerializations", "recompute_s", "peak_tracked_bytes", "over_budget_ops"):
            out[key] = statistics.median(getattr(s, key) for s in per_step)
        out["recompute_fraction"] = statistics.median(s.recompute_s / s.step_s for s in per_step)
    return out


def run_model(name: str, heuristics: list[str], steps: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model, step = MODELS[name]()
    model.zero_grad(set_to_none=True)
    with measure() as m:
        step()
    baseline = m.activation_bytes
    plain = _timed(model, step, steps, None)
    rows = []
    for heuristic in heuristics:
        for fraction in FRACTIONS:
            dtr = remat.DTR(model, fraction, heuristic=heuristic, baseline_bytes=baseline)
            model.zero_grad(set_to_none=True)
            with measure() as m, dtr:
                step()
            timed = _timed(model, step, steps, dtr)
            rows.append(
                {
                    "model": name,
                    "heuristic": heuristic,
                    "fraction": fraction,
                    "baseline_bytes": baseline,
                    "budget_bytes": dtr.budget_bytes,
                    "measured_bytes": m.activation_bytes,
                    "plain_step_s": plain["step_s"],
                    "plain_cpu_s": plain["cpu_s"],
                    **timed,
                }
            )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'model':<5} {'heur':<5} {'budget':>6} {'budget B':>10} {'measured':>10} {'/budget':>7} "
        f"{'DTR peak':>10} {'evict':>6} {'remat':>6} {'recomp ms':>9} {'step ms':>8} {'recomp/step':>11} "
        f"{'cpu vs none':>11}"
    )
    lines = [head, "-" * len(head)]
    fmt = remat.format_bytes
    for r in rows:
        lines.append(
            f"{r['model']:<5} {r['heuristic']:<5} {r['fraction']:>6.0%} {fmt(r['budget_bytes']):>10} "
            f"{fmt(r['measured_bytes']):>10} {r['measured_bytes'] / r['budget_bytes']:>7.2f} "
            f"{fmt(r['peak_tracked_bytes']):>10} {r['evictions']:>6.0f} {r['rematerializations']:>6.0f} "
            f"{1e3 * r['recompute_s']:>9.1f} {1e3 * r['step_s']:>8.1f} {r['recompute_fraction']:>11.1%} "
            f"{r['cpu_s'] / r['plain_cpu_s']:>10.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,gpt2,vit", help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--heuristics", default="dtr,lru,size", help="comma-separated DTR heuristics")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: steadier timings)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
    except ImportError:
        pass
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        if name not in MODELS:
            parser.error(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
        model_rows = run_model(name, args.heuristics.split(","), args.steps)
        base = model_rows[0]
        print(
            f"\n{name}: no-checkpoint activation memory {remat.format_bytes(base['baseline_bytes'])}, "
            f"step without DTR {1e3 * base['plain_step_s']:.1f} ms ({1e3 * base['plain_cpu_s']:.1f} ms CPU)"
        )
        print(format_table(model_rows))
        rows += model_rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
