"""Timing and memory helpers shared by the benchmarks: warmup, CUDA events, medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def time_ms(
    fn: Callable[[], object], warmup: int = 3, iters: int = 10, device: str = "cuda"
) -> float:
    """Median time of ``fn()`` in milliseconds after ``warmup`` untimed calls.

    On CUDA each call is bracketed by CUDA events and the calls are queued behind a GPU sleep as
    long as the warmup says they take (at most 200 ms): the host has enqueued them all before
    the GPU starts, so what is timed is the GPU's work, not the host's launch overhead — the
    situation of a training step, where the host runs ahead of the GPU. Every implementation
    compared in one table is timed the same way. On CPU: ``time.perf_counter``.
    Simplification: no L2 flush between calls — the benchmarked tensors are far larger than the
    50-60 MB L2 of an H100/H200.
    """
    if device != "cuda":
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(max(1, warmup)):
        fn()
    torch.cuda.synchronize()
    per_call_ms = (time.perf_counter() - t0) * 1e3 / max(1, warmup)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    sleep_ms = min(200.0, 1.2 * per_call_ms * iters + 0.2)
    torch.cuda._sleep(int(sleep_ms * _cycles_per_ms()))
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


_CYCLES_PER_MS: list[float] = []


def _cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep`` (measured once)."""
    if not _CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)  # load the kernel before timing it
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        torch.cuda.synchronize()
        _CYCLES_PER_MS.append(10_000_000 / max(start.elapsed_time(end), 1e-3))
    return _CYCLES_PER_MS[0]


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


def cuda_kernel_totals(prof: object) -> dict[str, list[float]]:
    """A finished ``torch.profiler.profile``'s CUDA kernels: name -> [launches, total µs]
    (kernels inside CUDA-graph replays included: CUPTI reports them)."""
    from torch.autograd import DeviceType

    agg: dict[str, list[float]] = {}
    for ev in prof.events():  # type: ignore[attr-defined]
        if ev.device_type == DeviceType.CUDA:
            slot = agg.setdefault(ev.name, [0, 0.0])
            slot[0] += 1
            slot[1] += ev.time_range.elapsed_us()
    return agg


def cuda_kernel_gaps(prof: object, short_us: float = 8.0) -> dict[str, float]:
    """Where a finished profile's GPU time went between kernels: ``busy`` (the union of kernel
    intervals), ``span`` (first kernel start to last kernel end), and the idle gaps between
    consecutive kernels split at ``short_us``: ``short`` (launch latency between back-to-back
    kernels, as inside a CUDA graph) and ``long`` (the GPU waiting on the host), with their
    counts ``n_short`` / ``n_long``. All in µs; zeros when no kernel was recorded."""
    from torch.autograd import DeviceType

    spans = sorted(
        (ev.time_range.start, ev.time_range.end)
        for ev in prof.events()  # type: ignore[attr-defined]
        if ev.device_type == DeviceType.CUDA
    )
    out = dict(busy=0.0, span=0.0, short=0.0, long=0.0, n_short=0.0, n_long=0.0)
    if not spans:
        return out
    cur_start, cur_end = spans[0]
    for a, b in spans[1:]:
        if a > cur_end:  # idle from cur_end to a
            out["busy"] += cur_end - cur_start
            gap = a - cur_end
            key = "short" if gap < short_us else "long"
            out[key] += gap
            out["n_" + key] += 1
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    out["busy"] += cur_end - cur_start
    out["span"] = cur_end - spans[0][0]
    return out


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
