"""A bounds check for Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``).

The interpreter dereferences raw addresses: a load past a tensor's end reads whatever the process
holds there (or crashes far from the cause), so an index bug that is an "illegal memory access"
on the GPU can pass a CPU test silently. Inside :func:`checked_bounds`, every load and store whose
mask is on must address bytes that lie wholly inside one of the launch's tensor arguments;
otherwise it raises ``IndexError`` naming the access and how far outside it fell. Masked-off lanes
may point anywhere (the GPU never dereferences them either).

The simplification: an address is checked against the union of the launch's arguments, not the
one tensor its pointer came from, so an offset that overruns one argument into another argument's
bytes passes (on the host copy the interpreter makes, separate allocations rarely touch).
Exercise: ``pytest tests/test_kernels_bounds.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


def _extent(t: torch.Tensor) -> tuple[int, int] | None:
    # [first byte, one past the last byte] of a strided view (non-negative strides, as torch makes).
    if t.numel() == 0:
        return None
    span = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _ranges(args: list, kwargs: dict) -> tuple[np.ndarray, np.ndarray]:
    spans = []
    for a in [*args, *kwargs.values()]:
        if isinstance(a, torch.Tensor):
            e = _extent(a)
            if e is not None:
                spans.append(e)
    spans.sort()
    return (
        np.array([s for s, _ in spans], dtype=np.uint64),
        np.array([e for _, e in spans], dtype=np.uint64),
    )


def _check(kind: str, ptrs, mask, ranges: tuple[np.ndarray, np.ndarray]) -> None:
    from triton.runtime.interpreter import _get_np_dtype

    size = np.dtype(_get_np_dtype(ptrs.get_element_ty())).itemsize
    addr = np.broadcast_to(ptrs.data, np.shape(mask.data))[np.asarray(mask.data, dtype=bool)]
    if addr.size == 0:
        return
    starts, ends = ranges
    i = np.searchsorted(starts, addr, side="right").astype(np.int64) - 1  # last start ≤ addr
    ok = i >= 0
    ok[ok] &= addr[ok] + np.uint64(size) <= ends[i[ok]]
    if not ok.all():
        bad = addr[~ok]
        raise IndexError(
            f"out-of-bounds {kind}: {bad.size} active lane(s) address memory outside every tensor "
            f"argument of the launch (first at 0x{int(bad[0]):x}, {size}-byte elements)"
        )


@contextlib.contextmanager
def checked_bounds() -> Iterator[None]:
    """Within the block, interpreted launches check every active load and store against the
    launch's tensor arguments (see the module docstring). Needs ``TRITON_INTERPRET=1``."""
    from triton.runtime import interpreter

    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    init_args, load, store = (
        executor._init_args_hst,
        builder.create_masked_load,
        builder.create_masked_store,
    )
    current: list[tuple[np.ndarray, np.ndarray]] = []

    def init_args_checked(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        current[:] = [_ranges(list(args_hst), kwargs_hst)]
        return args_hst, kwargs_hst

    def load_checked(self, ptrs, mask, other, *rest):
        if current:
            _check("load", ptrs, mask, current[0])
        return load(self, ptrs, mask, other, *rest)

    def store_checked(self, ptrs, value, mask, *rest):
        if current:
            _check("store", ptrs, mask, current[0])
        return store(self, ptrs, value, mask, *rest)

    executor._init_args_hst = init_args_checked
    builder.create_masked_load = load_checked
    builder.create_masked_store = store_checked
    try:
        yield
    finally:
        executor._init_args_hst = init_args
        builder.create_masked_load = load
        builder.create_masked_store = store
