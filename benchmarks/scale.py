"""Per-stage activation memory of GPT-2-architecture models from 100M to 70B parameters, on the meta device.

    PYTHONPATH=src python -m benchmarks.scale > docs/results/scale_table.md

For each configuration: the CostTable of one micro-batch computed on ``meta`` (``remat plan --device meta
--stages ...`` does the same), one transformer layer's kept bytes beside the layer formula
``34sbh + 5as²b`` (1-byte dropout masks, as on GPUs) and its variant with masks in the activation dtype
(what eager dropout keeps off the GPU, and on ``meta``) and what the meta table keeps beyond the latter in
units of ``sbh``, then the first and last pipeline stage: activation
bytes with their micro-batches in flight, without checkpointing and with the optimal plan at half of it.
Prints a markdown table and the seconds each configuration took.
"""

from __future__ import annotations

import sys
import time

from remat.cli import build_parser, layer_shape, model_costs, stage_figures
from remat.core import format_bytes
from remat.profiling import transformer_layer_activation_bytes

# name, layers, hidden, heads, seq, micro-batch, stages, tp, sequence parallel
CONFIGS = [
    ("125M", 12, 768, 12, 1024, 4, 2, 1, False),
    ("350M", 24, 1024, 16, 1024, 4, 2, 1, False),
    ("1.3B", 24, 2048, 16, 2048, 2, 4, 1, False),
    ("2.7B", 32, 2560, 32, 2048, 2, 4, 2, False),
    ("6.7B", 32, 4096, 32, 2048, 1, 4, 4, False),
    ("10B", 48, 4096, 32, 2048, 1, 8, 4, True),
    ("70B-class", 80, 8192, 64, 4096, 1, 8, 8, True),
]


def row(name: str, layers: int, hidden: int, heads: int, seq: int, mb: int, stages: int, tp: int, sp: bool) -> str:
    argv = ["plan", "--device", "meta", "--model", "gpt2", "--layers", str(layers), "--hidden", str(hidden)]
    argv += ["--heads", str(heads), "--seq-len", str(seq), "--dtype", "bfloat16", "--policies", ""]
    argv += ["--stages", str(stages), "--micro-batch", str(mb), "--tp", str(tp), "--budget", "0.5"]
    argv += ["--sequence-parallel"] if sp else []
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    spec, _, costs = model_costs(args, batch_size=mb)
    figures = stage_figures(args, spec, costs, 0.5)
    seconds = time.perf_counter() - start
    kept = costs.blocks[0].saved("keep")
    gpu = transformer_layer_activation_bytes(seq, mb, hidden, heads)
    eager = transformer_layer_activation_bytes(seq, mb, hidden, heads, mask_bytes=2)
    shape = layer_shape(spec, args)
    first, last = figures[0], figures[-1]
    excess = (kept - eager) / (seq * mb * hidden)

    def planned(s) -> str:  # noqa: ANN001
        return format_bytes(s.planned_stage_bytes) if s.planned_stage_bytes is not None else "no fit"

    par = f"S={stages} 1F1B, {2 * stages}x{mb}, tp {tp}{'+SP' if sp else ''}"
    return (
        f"| {name} | {spec.num_params / 1e9:.2f}B | {layers}/{hidden}/{heads}/{seq} | {par} | "
        f"{format_bytes(kept)} | {format_bytes(gpu)} | {format_bytes(eager)} | {excess:.2f} | "
        f"{format_bytes(shape.layer_bytes(tp, sp))} | "
        f"{first.in_flight} x {format_bytes(first.micro_batch_bytes)} = {format_bytes(first.stage_bytes)} | "
        f"{planned(first)} | "
        f"{last.in_flight} x {format_bytes(last.micro_batch_bytes)} = {format_bytes(last.stage_bytes)} | "
        f"{planned(last)} | {seconds:.1f} |"
    )


def main() -> None:
    print(
        "| model | parameters | layers/hidden/heads/seq | parallelism | meta: kept per layer | formula "
        "34sbh+5as²b | formula, 2-byte masks | (meta - that) / sbh | formula per layer per TP rank | "
        "stage 0, no checkpointing | stage 0, plan at 0.5 | last stage, no checkpointing | last stage, plan "
        "at 0.5 | seconds |"
    )
    print("|" + "---|" * 14)
    for config in CONFIGS:
        print(row(*config), flush=True)
    print(file=sys.stderr)


if __name__ == "__main__":
    main()
