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
without an interleave. Program (n, s) owns ``BLOCK_N`` rows and the K chunks s, s + SPLIT, …
(a chunk: ``SUB`` consecutive groups, int4, or BLOCK_K-wide slices, int8, whose loads are issued
together); split-K partial sums (SPLIT, M, N) fp32 are added by the caller (enough programs for
the SMs at batch 1). Launches per weight shape: :data:`TABLE`, else one group an iteration and
about two waves of programs (:func:`quant_gemv_config`).

An int4 launch may send batch 1 (one row of x) to a CUDA-core kernel instead
(``QuantGemvConfig.rows_kernel``, ``_int4_gemv_row_kernel``): each code dequantized in
registers (q·s + m) and multiplied into a (BLOCK_N, chunk) fp32 accumulator, one reduction
along K at the end. The dot kernel's int4 path stages the unpacked codes through shared memory
for the tensor cores (14 ``st.shared``, 30 ``ld.shared`` and 9 barriers a group in its sm_90
PTX, 96 registers); the row kernel's loop has no shared memory and no barrier (64 registers at
32 rows × 4 warps). The H100 sweep picked it on every TinyLlama shape (20-30% faster); int8's
row launches saved under 2% of its step and were removed. fp8 e4m3 weights have a row kernel
only (``_fp8_gemv_row_kernel``: batch 1, weight-only or W8A8 with the row's e4m3 codes and
scale), used for the shapes whose ("fp8", N, K, K) TABLE entry says it beat
``torch._scaled_mm``. The reference is
:func:`gemv_reference` (float64). Exercised by ``pytest tests/test_quant_kernels.py``
(TRITON_INTERPRET=1 on CPU) and ``benchmarks/quant.py``.

Shape legend: M rows of x (decode sequences), N output features, K input features, G group.
"""

from __future__ import annotations

import dataclasses

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
    G: tl.constexpr, SYMMETRIC: tl.constexpr, SUB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    split = tl.num_programs(1)
    HALF: tl.constexpr = G // 2
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_c = tl.minimum(rn, N - 1)  # rows past N re-read row N-1 and are not stored
    rm = tl.arange(0, BLOCK_M)
    rh = tl.arange(0, HALF)
    m_ok = rm < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    n_chunks = K // (G * SUB)  # a chunk: SUB consecutive groups, their loads issued together
    for c in range(pid_s, n_chunks, split):
        for j in tl.static_range(SUB):
            g = c * SUB + j
            b = tl.load(q_ptr + rn_c[:, None] * stride_qn + g * HALF + rh[None, :])  # (BN, G/2)
            x_lo = tl.load(
                x_ptr + rm[None, :] * stride_xm + g * G + rh[:, None], mask=m_ok[None, :]
            )
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
            xsum = tl.sum(x_lo.to(tl.float32), axis=0) + tl.sum(x_hi.to(tl.float32), axis=0)
            acc += part * s[:, None] + off[:, None] * xsum[None, :]
    out = out_ptr + pid_s * stride_os + rm[None, :] * stride_om + rn[:, None]
    tl.store(out, acc, mask=(rn[:, None] < N) & m_ok[None, :])


@triton.jit
def _int8_gemv_kernel(
    x_ptr, q_ptr, s_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_sn, stride_os, stride_om,
    G: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    split = tl.num_programs(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_c = tl.minimum(rn, N - 1)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for c in range(pid_s, K // (BLOCK_K * SUB), split):  # SUB K chunks an iteration
        for j in tl.static_range(SUB):
            k0 = (c * SUB + j) * BLOCK_K
            q = tl.load(q_ptr + rn_c[:, None] * stride_qn + k0 + rk[None, :])  # (BN, BK) int8
            xt = tl.load(x_ptr + rm[None, :] * stride_xm + k0 + rk[:, None], mask=m_ok[None, :])
            w = q.to(xt.dtype)  # |q| <= 127: exact in bf16 / fp16
            if IEEE:
                part = tl.dot(w, xt, input_precision="ieee")  # (BN, BM)
            else:
                part = tl.dot(w, xt)  # (BN, BM)
            s = tl.load(s_ptr + rn_c * stride_sn + k0 // G).to(tl.float32)  # (BN,): one group
            acc += part * s[:, None]
    out = out_ptr + pid_s * stride_os + rm[None, :] * stride_om + rn[:, None]
    tl.store(out, acc, mask=(rn[:, None] < N) & m_ok[None, :])


@triton.jit
def _int4_gemv_row_kernel(
    x_ptr, q_ptr, s_ptr, o_ptr, out_ptr,
    N, K,
    stride_qn, stride_sn, stride_os,
    G: tl.constexpr, SYMMETRIC: tl.constexpr, SUB: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # one decode row (M = 1) on the CUDA cores: each code dequantized in registers (q·s + m)
    # and multiplied into a (BLOCK_N, G/2) fp32 accumulator per nibble plane; one reduction
    # along K at the end. No shared-memory staging of the codes (a tensor-core dot needs it)
    # and no reduction across threads inside the loop.
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    split = tl.num_programs(1)
    HALF: tl.constexpr = G // 2
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_c = tl.minimum(rn, N - 1)  # rows past N re-read row N-1 and are not stored
    rh = tl.arange(0, HALF)
    acc = tl.zeros((BLOCK_N, HALF), dtype=tl.float32)
    for c in range(pid_s, K // (G * SUB), split):  # SUB consecutive groups an iteration
        for j in tl.static_range(SUB):
            g = c * SUB + j
            b = tl.load(q_ptr + rn_c[:, None] * stride_qn + g * HALF + rh[None, :])  # (BN, G/2)
            # x as (1, G/2) rows: loaded straight into the codes' layout (a 1-D load would be
            # converted through shared memory every iteration)
            x_lo = tl.load(x_ptr + g * G + rh[None, :]).to(tl.float32)
            x_hi = tl.load(x_ptr + g * G + HALF + rh[None, :]).to(tl.float32)
            s = tl.load(s_ptr + rn_c * stride_sn + g).to(tl.float32)[:, None]  # (BN, 1)
            if SYMMETRIC:
                off = -8.0 * s
            else:
                off = tl.load(o_ptr + rn_c * stride_sn + g).to(tl.float32)[:, None]
            w_lo = (b & 0x0F).to(tl.float32) * s + off  # (BN, G/2) dequantized
            w_hi = (b >> 4).to(tl.float32) * s + off
            acc += w_lo * x_lo + w_hi * x_hi
    tl.store(out_ptr + pid_s * stride_os + rn, tl.sum(acc, axis=1), mask=rn < N)


@triton.jit
def _fp8_gemv_row_kernel(
    x_ptr, q_ptr, s_ptr, xs_ptr, out_ptr,
    N, K,
    stride_qn, stride_os,
    PER_ROW: tl.constexpr, X_SCALE: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    # one decode row (M = 1) of e4m3 codes on the CUDA cores, as _int4_gemv_row_kernel; the
    # scale, one per row (PER_ROW) or one for the tensor, applied after the sum. X_SCALE: x
    # holds e4m3 codes whose row scale is at xs_ptr (W8A8: Σ x_q·w_q in fp32, then both scales,
    # as torch._scaled_mm computes it)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    split = tl.num_programs(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_c = tl.minimum(rn, N - 1)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for c in range(pid_s, K // (BLOCK_K * SUB), split):  # SUB K chunks an iteration
        for j in tl.static_range(SUB):
            k0 = (c * SUB + j) * BLOCK_K
            q = tl.load(q_ptr + rn_c[:, None] * stride_qn + k0 + rk[None, :])  # (BN, BK)
            # x read in the codes' (BN, BK) shape and layout (every row the same, from L1): a
            # (BK,) load would be converted through shared memory every iteration
            x = tl.load(x_ptr + k0 + rk[None, :] + 0 * rn_c[:, None]).to(tl.float32)
            acc += q.to(tl.float32) * x
    y = tl.sum(acc, axis=1)  # (BN,)
    if PER_ROW:
        y = y * tl.load(s_ptr + rn_c)
    else:
        y = y * tl.load(s_ptr)
    if X_SCALE:
        y = y * tl.load(xs_ptr)
    tl.store(out_ptr + pid_s * stride_os + rn, y, mask=rn < N)


@dataclasses.dataclass(frozen=True)
class QuantGemvConfig:
    """One launch of the int4/int8/fp8 decode GEMV."""

    split: int
    "programs along K (the partials' first dim), 1..8"
    sub: int = 1
    "groups (int4) or K chunks (int8) a program loads per loop iteration, issued together"
    block_n: int = _BLOCK_N
    "rows of W per program"
    warps: int = 4
    "num_warps"
    stages: int = 3
    "num_stages"
    rows_kernel: bool = False
    """int4 and fp8: a one-row x (batch-1 decode) takes the CUDA-core kernel
    (``_int4_gemv_row_kernel``, ``_fp8_gemv_row_kernel``: codes dequantized in registers, no
    tensor-core dot) with this launch; int4's larger batches take the dot kernel's default
    launch with the same split (the partials' shape depends on the split only)"""


# (format, N, K, group) -> config; shapes not listed take :func:`_default_config` (one group or
# chunk an iteration, ~two waves of programs; fp8: torch._scaled_mm, see Fp8Linear). Entries:
# launches of ``benchmarks/quant.py --part gemv`` that beat the default by more than 2% of
# their own time and buy more than 2% of a decode step (22 launches a step). From the H100 sweep
# of 2026-12-05 (commit 8071224, TinyLlama's shapes, us a call default -> best): int4 q|k|v
# 6.50 -> 4.43, o 5.34 -> 4.07, w1|w3 14.59 -> 11.57, w2 9.92 -> 7.55 (2.5-5.9% of the int4
# step each); fp8 18-32% faster than torch._scaled_mm on every shape. int8's best launches saved
# 0.4-2.0% of its step (q|k|v 5.96 -> 4.79 us, 1.97%), so int8 keeps the default.
TABLE: dict[tuple[str, int, int, int], QuantGemvConfig] = {
    ("int4", 2560, 2048, 128): QuantGemvConfig(8, sub=1, block_n=32, warps=4, rows_kernel=True),
    ("int4", 2048, 2048, 128): QuantGemvConfig(8, sub=1, block_n=32, warps=4, rows_kernel=True),
    ("int4", 11264, 2048, 128): QuantGemvConfig(4, sub=2, block_n=32, warps=4, rows_kernel=True),
    ("int4", 2048, 5632, 128): QuantGemvConfig(8, sub=1, block_n=64, warps=8, rows_kernel=True),
    ("fp8", 2560, 2048, 2048): QuantGemvConfig(8, sub=2, block_n=16, warps=2, rows_kernel=True),
    ("fp8", 2048, 2048, 2048): QuantGemvConfig(8, sub=2, block_n=32, warps=4, rows_kernel=True),
    ("fp8", 11264, 2048, 2048): QuantGemvConfig(2, sub=4, block_n=16, warps=2, rows_kernel=True),
    ("fp8", 2048, 5632, 5632): QuantGemvConfig(8, sub=2, block_n=16, warps=2, rows_kernel=True),
}


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few programs suffice


def _split(n: int, chunks: int, device: torch.device) -> int:
    """Split-K so that about two waves of programs cover the SMs, at most 8 and ≤ the chunks."""
    programs = triton.cdiv(n, _BLOCK_N)
    want = triton.cdiv(2 * _sm_count(device), programs)
    return max(1, min(8, chunks, want))


def fp8_block_k(k: int) -> int:
    """The K chunk of the fp8 row kernel: the largest power of two <= 64 dividing K (>= 16)."""
    bk = 64
    while bk > 16 and k % bk:
        bk //= 2
    return bk


def int8_block_k(group_size: int) -> int:
    """The K chunk of the int8 kernels: the largest power of two ≤ 128 dividing the group."""
    bk = 128
    while bk > 16 and group_size % bk:
        bk //= 2
    return bk


def _default_config(n: int, chunks: int, device: torch.device) -> QuantGemvConfig:
    return QuantGemvConfig(_split(n, chunks, device))


def quant_gemv_config(
    fmt: str, n: int, k: int, group_size: int, device: torch.device
) -> QuantGemvConfig:
    """The launch for an (N, K) int4 (``fmt`` "int4") or int8 weight of group ``group_size``:
    :data:`TABLE`'s, else the default."""
    cfg = TABLE.get((fmt, n, k, group_size))
    if cfg is not None:
        return cfg
    if fmt == "fp8":
        chunks = k // fp8_block_k(k)
    else:
        chunks = k // group_size if fmt == "int4" else k // int8_block_k(group_size)
    return _default_config(n, chunks, device)


def int4_split(n: int, k: int, group_size: int, device: torch.device) -> int:
    """The split-K of :func:`int4_gemv_partials` for an (N, K) weight: its partials' first dim."""
    return quant_gemv_config("int4", n, k, group_size, device).split


def int8_split(n: int, k: int, group_size: int, device: torch.device) -> int:
    """The split-K of :func:`int8_gemv_partials` for an (N, K) weight."""
    return quant_gemv_config("int8", n, k, group_size, device).split


def int4_gemv_partials(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    group_size: int,
    config: QuantGemvConfig | None = None,
) -> torch.Tensor:
    """x (M ≤ 8, K) -> split-K partial sums (SPLIT, M, N) fp32 for int4 weights (layout of
    :class:`~lmforge.quant.Int4Linear`); their sum over dim 0 is x Wᵀ. A compiled decode step
    adds them in its consumer's kernel (no kernel of their own). ``config``: the launch
    (default :func:`quant_gemv_config`'s; the benchmark's sweep passes others)."""
    m, k = x.shape
    n = qweight.shape[0]
    assert m <= MAX_ROWS and k % group_size == 0 and (group_size // 2) >= 16
    if interpreting():
        ensure_interpreter_compat()
    x = x.contiguous()
    cfg = config or quant_gemv_config("int4", n, k, group_size, x.device)
    assert (k // group_size) % cfg.sub == 0, (k, group_size, cfg)
    out = torch.empty(cfg.split, m, n, device=x.device, dtype=torch.float32)  # (SPLIT, M, N)
    o = scales if offsets is None else offsets
    if cfg.rows_kernel and m > 1:  # the dot kernel's default launch, the same split
        cfg = QuantGemvConfig(cfg.split)
    grid = (triton.cdiv(n, cfg.block_n), cfg.split)
    if cfg.rows_kernel:
        _int4_gemv_row_kernel[grid](
            x, qweight, scales, o, out,
            n, k,
            qweight.stride(0), scales.stride(0), out.stride(0),
            G=group_size, SYMMETRIC=offsets is None, SUB=cfg.sub, BLOCK_N=cfg.block_n,
            num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip
        return out
    _int4_gemv_kernel[grid](
        x, qweight, scales, o, out,
        m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), out.stride(1),
        G=group_size, SYMMETRIC=offsets is None, SUB=cfg.sub,
        BLOCK_N=cfg.block_n, BLOCK_M=_ROWS_PAD, IEEE=x.dtype == torch.float32,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return out


def int8_gemv_partials(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    config: QuantGemvConfig | None = None,
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
    cfg = config or quant_gemv_config("int8", n, k, group_size, x.device)
    assert (k // bk) % cfg.sub == 0, (k, bk, cfg)
    if cfg.rows_kernel:
        raise ValueError("int8 has no row kernel (the H100 sweep found it under 2% of a step)")
    out = torch.empty(cfg.split, m, n, device=x.device, dtype=torch.float32)  # (SPLIT, M, N)
    grid = (triton.cdiv(n, cfg.block_n), cfg.split)
    _int8_gemv_kernel[grid](
        x, qweight, scales, out,
        m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), out.stride(1),
        G=group_size, BLOCK_K=bk, SUB=cfg.sub,
        BLOCK_N=cfg.block_n, BLOCK_M=_ROWS_PAD, IEEE=x.dtype == torch.float32,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return out


def fp8_gemv_partials(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    config: QuantGemvConfig | None = None,
) -> torch.Tensor:
    """x (1, K) -> split-K partial sums (SPLIT, 1, N) fp32 of x Wᵀ for e4m3 ``qweight`` (N, K)
    with fp32 ``scales`` (N,) or (1,); x bf16/fp16 (weight-only), or e4m3 codes with their row
    scale ``x_scale`` (1,) (W8A8). Batch 1 only, on the row kernel: the launch is ``config``,
    else :data:`TABLE`'s ("fp8", N, K, K) entry, else the default split."""
    m, k = x.shape
    n = qweight.shape[0]
    bk = fp8_block_k(k)
    assert m == 1 and k % bk == 0 and (x_scale is None) == (x.dtype != torch.float8_e4m3fn)
    if interpreting():
        ensure_interpreter_compat()
    x = x.contiguous()
    cfg = config or quant_gemv_config("fp8", n, k, k, x.device)
    assert (k // bk) % cfg.sub == 0, (k, bk, cfg)
    out = torch.empty(cfg.split, 1, n, device=x.device, dtype=torch.float32)  # (SPLIT, 1, N)
    _fp8_gemv_row_kernel[(triton.cdiv(n, cfg.block_n), cfg.split)](
        x, qweight, scales, scales if x_scale is None else x_scale, out,
        n, k,
        qweight.stride(0), out.stride(0),
        PER_ROW=scales.numel() > 1, X_SCALE=x_scale is not None, BLOCK_K=bk, SUB=cfg.sub,
        BLOCK_N=cfg.block_n, num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return out


def fp8_split(n: int, k: int, device: torch.device) -> int:
    """The split-K of :func:`fp8_gemv_partials` for an (N, K) weight."""
    return quant_gemv_config("fp8", n, k, k, device).split


def gemv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ W (N, K)ᵀ in float64 (W the dequantized weights)."""
    return x.double() @ weight.double().t()
