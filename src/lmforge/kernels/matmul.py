"""Tuned GEMMs: each matmul problem of a training step runs the fastest of torch's kernel and
cuBLASLt's other candidates, measured once on the device.

torch's ``mm`` on CUDA runs the kernel cuBLAS's heuristic ranks first. For GPT-2-small's shapes
on an H200 that is not always the fastest one cuBLASLt offers (``benchmarks/gemm_algos.py``:
e.g. the K = 768 projections and the LM head's logits run 8–10% faster with another tile).
With ``TUNED`` on (the trainer sets it from ``train.matmul``), :func:`linear` — which the
model's Linear layers and packed projections call — runs ``x @ Wᵀ`` and its two backward GEMMs
through the custom op ``lmforge::mm_tuned``; its first call for a problem (shapes, layouts,
dtype) searches cuBLASLt's configurations (the heuristic's candidates, then every tile × custom
option and the cluster shapes of the fastest: ``_cublaslt.search``, about 1,300–5,000 a problem
on an H200, one quick timing each), checks the fastest against torch's result on the real
operands, times them with torch's kernel in interleaved rounds and keeps the fastest (torch's
unless another is 2% faster; ``_cublaslt.TUNING_LOG`` says what was chosen). Results are the
same product in fp32 accumulation with one bf16/fp16 rounding; only the kernel (tile shape,
split) changes, so values can differ from torch's in the last bit, and the choice (timed) can
differ between runs: ``train.matmul = "torch"`` keeps runs bit-reproducible.

Only CUDA bf16/fp16 operands take the tuned path; everything else (CPU, fp32, fp64) runs torch's
matmul, so the op and its gradients are exercised everywhere (``pytest tests/test_matmul.py``).
"""

from __future__ import annotations

import torch

from lmforge.kernels._common import autocast_dtype

__all__ = ["TUNED", "linear", "matmul_reference", "mm_into"]

TUNED = False
"Process-wide switch of the tuned path (set by the trainer from ``train.matmul``)."


def matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The reference: ``a @ b``."""
    return a @ b


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (x (…, D_in), weight (D_out, D_in)) through the tuned GEMM op, in
    autocast's dtype when autocast is on (as ``x @ weight.t()`` would run)."""
    from lmforge.kernels import _ops

    dtype = autocast_dtype(x.device.type)
    if dtype is not None:
        x, weight = x.to(dtype), weight.to(dtype)
    lead = x.shape[:-1]
    y = _ops.mm_tuned(x.reshape(-1, x.shape[-1]), weight.t())  # (N, D_out)
    return y.reshape(*lead, weight.shape[0])


def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
    """out = a @ b, or out += a @ b (no autograd): the tuned kernel for CUDA bf16/fp16 operands
    when ``TUNED`` is on, torch's otherwise. ``out`` (M, N) contiguous, a's dtype."""
    if TUNED and _tunable(a, b, out):
        from lmforge.kernels import _cublaslt

        _cublaslt.gemm(a, b, out, accumulate)
    elif accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def _tunable(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    return (
        a.is_cuda
        and a.dtype in (torch.bfloat16, torch.float16)
        and a.dtype == b.dtype == out.dtype
        and out.is_contiguous()
    )


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Body of ``lmforge::mm_tuned``: a fresh contiguous (M, N)."""
    out = a.new_empty((a.shape[0], b.shape[1]))
    mm_into(a, b, out)
    return out
