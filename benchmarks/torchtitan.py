"""remat next to torchtitan's own activation-checkpointing modes on torchtitan's Llama 3 debug model: the activation
peak, the step against no checkpointing and the gradients, at half the no-checkpoint activations.

Every model goes through torchtitan's own ``parallelize_llama`` (the mode applied to the ``meta`` model, then
torchtitan's per-block ``torch.compile`` where asked, then ``fully_shard`` with its mixed-precision policy), is
materialised with ``to_empty`` and initialised by ``init_weights`` from one seed, as torchtitan's trainer does.
Contenders: no checkpointing (twice: an A/A pair), ``FullAC``, ``SelectiveAC`` (torchtitan's default: every other
matmul and the attention saved), and ``RematAC`` at 0.5 (:mod:`remat.integrations.torchtitan`: the plan estimated on
the ``meta`` device at the batch; with ``--compile`` its plan runs inside torchtitan's compiled blocks).

Eager, the activation peak is ``remat.measure().activation_bytes`` around one step (what outlives the step, the
gradients, left out). Compiled code hides its buffers from that tracker and refuses its dispatch mode, so with
``--compile`` the figure is the bytes the compiled graphs save for the backward (unique storages packed by
``saved_tensors_hooks`` whose first dimension is the batch's rows or tokens), the part checkpointing changes.
Gradients are compared with no checkpointing's bitwise over two SGD steps. Steps are timed in CPU seconds with one
intra-op thread, in interleaved rounds (order reversed every other round), as ratios to no checkpointing's step of
the same round.

What a CPU run maps (:func:`torchtitan_on_cpu`, :func:`build`): torchtitan builds its device mesh on ``"cuda"`` when
it finds no accelerator, so the mesh's device type is set to ``"cpu"``; gloo reduces with SUM only, so ``fully_shard``
is told to divide the gradients around a SUM (``set_force_sum_reduction_for_comms``); and the model's attention is
SDPA, since flex attention, which torchtitan's language models name, has no backward on the CPU. On a GPU nothing
is mapped.

    .venv/bin/python -m benchmarks.torchtitan [--rounds 9] [--compile] [--markdown docs/results/torchtitan.md]
    .venv/bin/python -m benchmarks.torchtitan --check [--compile] [--precision bfloat16]   # one JSON line, tests
    .venv/bin/python -m benchmarks.torchtitan --check --ranks 2   # FSDP2 sharding over two gloo ranks
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import remat
from remat.chains import ratios_to_first
from remat.integrations.distributed import free_port

os.environ.setdefault("REMAT_CACHE_DIR", "off")
BATCH, SEQ, VOCAB = 4, 256, 2048
SHARE = 0.5


@contextlib.contextmanager
def torchtitan_on_cpu(rank: int = 0, world: int = 1, port: int | None = None) -> Iterator[None]:
    """A gloo group, and torchtitan's device mesh on the CPU (module docstring); undone on exit."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims

    saved = parallel_dims.device_type
    parallel_dims.device_type = "cpu"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port or free_port()}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        yield
    finally:
        dist.destroy_process_group()
        parallel_dims.device_type = saved


def llama3_debug() -> Any:
    """torchtitan's Llama 3 ``debugmodel`` config (6 layers, dim 256, 16 heads, vocabulary 2048), SDPA attention."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel").model
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def build(ac_config: Any, *, compile_backend: str | None = None, precision: str = "float32",
          dump_folder: str = "", world: int = 1) -> torch.nn.Module:  # fmt: skip
    """The debug model through torchtitan's ``parallelize_llama`` with ``ac_config``, initialised from seed 0,
    sharded over ``world`` ranks."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    compile_config = CompileConfig(enable=compile_backend is not None, components=["model"],
                                   backend=compile_backend or "inductor")  # fmt: skip
    with torch.device("meta"):
        model = llama3_debug().build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # policies the blocks cannot run are left out of their costs, with a warning
        model = parallelize_llama(model, parallel_dims=ParallelDims.from_config(parallelism, world),
                                  training=TrainingConfig(mixed_precision_param=precision), parallelism=parallelism,
                                  compile_config=compile_config, ac_config=ac_config,
                                  dump_folder=dump_folder)  # fmt: skip
    for module in model.modules():  # gloo reduces with SUM only (no PREMUL_SUM, no AVG): divide around it
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.train()


def batch(seed: int, rows: int = BATCH, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (rows, seq), generator=generator), torch.randint(
        0, VOCAB, (rows, seq), generator=generator
    )


def step(model: torch.nn.Module, seed: int = 0, rows: int = BATCH, seq: int = SEQ) -> None:
    tokens, labels = batch(seed, rows, seq)
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    del logits
    loss.backward()


def gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone() for p in model.parameters()]


def same_steps(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> bool:
    """Whether two runs' gradients, step by step, are bitwise equal."""
    return all(torch.equal(a, b) for mine, theirs in zip(got, want, strict=True)
               for a, b in zip(mine, theirs, strict=True))  # fmt: skip


def saved_bytes(model: torch.nn.Module, seed: int = 0) -> int:
    """Bytes one step's forward saves for the backward (module docstring), the step run to its end."""
    rows, tokens = BATCH, BATCH * SEQ
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() and t.shape[0] in (rows, tokens):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(model, seed)
    return sum(saved.values())


def measured(model: torch.nn.Module, compiled: bool) -> tuple[int, list[list[torch.Tensor]]]:
    """The activation peak of one step (after a warm-up step) and the gradients of two SGD steps from seed 0."""
    step(model)
    model.zero_grad(set_to_none=True)
    if compiled:
        peak = saved_bytes(model)
    else:
        with remat.measure() as meter:
            step(model)
        peak = meter.activation_bytes
    model.zero_grad(set_to_none=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for seed in (0, 1):
        step(model, seed)
        steps.append(gradients(model))
        optimizer.step()
        model.zero_grad(set_to_none=True)
    return peak, steps


def contenders(compile_backend: str | None, precision: str, dump_folder: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every contender's model, and RematAC's mode object (its plan and cost table)."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    from remat.integrations.torchtitan import RematAC

    models: dict[str, Any] = {}
    for name, ac in [("no checkpointing", None), ("no checkpointing (A/A)", None), ("torchtitan FullAC",
                     FullAC.Config()), ("torchtitan SelectiveAC", SelectiveAC.Config())]:  # fmt: skip
        models[name] = build(ac, compile_backend=compile_backend, precision=precision)
    mode = RematAC.Config(activations=str(SHARE), batch_size=BATCH, seq_len=SEQ, dtype=precision,
                          compiled=compile_backend is not None)  # fmt: skip
    models["remat RematAC"] = build(mode, compile_backend=compile_backend, precision=precision,
                                    dump_folder=dump_folder)  # fmt: skip
    with open(os.path.join(dump_folder, "remat_plan.json")) as f:
        plan = remat.Plan.from_json(f.read())
    return models, {"plan": plan}


def run(compile_backend: str | None, precision: str, rounds: int, dump_folder: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    started = time.perf_counter()
    compiled = compile_backend is not None
    with torchtitan_on_cpu():
        models, remat_side = contenders(compile_backend, precision, dump_folder)
        plan = remat_side["plan"]
        figures = {name: measured(model, compiled) for name, model in models.items()}
        plain_peak, expected = figures["no checkpointing"]
        rows = []
        for name, (peak, steps) in figures.items():
            rows.append({"contender": name, "peak_bytes": peak, "peak_share": peak / plain_peak,
                         "bitwise": same_steps(steps, expected)})  # fmt: skip

        def timed(name: str) -> float:
            begun = time.process_time()
            step(models[name], seed=1)
            models[name].zero_grad(set_to_none=True)
            return time.process_time() - begun

        ratios = ratios_to_first(list(models), timed, rounds) if rounds else {}
    for row in rows:
        r = ratios.get(row["contender"])
        if r:
            row.update(step_ratio=statistics.median(r), step_low=min(r), step_high=max(r), ratios=list(r))
    return {"share": SHARE, "compile": compile_backend, "precision": precision, "rounds": rounds,
            "plain_peak_bytes": plain_peak, "budget_bytes": plan.budget_bytes,
            "predicted_peak_bytes": plan.predicted_peak_bytes, "plan": plan.actions,
            "plan_counts": plan.action_counts(),
            "model": {"layers": 6, "dim": 256, "heads": 16, "batch": BATCH, "seq": SEQ},
            "torch": torch.__version__, "seconds": time.perf_counter() - started, "rows": rows}  # fmt: skip


def sharded_worker(rank: int, world: int, port: int, out: str) -> None:
    """One of ``world`` gloo ranks: no checkpointing, ``FullAC`` and ``RematAC`` sharded over them by torchtitan's
    ``fully_shard``, each rank its own batch; rank 0 writes each contender's activation peak and whether its full
    gradients equal no checkpointing's over two SGD steps, bitwise."""
    from torchtitan.distributed.activation_checkpoint import FullAC

    from remat.integrations.torchtitan import RematAC

    torch.set_num_threads(1)
    rows, seq = 2, 128
    with torchtitan_on_cpu(rank, world, port):
        modes = {"no checkpointing": None, "torchtitan FullAC": FullAC.Config(),
                 "remat RematAC": RematAC.Config(activations=str(SHARE), batch_size=rows, seq_len=seq,
                                                 dtype="float32")}  # fmt: skip
        figures = {}
        for name, mode in modes.items():
            model = build(mode, world=world)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            peaks, steps = [], []
            for seed in (0, 1):
                with remat.measure() as meter:
                    step(model, 100 * rank + seed, rows, seq)
                peaks.append(meter.activation_bytes)
                steps.append(gradients(model))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            figures[name] = (max(peaks), steps, getattr(getattr(model, "_remat_handle", None), "plan", None))
        plain = figures["no checkpointing"][1]
        record = {"world": world, "rows": []}
        for name, (peak, steps, plan) in figures.items():
            row = {"contender": name, "peak_bytes": peak, "bitwise": same_steps(steps, plain)}
            if plan is not None:
                row.update(budget_bytes=plan.budget_bytes, predicted_peak_bytes=plan.predicted_peak_bytes)
            record["rows"].append(row)
        if rank == 0:
            Path(out).write_text(json.dumps(record))
    os._exit(0)  # gloo's threads can abort a torn-down process at interpreter exit


def sharded_check(world: int) -> dict[str, Any]:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "record.json")
        mp.spawn(sharded_worker, args=(world, free_port(), out), nprocs=world)
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--compile", action="store_true", help="torchtitan compiles each block (inductor)")
    parser.add_argument("--backend", default="inductor", help="the compile backend with --compile")
    parser.add_argument("--precision", default="float32", choices=["float32", "bfloat16"],
                        help="torchtitan's training.mixed_precision_param")  # fmt: skip
    parser.add_argument("--check", action="store_true", help="no timing: print one JSON line (the tests read it)")
    parser.add_argument("--ranks", type=int, default=1, help="with --check: shard over this many gloo ranks")
    parser.add_argument("--dump-folder", default=None, help="where RematAC writes its plan (a temporary folder)")
    parser.add_argument("--out", type=Path, default=Path("docs/results/torchtitan.jsonl"))
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    import tempfile

    if args.check and args.ranks > 1:
        print(json.dumps(sharded_check(args.ranks)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        record = run(args.backend if args.compile else None, args.precision, 0 if args.check else args.rounds,
                     args.dump_folder or scratch)  # fmt: skip
    if args.check:
        print(json.dumps(record))
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps(record) + "\n")
    text = markdown(record, str(args.markdown or "<file>"))
    print(text)
    if args.markdown is not None:
        args.markdown.write_text(text)


def markdown(record: dict[str, Any], target: str) -> str:
    m = record["model"]
    compiled = record["compile"] is not None
    flag = f" --compile --backend {record['compile']}" if compiled else ""
    peak = "bytes saved for the backward" if compiled else "activation peak"
    lines = [
        f"# remat next to torchtitan's activation checkpointing{' (compiled blocks)' if compiled else ''}",
        "",
        f"Command: `python -m benchmarks.torchtitan --rounds {record['rounds']}{flag} --precision "
        f"{record['precision']} --markdown {target}`",
        "",
        f"torchtitan's Llama 3 debug model ({m['layers']} layers, dim {m['dim']}, {m['heads']} heads, SDPA), batch "
        f"{m['batch']} x {m['seq']}, through torchtitan's `parallelize_llama` (FSDP2 on one gloo rank, parameters in "
        f"{record['precision']}{', each block compiled by torchtitan' if compiled else ''}), torch {record['torch']}, "
        f"one intra-op thread. `RematAC` at {record['share']}: its meta-device estimate planned "
        f"{record['plan_counts']} for a budget of {record['budget_bytes'] / 2**20:.2f} MiB, predicted peak "
        f"{record['predicted_peak_bytes'] / 2**20:.2f} MiB. Steps in CPU seconds over {record['rounds']} interleaved "
        f"rounds ({record['seconds']:.0f} s in all).",
        "",
        f"| contender | {peak} (MiB) | / no checkpointing | step / no checkpointing, median [range] | gradients, "
        "two SGD steps |",
        "|---|---|---|---|---|",
    ]
    rows = {r["contender"]: r for r in record["rows"]}
    for r in record["rows"]:
        lines.append(f"| {r['contender']} | {r['peak_bytes'] / 2**20:.2f} | {r['peak_share']:.3f} | "
                     f"{r['step_ratio']:.3f} [{r['step_low']:.3f}-{r['step_high']:.3f}] | "
                     f"{'bitwise' if r['bitwise'] else 'differ'} |")  # fmt: skip
    mine, selective = rows["remat RematAC"], rows["torchtitan SelectiveAC"]
    paired = [a / b for a, b in zip(mine["ratios"], selective["ratios"], strict=True)]
    aa = rows["no checkpointing (A/A)"]["ratios"]
    lines += [
        "",
        f"RematAC over SelectiveAC, paired by round: {statistics.median(paired):.3f} "
        f"[{min(paired):.3f}-{max(paired):.3f}]; A/A {statistics.median(aa):.3f} [{min(aa):.3f}-{max(aa):.3f}].",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
