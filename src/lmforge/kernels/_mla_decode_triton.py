"""The Triton paged decode kernel of absorbed multi-head latent attention.

Math (see :mod:`lmforge.kernels.mla_decode`): per sequence s and head h, with the cache row of
token j being ``[c_j (C) ; k^R_j (R)]`` and the latent-space query ``q̃_h = [q^C_h ; q^R_h]``:

    s_hj = scale · (q^C_h · c_j + q^R_h · k^R_j),     out_h = Σ_j softmax_j(s_hj) c_j   (C,)

The grid is (sequence, head block, partition). One program holds HB query heads (all H of the
sequence when H ≤ 32, padded to 16 rows so both products are ``tl.dot`` tiles; more heads go in
blocks of 32, each reading the latents once: 64 heads × C = 512 spill registers on sm_90) and walks its
partition's blocks of the table one TILE (NT blocks of BS slots) at a time: it loads the tile's
latent rows ONCE, as a (TILE, C) value/key tile and a (TILE, R) rope-key tile, and uses them for
every head: ``scores = q_c · c_tileᵀ + q_r · r_tileᵀ`` (HB, TILE), then ``acc += p · c_tile``
(the latents are also the values: no second read). Online softmax in fp32:

    m' = max(m, max_j s_j);  acc = acc·e^(m−m') + Σ_j e^(s_j−m') c_j;  l = l·e^(m−m') + Σ_j e^(s_j−m')

With one partition it writes ``acc / l``; with several (flash-decoding, so that a small batch
still fills the GPU) each writes (m, l, acc) to a workspace and :func:`_combine_kernel` merges
them: M = max_p m_p, out = Σ_p acc_p e^(m_p−M) / Σ_p l_p e^(m_p−M); an empty partition (past the
context) wrote m = −inf, l = 0 and drops out. The partition count depends on shapes only, never
on the context lengths, so a CUDA graph captured for one batch bucket stays valid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmforge.kernels._common import ensure_interpreter_compat, interpreting
from lmforge.kernels._split_decode_triton import combine_kernel, num_partitions

MAX_HEAD_BLOCK = 32  # heads per program (64 spills registers on sm_90); more re-read per 32


@triton.jit
def _mla_decode_kernel(
    q_ptr,
    cache_ptr,
    bt_ptr,
    lens_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    scale,
    part_blocks,
    n_parts,
    n_heads,
    stride_qs,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_bts,
    stride_os,
    stride_oh,
    HB: tl.constexpr,
    C: tl.constexpr,
    CP: tl.constexpr,
    R: tl.constexpr,
    RP: tl.constexpr,
    BS: tl.constexpr,
    NT: tl.constexpr,
    SPLIT: tl.constexpr,
    PREC: tl.constexpr,
    MMA: tl.constexpr,
):
    s = tl.program_id(0)
    hb = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(lens_ptr + s)
    n_blocks = tl.cdiv(ctx, BS)
    b_lo = part * part_blocks
    b_hi = tl.minimum(b_lo + part_blocks, n_blocks)
    g = tl.arange(0, HB)
    heads = hb * HB + g  # (HB,) query heads of this program
    h_ok = heads < n_heads
    ci = tl.arange(0, CP)
    ri = tl.arange(0, RP)
    c_ok = ci < C
    r_ok = ri < R
    t = tl.arange(0, NT * BS)  # (TILE,) slots of NT consecutive table entries
    t_blk = t // BS
    t_off = t % BS
    q_row = q_ptr + s * stride_qs + heads[:, None] * stride_qh
    q_c = tl.load(q_row + ci[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    q_r = tl.load(q_row + C + ri[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_c = (q_c.to(tl.float32) * scale).to(MMA)  # (HB, CP)
    q_r = (q_r.to(tl.float32) * scale).to(MMA)  # (HB, RP)
    m = tl.full([HB], float("-inf"), tl.float32)
    l_sum = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, CP], tl.float32)
    for j in range(b_lo, b_hi, NT):
        blk = j + t_blk  # (TILE,) table index of each slot
        blk_ok = blk < b_hi
        t_ok = blk_ok & (blk * BS + t_off < ctx)
        block = tl.load(bt_ptr + s * stride_bts + blk, mask=blk_ok, other=0).to(tl.int64)
        row = cache_ptr + block[:, None] * stride_cb + t_off[:, None] * stride_ct  # (TILE, 1)
        lat_c = tl.load(row + ci[None, :], mask=t_ok[:, None] & c_ok[None, :], other=0.0)
        lat_r = tl.load(row + C + ri[None, :], mask=t_ok[:, None] & r_ok[None, :], other=0.0)
        lat_c = lat_c.to(MMA)  # (TILE, CP): keys (with lat_r) and values at once
        scores = tl.dot(q_c, tl.trans(lat_c), input_precision=PREC)  # (HB, TILE) fp32
        scores += tl.dot(q_r, tl.trans(lat_r.to(MMA)), input_precision=PREC)
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        # Slot 0 of every tile lies inside the context (j < b_hi <= cdiv(ctx, BS)), so m_new
        # is finite and exp() never sees -inf - -inf.
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # (HB,)
        p = tl.exp(scores - m_new[:, None])  # (HB, TILE)
        alpha = tl.exp(m - m_new)  # (HB,)
        acc = acc * alpha[:, None] + tl.dot(p.to(MMA), lat_c, input_precision=PREC)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        m = m_new
    out_mask = h_ok[:, None] & c_ok[None, :]
    if SPLIT:
        # workspace (S, H, P) for m and l, (S, H, P, CP) for acc
        ml = (s * n_heads + heads) * n_parts + part  # (HB,)
        tl.store(m_ptr + ml, m, mask=h_ok)
        tl.store(l_ptr + ml, l_sum, mask=h_ok)
        tl.store(acc_ptr + ml[:, None] * CP + ci[None, :], acc, mask=out_mask)
    else:
        out = acc / l_sum[:, None]
        tl.store(
            out_ptr + s * stride_os + heads[:, None] * stride_oh + ci[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


def launch_config(
    h: int, c: int, bs: int, tile: int = 32, elem_bytes: int = 2
) -> tuple[int, int, int]:
    """(heads per program HB, blocks per tile NT, warps) for H heads, latent width C, block size
    BS, ``tile`` slots per iteration and the cache's element size (fp32 caches: half the
    tile). Checked to compile for sm_90 without register spills at C = 512 in bf16
    (``tests/test_kernels_mla_decode.py``)."""
    hb = min(max(16, triton.next_power_of_2(h)), MAX_HEAD_BLOCK)
    if elem_bytes > 2:
        tile //= 2
    nt = max(1, tile // bs)
    if nt * bs < 16:  # tl.dot needs K >= 16 for the p · c_tile product
        nt = triton.cdiv(16, bs)
    cp = max(16, triton.next_power_of_2(c))
    return hb, nt, 8 if hb * cp >= 8192 else 4


def mla_decode_triton(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    *,
    n_parts: int | None = None,
    tile: int = 32,
) -> torch.Tensor:
    """q (S, H, C+R), cache (NB, BS, C+R), block_tables (S, M) int32, ctx_lens (S,) int32
    -> (S, H, C) in q's dtype. ``n_parts`` forces the partition count (tests); None picks it
    from the shapes. ``tile``: slots per loop iteration (rounded to whole blocks)."""
    if interpreting():
        ensure_interpreter_compat()
    s, h, width_q = q.shape
    _, bs, latent_dim = cache.shape
    c = kv_lora_rank
    r = latent_dim - c
    assert width_q == latent_dim and cache.stride(-1) == 1
    hb, nt, num_warps = launch_config(h, c, bs, tile, cache.element_size())
    head_blocks = triton.cdiv(h, hb)
    width = block_tables.shape[1]
    if n_parts is None:
        n_parts, part_blocks = num_partitions(s, head_blocks, width, nt)
    else:
        part_blocks = triton.cdiv(triton.cdiv(width, n_parts), nt) * nt
    q = q.contiguous()
    out = torch.empty(s, h, c, device=q.device, dtype=q.dtype)
    cp = max(16, triton.next_power_of_2(c))
    rp = max(16, triton.next_power_of_2(r))
    split = n_parts > 1
    # tl.dot operands in the cache dtype (tensor cores); fp32 where the cache is fp32, and in
    # Triton 3.6's CPU interpreter for bf16, whose tl.dot multiplies bf16 bit patterns.
    mma = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(cache.dtype, tl.float32)
    if interpreting() and mma == tl.bfloat16:
        mma = tl.float32
    if split:
        m_ws = torch.empty(s, h, n_parts, device=q.device, dtype=torch.float32)
        l_ws = torch.empty_like(m_ws)
        acc_ws = torch.empty(s, h, n_parts, cp, device=q.device, dtype=torch.float32)
    else:
        m_ws = l_ws = acc_ws = out  # unused
    _mla_decode_kernel[(s, head_blocks, n_parts)](
        q,
        cache,
        block_tables,
        ctx_lens,
        out,
        m_ws,
        l_ws,
        acc_ws,
        scale,
        part_blocks,
        n_parts,
        h,
        q.stride(0),
        q.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        HB=hb,
        C=c,
        CP=cp,
        R=r,
        RP=rp,
        BS=bs,
        NT=nt,
        SPLIT=split,
        PREC="ieee" if mma == tl.float32 else "tf32",
        MMA=mma,
        num_warps=num_warps,
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
            E=c,
            EP=cp,
            PP=triton.next_power_of_2(n_parts),
        )
    return out
