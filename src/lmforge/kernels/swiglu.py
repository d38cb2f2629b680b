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
    """``SwiGLUTriton.apply(a, b)`` → silu(a)·b; saves a and b only."""

    @staticmethod
    def forward(ctx, a, b):  # type: ignore[override]
        _check(a, b)
        from lmforge.kernels import _elementwise_triton

        a_c, b_c = a.contiguous(), b.contiguous()
        ctx.save_for_backward(a_c, b_c)
        return _elementwise_triton.swiglu_forward(a_c, b_c)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        from lmforge.kernels import _elementwise_triton

        a, b = ctx.saved_tensors
        return _elementwise_triton.swiglu_backward(a, b, dy.contiguous())


@torch.compiler.disable
def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Fused silu(a) ⊙ b (the SwiGLU gate); a, b same shape and dtype (fp16/bf16/fp32) on CUDA
    (or CPU under ``TRITON_INTERPRET=1``); differentiable. Raises KernelUnsupportedError else."""
    return SwiGLUTriton.apply(a, b)
