"""What one ``remat bench`` invocation does: :class:`BenchConfig`, the command-line options that fill it, and
:class:`BenchError`, the error for bad input found before training."""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .strategies import DEFAULT_STRATEGIES, StrategyError, StrategySpec, parse_strategies, parse_sweep

MIN_LAYERS = 6


class BenchError(Exception):
    """A problem with the bench's input or output folder, found before training; the message says what to do."""


@dataclass
class BenchConfig:
    """Everything one ``remat bench`` invocation does. Field names match the command-line options."""

    model: str = "gpt2"
    preset: str = "tiny"
    layers: int | None = None  # None: the preset's depth raised to MIN_LAYERS
    steps: int = 24  # the default run (`make demo`) must finish in under 5 minutes on a 2-core CPU
    warmup: int = 4
    seeds: int = 2
    strategies: list[StrategySpec] = field(default_factory=lambda: parse_strategies(DEFAULT_STRATEGIES))
    budget: str = "0.5"
    out: Path = Path("results/bench")
    resume: bool = False
    sweeps: list[tuple[str, list[Any]]] = field(default_factory=list)
    json_path: Path | None = None
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 1e-3
    tokenizer: str = "bytes"
    dataset: str | None = None
    max_bytes: int | None = None
    dropout: float | None = None
    eval_batches: int = 8
    measure_every: int = 0
    dynamic_padding: bool = False  # Shakespeare's paragraphs, each batch padded to its longest; every step measured
    threads: int = 0  # 0: half the cores
    device: str = "cpu"
    profile_repeats: int = 2
    progress: bool = True
    fail_fast: bool = False
    report: bool = True
    command: str = ""

    def settings(self) -> dict[str, Any]:
        """JSON-safe settings (what config.json records and --resume compares)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("strategies", "sweeps", "out", "json_path")}
        out["strategies"] = [s.label for s in self.strategies]
        out["sweeps"] = [[k, list(v)] for k, v in self.sweeps]
        out["out"] = str(self.out)
        return out

    def run_fields(self, layers: int | None, seed: int) -> dict[str, Any]:
        """The model, data and training fields every training job carries (a run, a sweep's torchrun child)."""
        return {
            "model": self.model,
            "preset": self.preset,
            "layers": layers,
            "dropout": self.dropout,
            "tokenizer": self.tokenizer,
            "dataset": self.dataset,
            "max_bytes": self.max_bytes,
            "dynamic_padding": self.dynamic_padding,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "lr": self.lr,
            "seed": seed,
            "steps": self.steps,
            "warmup": self.warmup,
        }

    def pgac_options(self) -> dict[str, Any]:
        """The options of the listed ``pgac`` strategy (none if it is not listed), less ``sync``: what the
        torchrun sweeps give each PGAC they start, with the mode under test set by the sweep."""
        base = next((s for s in self.strategies if s.name == "pgac"), None)
        opts = dict(base.options) if base is not None else {}
        opts.pop("sync", None)
        return opts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``remat bench`` (also ``python -m remat.bench``)."""
    d = BenchConfig()
    parser.add_argument("--model", default=d.model, help="gpt2, bert, vit or mlp (default: %(default)s)")
    parser.add_argument("--preset", default=d.preset, help="tiny, mini, base, medium... (default: %(default)s)")
    parser.add_argument(
        "--layers",
        default=None,
        help=f"repeated blocks: a number, or 'preset' for the preset's own depth (default: the "
        f"preset's depth, raised to at least {MIN_LAYERS} so the plans have a chain to "
        "choose over)",
    )
    parser.add_argument("--steps", type=int, default=d.steps, help="training steps per run (default: %(default)s)")
    parser.add_argument(
        "--warmup", type=int, default=d.warmup, help="first steps left out of every statistic (default: %(default)s)"
    )
    parser.add_argument("--seeds", type=int, default=d.seeds, help="repeats with seeds 0..N-1 (default: %(default)s)")
    parser.add_argument(
        "--strategies",
        default=DEFAULT_STRATEGIES,
        help="comma-separated; options as pgac:q=0.3,alpha=0.8,gamma=linear. Known: none, full, "
        "every_k, sqrt, memory_poor, random, optimal, pgac, dtr, compile_budget "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--budget",
        default=d.budget,
        help="activation memory budget: a fraction in (0, 1] of the no-checkpoint peak or a "
        "size like 2GiB (default: %(default)s)",
    )
    parser.add_argument("--out", default=str(d.out), help="results folder (default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="keep finished runs in --out and run the rest")
    parser.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="PGAC ablation: q=..., alpha=..., gamma=constant,linear,learned, sync=local,global (two DDP ranks) "
        "or stage_sync=local,global (a two-stage pipeline; gpt2 and mlp) (repeatable)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the summary as JSON here")
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per example (text models)")
    parser.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate")
    parser.add_argument(
        "--tokenizer",
        default=d.tokenizer,
        choices=["bytes", "bpe", "auto"],
        help="text tokens (default: %(default)s: with tiny models GPT-2's 50k-token vocabulary "
        "makes the logits, not the blocks, dominate activation memory)",
    )
    parser.add_argument("--dataset", default=None, help="image data: mnist (default) or fashion-mnist")
    parser.add_argument("--max-bytes", type=int, default=None, help="read only this much of the text corpus")
    parser.add_argument("--dropout", type=float, default=None, help="dropout of every layer (default: the model's)")
    parser.add_argument("--eval-batches", type=int, default=d.eval_batches, help="validation batches per run")
    parser.add_argument(
        "--measure-every",
        type=int,
        default=d.measure_every,
        help="also measure memory every N steps after warm-up (default: only the first step "
        "after warm-up and the last step)",
    )
    parser.add_argument(
        "--dynamic-padding",
        action="store_true",
        help="gpt2 on Shakespeare's paragraphs, each batch padded to its longest (at most --seq-len) and every "
        "tenth a third as many rows: plans per input shape within the budget, profiled at the largest batch, and "
        "every step's peak measured against the budget",
    )
    parser.add_argument("--threads", type=int, default=d.threads, help="intra-op threads (default: half the cores)")
    parser.add_argument("--device", default=d.device, help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--profile-repeats", type=int, default=d.profile_repeats, help="timed repeats per block")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-report", action="store_true", help="write the result files but no report/plots")
    parser.add_argument("--fail-fast", action="store_true", help="stop at the first failed run")


def config_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> BenchConfig:
    """A :class:`BenchConfig` from parsed options; raises :class:`BenchError` on malformed values."""
    try:
        strategies = parse_strategies(args.strategies)
        sweeps = [parse_sweep(s) for s in args.sweep]
    except StrategyError as err:
        raise BenchError(str(err)) from err
    layers: int | None
    if args.layers in (None, "auto"):
        layers = None
    elif str(args.layers) == "preset":
        layers = -1
    else:
        try:
            layers = int(args.layers)
        except ValueError:
            raise BenchError(f"--layers must be a number or 'preset', got {args.layers!r}") from None
    return BenchConfig(
        model=args.model,
        preset=args.preset,
        layers=layers,
        steps=args.steps,
        warmup=args.warmup,
        seeds=args.seeds,
        strategies=strategies,
        budget=str(args.budget),
        out=Path(args.out),
        resume=args.resume,
        sweeps=sweeps,
        json_path=Path(args.json) if args.json else None,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        tokenizer=args.tokenizer,
        dataset=args.dataset,
        max_bytes=args.max_bytes,
        dropout=args.dropout,
        eval_batches=args.eval_batches,
        measure_every=args.measure_every,
        dynamic_padding=args.dynamic_padding,
        threads=args.threads,
        device=args.device,
        profile_repeats=args.profile_repeats,
        progress=not args.no_progress,
        fail_fast=args.fail_fast,
        report=not args.no_report,
        command=_command_line(argv),
    )


def _command_line(argv: list[str] | None) -> str:
    """The command as typed: ``remat bench ...`` or ``python -m remat.bench ...``."""
    if argv is not None:
        return shlex.join(["remat", "bench", *argv])
    prog = Path(sys.argv[0]).name
    if prog == "__main__.py":
        return shlex.join(["python", "-m", "remat.bench", *sys.argv[1:]])
    return shlex.join([prog, *sys.argv[1:]])
