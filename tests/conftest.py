"""Test-session settings shared by every test file.

The models in the tests are small: one intra-op thread runs them fastest (no thread start-up, no
oversubscription on a busy machine) and makes floating-point reductions reproducible run to run, which the
exact gradient comparisons rely on.
"""

from __future__ import annotations

import torch

torch.set_num_threads(1)
