"""Test-session settings and fixtures shared by every test file.

The models in the tests are small: one intra-op thread runs them fastest (no thread start-up, no
oversubscription on a busy machine) and makes floating-point reductions reproducible run to run, which the
exact gradient comparisons rely on. The profile cache is off (``REMAT_CACHE_DIR=off``), so that every test
profiles what it plans.

Fixtures: ``make_gpt2`` builds the tiny GPT-2 of :func:`toy_models.tiny_gpt2` (the test is skipped when
transformers is not installed); ``free_port()`` gives a TCP port free on this host, for ``MASTER_PORT``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import pytest
import torch
from torch import nn
from toy_models import tiny_gpt2

torch.set_num_threads(1)
# Every test profiles what it plans: the profile cache (remat.profiling.profile_cache) is tested on its own.
os.environ["REMAT_CACHE_DIR"] = "off"


@pytest.fixture(scope="session")
def make_gpt2() -> Callable[..., nn.Module]:
    """:func:`toy_models.tiny_gpt2`, with transformers' warnings about the tiny configs silenced."""
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    return tiny_gpt2


def find_free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """Call it for a fresh free port each time a process group starts (a port is not reused across groups)."""
    return find_free_port
