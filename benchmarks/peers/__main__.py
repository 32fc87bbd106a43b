"""``python -m benchmarks.peers``: the peers benchmark (:mod:`benchmarks.peers.run`)."""

import sys

from .run import main

sys.exit(main())
