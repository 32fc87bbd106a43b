"""The ``remat`` command: ``bench``, ``plan``, ``profile``, ``estimate`` and ``advise``.

Each sub-command prints a human-readable table and, with ``--json PATH``, writes machine-readable results.
Models come from :mod:`remat.bench.models` (GPT-2, BERT, ViT built from their configs, and an MLP chain).
Arguments are checked before any model is built (:mod:`remat.cli.args`); a bad one exits with code 2 and a
message naming it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..checkpointing import PROFILED_BY_DEFAULT
from ..core import KEEP, BudgetError, CostTable, format_bytes, profile_summary
from . import args as cli_args
from . import parallel as cli_parallel


def _write_json(path: str | None, payload: Any) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2, default=str))
        print(f"wrote {path}")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt2", help="gpt2, bert, vit or mlp (or e.g. gpt2-medium)")
    p.add_argument("--preset", default=None, help="tiny, mini (6x256), medium, base... (default tiny)")
    p.add_argument("--batch-size", type=cli_args.positive_int, default=8)
    p.add_argument("--seq-len", type=cli_args.positive_int, default=128, help="tokens per sample (text models)")
    p.add_argument("--layers", type=cli_args.positive_int, default=None, help="override the number of layers")
    p.add_argument("--hidden", type=cli_args.positive_int, default=None, help="override the hidden size")
    p.add_argument("--heads", type=cli_args.positive_int, default=None, help="override the number of attention heads")
    p.add_argument(
        "--device", type=cli_args.device, default="cpu", help="cpu, cuda, cuda:N, or meta (estimate without running)"
    )
    p.add_argument("--dtype", default="float32", choices=cli_args.FLOAT_DTYPES)
    p.add_argument(
        "--policies",
        default=PROFILED_BY_DEFAULT,
        help="selective policies to cost, comma-separated ('menu', the default: every policy of remat.policies.MENU)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write machine-readable results here")


def _build(args: argparse.Namespace):  # noqa: ANN202
    from ..bench import build_model, parse_model_id

    name, preset = parse_model_id(args.model) if "-" in args.model else (args.model, args.preset or "tiny")
    if args.preset and "-" not in args.model:
        preset = args.preset
    overrides = {
        k: v
        for k, v in {"num_layers": args.layers, "hidden_size": args.hidden, "num_heads": args.heads}.items()
        if v is not None
    }
    if name in ("gpt2", "bert"):
        overrides.setdefault("max_positions", max(args.seq_len, 8))
    spec = build_model(name, preset, device=args.device if args.device == "meta" else None, **overrides)
    if name == "gpt2" and hasattr(spec.module.config, "use_cache"):
        spec.module.config.use_cache = False
    dtype = getattr(torch, args.dtype)
    if args.device != "meta":
        spec.module.to(device=args.device, dtype=dtype)
    elif dtype != torch.float32:
        spec.module.to(dtype=dtype)
    return spec


def example_batch(spec: Any, batch_size: int, seq_len: int, device: str) -> dict[str, torch.Tensor]:
    """A batch of the right shapes for ``spec`` (random tokens or pixels; costs do not depend on values)."""
    cfg = spec.config
    gen = torch.Generator().manual_seed(0)
    if spec.kind in ("lm", "mlm"):
        vocab = int(cfg.get("vocab_size", 256))
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
        batch = {"input_ids": ids.to(device), "labels": ids.to(device)}
        if spec.kind == "lm":
            # An explicit mask keeps GPT-2's causal-mask construction free of value reads (runs on meta).
            batch["attention_mask"] = torch.ones_like(ids).to(device)
        return batch
    channels = int(cfg.get("num_channels", 1))
    size = int(cfg.get("image_size", 28))
    dtype = next(spec.module.parameters()).dtype
    pixels = torch.randn(batch_size, channels, size, size, generator=gen).to(device=device, dtype=dtype)
    labels = torch.randint(0, int(cfg.get("num_labels", 10)), (batch_size,), generator=gen)
    return {"pixel_values": pixels, "labels": labels.to(device)}


def _label(spec: Any, args: argparse.Namespace) -> str:
    overrides = [f"{k} {v}" for k, v in (("layers", args.layers), ("hidden", args.hidden), ("heads", args.heads)) if v]
    label = f"{spec.name}-{spec.preset}" + (f" ({', '.join(overrides)})" if overrides else "")
    return f"{label}: {spec.num_params:,} parameters, batch {args.batch_size}x{args.seq_len}"


def model_costs(args: argparse.Namespace, batch_size: int | None = None) -> tuple[Any, Any, CostTable]:
    """The model the command's arguments describe, a batch for it and its cost table (profiled, or estimated
    on ``--device meta``)."""
    spec = _build(args)
    batch = example_batch(spec, batch_size or args.batch_size, args.seq_len, args.device)
    policies = [p for p in args.policies.split(",") if p]
    if args.device == "meta":
        from ..profiling import meta_cost_table

        costs = meta_cost_table(spec.module, batch, step=spec.step, policies=policies)
    else:
        from ..profiling import profile

        costs = profile(spec.module, batch, step=spec.step, policies=policies)
    return spec, batch, costs


REFUSED = "cannot run"  # the cell of an action a block cannot run (the reason is printed below the table)
DEFERRAL_LINE = "a block a segment re-runs ahead of a later block's backward adds"


def _print_time_costs(costs: Any, actions: list[str]) -> None:
    """Per block and action, the milliseconds the action adds to a step: recomputation + overhead (the overhead
    negative where the action's forward or backward runs faster than keep's), and the no-grad forward a
    memory-poor group re-runs the block with."""
    print("ms added to a step per action: recompute + overhead")
    print(f"{'block':<24}{'no-grad fwd':>12}" + "".join(f"{a[:22]:>24}" for a in actions))
    for b in costs.blocks:
        nograd = "-" if b.nograd_fwd_s is None else f"{b.nograd_fwd_s * 1e3:.2f}"
        cells = [
            f"{b.recompute_s[a] * 1e3:.2f} + {b.overhead_s.get(a, 0.0) * 1e3:.2f}" if a in b.recompute_s else REFUSED
            for a in actions
        ]
        print(f"{b.fqn:<24}{nograd:>12}" + "".join(f"{c:>24}" for c in cells))


def print_costs(costs: Any) -> None:
    """What ``remat profile`` prints of a cost table: bytes kept and time added per block and action."""
    actions = costs.plannable_actions()
    head = f"{'block':<24}{'fwd ms':>9}{'bwd ms':>9}" + "".join(f"{a[:22]:>24}" for a in actions)
    print(head)
    for b in costs.blocks:
        row = f"{b.fqn:<24}{b.fwd_s * 1e3:>9.2f}{b.bwd_s * 1e3:>9.2f}"
        row += "".join(f"{format_bytes(b.saved_bytes[a]) if a in b.saved_bytes else REFUSED:>24}" for a in actions)
        print(row)
    _print_time_costs(costs, [a for a in actions if a != KEEP])
    for b in costs.blocks:
        for action, why in b.unavailable.items():
            print(f"{b.fqn}: {action} cannot run here, left out of its plans: {why}")
    print(f"stem {format_bytes(costs.stem_bytes)}, head {format_bytes(costs.head_bytes)}, source {costs.source}")
    if "profile_s" in costs.info:
        print(f"profiled in {profile_summary(costs)}")
    for fqn, calls in costs.info.get("called_more_than_once", {}).items():
        print(f"{fqn} runs {calls} times per step: one row per call ({fqn}@2 .. @{calls})")
    if costs.outside_s is not None:
        kept = sum(b.fwd_s + b.bwd_s for b in costs.blocks)
        print(
            f"step keeping everything {(kept + costs.outside_s) * 1e3:.2f} ms: blocks {kept * 1e3:.2f} ms, "
            f"outside them {costs.outside_s * 1e3:.2f} ms"
        )
    if costs.deferred_s_per_byte > 0:
        print(f"{DEFERRAL_LINE} {costs.deferred_s_per_byte * 2**20 * 1e3:.3f} ms per MiB it saves")


def cmd_profile(args: argparse.Namespace) -> int:
    spec, _, costs = model_costs(args)
    print(_label(spec, args))
    print_costs(costs)
    _write_json(args.json, costs.to_dict())
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from ..planning import make_plan as plan

    start = time.perf_counter()
    if args.stages:
        return _plan_stages(args, start)
    spec, _, costs = model_costs(args)
    options: dict[str, Any] = {}
    if args.k is not None:
        options["k"] = args.k
    if args.fraction is not None:
        options["fraction"] = args.fraction
    try:
        result = plan(costs, args.strategy, args.budget, **options)
    except BudgetError as error:  # the planner's hint speaks Python; say it in this command's options
        from ..planning import no_checkpoint_peak

        if error.floor is None:
            raise
        share = error.floor / max(no_checkpoint_peak(costs), 1)
        given = format_bytes(args.budget).replace(" ", "") if isinstance(args.budget, int) else args.budget
        least = format_bytes(error.floor).replace(" ", "")
        raise ValueError(
            f"no exact plan fits --budget {given}: the least any plan reaches is {least}, "
            f"{share:.2f} of the activations without checkpointing. Give --budget {least} or "
            f"--budget {min(1.0, share + 0.005):.2f} or more, or a smaller --batch-size or --seq-len"
        ) from None
    print(f"{_label(spec, args)}, costs from {costs.source} ({costs.device})")
    print(result.table(costs))
    print(f"planned in {time.perf_counter() - start:.1f} s")
    _write_json(args.json, {"plan": json.loads(result.to_json()), "costs": costs.to_dict()})
    return 0


def _plan_stages(args: argparse.Namespace, start: float) -> int:
    spec, _, costs = model_costs(args, batch_size=args.micro_batch)
    stages = cli_parallel.stage_figures(args, spec, costs, args.budget)
    label = f"{spec.name} ({spec.num_params:,} parameters), sequence {args.seq_len}, costs from {costs.source}"
    cli_parallel.print_stages(label, args, stages)
    for s in stages:
        if s.plan is not None:
            counts = {a: list(s.plan.actions.values()).count(a) for a in dict.fromkeys(s.plan.actions.values())}
            print(f"stage {s.index} plan: " + ", ".join(f"{a} x{n}" for a, n in counts.items()))
    print(f"planned in {time.perf_counter() - start:.1f} s")
    _write_json(args.json, {"stages": [cli_parallel.stage_json(s) for s in stages]})
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from ..profiling import transformer_layer_activation_bytes

    bytes_per_element = cli_args.bytes_per_element(args.dtype)
    common = dict(
        bytes_per_element=bytes_per_element,
        dropout=not args.no_dropout,
        flash_attention=args.flash,
        activation=args.activation,
    )
    s, b, h, a = args.seq_len, args.batch_size, args.hidden, args.heads
    per_layer = transformer_layer_activation_bytes(s, b, h, a, **common)
    recompute = transformer_layer_activation_bytes(s, b, h, a, **common, full_recompute=True)
    print(
        f"transformer layer, s={s} b={b} h={h} a={a}, {args.dtype}, dropout={not args.no_dropout}, "
        f"flash={args.flash}, {args.activation}"
    )
    print(f"  activations per layer:            {format_bytes(per_layer)}")
    print(f"  per layer with full recompute:    {format_bytes(recompute)}")
    print(f"  {args.layers} layers:                       {format_bytes(per_layer * args.layers)}")
    print(f"  {args.layers} layers, full recompute:       {format_bytes(recompute * args.layers)}")
    _write_json(
        args.json,
        {
            "per_layer_bytes": per_layer,
            "per_layer_full_recompute_bytes": recompute,
            "layers": args.layers,
            "total_bytes": per_layer * args.layers,
            "total_full_recompute_bytes": recompute * args.layers,
        },
    )
    return 0


def cmd_advise(args: argparse.Namespace) -> int:
    from ..fitting import advise, advise_costs, model_state_bytes

    if args.stages:
        return cli_parallel.advise_stages(args, *model_costs(args, batch_size=args.micro_batch), _write_json)
    if args.device != "meta":  # measured on the model: remat.advise
        spec = _build(args)
        batch = example_batch(spec, args.batch_size, args.seq_len, args.device)
        make = torch.optim.Adam if args.optimizer == "adam" else torch.optim.SGD
        optimizer = make(spec.module.parameters(), lr=1e-4)
        measured = advise(spec.module, batch, args.device_memory, optimizer=optimizer, step=spec.step)
        print(_label(spec, args))
        print(measured.text())
        _write_json(
            args.json,
            {
                "fits_without_checkpointing": measured.fits_plain,
                "whole_peaks": measured.whole_peaks,
                "step_seconds": measured.step_seconds,
                "plan": json.loads(measured.fit.plan.to_json()) if measured.fit else None,
                "planned_ratios": list(measured.planned_ratios),
                "largest_plain_batch": measured.largest_plain_batch,
                "largest_planned_batch": measured.largest_planned_batch,
                "out_of_memory": list(measured.out_of_memory),
                "refusal": measured.refusal,
            },
        )
        return 0
    spec, batch, costs = model_costs(args)
    state = model_state_bytes(spec.num_params, args.optimizer, args.dtype != "float32")
    result = advise_costs(costs, batch_size=args.batch_size, device_memory=args.device_memory, state_bytes=state)
    print(_label(spec, args))
    print(result.text())
    _write_json(
        args.json,
        {
            "needs_checkpointing": result.needs_checkpointing,
            "available_bytes": result.available_bytes,
            "no_checkpoint_bytes": result.no_checkpoint_bytes,
            "minimum_bytes": result.minimum_bytes,
            "plan": json.loads(result.plan.to_json()) if result.plan else None,
            "overhead": result.overhead,
            "batch_options": [
                {"batch_size": o.batch_size, "fits": o.plan is not None, "step_s": o.step_s, "throughput": o.throughput}
                for o in result.batch_options
            ],
        },
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="remat", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    from ..bench import runner

    bench = sub.add_parser("bench", help="run the strategy comparison experiment and write a report")
    runner.add_arguments(bench)
    bench.set_defaults(func=runner.run_from_args)

    p = sub.add_parser("plan", help="plan which blocks to keep, checkpoint or recompute under a budget")
    _add_model_args(p)
    p.add_argument("--strategy", default="optimal")
    p.add_argument(
        "--budget",
        type=cli_args.budget,
        default=None,
        help="bytes (4096, 20GiB) or a fraction of the no-checkpoint activation memory (0.5, 50%%)",
    )
    p.add_argument("-k", type=cli_args.positive_int, default=None, help="segment length for every_k")
    p.add_argument("--fraction", type=cli_args.unit_fraction, default=None, help="fraction checkpointed for random")
    cli_parallel.add_arguments(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("profile", help="measure per-block costs (time, saved bytes per action)")
    _add_model_args(p)
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("estimate", help="analytic activation memory of a transformer layer")
    p.add_argument("--seq-len", type=cli_args.positive_int, default=1024)
    p.add_argument("--batch-size", type=cli_args.positive_int, default=8)
    p.add_argument("--hidden", type=cli_args.positive_int, default=1024)
    p.add_argument("--heads", type=cli_args.positive_int, default=16)
    p.add_argument("--layers", type=cli_args.positive_int, default=24)
    p.add_argument("--dtype", default="bfloat16", choices=cli_args.FLOAT_DTYPES)
    p.add_argument("--no-dropout", action="store_true")
    p.add_argument("--flash", action="store_true", help="fused attention: no s*s scores stored")
    p.add_argument("--activation", default="gelu", choices=["gelu", "relu"])
    p.add_argument("--json", default=None, metavar="PATH")
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("advise", help="is checkpointing needed, which plan fits, is a larger batch worth it")
    _add_model_args(p)
    p.add_argument("--device-memory", type=cli_args.size, default="80GiB", help="memory of the training device")
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    cli_parallel.add_arguments(p)
    p.set_defaults(func=cmd_advise)
    return parser


MODEL_COMMANDS = ("plan", "profile", "advise")


def check_args(args: argparse.Namespace) -> None:
    """Checks that need several arguments or the file system; raise ValueError before any work is done."""
    cli_args.check_output_file(getattr(args, "json", None))
    if args.command == "bench":
        cli_args.check_output_folder(args.out)
    if args.command in MODEL_COMMANDS:
        from ..bench import parse_model_id

        name, _ = parse_model_id(args.model)  # raises on an unknown model or preset, naming the known ones
        if args.preset:
            parse_model_id(f"{name}-{args.preset}")
    if args.command == "plan":
        from ..planning import STRATEGIES

        if args.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {args.strategy!r}; known strategies: {', '.join(STRATEGIES)}")
        if args.strategy == "optimal" and args.budget is None:
            raise ValueError("strategy 'optimal' needs --budget: bytes (e.g. 2GiB) or a fraction (e.g. 0.5 or 50%)")
    if args.command == "estimate" and args.hidden % args.heads:
        raise ValueError(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")


def main(argv: list[str] | None = None) -> int:
    """The ``remat`` command; returns the exit code (2 for a bad argument, with a message on stderr)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # argparse printed the usage and the error, or the help
        return stop.code if isinstance(stop.code, int) else 2
    try:
        check_args(args)
        return int(args.func(args) or 0)
    except (ValueError, KeyError, RuntimeError) as err:
        print(f"remat {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
