"""The experiment harness: models people train, real offline data, energy meters and the statistics that
compare checkpointing strategies.

``models`` builds GPT-2, BERT, ViT (Hugging Face configs, random weights) and a residual MLP chain;
``data`` serves Shakespeare text and MNIST / Fashion-MNIST digits with fixed train/validation splits;
``energy`` reads NVML or RAPL energy counters where the hardware exposes them; ``stats`` gives means,
confidence intervals and paired t-tests; the runner, report and plots build on them. Each submodule is
imported on its own, so using one does not pull in the heavy dependencies of another. The harness uses remat
through its public faces only, as the benchmarks do.

The modules, in the order a ``remat bench`` run uses them:

- input: ``config`` (options, :class:`~remat.bench.config.BenchConfig`), ``strategies`` (strategy strings),
  ``budget``, ``checks`` (everything checked before training), ``output_folder``;
- data and models: ``data`` (``data_sources``, ``tokenizers``, ``batches``, ``text_data``, ``image_data``),
  ``models``;
- training: ``runner`` (the orchestration and the entry points), ``train`` (one run), ``static_plans`` and
  ``controllers`` (each strategy in the loop), ``compile_child`` (``compile_budget`` in a child process under
  the whole-process meter of :mod:`remat.meters`), ``ddp_sweep`` (the torchrun sync ablation), ``pipeline_sweep`` and
  ``pipeline_stages`` (the torchrun two-stage pipeline ablation of thresholds), ``childproc``,
  ``records`` (JSON-lines files), ``energy``; the runner also says what runs (progress) and on which machine;
- report: ``report`` (``python -m remat.bench.report``), ``results``, ``summary``, ``stats``, ``claims``,
  ``formatting``, ``figures``, ``plots``, ``markdown``, ``distributed_sections``, ``pipeline_summary``.
"""

from __future__ import annotations

import importlib
from typing import Any

# What the command line and the benchmarks take from the harness: name -> its module, imported on first use
# (None: the module itself).
_NAMES = {
    "architectures": "arch_zoo",
    "build_model": "models",
    "check": "arch_check",
    "child_env": "childproc",
    "default_threads": "runner",
    "emit": "childproc",
    "environment": "runner",
    "format_table": "arch_check",
    "get_tokenizer": "tokenizers",
    "load_dataset": "data",
    "median_interval": "stats",
    "parse": "childproc",
    "parse_model_id": "models",
    "plan_peak": "arch_check",
    "runner": None,
    "shakespeare_files": "data_sources",
    "uniform_plan": "static_plans",
}

__all__ = list(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _NAMES[name]
    value = (
        importlib.import_module(f"{__name__}.{name}")
        if module is None
        else getattr(importlib.import_module(f"{__name__}.{module}"), name)
    )
    globals()[name] = value
    return value
