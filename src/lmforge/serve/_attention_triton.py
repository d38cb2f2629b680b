"""The Triton paged-attention decode kernel (see :mod:`lmforge.serve.attention` for the math).

One program per (sequence, kv-head): it loads the group's G = H/K query vectors once, then walks
the sequence's block table, one BS-slot K/V tile per iteration, keeping FlashAttention's running
max ``m``, normaliser ``l`` and unnormalised output ``acc`` in fp32:

    m' = max(m, max_j s_j);  acc = acc·e^(m−m') + Σ_j e^(s_j−m') v_j;  l = l·e^(m−m') + Σ_j e^(s_j−m')

and writes ``acc / l``. The q·k products are broadcast-multiply-sums rather than ``tl.dot``
(G is often below the 16 rows ``tl.dot`` needs, and decode is bound by reading K/V anyway).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmforge.kernels._common import ensure_interpreter_compat, interpreting


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    lens_ptr,
    out_ptr,
    scale,
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
):
    s = tl.program_id(0)
    kh = tl.program_id(1)
    ctx = tl.load(lens_ptr + s)
    g = tl.arange(0, GP)
    e = tl.arange(0, EP)
    t = tl.arange(0, BS)
    g_ok = g < G
    e_ok = e < E
    heads = kh * G + g  # (GP,) query heads of this kv-head
    q = tl.load(
        q_ptr + s * stride_qs + heads[:, None] * stride_qh + e[None, :],
        mask=g_ok[:, None] & e_ok[None, :],
        other=0.0,
    ).to(tl.float32)  # (GP, EP)
    q = q * scale
    m = tl.full([GP], float("-inf"), tl.float32)
    l_sum = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, EP], tl.float32)
    for i in range(0, tl.cdiv(ctx, BS)):
        pos = i * BS + t  # (BS,)
        t_ok = pos < ctx
        block = tl.load(bt_ptr + s * stride_bts + i).to(tl.int64)
        offs = block * stride_kb + t[:, None] * stride_kt + kh * stride_kh + e[None, :]
        kv_mask = t_ok[:, None] & e_ok[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)  # (BS, EP)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (GP, BS)
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        # Every tile holds at least one valid slot (the loop stops at the context), so m_new
        # is finite and exp() never sees -inf - -inf.
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # (GP,)
        p = tl.exp(scores - m_new[:, None])  # (GP, BS)
        alpha = tl.exp(m - m_new)  # (GP,)
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)  # (BS, EP)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # (GP, EP)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(
        out_ptr + s * stride_os + heads[:, None] * stride_oh + e[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_ok[:, None] & e_ok[None, :],
    )


def paged_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
) -> torch.Tensor:
    """q (S, H, E), caches (NB, BS, K, E), block_tables (S, M) int32, ctx_lens (S,) -> (S, H, E)."""
    if interpreting():
        ensure_interpreter_compat()
    s, h, e = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    group = h // kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    _paged_decode_kernel[(s, kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        ctx_lens,
        out,
        1.0 / (e**0.5),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        G=group,
        GP=triton.next_power_of_2(group),
        E=e,
        EP=triton.next_power_of_2(e),
        BS=bs,
    )
    return out
