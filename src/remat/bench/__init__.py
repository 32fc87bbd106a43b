"""The experiment harness: models people train, real offline data, energy meters and the statistics that
compare checkpointing strategies.

``models`` builds GPT-2, BERT, ViT (Hugging Face configs, random weights) and a residual MLP chain;
``data`` serves Shakespeare text and MNIST / Fashion-MNIST digits with fixed train/validation splits;
``energy`` reads NVML or RAPL energy counters where the hardware exposes them; ``stats`` gives means,
confidence intervals and paired t-tests; the runner, report and plots build on them. Each submodule is
imported on its own, so using one does not pull in the heavy dependencies of another.
"""
