"""Train a tiny GPT-2 with DDP (or FSDP2) and a remat plan; print loss and memory per step.

    torchrun --nproc_per_node 2 examples/train_ddp.py                 # gloo on CPU, nccl on GPU
    torchrun --nproc_per_node 2 examples/train_ddp.py --pgac          # gradient-aware PGAC instead of a plan
    torchrun --nproc_per_node 2 examples/train_ddp.py --fsdp          # FSDP2 (the plan is made before sharding)
    torchrun --nproc_per_node 2 examples/train_ddp.py --static-graph  # DistributedDataParallel(static_graph=True)

The model is built from a config with random weights and trained on random tokens: nothing is downloaded.
With DDP the first step runs with every layer checkpointed and is profiled; the plan applies from the second
step on. FSDP2 frees each layer's parameters after its forward, so there the plan is made from a sample batch
before ``fully_shard``. Rank 0 prints the plan and, per step, the loss, the step time and the memory measured
by ``remat.measure`` (the CUDA allocator's peak on GPU; on CPU the live-tensor tracker, which slows the step).
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import remat
from remat.integrations import distributed, hf


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--strategy", default="optimal", help=f"one of {sorted(remat.STRATEGIES)}")
    p.add_argument("--budget", default="0.5", help="a fraction of the no-checkpoint activation memory, or '2MiB'")
    p.add_argument("--pgac", action="store_true", help="use remat.PGAC (gradient-aware, re-planned every step)")
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2's fully_shard instead of DDP")
    p.add_argument("--static-graph", action="store_true", help="DDP with static_graph=True")
    return p.parse_args()


def budget_arg(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def main() -> None:
    args = parse_args()
    backend = distributed.default_backend()
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # the same initial weights on every rank
    config = GPT2Config(
        n_layer=args.layers,
        n_embd=args.hidden,
        n_head=4,
        vocab_size=512,
        n_positions=args.seq_len,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).to(device).train()
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own data

    def sample() -> dict[str, torch.Tensor]:
        ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), generator=gen).to(device)
        return {"input_ids": ids, "labels": ids}

    strategy = "pgac" if args.pgac else args.strategy
    # The plan goes on before DDP wrapping or fully_shard, on every rank (rank 0's measurements are used by
    # all). hf.enable also sets use_cache=False: a KV cache would keep every layer's keys and values alive.
    session = hf.enable(model, strategy, budget_arg(args.budget), batch=sample() if args.fsdp else None)
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,))
        trained: nn.Module = distributed.fully_shard_blocks(model, session, mesh=mesh)
    else:
        device_ids = [device.index] if device.type == "cuda" else None
        trained = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, static_graph=args.static_graph)
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-3)

    if rank == 0:
        how = "FSDP2" if args.fsdp else "DDP"
        print(f"{how} on {world} ranks ({backend}), GPT-2 with {args.layers} layers, strategy {strategy!r}", flush=True)
    for step in range(args.steps):
        batch = sample()
        ran = session.plan  # the plan this step runs with
        start = time.perf_counter()
        # The whole step is measured, optimizer included: the first step's profiling ends at optimizer.step().
        with remat.measure(device) as mem:
            loss = trained(**batch).loss
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        if rank == 0:
            if step == 0:  # the plan made from the profiled first step (or from the sample batch)
                print(session.plan.table(session.costs or getattr(session.pgac, "costs", None)), flush=True)
            kept = sum(ran.actions[f] == "keep" for f in ran.actions)
            predicted = ran.predicted_peak_bytes
            print(
                f"step {step}  loss {loss.item():.4f}  {seconds * 1e3:.0f} ms  "
                f"activation peak {remat.format_bytes(mem.activation_bytes)}"
                + (f" (predicted {remat.format_bytes(predicted)})" if predicted is not None else " (profiling step)")
                + f"  peak {remat.format_bytes(mem.peak_bytes)}  layers kept {kept}/{len(session.mask)}",
                flush=True,
            )
    session.remove()
    # The DDP wrapper's reducer holds the process group's pending work: free it while the group is alive, or gloo
    # may abort at interpreter exit ("terminate called without an active exception").
    del trained
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
