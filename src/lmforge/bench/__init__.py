"""Benchmarks as library code behind ``lmforge bench``. This is the public API.

``kernels`` checks and times lmforge's Triton kernels against their peers (torch SDPA flash and
cuDNN, ``F.rms_norm``, unfused matmul + cross-entropy, Liger-Kernel when installed); ``model``
times a preset's forward / backward / training step with a profiler table, memory by category
and roofline numbers. Modules load lazily (``from lmforge.bench import kernels``) so importing
the package costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from lmforge.bench.timing import markdown_table, peak_extra_bytes, time_ms

__all__ = ["markdown_table", "peak_extra_bytes", "time_ms"]

_EXPORTS = {
    "markdown_table": "timing",
    "peak_extra_bytes": "timing",
    "time_ms": "timing",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
