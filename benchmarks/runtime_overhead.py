"""remat's runtime against hand-written ``torch.utils.checkpoint`` running the same plan, on HF models.

The same plan (the first four of six blocks checkpointed, ``CCCCKK``, and all six, ``CCCCCC``) is run two ways
on copies of one model: by ``remat.apply`` (hooks) and by a hand-written wrapper that calls
``torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False)`` on the same blocks (what
``peers.py``'s "torch checkpoint, first k blocks" runs). Models, batch and step are those of the peers
benchmark (:mod:`benchmarks.peers.models`: HF GPT-2 with dropout 0.1 and Llama, built from config), in fp32 and under
bf16 autocast. Each step is timed with ``time.process_time`` (CPU seconds, one intra-op thread), every
contender once per round, the order reversed every other round; an A/A pair (the hand-written contender
twice) shows the noise floor. Per case it prints the median of the per-round ratios remat / hand-written,
with the 25th-75th percentile spread, the median per-round difference remat - hand-written of the forward
(model call and loss) and of the backward (``+fwd ms``, ``+bwd ms``), and checks that remat's gradients equal
the hand-written ones bitwise.

    python -m benchmarks.runtime_overhead [--rounds 30] [--models gpt2 llama] [--dtypes fp32 bf16]
        [--profile]   # also print remat's own Python time per step (cProfile) for CCCCCC
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable

import torch

import remat
from benchmarks.peers.contenders import HandCheckpointed
from benchmarks.peers.device import precision_context
from benchmarks.peers.models import ModelSetting, block_list, build_model, make_batch

PLANS = {"CCCCKK": 4, "CCCCCC": 6}


def remat_plan(model: torch.nn.Module, k: int) -> remat.Plan:
    blocks = block_list(model)
    names = {id(m): n for n, m in model.named_modules()}
    return remat.Plan({names[id(b)]: ("checkpoint" if i < k else "keep") for i, b in enumerate(blocks)})


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def quantiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], statistics.median(values), q[2]


def run_setting(setting: ModelSetting, rounds: int, warmup: int, profile: bool) -> list[dict[str, float | str]]:
    base = build_model(setting)
    batch = make_batch(setting)
    hand_model = copy.deepcopy(base)
    hand = HandCheckpointed(hand_model, block_list(hand_model))
    remat_model = copy.deepcopy(base)
    handle = remat.apply(remat_model, remat_plan(remat_model, 0))
    plain = copy.deepcopy(base)

    def step(model: torch.nn.Module, select: Callable[[], None]) -> Callable[[], tuple[float, float]]:
        def run() -> tuple[float, float]:  # the forward's and the backward's CPU seconds
            select()
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            start = time.process_time()
            with precision_context(setting.dtype, "cpu"):
                loss = model(**batch).loss
            forward_done = time.process_time()
            loss.backward()
            return forward_done - start, time.process_time() - forward_done

        return run

    contenders: dict[str, Callable[[], tuple[float, float]]] = {"none": step(plain, lambda: None)}
    for name, k in PLANS.items():
        plan = remat_plan(remat_model, k)
        contenders[f"hand-{name}"] = step(hand_model, lambda k=k: hand.use("plain", k))
        contenders[f"hand-{name}-aa"] = step(hand_model, lambda k=k: hand.use("plain", k))
        contenders[f"remat-{name}"] = step(remat_model, lambda plan=plan: handle.set_plan(plan))

    # gradients: remat's equal the hand-written ones (same seed, same dropout draws) bitwise
    exact = {}
    for name in PLANS:
        contenders[f"hand-{name}"]()
        want = grads(hand_model)
        contenders[f"remat-{name}"]()
        got = grads(remat_model)
        exact[name] = all(torch.equal(want[n], got[n]) for n in want) and want.keys() == got.keys()

    for _ in range(warmup):
        for run in contenders.values():
            run()
    parts: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    for r in range(rounds):
        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for name in order:
            parts[name].append(contenders[name]())
    times = {name: [f + b for f, b in steps] for name, steps in parts.items()}

    rows: list[dict[str, float | str]] = []
    for name in PLANS:
        hand_t, remat_t, aa_t = times[f"hand-{name}"], times[f"remat-{name}"], times[f"hand-{name}-aa"]
        ratio = [a / b for a, b in zip(remat_t, hand_t, strict=True)]
        aa = [a / b for a, b in zip(aa_t, hand_t, strict=True)]
        vs_none = [a / b for a, b in zip(hand_t, times["none"], strict=True)]
        remat_p, hand_p = parts[f"remat-{name}"], parts[f"hand-{name}"]
        extra = [statistics.median((r[i] - h[i]) * 1e3 for r, h in zip(remat_p, hand_p, strict=True)) for i in (0, 1)]
        rows.append({
            "model": setting.model, "dtype": setting.dtype, "plan": name,
            "none_ms": statistics.median(times["none"]) * 1e3,
            "hand_ms": statistics.median(hand_t) * 1e3, "remat_ms": statistics.median(remat_t) * 1e3,
            "ratio": quantiles(ratio), "aa": quantiles(aa), "hand_vs_none": statistics.median(vs_none),
            "exact": "yes" if exact[name] else "NO", "extra_fwd_ms": extra[0], "extra_bwd_ms": extra[1],
        })
    if profile:
        handle.set_plan(remat_plan(remat_model, 6))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            contenders["remat-CCCCCC"]()
        prof.disable()
        stats = pstats.Stats(prof)
        own = sum(row[2] for key, row in stats.stats.items() if "/remat/" in key[0])
        print(f"  [{setting.model} {setting.dtype}] remat's own code, CCCCCC: {own / 5 * 1e3:.2f} ms per step "
              "(cProfile, self time)")
        stats.sort_stats("tottime").print_stats(r"/remat/", 10)
    handle.remove()
    return rows


def fmt(q: tuple[float, float, float]) -> str:
    return f"{q[1]:.3f} [{q[0]:.3f}-{q[2]:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--size", default="default")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s), CPU seconds "
          f"(time.process_time), {args.rounds} interleaved rounds, size {args.size!r}")
    header = (f"{'model':<6} {'dtype':<5} {'plan':<7} {'none ms':>8} {'hand ms':>8} {'remat ms':>9} "
              f"{'remat/hand [q1-q3]':>22} {'A/A [q1-q3]':>22} {'hand/none':>9} {'grads equal':>11} "
              f"{'+fwd ms':>8} {'+bwd ms':>8}")
    rows = []
    for model in args.models:
        for dtype in args.dtypes:
            rows += run_setting(ModelSetting(model, dtype, args.size), args.rounds, args.warmup, args.profile)
    print(header)
    for r in rows:
        print(f"{r['model']:<6} {r['dtype']:<5} {r['plan']:<7} {r['none_ms']:>8.1f} {r['hand_ms']:>8.1f} "
              f"{r['remat_ms']:>9.1f} {fmt(r['ratio']):>22} {fmt(r['aa']):>22} {r['hand_vs_none']:>9.3f} "
              f"{r['exact']:>11} {r['extra_fwd_ms']:>+8.2f} {r['extra_bwd_ms']:>+8.2f}")


if __name__ == "__main__":
    main()
