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
from torch import Tensor

from lmforge.kernels._common import KernelUnsupportedError, check_triton_tensors
from lmforge.kernels._ops import _define


# -- the custom ops (torch.ops.lmforge.*) --------------------------------------------------
def _swiglu_fwd(a: Tensor, b: Tensor) -> Tensor:
    from lmforge.kernels import _elementwise_triton

    return _elementwise_triton.swiglu_forward(a.contiguous(), b.contiguous())


def _swiglu_fwd_fake(a: Tensor, b: Tensor) -> Tensor:
    return a.new_empty(a.shape)


def _swiglu_bwd(a: Tensor, b: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    from lmforge.kernels import _elementwise_triton

    return _elementwise_triton.swiglu_backward(a.contiguous(), b.contiguous(), dy.contiguous())


def _swiglu_bwd_fake(a: Tensor, b: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    return a.new_empty(a.shape), b.new_empty(b.shape)


def _swiglu_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dy):
    a, b = ctx.saved_tensors
    return swiglu_bwd(a, b, dy)


def _swiglu_packed_fwd(ab: Tensor) -> Tensor:
    from lmforge.kernels import _elementwise_triton

    return _elementwise_triton.swiglu_packed_forward(ab.contiguous())


def _swiglu_packed_fwd_fake(ab: Tensor) -> Tensor:
    return ab.new_empty((*ab.shape[:-1], ab.shape[-1] // 2))


def _swiglu_packed_bwd(ab: Tensor, dy: Tensor) -> Tensor:
    from lmforge.kernels import _elementwise_triton

    return _elementwise_triton.swiglu_packed_backward(ab.contiguous(), dy.contiguous())


def _swiglu_packed_bwd_fake(ab: Tensor, dy: Tensor) -> Tensor:
    return ab.new_empty(ab.shape)


def _swiglu_packed_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_packed_backward(ctx, dy):
    (ab,) = ctx.saved_tensors
    return swiglu_packed_bwd(ab, dy)


swiglu_fwd = _define("swiglu_fwd", _swiglu_fwd, _swiglu_fwd_fake, _swiglu_backward, _swiglu_setup)
swiglu_bwd = _define("swiglu_bwd", _swiglu_bwd, _swiglu_bwd_fake)
swiglu_packed_fwd = _define(
    "swiglu_packed_fwd",
    _swiglu_packed_fwd,
    _swiglu_packed_fwd_fake,
    _swiglu_packed_backward,
    _swiglu_packed_setup,
)
swiglu_packed_bwd = _define("swiglu_packed_bwd", _swiglu_packed_bwd, _swiglu_packed_bwd_fake)


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


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Fused silu(a) ⊙ b (the SwiGLU gate); a, b same shape and dtype (fp16/bf16/fp32) on CUDA
    (or CPU under ``TRITON_INTERPRET=1``); differentiable. Raises KernelUnsupportedError else.
    A custom op (``torch.ops.lmforge.swiglu_fwd``), so torch.compile traces through it."""
    _check(a, b)
    return swiglu_fwd(a, b)


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
    return swiglu_packed_fwd(ab)
