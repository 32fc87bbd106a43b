"""Train a GPT-2-like chain split into pipeline stages (one per rank) with a remat plan or PGAC mask per stage.

    torchrun --nproc-per-node 2 examples/train_pipeline.py                         # 1F1B, a plan per stage
    torchrun --nproc-per-node 4 examples/train_pipeline.py --schedule gpipe        # GPipe on 4 stages
    torchrun --nproc-per-node 4 examples/train_pipeline.py --pgac --thresholds global

``torch.distributed.pipelining`` runs the schedule over ``--micro-batches`` micro-batches (gloo on CPU). Each
stage profiles its own blocks on one micro-batch, divides its budget by the micro-batches alive on it at once
under the schedule (GPipe: all of them; 1F1B: ``stages - stage_index`` at most) and plans one micro-batch in
that share, or lets PGAC fit a mask there after every step. Rank 0 prints, per stage, the plan and, per step,
the loss and each stage's activation peak measured by ``remat.measure`` beside its budget. Random weights and
random tokens: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import remat
from remat.integrations import pipeline
from remat.planning import no_checkpoint_peak


class Embed(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, as in GPT-2."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(att))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16, help="the whole batch, split into micro-batches")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--schedule", choices=pipeline.SCHEDULES, default="1f1b")
    p.add_argument("--strategy", default="optimal", help=f"static plan, one of {sorted(remat.STRATEGIES)}")
    p.add_argument(
        "--budget",
        default="0.6",
        help="per stage: a fraction of the stage's no-checkpoint activation memory with its micro-batches in "
        "flight, or bytes such as '8MiB'",
    )
    p.add_argument("--pgac", action="store_true", help="a PGAC mask per stage, re-fitted after every step")
    p.add_argument("--thresholds", choices=pipeline.THRESHOLDS, default="local", help="PGAC's threshold scope")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    torch.manual_seed(0)  # the same whole model on every rank; each keeps its own stage
    blocks = [Block(args.hidden, args.heads) for _ in range(args.layers)]
    head = nn.Sequential(nn.LayerNorm(args.hidden), nn.Linear(args.hidden, args.vocab))
    stem = Embed(args.vocab, args.seq_len, args.hidden)
    stage = pipeline.split_chain(blocks, world, stem=stem, head=head)[rank]
    del blocks, head, stem

    mb = args.batch_size // args.micro_batches
    sample = (
        torch.randint(0, args.vocab, (mb, args.seq_len)) if rank == 0 else torch.randn(mb, args.seq_len, args.hidden)
    )

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, args.vocab), target.reshape(-1))

    # One micro-batch of what this stage receives; the last stage's loss is part of its activation memory.
    target = torch.randint(0, args.vocab, (mb, args.seq_len))
    last_loss = (lambda out: loss_fn(out, target)) if rank == world - 1 else None
    costs = remat.profile(stage, sample, loss_fn=last_loss, repeats=1)
    flight = pipeline.in_flight(args.schedule, world, rank, args.micro_batches)
    try:
        budget: int | str = int(float(args.budget) * flight * no_checkpoint_peak(costs))
    except ValueError:
        budget = args.budget
    if args.pgac:
        control = pipeline.stage_pgac(
            stage, budget, args.schedule, n_microbatches=args.micro_batches, costs=costs, thresholds=args.thresholds
        )
    else:
        control = pipeline.apply_stage_plan(
            stage, costs, budget, args.schedule, n_microbatches=args.micro_batches, strategy=args.strategy
        )

    _, schedule = pipeline.build(
        stage, rank, world, args.schedule, n_microbatches=args.micro_batches, sample=sample, loss_fn=loss_fn
    )
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    if args.pgac:
        control.attach(opt)
    stage_budget = remat.parse_bytes(budget) if isinstance(budget, str) else budget
    header = (
        f"stage {rank}: blocks {stage.first_block}..{stage.first_block + len(stage.blocks) - 1}, "
        f"{flight} micro-batch(es) in flight, budget {remat.format_bytes(stage_budget)} "
        f"({remat.format_bytes(stage_budget // flight)} per micro-batch)\n{control.plan.table(costs)}"
    )
    headers = [None] * world if rank == 0 else None
    dist.gather_object(header, headers)
    if rank == 0:
        what = f"PGAC ({args.thresholds} thresholds)" if args.pgac else f"plan {args.strategy!r}"
        print(f"{args.schedule} on {world} stages (gloo), {args.micro_batches} micro-batches of {mb}, {what}")
        print("\n".join(headers), flush=True)

    gen = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=gen)
        kept = sum(a == "keep" for a in control.plan.actions.values())
        losses: list[torch.Tensor] = []
        start = time.perf_counter()
        # return_outputs=False: the last stage would otherwise keep every micro-batch's logits to merge them.
        with remat.measure("cpu") as mem:
            if rank == 0:
                schedule.step(ids, return_outputs=False)
            elif rank == world - 1:
                schedule.step(target=ids.roll(-1, dims=1), losses=losses, return_outputs=False)
            else:
                schedule.step(return_outputs=False)
        seconds = time.perf_counter() - start
        opt.step()
        opt.zero_grad(set_to_none=True)
        row = (
            mem.activation_bytes,
            kept,
            len(stage.blocks),
            float(torch.stack(losses).detach().mean()) if losses else None,
        )
        rows = [None] * world if rank == 0 else None
        dist.gather_object(row, rows)
        if rank == 0:
            loss = rows[-1][3]
            peaks = "  ".join(f"s{p} {remat.format_bytes(r[0])} (kept {r[1]}/{r[2]})" for p, r in enumerate(rows))
            print(f"step {step}  loss {loss:.4f}  {seconds * 1e3:.0f} ms  activation peaks: {peaks}", flush=True)
    fits = mem.activation_bytes <= stage_budget
    verdicts = [None] * world if rank == 0 else None
    scores = " ".join(f"{v:.3g}" for v in control.scores.values()) if args.pgac else ""
    tau = f", tau {control.tau:.3g}" if args.pgac else ""
    dist.gather_object((rank, mem.activation_bytes, stage_budget, fits, scores, tau), verdicts)
    if rank == 0:
        for p, peak, limit, ok, scores, tau in verdicts:
            if scores:
                print(f"stage {p}: PGAC scores {scores}{tau}")
            state = "within" if ok else "OVER"
            print(
                f"stage {p}: last step's peak {remat.format_bytes(peak)} {state} its budget {remat.format_bytes(limit)}"
            )
    control.remove()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
