"""Dequant-fused GEMM for prefill and large batches: y (M, N) = x (M, K) @ W (N, K)ᵀ, W int4/int8.

Past a few rows the product is compute-bound, so each program dequantizes its weight tile in
registers (``w = q·s + m`` for int4 — m = −8·s when symmetric — and ``w = q·s`` for int8, the
group's scale loaded once per K step) to x's dtype and feeds it to a tensor-core dot with fp32
accumulation; the dequantized weights never reach memory. Program (i, j) owns output tile
``BLOCK_M × BLOCK_N`` and walks K one group (int4: the two nibble planes against the two halves
of x's group, see :mod:`lmforge.quant.formats`) or one power-of-two chunk of a group (int8) at a
time. The reference is :func:`gemm_reference` (float64 against the dequantized weights).
Exercised by ``pytest tests/test_quant_kernels.py`` (TRITON_INTERPRET=1) and
``benchmarks/quant.py``.

Shape legend: M rows of x, N output features, K input features, G group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmforge.kernels._common import ensure_interpreter_compat, interpreting
from lmforge.quant._gemv_triton import int8_block_k


@triton.jit
def _int4_gemm_kernel(
    x_ptr, q_ptr, s_ptr, o_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_sn, stride_ym,
    G: tl.constexpr, SYMMETRIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    HALF: tl.constexpr = G // 2
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm_c = tl.minimum(rm, M - 1)  # clamped rows/columns are computed but never stored
    rn_c = tl.minimum(rn, N - 1)
    rh = tl.arange(0, HALF)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, K // G):
        x_lo = tl.load(x_ptr + rm_c[:, None] * stride_xm + g * G + rh[None, :])  # (BM, G/2)
        x_hi = tl.load(x_ptr + rm_c[:, None] * stride_xm + g * G + HALF + rh[None, :])
        b = tl.load(q_ptr + rn_c[None, :] * stride_qn + g * HALF + rh[:, None])  # (G/2, BN)
        s = tl.load(s_ptr + rn_c * stride_sn + g).to(tl.float32)[None, :]  # (1, BN)
        if SYMMETRIC:
            off = -8.0 * s
        else:
            off = tl.load(o_ptr + rn_c * stride_sn + g).to(tl.float32)[None, :]
        w_lo = ((b & 0x0F).to(tl.float32) * s + off).to(x_lo.dtype)  # (G/2, BN)
        w_hi = ((b >> 4).to(tl.float32) * s + off).to(x_lo.dtype)
        if IEEE:
            acc = tl.dot(x_lo, w_lo, acc, input_precision="ieee")
            acc = tl.dot(x_hi, w_hi, acc, input_precision="ieee")
        else:
            acc = tl.dot(x_lo, w_lo, acc)
            acc = tl.dot(x_hi, w_hi, acc)
    y = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _int8_gemm_kernel(
    x_ptr, q_ptr, s_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_sn, stride_ym,
    G: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm_c = tl.minimum(rm, M - 1)
    rn_c = tl.minimum(rn, N - 1)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xt = tl.load(x_ptr + rm_c[:, None] * stride_xm + k0 + rk[None, :])  # (BM, BK)
        q = tl.load(q_ptr + rn_c[None, :] * stride_qn + k0 + rk[:, None])  # (BK, BN) int8
        s = tl.load(s_ptr + rn_c * stride_sn + k0 // G).to(tl.float32)[None, :]  # (1, BN)
        w = (q.to(tl.float32) * s).to(xt.dtype)
        if IEEE:
            acc = tl.dot(xt, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, w, acc)
    y = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): 64×128 for prefill-sized M, 16×64 for a few rows."""
    if m <= 16:
        return 16, 64, 4
    return 64, 128, 4


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """x (M, K) -> (M, N) in x's dtype for int4 weights (layout of ``Int4Linear``)."""
    m, k = x.shape
    n = qweight.shape[0]
    assert k % group_size == 0 and (group_size // 2) >= 16
    if interpreting():
        ensure_interpreter_compat()
    x = x.contiguous()
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)  # (M, N)
    bm, bn, warps = _tiles(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _int4_gemm_kernel[grid](
        x, qweight, scales, scales if offsets is None else offsets, y,
        m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        G=group_size, SYMMETRIC=offsets is None,
        BLOCK_M=bm, BLOCK_N=bn, IEEE=x.dtype == torch.float32, num_warps=warps,
    )  # fmt: skip
    return y


def int8_gemm(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x (M, K) -> (M, N) in x's dtype for int8 weights (layout of ``Int8Linear``)."""
    m, k = x.shape
    n = qweight.shape[0]
    assert k % group_size == 0
    if interpreting():
        ensure_interpreter_compat()
    x = x.contiguous()
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)  # (M, N)
    bm, bn, warps = _tiles(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _int8_gemm_kernel[grid](
        x, qweight, scales, y,
        m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        G=group_size, BLOCK_K=int8_block_k(group_size),
        BLOCK_M=bm, BLOCK_N=bn, IEEE=x.dtype == torch.float32, num_warps=warps,
    )  # fmt: skip
    return y


def gemm_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ W (N, K)ᵀ in float64 (W the dequantized weights)."""
    return x.double() @ weight.double().t()
