"""What ``remat bench`` tells the person watching it: notes on stderr and a tqdm progress bar over the training
steps, or nothing at all with ``--no-progress``."""

from __future__ import annotations

import sys
from typing import Any


class ProgressLog:
    """Notes to stderr and the tqdm progress bar (a silent stand-in with --no-progress)."""

    def __init__(self, progress: bool) -> None:
        self.progress = progress

    def note(self, text: str) -> None:
        if self.progress:
            print(f"remat bench: {text}", file=sys.stderr, flush=True)

    def bar(self, total: int) -> Any:
        if self.progress:
            from tqdm import tqdm

            return tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True)
        return SilentBar()


class SilentBar:
    """The progress bar's interface, doing nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, text: str) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass
