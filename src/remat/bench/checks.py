"""Everything about a bench that can be checked before any training: the model and preset, the numbers of steps
and seeds, the strategies and their options, the sweeps, the data packages and the budget's syntax. Each problem
is a :class:`~remat.bench.config.BenchError` whose message says what to do."""

from __future__ import annotations

from typing import Any

import torch

from .budget import parse_budget
from .config import MIN_LAYERS, BenchConfig, BenchError
from .strategies import DISTRIBUTED_SWEEPS, StrategyError, StrategySpec, check_available, make_spec


def resolve_layers(config: BenchConfig) -> int | None:
    """The number of repeated blocks to build (None: the preset's own)."""
    from .models import model_config

    if config.layers == -1:
        return None
    if config.layers is not None:
        if config.layers < 1:
            raise BenchError(f"--layers must be at least 1, got {config.layers}")
        return config.layers
    depth = model_config(config.model, config.preset)["num_layers"]
    return max(depth, MIN_LAYERS) if depth < MIN_LAYERS else None


def validate(config: BenchConfig) -> dict[str, Any]:
    """Check everything that needs no training; returns what the data check found. Raises BenchError."""
    from .data import check_data_available
    from .data_sources import DataUnavailableError
    from .models import list_models, model_config

    if config.model not in list_models():
        raise BenchError(f"unknown model {config.model!r}; known models: {', '.join(list_models())}")
    try:
        model_facts = model_config(config.model, config.preset)
    except ValueError as err:
        raise BenchError(str(err)) from None
    positions = model_facts.get("max_positions")
    if config.model in ("gpt2", "bert") and positions is not None and config.seq_len > positions:
        raise BenchError(
            f"--seq-len {config.seq_len} exceeds {config.model}-{config.preset}'s {positions} positions: use "
            f"--seq-len {positions} or less, or a larger --preset"
        )
    for name, value, low in (
        ("--steps", config.steps, 1),
        ("--seeds", config.seeds, 1),
        ("--batch-size", config.batch_size, 1),
        ("--eval-batches", config.eval_batches, 0),
        ("--warmup", config.warmup, 0),
        ("--measure-every", config.measure_every, 0),
        ("--profile-repeats", config.profile_repeats, 1),
    ):
        if value < low:
            raise BenchError(f"{name} must be at least {low}, got {value}")
    if config.warmup >= config.steps:
        raise BenchError(
            f"--warmup {config.warmup} leaves no measured steps out of --steps {config.steps}; use more steps"
        )
    if config.threads < 0:
        raise BenchError(f"--threads must be positive (0: half the cores), got {config.threads}")
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise BenchError("--device cuda: torch sees no CUDA device; use --device cpu")
    parse_budget(config.budget)
    specs = all_specs(config)
    try:
        check_available(specs)
    except (StrategyError, ValueError) as err:
        raise BenchError(str(err)) from None
    if config.dynamic_padding:
        if config.model != "gpt2":
            raise BenchError(
                f"--dynamic-padding pads Shakespeare's paragraphs for the causal language model: use --model gpt2, "
                f"not {config.model!r}"
            )
        unsupported = [s.label for s in specs if s.name == "compile_budget" or s.lossy]
        if unsupported or config.sweeps:
            raise BenchError(
                "--dynamic-padding runs the strategies that plan per input shape or hold a budget per step (none, "
                "full, every_k, sqrt, memory_poor, random, optimal, pgac, dtr), without --sweep; leave out "
                f"{unsupported or [k for k, _ in config.sweeps]}"
            )
    if any(s.name == "compile_budget" for s in specs) and config.warmup < 1:
        raise BenchError("compile_budget compiles during its first step: use --warmup 1 or more")
    for key in DISTRIBUTED_SWEEPS:
        if any(k == key for k, _ in config.sweeps) and importlib_missing("torch.distributed.run"):
            raise BenchError(f"the {key} sweep needs torch.distributed (torchrun); this torch build has none")
    if any(k == "stage_sync" for k, _ in config.sweeps):
        from .pipeline_stages import check_pipeline_model

        try:
            check_pipeline_model(config.model)
        except ValueError as err:
            raise BenchError(str(err)) from None
    try:
        return check_data_available(config.model, tokenizer=config.tokenizer, dataset=config.dataset)
    except DataUnavailableError as err:
        raise BenchError(str(err)) from None
    except ValueError as err:
        raise BenchError(str(err)) from None


def importlib_missing(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def all_specs(config: BenchConfig) -> list[StrategySpec]:
    """The strategies to run: the listed ones, then the PGAC variants of the sweeps (the distributed sweeps,
    which run under torchrun, excepted)."""
    specs = list(config.strategies)
    base = next((s for s in specs if s.name == "pgac"), make_spec("pgac"))
    for key, values in config.sweeps:
        if key in DISTRIBUTED_SWEEPS:
            continue
        for value in values:
            variant = base.with_option(key, value)
            if variant.label not in {s.label for s in specs}:
                specs.append(variant)
    return specs
