"""Fused RMSNorm, forward and backward (weight-gradient reduction included).

Math, per row x ∈ R^D with weight w:
    r = 1 / sqrt(mean(x²) + eps)        y = x · r · w
    dx = r · (w∘dy) − x · r³ · mean(w∘dy∘x)
    dw = Σ_rows dy∘x·r
The forward saves only r (one float32 per row). The backward writes dx and, per program, a
float32 partial sum of dw over its block of rows; the partials (a few hundred × D) are summed in
torch — a two-stage reduction that needs no atomics and is deterministic.

Exercise: ``pytest tests/test_kernels.py -k rms`` (CPU interpreter) and
``pytest -m gpu tests/test_kernels_gpu.py -k rms``.
"""

from __future__ import annotations

import torch

from lmforge.kernels import _ops
from lmforge.kernels._common import KernelUnsupportedError, check_triton_tensors

MAX_DIM = 16384  # one row (a block of ≤ 16384 values) is held in registers


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm in plain torch: statistics in float32 (float64 for float64 input), output x.dtype."""
    acc_t = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc_t)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(acc_t)
    return y.to(x.dtype)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_triton_tensors("rms_norm", x, weight)
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise KernelUnsupportedError(
            f"rms_norm: weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}"
        )
    if x.shape[-1] > MAX_DIM:
        raise KernelUnsupportedError(f"rms_norm: last dim {x.shape[-1]} exceeds {MAX_DIM}")


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`rms_norm` accepts these inputs (for an ``auto`` backend choice)."""
    try:
        _check(x, weight)
    except KernelUnsupportedError:
        return False
    return True


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])  # (N, D): rows of any leading shape
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class RMSNormTriton(torch.autograd.Function):
    """Autograd wrapper over the Triton kernels; ``RMSNormTriton.apply(x, weight, eps)``.

    Runs the custom ops ``torch.ops.lmforge.rms_norm_fwd/bwd`` that :func:`rms_norm` uses with
    their own (compile-traceable) autograd; kept for callers of ``.apply``.
    """

    @staticmethod
    def forward(ctx, x, weight, eps=1e-5):  # type: ignore[override]
        _check(x, weight)
        x2 = _rows(x)  # (N, D)
        y, rstd = _ops.rms_norm_fwd(x2, weight, float(eps), None)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = _ops.rms_norm_bwd(x2, weight, rstd, dy.reshape(-1, x2.shape[-1]))
        return dx.reshape(ctx.x_shape), dw, None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Fused RMSNorm over the last dim: y = x / sqrt(mean(x²) + eps) · weight; differentiable.

    x (…, D) in fp16/bf16/fp32 on CUDA (or CPU under ``TRITON_INTERPRET=1``), weight (D,);
    y has x's dtype unless ``out_dtype`` (fp16/bf16/fp32) says otherwise — e.g. the autocast
    dtype, so a norm of the fp32 residual stream feeding a matmul writes its bf16 input directly
    instead of an fp32 output and a separate cast. Statistics are float32. Raises KernelUnsupportedError otherwise — use
    :func:`rms_norm_reference` there. The kernels run as the custom op
    ``torch.ops.lmforge.rms_norm_fwd`` (backward ``rms_norm_bwd``), so torch.compile traces
    through this function without a graph break.
    """
    _check(x, weight)
    if out_dtype is not None and out_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise KernelUnsupportedError(f"rms_norm: out_dtype {out_dtype} is not supported")
    y, _ = _ops.rms_norm_fwd(_rows(x), weight, float(eps), out_dtype)  # (N, D)
    return y.reshape(x.shape)
