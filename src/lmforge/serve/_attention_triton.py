"""The Triton paged-attention decode kernels (see :mod:`lmforge.serve.attention` for the math).

Flash-decoding: the grid is (sequence, kv-head, partition). Partition p of a sequence owns a
fixed run of ``part_blocks`` blocks of its table; it loads the group's G = H/K query vectors
once (padded to 16 rows so both products are ``tl.dot`` tensor-core tiles), then walks its
blocks NT at a time (one TILE = NT·BS-slot K/V tile per iteration, more bytes in flight per
program than one block), keeping FlashAttention's running max ``m``, normaliser ``l`` and
unnormalised output ``acc`` in fp32:

    m' = max(m, max_j s_j);  acc = acc·e^(m−m') + Σ_j e^(s_j−m') v_j;  l = l·e^(m−m') + Σ_j e^(s_j−m')

With one partition it writes ``acc / l``; with several, each writes (m, l, acc) to a workspace
and a second kernel combines them: M = max_p m_p, out = Σ_p acc_p e^(m_p−M) / Σ_p l_p e^(m_p−M)
(a partition past the context wrote m = −inf, l = 0 and drops out). The partition count depends
on shapes only (S, K and the table width), never on the context lengths, so a CUDA graph
captured for one bucket stays valid for every step replayed in it.

Quantized caches (QUANT 1: fp8 e4m3, 2: int8; rows of E values + a float32 scale, see
:mod:`lmforge.serve.attention`): the values load as bytes and convert exactly to the MMA dtype
(e4m3 and |int8| ≤ 127 fit bf16's 8-bit mantissa); the TILE scales of K multiply the scores
(``s_j = q·k̂_j · sk_j``) and those of V the softmax weights before the second product
(``Σ_j p_j sv_j v̂_j``), so dequantization costs 2·TILE multiplies per tile, not 2·TILE·E.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmforge.kernels._common import ensure_interpreter_compat, interpreting
from lmforge.kernels._split_decode_triton import combine_kernel, num_partitions


@triton.jit
def _load_values(ptrs, mask, QUANT: tl.constexpr, MMA: tl.constexpr):
    """A K/V tile in the MMA dtype: plain, or quantized bytes (fp8 e4m3 reinterpreted from
    uint8, or int8) converted exactly."""
    x = tl.load(ptrs, mask=mask, other=0)
    if QUANT == 1:
        x = x.to(tl.float8e4nv, bitcast=True)
    return x.to(MMA)  # exact: e4m3 and int8 values are bf16/f16/fp32 values


def quant_code(cache: torch.Tensor) -> int:
    """The kernels' QUANT constant for a cache: 0 plain, 1 fp8 e4m3, 2 int8."""
    return {torch.float8_e4m3fn: 1, torch.int8: 2}.get(cache.dtype, 0)


def kernel_view(cache: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel reads: fp8 caches as uint8 (bitcast in the kernel, so the CPU
    interpreter and every GPU read the same bytes), others as they are."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    lens_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    scale,
    part_blocks,
    n_parts,
    window,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_bts,
    stride_os,
    stride_oh,
    G: tl.constexpr,
    GP: tl.constexpr,
    E: tl.constexpr,
    EP: tl.constexpr,
    BS: tl.constexpr,
    NT: tl.constexpr,
    SPLIT: tl.constexpr,
    PREC: tl.constexpr,
    MMA: tl.constexpr,
    QUANT: tl.constexpr,
):
    s = tl.program_id(0)
    kh = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(lens_ptr + s)
    n_blocks = tl.cdiv(ctx, BS)
    # a sliding window (window > 0): the query (position ctx − 1) sees positions >= lo only;
    # the blocks before lo's are never read (they may be given back: the null block)
    lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    b_lo = tl.maximum(part * part_blocks, lo // BS)
    b_hi = tl.minimum(part * part_blocks + part_blocks, n_blocks)
    g = tl.arange(0, GP)
    e = tl.arange(0, EP)
    t = tl.arange(0, NT * BS)  # (TILE,) slots of NT consecutive table entries
    t_blk = t // BS
    t_off = t % BS
    g_ok = g < G
    e_ok = e < E
    heads = kh * G + g  # (GP,) query heads of this kv-head (rows >= G are padding)
    q = tl.load(
        q_ptr + s * stride_qs + heads[:, None] * stride_qh + e[None, :],
        mask=g_ok[:, None] & e_ok[None, :],
        other=0.0,
    ).to(tl.float32)  # (GP, EP)
    q = (q * scale).to(MMA)
    m = tl.full([GP], float("-inf"), tl.float32)
    l_sum = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, EP], tl.float32)
    for j in range(b_lo, b_hi, NT):
        blk = j + t_blk  # (TILE,) table index of each slot
        blk_ok = blk < b_hi
        pos = blk * BS + t_off  # (TILE,) the slot's position in its sequence
        t_ok = blk_ok & (pos < ctx) & (pos >= lo)
        block = tl.load(bt_ptr + s * stride_bts + blk, mask=blk_ok, other=0).to(tl.int64)
        base = block * stride_kb + t_off * stride_kt + kh * stride_kh  # (TILE,) row starts
        if QUANT:  # rows of E + 4 bytes: 4-byte aligned (E % 4 == 0), which Triton cannot see
            base = tl.multiple_of(base, 4)
        offs = base[:, None] + e[None, :]
        kv_mask = t_ok[:, None] & e_ok[None, :]
        k = _load_values(k_ptr + offs, kv_mask, QUANT, MMA)  # (TILE, EP)
        scores = tl.dot(q, tl.trans(k), input_precision=PREC)  # (GP, TILE) fp32
        if QUANT:
            sk = tl.load((k_ptr + base + E).to(tl.pointer_type(tl.float32)), mask=t_ok, other=0.0)
            sv = tl.load((v_ptr + base + E).to(tl.pointer_type(tl.float32)), mask=t_ok, other=0.0)
            scores = scores * sk[None, :]
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        # Every tile holds a slot inside the context and window (its first block j < b_hi <=
        # cdiv(ctx, BS), and j >= lo // BS: lo itself when j is lo's block), so m_new is finite
        # and exp() never sees -inf - -inf.
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # (GP,)
        p = tl.exp(scores - m_new[:, None])  # (GP, TILE)
        alpha = tl.exp(m - m_new)  # (GP,)
        v = _load_values(v_ptr + offs, kv_mask, QUANT, MMA)  # (TILE, EP)
        if QUANT:
            acc = acc * alpha[:, None] + tl.dot((p * sv[None, :]).to(MMA), v, input_precision=PREC)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(MMA), v, input_precision=PREC)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        m = m_new
    row_mask = g_ok[:, None] & e_ok[None, :]
    if SPLIT:
        # workspace (S, H, P) for m and l, (S, H, P, EP) for acc
        ml = (s * (G * tl.num_programs(1)) + heads) * n_parts + part  # (GP,)
        tl.store(m_ptr + ml, m, mask=g_ok)
        tl.store(l_ptr + ml, l_sum, mask=g_ok)
        tl.store(acc_ptr + ml[:, None] * EP + e[None, :], acc, mask=row_mask)
    else:
        out = acc / l_sum[:, None]
        tl.store(
            out_ptr + s * stride_os + heads[:, None] * stride_oh + e[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask,
        )


def paged_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    *,
    n_parts: int | None = None,
    window: int = 0,
) -> torch.Tensor:
    """q (S, H, E), caches (NB, BS, K, E), block_tables (S, M) int32, ctx_lens (S,) -> (S, H, E).

    ``n_parts`` forces the partition count (tests); None picks it from the shapes. ``window``
    > 0: sliding-window attention (the query at position ctx − 1 sees the last ``window``
    positions; blocks before them are skipped, never read), 0: the whole context.
    """
    if interpreting():
        ensure_interpreter_compat()
    s, h, e = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    quant = quant_code(k_cache)
    assert quant == quant_code(v_cache) and (not quant or k_cache.shape[-1] == e + 4)
    group = h // kv_heads
    width = block_tables.shape[1]
    nt = max(1, 64 // bs)  # 64-slot tiles
    if n_parts is None:
        n_parts, part_blocks = num_partitions(s, kv_heads, width, nt)
    else:
        part_blocks = triton.cdiv(triton.cdiv(width, n_parts), nt) * nt
    q = q.contiguous()
    out = torch.empty_like(q)
    ep = max(16, triton.next_power_of_2(e))
    split = n_parts > 1
    # tl.dot operands in the cache dtype (tensor cores); fp32 where the cache is fp32, and in
    # Triton 3.6's CPU interpreter for bf16, whose tl.dot multiplies bf16 bit patterns.
    # (quantized caches: q's dtype, to which their values convert exactly)
    mma_src = q.dtype if quant else k_cache.dtype
    mma = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(mma_src, tl.float32)
    if interpreting() and mma == tl.bfloat16:
        mma = tl.float32
    if split:
        m_ws = torch.empty(s, h, n_parts, device=q.device, dtype=torch.float32)
        l_ws = torch.empty_like(m_ws)
        acc_ws = torch.empty(s, h, n_parts, ep, device=q.device, dtype=torch.float32)
    else:
        m_ws = l_ws = acc_ws = out  # unused
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    _paged_decode_kernel[(s, kv_heads, n_parts)](
        q,
        kernel_view(k_cache),
        kernel_view(v_cache),
        block_tables,
        ctx_lens,
        out,
        m_ws,
        l_ws,
        acc_ws,
        1.0 / (e**0.5),
        part_blocks,
        n_parts,
        window,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        G=group,
        GP=max(16, triton.next_power_of_2(group)),
        E=e,
        EP=ep,
        BS=bs,
        NT=nt,
        SPLIT=split,
        PREC="ieee" if mma == tl.float32 else "tf32",
        MMA=mma,
        QUANT=quant,
    )
    if split:
        combine_kernel[(s, h)](
            m_ws,
            l_ws,
            acc_ws,
            out,
            n_parts,
            out.stride(0),
            out.stride(1),
            H=h,
            E=e,
            EP=ep,
            PP=triton.next_power_of_2(n_parts),
        )
    return out
