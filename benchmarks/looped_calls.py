"""Models that run the same blocks more than once per step, planned per call: a toy model looping four
residual layers twice, and Hugging Face's ALBERT (one layer shared across four depths), built from config.

For each budget (a fraction of the no-checkpoint activation memory, and the all-checkpoint minimum): the
optimal plan's actions per call, the budget, the predicted and measured peak activation memory (CPU, live-tensor
tracker), their ratio, and whether the gradients are bitwise equal to a step without checkpointing.

    python -m benchmarks.looped_calls [--batch 256] [--albert-batch 32]
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import remat
from remat.core import format_bytes


class Residual(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Looped(nn.Module):
    def __init__(self, d: int = 64, passes: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Residual(d) for _ in range(4))
        self.passes = passes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.passes):
            for layer in self.layers:
                x = layer(x)
        return x.square().mean()


def grads(model: nn.Module, run: Callable[[nn.Module], torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    run(model).backward()
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def report(name: str, model: nn.Module, run: Callable[[nn.Module], torch.Tensor], batch: Any, blocks: Any) -> None:
    expected = grads(copy.deepcopy(model), run)
    costs = remat.profile(model, batch, blocks=blocks, repeats=1)
    minimum = remat.plan(costs, "full").predicted_peak_bytes
    print(f"{name}: {len(costs)} rows {costs.fqns[0]} .. {costs.fqns[-1]}")
    print(f"{'budget':>12} {'predicted':>12} {'measured':>12} {'ratio':>6} {'exact':>6}  actions")
    for budget in (0.5, 0.35, minimum):
        plan = remat.plan(costs, "optimal", budget)
        handle = remat.apply(model, plan, blocks=blocks)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        with remat.measure() as meter:
            run(model).backward()
        handle.remove()
        exact = all(torch.equal(p.grad, q) for p, q in zip(model.parameters(), expected, strict=True))
        peak = meter.activation_bytes
        actions = " ".join(a.replace("selective:dots_saveable", "sel") for a in plan.actions.values())
        print(
            f"{format_bytes(plan.budget_bytes):>12} {format_bytes(plan.predicted_peak_bytes):>12} "
            f"{format_bytes(peak):>12} {plan.predicted_peak_bytes / peak:>6.3f} {exact!s:>6}  {actions}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--albert-batch", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.batch, 64)
    report("looped toy model (4 layers x 2)", Looped(), lambda m: m(x), x, None)
    from transformers import AlbertConfig, AlbertForMaskedLM

    config = AlbertConfig(
        vocab_size=100, embedding_size=32, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=256, max_position_embeddings=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    )  # fmt: skip
    albert = AlbertForMaskedLM(config).train()
    ids = torch.randint(0, 100, (args.albert_batch, 64))
    batch = {"input_ids": ids, "labels": ids}
    report("ALBERT (1 layer x 4)", albert, lambda m: m(**batch).loss, batch, ["albert.encoder.albert_layer_groups.0"])


if __name__ == "__main__":
    main()
