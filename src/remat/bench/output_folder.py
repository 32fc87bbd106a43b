"""The results folder of ``remat bench``: checked before anything changes in it, then created afresh or reopened
by ``--resume``, which keeps the finished (strategy, seed) runs and the finished modes of the pipeline sweep and
drops everything of unfinished ones."""

from __future__ import annotations

import json
import shutil

from .config import BenchConfig, BenchError
from .pipeline_summary import keep_finished
from .records import read_jsonl, rewrite_jsonl

# Settings that must match for --resume to continue a results folder.
RESUME_KEYS = (
    "model",
    "preset",
    "layers",
    "steps",
    "warmup",
    "budget",
    "batch_size",
    "seq_len",
    "lr",
    "tokenizer",
    "dropout",
    "eval_batches",
    "measure_every",
    "device",
    "dataset",
    "max_bytes",
)


def check_out(config: BenchConfig) -> bool:
    """Check the results folder without changing it; True when ``--resume`` continues results there."""
    out = config.out
    if out.exists() and not out.is_dir():
        raise BenchError(f"--out {out} exists and is not a folder; choose another path")
    config_path = out / "config.json"
    if not (config.resume and config_path.exists()):
        return False
    old = json.loads(config_path.read_text())["settings"]
    new = config.settings()
    changed = [k for k in RESUME_KEYS if old.get(k) != new.get(k)]
    if changed:
        detail = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
        raise BenchError(
            f"--resume: {out} holds results made with other settings ({detail}); rerun with the same settings "
            "or use a new --out"
        )
    return True


def prepare_out(config: BenchConfig, resuming: bool) -> set[tuple[str, int]]:
    """Create or reopen the results folder; returns the (strategy, seed) runs already finished.

    Resuming keeps the finished runs and their steps and drops everything of unfinished runs (they run again
    from their first step); otherwise earlier results in the folder are removed."""
    out = config.out
    out.mkdir(parents=True, exist_ok=True)
    finished: set[tuple[str, int]] = set()
    if resuming:
        runs = [r for r in read_jsonl(out / "runs.jsonl") if r.get("status") == "ok"]
        finished = {(r["strategy"], int(r["seed"])) for r in runs}
        steps = [s for s in read_jsonl(out / "steps.jsonl") if (s.get("strategy"), s.get("seed")) in finished]
        rewrite_jsonl(out / "runs.jsonl", runs)
        rewrite_jsonl(out / "steps.jsonl", steps)
        (out / "ddp.jsonl").unlink(missing_ok=True)  # the distributed sweep is short: it runs again
        pipeline = out / "pipeline.jsonl"
        if pipeline.exists():  # finished threshold modes are kept, unfinished ones run again
            rewrite_jsonl(pipeline, keep_finished(read_jsonl(pipeline)))
    else:
        names = ("steps.jsonl", "runs.jsonl", "ddp.jsonl", "pipeline.jsonl", "summary.csv", "report.md", "summary.json")
        for name in names:
            (out / name).unlink(missing_ok=True)
        for sub in ("runs", "costs", "plots"):
            shutil.rmtree(out / sub, ignore_errors=True)
    for sub in ("runs", "costs", "plots"):
        (out / sub).mkdir(exist_ok=True)
    return finished
