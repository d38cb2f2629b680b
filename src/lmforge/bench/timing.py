"""Timing and memory helpers shared by the benchmarks: warmup, CUDA events, medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def time_ms(
    fn: Callable[[], object], warmup: int = 3, iters: int = 10, device: str = "cuda"
) -> float:
    """Median wall time of ``fn()`` in milliseconds after ``warmup`` untimed calls.

    On CUDA each call is bracketed by CUDA events (device time, no host sync inside the loop);
    on CPU by ``time.perf_counter``. Simplification: no L2 flush between calls — the benchmarked
    tensors are far larger than the 50-60 MB L2 of an H100/H200.
    """
    for _ in range(warmup):
        fn()
    if device != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Peak CUDA memory allocated while ``fn()`` runs, above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def copy_bandwidth_gbs(n_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (GB/s, read + write counted) on a ``n_bytes`` buffer."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup=3, iters=20)
    return 2 * n_bytes / (ms * 1e-3) / 1e9


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    """A GitHub-markdown table; floats are printed with 3 significant decimals."""

    def cell(x: object) -> str:
        if isinstance(x, float):
            return f"{x:.1f}" if abs(x) >= 100 else f"{x:.3g}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def environment_line() -> str:
    """Device, torch, Triton and CUDA versions, for result headers."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return (
        f"device {device}; torch {torch.__version__}; triton {triton_version}; "
        f"CUDA {torch.version.cuda}"
    )
