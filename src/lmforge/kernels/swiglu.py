"""Fused SwiGLU gate: y = silu(a) ⊙ b, forward and backward in one elementwise pass each.

Math (σ the logistic function):
    y  = a·σ(a)·b
    da = dy·b·σ(a)·(1 + a·(1 − σ(a)))        db = dy·a·σ(a)
Unfused torch saves silu(a) (or recomputes it) and launches several elementwise kernels; the
fused op saves only a and b and touches each element once per direction. Math in float32.
Exercise: ``pytest tests/test_kernels_interp.py`` (interpreter) and ``-m gpu``.
"""

from __future__ import annotations

import torch

from lmforge.kernels import _ops
from lmforge.kernels._common import KernelUnsupportedError, check_triton_tensors


def swiglu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) · b in float32 (float64 for float64 input), returned in a's dtype."""
    acc_t = torch.float64 if a.dtype == torch.float64 else torch.float32
    af = a.to(acc_t)
    return (af * torch.sigmoid(af) * b.to(acc_t)).to(a.dtype)


def _check(a: torch.Tensor, b: torch.Tensor) -> None:
    check_triton_tensors("swiglu", a, b)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise KernelUnsupportedError(
            f"swiglu: a and b must match, got {tuple(a.shape)} {a.dtype} and "
            f"{tuple(b.shape)} {b.dtype}"
        )


class SwiGLUTriton(torch.autograd.Function):
    """``SwiGLUTriton.apply(a, b)`` → silu(a)·b; saves a and b only. Runs the custom ops
    ``torch.ops.lmforge.swiglu_fwd/bwd`` that :func:`swiglu` uses with their own autograd."""

    @staticmethod
    def forward(ctx, a, b):  # type: ignore[override]
        _check(a, b)
        ctx.save_for_backward(a, b)
        return _ops.swiglu_fwd(a, b)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        a, b = ctx.saved_tensors
        return _ops.swiglu_bwd(a, b, dy)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Fused silu(a) ⊙ b (the SwiGLU gate); a, b same shape and dtype (fp16/bf16/fp32) on CUDA
    (or CPU under ``TRITON_INTERPRET=1``); differentiable. Raises KernelUnsupportedError else.
    A custom op (``torch.ops.lmforge.swiglu_fwd``), so torch.compile traces through it."""
    _check(a, b)
    return _ops.swiglu_fwd(a, b)


def swiglu_packed_reference(ab: torch.Tensor) -> torch.Tensor:
    """silu(a) · b for ab (…, 2F) = [a | b] (a the first F columns), in float32 (float64
    kept); returns (…, F) in ab's dtype."""
    a, b = ab.chunk(2, dim=-1)
    return swiglu_reference(a, b)


def swiglu_packed(ab: torch.Tensor) -> torch.Tensor:
    """Fused SwiGLU gate on one packed buffer ab (…, 2F) = [a | b] — the output of a single
    matmul against ``cat([w1, w3])`` — returning silu(a) ⊙ b (…, F); differentiable, its
    backward writes [da | db] into one (…, 2F) buffer (the gradient of that matmul's output,
    with no concatenation). fp16/bf16/fp32 on CUDA (or CPU under ``TRITON_INTERPRET=1``);
    raises KernelUnsupportedError else. A custom op (``torch.ops.lmforge.swiglu_packed_fwd``)."""
    check_triton_tensors("swiglu_packed", ab)
    if ab.dim() < 1 or ab.shape[-1] % 2:
        raise KernelUnsupportedError(
            f"swiglu_packed: the last dimension must be even (2F), got {tuple(ab.shape)}"
        )
    return _ops.swiglu_packed_fwd(ab)
