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
from torch import Tensor

from lmforge.kernels._common import KernelUnsupportedError, check_triton_tensors
from lmforge.kernels._ops import _define, _unit_stride


# -- the custom ops (torch.ops.lmforge.*) --------------------------------------------------
def _rms_norm_fwd(
    x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype | None
) -> tuple[Tensor, Tensor]:
    from lmforge.kernels import _rms_norm_triton

    return _rms_norm_triton.forward(_unit_stride(x), weight.contiguous(), eps, out_dtype=out_dtype)


def _rms_norm_fwd_fake(
    x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype | None
) -> tuple[Tensor, Tensor]:
    y = x.new_empty(x.shape, dtype=out_dtype or x.dtype)  # (N, D)
    return y, x.new_empty(x.shape[:1], dtype=torch.float32)  # (N,)


def _rms_norm_bwd(x: Tensor, weight: Tensor, rstd: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    from lmforge.kernels import _rms_norm_triton

    x, weight, rstd = _unit_stride(x), weight.contiguous(), rstd.contiguous()
    return _rms_norm_triton.backward(x, weight, rstd, _unit_stride(dy))


def _rms_norm_bwd_fake(
    x: Tensor, weight: Tensor, rstd: Tensor, dy: Tensor
) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_setup(ctx, inputs, output) -> None:
    x, weight, _eps, _out_dtype = inputs
    _y, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, weight, rstd)


def _rms_backward(ctx, dy, _drstd):
    if dy is None:
        return None, None, None, None
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_bwd(x, weight, rstd, dy)
    return dx, dw if ctx.needs_input_grad[1] else None, None, None


rms_norm_fwd = _define("rms_norm_fwd", _rms_norm_fwd, _rms_norm_fwd_fake, _rms_backward, _rms_setup)
rms_norm_bwd = _define("rms_norm_bwd", _rms_norm_bwd, _rms_norm_bwd_fake)


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
    y, _ = rms_norm_fwd(_rows(x), weight, float(eps), out_dtype)  # (N, D)
    return y.reshape(x.shape)
