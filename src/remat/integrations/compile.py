"""torch.compile and remat: what to compile, and how to measure compiled code.

Two ways compose correctly (``docs/compile.md`` has the details and examples):

* **Checkpoints inside the compiled code**: ``remat.checkpoint(fn, x, policy=...)`` or
  ``remat.Checkpoint(module, policy=...)`` called in a compiled function or module become torch's
  ``tag_activation_checkpoint`` region; the compiler's partitioner recomputes inside the compiled backward and
  applies the per-op policy (selective checkpointing). Whole-model ``torch.compile(model)`` works this way.
* **A plan on compiled blocks**: :func:`remat.apply` (and every integration built on it) keeps its hooks out of
  compilation, so compile the *blocks*, not the whole model: :func:`compile_blocks` calls ``block.compile()`` on
  each block of the chain. The checkpoint regions open and close in eager code around each compiled forward,
  recomputation calls the same compiled forward again, and ``handle.set_plan`` switches actions between steps
  without recompiling. Compiling the whole model around an applied plan is not supported: the forward would
  run compiled and the recomputation eagerly; such a forward is refused at its start.
* **torch.compile's own budget, fitted to bytes**: :func:`fit_compile_budget` (:mod:`remat.fitting.compile_budget`)
  compiles
  the whole model under a grid of ``activation_memory_budget`` fractions, measures each step's peak and time,
  and returns the fastest that fits a byte budget. One graph takes one budget, so below the least peak it
  reaches, plans on compiled blocks (above) are the way down.
* **Whichever is faster**: :func:`fit_compiled` (:mod:`remat.fitting.compiled_choice`) measures both routes under a byte
  budget,
  head to head, and sets the model up for the faster that fits.

Measuring: remat's live-tensor tracker (``remat.measure()`` on CPU, the profiler) does not see buffers that
compiled kernels allocate, so profile the model *before* compiling it (or pass ``costs=``), and measure compiled
steps on CPU with the whole-process high-water mark (:func:`reset_peak_rss`, :func:`peak_rss_bytes`, in a
process started with ``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0 MALLOC_TOP_PAD_=131072`` so freed
memory returns to the system) or on CUDA with ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

from ..fitting import CompileBudgetFit, CompiledFit, compile_blocks, fit_compile_budget, fit_compiled, uncompile_blocks
from ..meters import peak_rss_bytes, reset_peak_rss

__all__ = [
    "CompileBudgetFit",
    "CompiledFit",
    "compile_blocks",
    "fit_compile_budget",
    "fit_compiled",
    "peak_rss_bytes",
    "reset_peak_rss",
    "uncompile_blocks",
]
