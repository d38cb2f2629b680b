"""Dequant-fused decode GEMV: y (M, N) = x (M, K) @ W (N, K)ᵀ for M ≤ 8 rows, W int4 or int8.

A decode step reads every weight once and does almost no arithmetic: its floor is the bytes of
the codes and scales at the HBM bandwidth, so the codes are never written back dequantized.
Math, per output row n and group g of G inputs (codes q, scale s, offset m; symmetric int4 has
m = −8·s, int8 has m = 0):

    y[:, n] = Σ_g ( s[n, g] · Σ_{k in g} q[n, k] · x[:, k]  +  m[n, g] · Σ_{k in g} x[:, k] )

so the inner product runs on the raw codes (exact in bf16/fp16: |q| ≤ 127) as a tensor-core dot
``codes (BLOCK_N, BK) @ xᵀ (BK, 16)`` (the M ≤ 8 rows padded to the dot's smallest side with
masked loads), and the group scale and offset are applied once per group in fp32. For int4 one
group's bytes hold columns [0, G/2) in their low nibbles and [G/2, G) in their high nibbles
(:mod:`lmforge.quant.formats`), so the two nibble planes meet the two halves of x's group
without an interleave. Program (n, s) owns ``BLOCK_N`` rows and the K chunks s, s + SPLIT, …;
split-K partial sums (SPLIT, M, N) fp32 are added by the caller (enough programs for the SMs at
batch 1). The reference is :func:`gemv_reference` (float64). Exercised by
``pytest tests/test_quant_kernels.py`` (TRITON_INTERPRET=1 on CPU) and ``benchmarks/quant.py``.

Shape legend: M rows of x (decode sequences), N output features, K input features, G group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmforge.kernels._common import ensure_interpreter_compat, interpreting

MAX_ROWS = 8  # decode batches; more rows go to the GEMM (lmforge.quant._gemm_triton)
_ROWS_PAD = 16  # tl.dot's smallest tile side
_BLOCK_N = 64


@triton.jit
def _int4_gemv_kernel(
    x_ptr, q_ptr, s_ptr, o_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_sn, stride_os, stride_om,
    G: tl.constexpr, SYMMETRIC: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    HALF: tl.constexpr = G // 2
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_c = tl.minimum(rn, N - 1)  # rows past N re-read row N-1 and are not stored
    rm = tl.arange(0, BLOCK_M)
    rh = tl.arange(0, HALF)
    m_ok = rm < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    n_groups = K // G
    for g in range(pid_s, n_groups, SPLIT):
        b = tl.load(q_ptr + rn_c[:, None] * stride_qn + g * HALF + rh[None, :])  # (BN, G/2)
        x_lo = tl.load(x_ptr + rm[None, :] * stride_xm + g * G + rh[:, None], mask=m_ok[None, :])
        x_hi = tl.load(
            x_ptr + rm[None, :] * stride_xm + g * G + HALF + rh[:, None], mask=m_ok[None, :]
        )  # (G/2, BM) each
        lo = (b & 0x0F).to(x_lo.dtype)
        hi = (b >> 4).to(x_lo.dtype)
        if IEEE:
            part = tl.dot(lo, x_lo, input_precision="ieee")
            part = tl.dot(hi, x_hi, part, input_precision="ieee")  # (BN, BM)
        else:
            part = tl.dot(lo, x_lo)
            part = tl.dot(hi, x_hi, part)  # (BN, BM)
        s = tl.load(s_ptr + rn_c * stride_sn + g).to(tl.float32)  # (BN,)
        if SYMMETRIC:
            off = -8.0 * s
        else:
            off = tl.load(o_ptr + rn_c * stride_sn + g).to(tl.float32)
        xsum = tl.sum(x_lo.to(tl.float32), axis=0) + tl.sum(x_hi.to(tl.float32), axis=0)  # (BM,)
        acc += part * s[:, None] + off[:, None] * xsum[None, :]
    out = out_ptr + pid_s * stride_os + rm[None, :] * stride_om + rn[:, None]
    tl.store(out, acc, mask=(rn[:, None] < N) & m_ok[None, :])


@triton.jit
def _int8_gemv_kernel(
    x_ptr, q_ptr, s_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_sn, stride_os, stride_om,
    G: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_c = tl.minimum(rn, N - 1)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for c in range(pid_s, K // BLOCK_K, SPLIT):
        k0 = c * BLOCK_K
        q = tl.load(q_ptr + rn_c[:, None] * stride_qn + k0 + rk[None, :])  # (BN, BK) int8
        xt = tl.load(x_ptr + rm[None, :] * stride_xm + k0 + rk[:, None], mask=m_ok[None, :])
        w = q.to(xt.dtype)  # |q| <= 127: exact in bf16 / fp16
        if IEEE:
            part = tl.dot(w, xt, input_precision="ieee")  # (BN, BM)
        else:
            part = tl.dot(w, xt)  # (BN, BM)
        s = tl.load(s_ptr + rn_c * stride_sn + k0 // G).to(tl.float32)  # (BN,): chunk in 1 group
        acc += part * s[:, None]
    out = out_ptr + pid_s * stride_os + rm[None, :] * stride_om + rn[:, None]
    tl.store(out, acc, mask=(rn[:, None] < N) & m_ok[None, :])


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few programs suffice


def _split(n: int, chunks: int, device: torch.device) -> int:
    """Split-K so that about two waves of programs cover the SMs, at most 8 and ≤ the chunks."""
    programs = triton.cdiv(n, _BLOCK_N)
    want = triton.cdiv(2 * _sm_count(device), programs)
    return max(1, min(8, chunks, want))


def int8_block_k(group_size: int) -> int:
    """The K chunk of the int8 kernels: the largest power of two ≤ 128 dividing the group."""
    bk = 128
    while bk > 16 and group_size % bk:
        bk //= 2
    return bk


def int4_split(n: int, k: int, group_size: int, device: torch.device) -> int:
    """The split-K of :func:`int4_gemv_partials` for an (N, K) weight: its partials' first dim."""
    return _split(n, k // group_size, device)


def int8_split(n: int, k: int, group_size: int, device: torch.device) -> int:
    """The split-K of :func:`int8_gemv_partials` for an (N, K) weight."""
    return _split(n, k // int8_block_k(group_size), device)


def int4_gemv_partials(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """x (M ≤ 8, K) -> split-K partial sums (SPLIT, M, N) fp32 for int4 weights (layout of
    :class:`~lmforge.quant.Int4Linear`); their sum over dim 0 is x Wᵀ. A compiled decode step
    adds them in its consumer's kernel (no kernel of their own)."""
    m, k = x.shape
    n = qweight.shape[0]
    assert m <= MAX_ROWS and k % group_size == 0 and (group_size // 2) >= 16
    if interpreting():
        ensure_interpreter_compat()
    x = x.contiguous()
    split = int4_split(n, k, group_size, x.device)
    out = torch.empty(split, m, n, device=x.device, dtype=torch.float32)  # (SPLIT, M, N)
    o = scales if offsets is None else offsets
    grid = (triton.cdiv(n, _BLOCK_N), split)
    _int4_gemv_kernel[grid](
        x, qweight, scales, o, out,
        m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), out.stride(1),
        G=group_size, SYMMETRIC=offsets is None, SPLIT=split,
        BLOCK_N=_BLOCK_N, BLOCK_M=_ROWS_PAD, IEEE=x.dtype == torch.float32,
    )  # fmt: skip
    return out


def int8_gemv_partials(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x (M ≤ 8, K) -> split-K partial sums (SPLIT, M, N) fp32 for int8 weights (layout of
    :class:`~lmforge.quant.Int8Linear`); their sum over dim 0 is x Wᵀ."""
    m, k = x.shape
    n = qweight.shape[0]
    assert m <= MAX_ROWS and k % group_size == 0
    if interpreting():
        ensure_interpreter_compat()
    x = x.contiguous()
    bk = int8_block_k(group_size)
    split = int8_split(n, k, group_size, x.device)
    out = torch.empty(split, m, n, device=x.device, dtype=torch.float32)  # (SPLIT, M, N)
    grid = (triton.cdiv(n, _BLOCK_N), split)
    _int8_gemv_kernel[grid](
        x, qweight, scales, out,
        m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), out.stride(1),
        G=group_size, BLOCK_K=bk, SPLIT=split,
        BLOCK_N=_BLOCK_N, BLOCK_M=_ROWS_PAD, IEEE=x.dtype == torch.float32,
    )  # fmt: skip
    return out


def gemv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ W (N, K)ᵀ in float64 (W the dequantized weights)."""
    return x.double() @ weight.double().t()
