"""The cache flush of the profile's isolated timings: as many bytes as the step moves between a block's forward
and its backward, at most twice the last-level cache, and the profiler's estimate of that traffic."""

from __future__ import annotations

from typing import Any

import torch
from toy_models import chain_input, uniform_chain

import remat
from remat.profiling import block_measure
from remat.profiling.block_timing import CacheFlush, flush_bytes, last_level_cache_bytes


def test_the_flush_writes_the_traffic_given_at_most_twice_the_last_level_cache() -> None:
    ceiling = 2 * last_level_cache_bytes()
    assert flush_bytes() == ceiling
    assert flush_bytes(4096) == 4096
    assert flush_bytes(10 * ceiling) == ceiling
    assert flush_bytes(0) == 0
    cpu = torch.device("cpu")
    assert CacheFlush(cpu, 4096).buffer.numel() * 4 == 4096
    assert CacheFlush(cpu, 0).buffer is None  # nothing to evict: no buffer, no write
    assert CacheFlush(torch.device("meta"), 4096).buffer is None  # only the CPU's caches are flushed


def test_the_profile_flushes_what_the_steps_blocks_save(monkeypatch) -> None:
    traffic: list[int | None] = []
    timed = block_measure.time_actions

    def spy(*args: Any, **kwargs: Any) -> Any:
        traffic.append(kwargs.get("traffic_bytes"))
        return timed(*args, **kwargs)

    monkeypatch.setattr(block_measure, "time_actions", spy)
    n_blocks = 5
    model = uniform_chain(n_blocks, width=64)
    costs = remat.profile(model, chain_input(batch=16), repeats=1, reuse_identical=False)
    assert len(traffic) == n_blocks
    for row, flushed in zip(costs.blocks, traffic, strict=True):
        # the rest of the step writes and reads back about as much as its blocks save under keep
        assert flushed == n_blocks * row.saved_bytes["keep"] > 0
