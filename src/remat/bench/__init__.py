"""The experiment harness: models people train, real offline data, energy meters and the statistics that
compare checkpointing strategies.

``models`` builds GPT-2, BERT, ViT (Hugging Face configs, random weights) and a residual MLP chain;
``data`` serves Shakespeare text and MNIST / Fashion-MNIST digits with fixed train/validation splits;
``energy`` reads NVML or RAPL energy counters where the hardware exposes them; ``stats`` gives means,
confidence intervals and paired t-tests; the runner, report and plots build on them. Each submodule is
imported on its own, so using one does not pull in the heavy dependencies of another.

The modules, in the order a ``remat bench`` run uses them:

- input: ``config`` (options, :class:`~remat.bench.config.BenchConfig`), ``strategies`` (strategy strings),
  ``budget``, ``checks`` (everything checked before training), ``output_folder``, ``machine``;
- data and models: ``data`` (``data_sources``, ``tokenizers``, ``batches``, ``text_data``, ``image_data``),
  ``models``;
- training: ``runner`` (the orchestration and the entry points), ``train`` (one run), ``static_plans`` and
  ``controllers`` (each strategy in the loop), ``compile_child`` and ``procmem`` (``compile_budget`` in a child
  process under the whole-process meter), ``ddp_sweep`` (the torchrun sync ablation), ``pipeline_sweep`` and
  ``pipeline_stages`` (the torchrun two-stage pipeline ablation of thresholds), ``childproc``,
  ``records`` (JSON-lines files), ``progress``, ``energy``;
- report: ``report`` (``python -m remat.bench.report``), ``results``, ``summary``, ``stats``, ``claims``,
  ``formatting``, ``figures``, ``plots``, ``markdown``, ``distributed_sections``, ``pipeline_summary``.
"""
