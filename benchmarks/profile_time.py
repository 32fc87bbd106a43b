"""Time to a cost table: ``remat.profile`` of a GPT-2 with every block timed, against the same profile measuring
one block of each group of identical blocks and reusing its row (the default).

The model is Hugging Face's ``GPT2LMHeadModel`` built from its config (random weights, dropout 0.1, eager
attention) at hidden 384 and 6 heads, with 12 and with 48 blocks, on a batch of 4 x 256 tokens; the two
profiles of one model alternate (order reversed every other round) and the table's own ``profile_s`` is
printed, with the blocks measured and reused and whether the two tables' bytes agree. One plain training step
runs first, so that neither profile pays for the process's lazy setup.

    .venv/bin/python -m benchmarks.profile_time [--layers 12,48] [--hidden 384] [--batch 4] [--seq 256]
        [--rounds 1] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics

import torch

import remat
from remat.bench import build_model
from remat.chains import run_step
from remat.core import CostTable


def byte_rows(costs: CostTable) -> list[tuple]:
    return [(b.saved_bytes, b.fwd_temp_bytes, b.bwd_temp_bytes, b.bwd_extra_bytes) for b in costs.blocks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="12,48")
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"GPT-2 hidden {args.hidden}, batch {args.batch}x{args.seq}, vocab {args.vocab}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(f"{'blocks':>6} {'reuse':>6} {'profile s':>10} {'measured':>9} {'reused':>7}")
    for layers in [int(n) for n in args.layers.split(",")]:
        spec = build_model(
            "gpt2",
            "mini",
            seed=0,
            dropout=0.1,
            vocab_size=args.vocab,
            num_layers=layers,
            hidden_size=args.hidden,
            num_heads=args.heads,
            max_positions=args.seq,
        )
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "labels": ids}
        run_step(spec.module, batch, spec.loss_fn)  # warm-up: the first step pays for lazy setup
        spec.module.zero_grad(set_to_none=True)
        seconds: dict[bool, list[float]] = {True: [], False: []}
        tables: dict[bool, CostTable] = {}
        for r in range(args.rounds):
            for reuse in (True, False) if r % 2 == 0 else (False, True):
                costs = remat.profile(spec.module, batch, loss_fn=spec.loss_fn, reuse_identical=reuse)
                seconds[reuse].append(costs.info["profile_s"])
                tables[reuse] = costs
                info = costs.info
                print(
                    f"{layers:>6} {str(reuse):>6} {info['profile_s']:>10.1f} "
                    f"{info['blocks_measured']:>9} {info['blocks_reused']:>7}",
                    flush=True,
                )
        with_reuse, without = statistics.median(seconds[True]), statistics.median(seconds[False])
        same = byte_rows(tables[True]) == byte_rows(tables[False])
        print(
            f"{layers} blocks: {without:.1f} s timing every block, {with_reuse:.1f} s reusing "
            f"({without / with_reuse:.1f}x faster); bytes of the two tables equal: {same}"
        )


if __name__ == "__main__":
    main()
