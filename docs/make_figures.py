"""Regenerate the figures of ``docs/strategies.md``: memory over time during one training step, per strategy.

    .venv/bin/python docs/make_figures.py            # writes docs/img/memory_timeline.png and prints the table

A small GPT-2 (built from a config, random weights, nothing downloaded) is profiled once; each strategy's plan
is applied with ``remat.apply`` and one forward and backward is measured with ``remat.measure()``, whose
``timeline`` is the live bytes of the step's own tensors after every allocation and free (parameter gradients
and other tensors that outlive the step are left out, so the curve is the activation memory). The x axis is
the position in the step (events divided by their number), so steps with recomputation, which have more
events, are drawn on the same width.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import remat

HERE = Path(__file__).resolve().parent


def build_model(layers: int, hidden: int, seq_len: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers, n_embd=hidden, n_head=4, vocab_size=2048, n_positions=seq_len, bos_token_id=0,
        eos_token_id=0, use_cache=False,
    )
    return GPT2LMHeadModel(config).train()


def measure_strategies(
    layers: int = 8, hidden: int = 128, seq_len: int = 128, batch_size: int = 4, budget: float = 0.5
) -> list[dict]:
    model = build_model(layers, hidden, seq_len)
    ids = torch.randint(0, model.config.vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    costs = remat.profile(model, batch)
    plans = [
        ("none: keep everything", remat.plan(costs, "none")),
        ("full: checkpoint every layer", remat.plan(costs, "full")),
        ("sqrt: segments of sqrt(L) layers", remat.plan(costs, "sqrt")),
        ("memory_poor: recompute from the chain input", remat.plan(costs, "memory_poor")),
        (f"optimal: budget {budget:.0%} of none", remat.plan(costs, "optimal", budget)),
    ]
    rows = []
    for label, plan in plans:
        handle = remat.apply(model, plan)
        for measured in (False, True):  # one warm-up step, then the measured one
            model.zero_grad(set_to_none=True)
            torch.manual_seed(2)
            if measured:
                handle.stats.reset()
                with remat.measure("cpu") as mem:
                    output = model(**batch)  # held through backward, as training loops (and remat.profile) do
                    output.loss.backward()
                    del output
            else:
                model(**batch).loss.backward()
        rows.append(
            {
                "label": label,
                "timeline": mem.timeline,
                "activation_bytes": mem.activation_bytes,
                "predicted_bytes": plan.predicted_peak_bytes,
                "recomputed_layers": handle.stats.total_calls,
            }
        )
        handle.remove()
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=120)
    for row in rows:
        series = row["timeline"]
        n = max(len(series) - 1, 1)
        xs = [i / n for i in range(len(series))]
        label = f"{row['label']} (peak {remat.format_bytes(row['activation_bytes'])})"
        ax.plot(xs, [b / 2**20 for b in series], label=label, lw=1.2)
    ax.set_xlabel("position in the training step (forward, then backward)")
    ax.set_ylabel("live activation memory (MiB)")
    ax.set_title("Memory during one step of a small GPT-2, per strategy (measured with remat.measure)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description="Regenerate docs/img/memory_timeline.png")
    p.add_argument("--out", type=Path, default=HERE / "img" / "memory_timeline.png")
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(1)  # steadier timings for the profile the optimal plan is made from
    rows = measure_strategies(layers=args.layers)
    plot(rows, args.out)
    print(f"{'strategy':<46} {'measured peak':>14} {'predicted peak':>15} {'layers re-run':>14}")
    for row in rows:
        print(
            f"{row['label']:<46} {remat.format_bytes(row['activation_bytes']):>14} "
            f"{remat.format_bytes(row['predicted_bytes']):>15} {row['recomputed_layers']:>14}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
