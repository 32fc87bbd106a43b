"""``python -m remat.bench``: the same as ``remat bench`` (see :mod:`remat.bench.runner`)."""

from __future__ import annotations

import sys

from .runner import main

if __name__ == "__main__":
    sys.exit(main())
