"""What a selective-checkpoint region adds to a block's forward: a GPT-2 block's forward inside
``remat.checkpoint(block, x, policy=...)`` against the same forward without a region, on the CPU.

Every policy runs on the same block and input, with dropout on (0.1) and off (0.0). Each round times every
variant right beside a plain forward (the pair's order flipped every other round, the variants' order reversed
every other round), so that load drifting on a shared machine hits both sides of a pair alike; each sample is
the median of ``--inner`` forwards. A variant's figure is the median over rounds of its ratio to its pair's
plain forward, with the 25th and 75th percentiles, and the median extra milliseconds. ``plain (A/A)`` is the
plain forward against itself, the noise floor. ``checkpoint`` is a region with no policy.

``--before REV`` also loads remat as it was at git revision ``REV`` (extracted to a temporary folder and
imported under another name) and times its regions in the same rounds, so both versions meet the same load.

    .venv/bin/python benchmarks/selective_overhead.py [--hidden 384] [--heads 6] [--batch 4] [--seq 256]
        [--rounds 15] [--inner 5] [--threads N] [--before REV]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import remat

POLICIES = ("nothing_saveable", "dots_saveable", "everything_saveable")


def load_before(rev: str) -> Any:
    """remat's source at git revision ``rev``, imported as the package ``remat_before``."""
    root = Path(__file__).resolve().parents[1]
    folder = Path(tempfile.mkdtemp(prefix="remat_before_"))
    archive = subprocess.run(["git", "-C", str(root), "archive", rev, "src/remat"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    (folder / "src" / "remat").rename(folder / "remat_before")
    sys.path.insert(0, str(folder))
    return importlib.import_module("remat_before")


def gpt2_block(hidden: int, heads: int, seq: int, dropout: float) -> torch.nn.Module:
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = GPT2Config(
        n_embd=hidden,
        n_head=heads,
        n_positions=seq,
        resid_pdrop=dropout,
        attn_pdrop=dropout,
        embd_pdrop=dropout,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return GPT2Block(config).train()


def first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def variants(block: torch.nn.Module, before: Any) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    found: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "plain": lambda x: first(block(x)),
        "plain (A/A)": lambda x: first(block(x)),
        "checkpoint": lambda x: first(remat.checkpoint(block, x)),
    }
    libraries = [("", remat)] + ([("before ", before)] if before is not None else [])
    for label, lib in libraries:
        for policy in POLICIES:
            found[f"{label}{policy}"] = lambda x, lib=lib, policy=policy: first(lib.checkpoint(block, x, policy=policy))
    return found


def sample(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, inner: int) -> float:
    times = []
    for _ in range(inner):
        start = time.perf_counter()
        out = fn(x)
        times.append(time.perf_counter() - start)
        del out
    return statistics.median(times)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return q[0], statistics.median(values), q[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--before", default=None, help="git revision of remat to time beside this one")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    before = load_before(args.before) if args.before else None
    print(
        f"GPT-2 block, hidden {args.hidden}, {args.heads} heads, input {args.batch}x{args.seq}, CPU, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}; {args.rounds} rounds of "
        f"{args.inner} forwards, ratio to the plain forward of its pair (median [p25, p75]), extra ms"
    )
    for dropout in (0.1, 0.0):
        block = gpt2_block(args.hidden, args.heads, args.seq, dropout)
        x = torch.randn(args.batch, args.seq, args.hidden, requires_grad=True)
        runs = variants(block, before)
        for fn in runs.values():  # warm-up
            fn(x)
        names = [name for name in runs if name != "plain"]
        pairs: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else reversed(names):
                if r % 2 == 0:
                    base = sample(runs["plain"], x, args.inner)
                    other = sample(runs[name], x, args.inner)
                else:
                    other = sample(runs[name], x, args.inner)
                    base = sample(runs["plain"], x, args.inner)
                pairs[name].append((other, base))
        plain = [base for samples in pairs.values() for _, base in samples]
        print(f"\ndropout {dropout}: plain forward {statistics.median(plain) * 1e3:.2f} ms")
        for name in names:
            lo, mid, hi = quartiles([o / b for o, b in pairs[name]])
            extra = statistics.median([o - b for o, b in pairs[name]]) * 1e3
            print(f"  {name:<28} {mid:6.3f}  [{lo:.3f}, {hi:.3f}]   {extra:+7.2f} ms")


if __name__ == "__main__":
    main()
