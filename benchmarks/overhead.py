"""Step-time overhead of remat's runtime: the ``full`` plan applied with ``remat.apply`` against a hand-written
loop of ``torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)`` on the same model.

The model is a GPT-2-style stack of pre-norm transformer blocks (attention through
``scaled_dot_product_attention``, a 4x MLP, dropout). Both variants run the same blocks on the same batch
and both preserve the RNG state; the only difference is who opens the checkpoint frames: remat's forward
hooks, or an explicit call per block. Steps are interleaved (manual, remat, no checkpointing, ...) after a
warm-up, and medians are compared, so drifts in machine load hit all variants alike.

    .venv/bin/python -m benchmarks.overhead [--layers 8] [--width 128] [--seq 128] [--batch 4] [--repeats 40]
        [--profile]   # also break down where remat's hooks spend their time (cProfile)

Target: remat / manual step-time ratio at most 1.02.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import remat


class Block(nn.Module):
    """A GPT-2 block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``, causal attention, dropout."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class Stack(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, vocab: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([Block(width, heads, dropout) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.manual_checkpoint = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.manual_checkpoint else block(h)
        logits = self.head(self.ln(h))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def time_step(model: Stack, ids: torch.Tensor, optimizer: torch.optim.Optimizer) -> float:
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    model(ids).backward()
    optimizer.step()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, float]:
    torch.manual_seed(0)
    model = Stack(args.layers, args.width, args.heads, args.vocab).train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    fqns = [f"blocks.{i}" for i in range(args.layers)]
    full = remat.Plan(dict.fromkeys(fqns, "checkpoint"), strategy="full")
    keep = remat.Plan(dict.fromkeys(fqns, "keep"), strategy="none")
    handle = remat.apply(model, keep)

    def manual() -> float:
        handle.set_plan(keep)
        model.manual_checkpoint = True
        return time_step(model, ids, optimizer)

    def with_remat() -> float:
        handle.set_plan(full)
        model.manual_checkpoint = False
        return time_step(model, ids, optimizer)

    def plain() -> float:
        handle.set_plan(keep)
        model.manual_checkpoint = False
        return time_step(model, ids, optimizer)

    variants: dict[str, Callable[[], float]] = {"manual": manual, "remat": with_remat, "none": plain}
    for fn in variants.values():  # warm-up
        for _ in range(args.warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(args.repeats):
        order = list(variants) if i % 2 == 0 else list(reversed(variants))
        for name in order:
            times[name].append(variants[name]())
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"GPT-2-style stack: {args.layers} blocks, width {args.width}, {args.heads} heads, batch "
          f"{args.batch}x{args.seq} tokens, vocab {args.vocab}, {torch.get_num_threads()} threads, "
          f"{args.repeats} interleaved steps each")
    print(f"{'variant':<44} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    labels = {"none": "no checkpointing", "manual": "torch checkpoint loop (use_reentrant=False)",
              "remat": "remat.apply, full plan"}
    for name in ("none", "manual", "remat"):
        t = times[name]
        print(f"{labels[name]:<44} {med[name] * 1e3:>10.1f} {min(t) * 1e3:>8.1f} {max(t) * 1e3:>8.1f}")
    ratio = med["remat"] / med["manual"]
    # Paired ratios (each remat step against the manual step of the same round) are less noisy.
    paired = statistics.median(r / m for r, m in zip(times["remat"], times["manual"], strict=True))
    fastest = min(times["remat"]) / min(times["manual"])
    print(f"remat / manual: {ratio:.3f} (medians), {paired:.3f} (median of paired rounds), {fastest:.3f} "
          "(fastest steps); target <= 1.02")
    print(f"manual / none: {med['manual'] / med['none']:.3f}  (the price of recomputation itself)")
    if args.profile:
        handle.set_plan(full)
        model.manual_checkpoint = False
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(5):
            time_step(model, ids, optimizer)
        profiler.disable()
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        own = sum(row[2] for key, row in stats.stats.items() if "/remat/" in key[0])  # tottime
        total = sum(row[2] for row in stats.stats.values())
        stats.sort_stats("tottime").print_stats(r"/remat/", 12)
        print(f"\nremat's own code (its lines, not the blocks it calls): {own / 5 * 1e3:.2f} ms per step, "
              f"{own / total:.2%} of the profiled time")
        print(out.getvalue())
    handle.remove()
    figures = {"remat_over_manual": ratio, "paired": paired, "fastest": fastest}
    return figures | {f"{k}_ms": v * 1e3 for k, v in med.items()}


class TinyBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class TinyStack(nn.Module):
    """Blocks so small that a step's time is almost all framework overhead."""

    def __init__(self, layers: int, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TinyBlock(width) for _ in range(layers)])
        self.manual_checkpoint = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.manual_checkpoint else block(x)
        return x.square().mean()


def per_block_overhead(layers: int = 32, rounds: int = 200) -> dict[str, float]:
    """Microseconds per block and step for tiny blocks: the fixed cost of opening a checkpoint frame."""
    torch.manual_seed(0)
    model = TinyStack(layers)
    x = torch.randn(4, 16, requires_grad=True)
    fqns = [f"blocks.{i}" for i in range(layers)]
    keep = remat.Plan(dict.fromkeys(fqns, "keep"))
    full = remat.Plan(dict.fromkeys(fqns, "checkpoint"))
    handle = remat.apply(model, keep)
    settings = {"none": (keep, False), "manual": (keep, True), "remat": (full, False)}
    times: dict[str, list[float]] = {name: [] for name in settings}
    for i in range(rounds + 10):
        for name, (plan, manual) in settings.items():
            handle.set_plan(plan)
            model.manual_checkpoint = manual
            start = time.perf_counter()
            model(x).backward()
            if i >= 10:
                times[name].append(time.perf_counter() - start)
    handle.remove()
    us = {name: statistics.median(t) / layers * 1e6 for name, t in times.items()}
    print(f"\ntiny blocks (Linear 16x16 + tanh, batch 4, {layers} blocks, {rounds} interleaved steps): "
          "median microseconds per block per step")
    print(f"  no checkpointing {us['none']:.1f}   torch checkpoint loop {us['manual']:.1f}   "
          f"remat full plan {us['remat']:.1f}   -> remat adds {us['remat'] - us['manual']:+.1f} us per block "
          "over the hand-written loop")
    return {f"tiny_{k}_us_per_block": v for k, v in us.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--profile", action="store_true", help="cProfile remat's hooks after timing")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = run(args)
    result |= per_block_overhead()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
