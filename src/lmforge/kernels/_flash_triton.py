"""Triton kernels of FlashAttention-2 (see ``flash_attention.py`` for the math and the public op).

Layout: q (B, H, T, E), k/v (B, K, S, E) with any strides except a unit stride on E; O and dq/dk/dv
are written contiguous; L and D are (B, H, T) float32. Work split:
  * forward — one program per (query tile, batch·head); key tiles left of the diagonal run an
    unmasked loop, the tiles on the diagonal (and a ragged tail) a masked one; tiles above the
    diagonal are never visited. Causal grids start with the longest rows for load balance.
  * backward — ``_delta`` computes D = rowsum(dO∘O); ``_dkdv`` gives each program one key tile
    of one key/value head and loops over the query heads of its group (GQA without atomics and
    without repeating K/V); ``_dq`` mirrors the forward loop. P is recomputed from L in both.
Rows past T are handled by loading L = +inf there (so P = 0), keys past S by the masked loop.
Sliding window (``window`` W > 0, causal only: query i sees keys i − W < j ≤ i): the loops start
at the first tile the window reaches (forward, dq) or stop at the last row that sees the key tile
(dkdv); tiles crossing the window's edge take the masked loop with the window in the mask, the
tiles wholly inside it the unmasked one. A row can see none of a window-edge tile's keys, so the
forward keeps the running max finite there (an all −∞ row would give exp2(−∞ + ∞)).
Block shapes, warps and stages are autotuned over a handful of Hopper-friendly configs per
head-dim class; under ``TRITON_INTERPRET=1`` one small fixed config runs instead.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from lmforge.kernels._common import ensure_interpreter_compat, interpreting

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _fwd_inner(
    acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, lo, hi, T_K,
    qk_scale, WINDOW,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=offs_n[:, None] < T_K, other=0.0)
            v = tl.load(v_ptrs, mask=offs_n[:, None] < T_K, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        qk = tl.dot(q, tl.trans(k))  # (BM, BN) float32, unscaled
        if MASKED:
            keep = offs_n[None, :] < T_K
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            if WINDOWED:
                keep = keep & (offs_m[:, None] - offs_n[None, :] < WINDOW)
            qk = tl.where(keep, qk, float("-inf"))
        # The scale is applied inside the exponent (one FMA per score) rather than to the tile.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        if WINDOWED:  # a row that has seen no key yet: subtract 0, not −∞ (P and alpha stay 0)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.math.exp2(qk * qk_scale - m_use[:, None])  # (BM, BN)
        alpha = tl.math.exp2(m_i - m_use)  # rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)  # (BM, E)
        m_i = m_new
    return acc, m_i, l_i


# Lengths and head counts are not specialised on (no recompile per sequence length); strides
# still are, since their 16-alignment lets loads vectorise.
_LENGTH_ARGS = ["H", "GROUP", "T_Q", "T_K", "T_BUCKET", "WINDOW"]


@triton.jit
def _window_tiles(start_m, diag, WINDOW, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Key tiles of query tile [start_m, start_m + BLOCK_M) under a window: [lo_w, lo_full)
    # cross the window's edge (some row sees only part of them), [lo_full, diag) are seen whole
    # by every row; both bounds multiples of BLOCK_N, lo_w <= lo_full <= diag.
    lo_w = tl.maximum(start_m - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    lo_full = (tl.maximum(start_m + BLOCK_M - WINDOW, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo_full = tl.minimum(tl.maximum(lo_full, lo_w), diag)
    return tl.minimum(lo_w, lo_full), lo_full


@triton.jit(do_not_specialize=_LENGTH_ARGS)
def _attn_fwd(
    Q, K, V, Out, L, sm_scale,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    H, GROUP, T_Q, T_K, T_BUCKET, WINDOW,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr,
):  # fmt: skip
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    if CAUSAL:  # longest rows first: the last query tiles carry the most key tiles
        start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    else:
        start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    kvh = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=offs_m[:, None] < T_Q, other=0.0)  # (BM, E)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # work in base 2: exp(x) = exp2(x·log2 e)
    if CAUSAL:
        lo = tl.minimum(start_m, T_K) // BLOCK_N * BLOCK_N
        hi = tl.minimum(start_m + BLOCK_M, T_K)
    else:
        lo = T_K // BLOCK_N * BLOCK_N
        hi = T_K
    start = 0
    if WINDOWED:  # tiles crossing the window's edge (masked), then those wholly inside it
        lo_w, lo_full = _window_tiles(start_m, lo, WINDOW, BLOCK_M, BLOCK_N)
        acc, m_i, l_i = _fwd_inner(
            acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, lo_w,
            lo_full, T_K, qk_scale, WINDOW, True, CAUSAL, BLOCK_N, WINDOWED,
        )  # fmt: skip
        start = lo_full
    acc, m_i, l_i = _fwd_inner(
        acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, start, lo, T_K,
        qk_scale, WINDOW, False, CAUSAL, BLOCK_N, WINDOWED,
    )  # fmt: skip
    acc, m_i, l_i = _fwd_inner(
        acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, lo, hi, T_K,
        qk_scale, WINDOW, True, CAUSAL, BLOCK_N, WINDOWED,
    )  # fmt: skip
    if WINDOWED:  # padding rows past T + W − 1 see no key: l = 0 there (never stored)
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_i[:, None]
    row_ok = offs_m < T_Q
    o_ptrs = Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[:, None])
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # natural-log logsumexp
    tl.store(L + pid_bh.to(tl.int64) * T_Q + offs_m, lse, mask=row_ok)


@triton.jit(do_not_specialize=["H", "T_Q"])
def _attn_bwd_delta(
    Out, DO, Dl, stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom, H, T_Q,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m[:, None] < T_Q
    o = tl.load(
        Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
        mask=row_ok, other=0.0,
    )  # fmt: skip
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :],
        mask=row_ok, other=0.0,
    )  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (BM,)
    tl.store(Dl + pid_bh.to(tl.int64) * T_Q + offs_m, delta, mask=offs_m < T_Q)


@triton.jit
def _dkdv_inner(
    dk, dv, k, v, q_base, do_base, l_base, d_base, stride_qm, stride_dom, offs_n, offs_d, lo, hi,
    T_Q, qk_scale, WINDOW,
    MASKED: tl.constexpr, BLOCK_M: tl.constexpr, WINDOWED: tl.constexpr,
):  # fmt: skip
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < T_Q
        q = tl.load(
            q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=row_ok[:, None], other=0.0
        )  # (BM, E)
        do = tl.load(
            do_base + offs_m[:, None] * stride_dom + offs_d[None, :],
            mask=row_ok[:, None], other=0.0,
        )  # fmt: skip
        # L = +inf past T makes those rows' probabilities exactly 0: no separate row mask.
        lse2 = tl.load(l_base + offs_m, mask=row_ok, other=float("inf")) * 1.4426950408889634
        delta = tl.load(d_base + offs_m, mask=row_ok, other=0.0)
        qk_t = tl.dot(k, tl.trans(q))  # (BN, BM) = (q kᵀ)ᵀ
        s_t = qk_t * qk_scale - lse2[None, :]
        if MASKED:  # mask before exp2 so entries above the diagonal never overflow
            keep = offs_m[None, :] >= offs_n[:, None]
            if WINDOWED:
                keep = keep & (offs_m[None, :] - offs_n[:, None] < WINDOW)
            s_t = tl.where(keep, s_t, float("-inf"))
        p_t = tl.math.exp2(s_t)
        dv = tl.dot(p_t.to(do.dtype), do, dv)  # (BN, E)
        dp_t = tl.dot(v, tl.trans(do))  # (BN, BM)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)  # (BN, E)
    return dk, dv


@triton.jit(do_not_specialize=[*_LENGTH_ARGS, "KV_HEADS"])
def _attn_bwd_dkdv(
    Q, K, V, DO, L, Dl, DK, DV, sm_scale,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    H, KV_HEADS, GROUP, T_Q, T_K, T_BUCKET, WINDOW,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr,
):  # fmt: skip
    tl.static_assert(BLOCK_N % BLOCK_M == 0)
    start_n = tl.program_id(0) * BLOCK_N
    pid_bk = tl.program_id(1)
    b = (pid_bk // KV_HEADS).to(tl.int64)
    kvh = (pid_bk % KV_HEADS).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n[:, None] < T_K
    k = tl.load(
        K + b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
        mask=col_ok, other=0.0,
    )  # fmt: skip
    v = tl.load(
        V + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :],
        mask=col_ok, other=0.0,
    )  # fmt: skip
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    # rows a causal tile's unmasked loop covers, and (window) the rows that see any of its keys
    hi_full = T_Q
    hi_w = T_Q
    if WINDOWED:  # rows >= start_n + WINDOW miss the tile's first key: masked up to the last
        hi_w = tl.minimum(start_n + BLOCK_N + WINDOW - 1, T_Q)  # row seeing its last key
        hi_full = tl.minimum(
            tl.maximum((start_n + WINDOW) // BLOCK_M * BLOCK_M, start_n + BLOCK_N), hi_w
        )
    for g in range(GROUP):  # the query heads sharing this key/value head
        h = kvh * GROUP + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        row0 = (b * H + h) * T_Q
        if CAUSAL:
            # rows above start_n see none of this tile; the first BLOCK_N rows cross the diagonal
            dk, dv = _dkdv_inner(
                dk, dv, k, v, q_base, do_base, L + row0, Dl + row0, stride_qm, stride_dom,
                offs_n, offs_d, start_n, start_n + BLOCK_N, T_Q, qk_scale, WINDOW, True,
                BLOCK_M, WINDOWED,
            )  # fmt: skip
            dk, dv = _dkdv_inner(
                dk, dv, k, v, q_base, do_base, L + row0, Dl + row0, stride_qm, stride_dom,
                offs_n, offs_d, start_n + BLOCK_N, hi_full, T_Q, qk_scale, WINDOW, False,
                BLOCK_M, WINDOWED,
            )  # fmt: skip
            if WINDOWED:  # the rows where the window's edge crosses the tile
                dk, dv = _dkdv_inner(
                    dk, dv, k, v, q_base, do_base, L + row0, Dl + row0, stride_qm, stride_dom,
                    offs_n, offs_d, hi_full, hi_w, T_Q, qk_scale, WINDOW, True, BLOCK_M,
                    WINDOWED,
                )  # fmt: skip
        else:
            dk, dv = _dkdv_inner(
                dk, dv, k, v, q_base, do_base, L + row0, Dl + row0, stride_qm, stride_dom,
                offs_n, offs_d, 0, T_Q, T_Q, qk_scale, WINDOW, False, BLOCK_M, WINDOWED,
            )  # fmt: skip
    dk = dk * sm_scale
    out_off = b * stride_dkb + kvh * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :]
    tl.store(DK + out_off, dk.to(DK.dtype.element_ty), mask=col_ok)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=col_ok)


@triton.jit
def _dq_inner(
    dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, lo, hi, T_K,
    qk_scale, WINDOW,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=offs_n[:, None] < T_K, other=0.0)
            v = tl.load(v_ptrs, mask=offs_n[:, None] < T_K, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        qk = tl.dot(q, tl.trans(k))  # (BM, BN)
        s = qk * qk_scale - lse2[:, None]
        if MASKED:
            keep = offs_n[None, :] < T_K
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            if WINDOWED:
                keep = keep & (offs_m[:, None] - offs_n[None, :] < WINDOW)
            s = tl.where(keep, s, float("-inf"))
        p = tl.math.exp2(s)
        dp = tl.dot(do, tl.trans(v))  # (BM, BN)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)  # (BM, E)
    return dq


@triton.jit(do_not_specialize=_LENGTH_ARGS)
def _attn_bwd_dq(
    Q, K, V, DO, L, Dl, DQ, sm_scale,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    H, GROUP, T_Q, T_K, T_BUCKET, WINDOW,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr,
):  # fmt: skip
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    if CAUSAL:
        start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    else:
        start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    kvh = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < T_Q
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
        mask=row_ok[:, None], other=0.0,
    )  # fmt: skip
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :],
        mask=row_ok[:, None], other=0.0,
    )  # fmt: skip
    row0 = pid_bh.to(tl.int64) * T_Q
    lse2 = tl.load(L + row0 + offs_m, mask=row_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(Dl + row0 + offs_m, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    if CAUSAL:
        lo = tl.minimum(start_m, T_K) // BLOCK_N * BLOCK_N
        hi = tl.minimum(start_m + BLOCK_M, T_K)
    else:
        lo = T_K // BLOCK_N * BLOCK_N
        hi = T_K
    start = 0
    if WINDOWED:
        lo_w, lo_full = _window_tiles(start_m, lo, WINDOW, BLOCK_M, BLOCK_N)
        dq = _dq_inner(
            dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, lo_w,
            lo_full, T_K, qk_scale, WINDOW, True, CAUSAL, BLOCK_N, WINDOWED,
        )  # fmt: skip
        start = lo_full
    dq = _dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, start, lo,
        T_K, qk_scale, WINDOW, False, CAUSAL, BLOCK_N, WINDOWED,
    )  # fmt: skip
    dq = _dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, lo, hi, T_K,
        qk_scale, WINDOW, True, CAUSAL, BLOCK_N, WINDOWED,
    )  # fmt: skip
    dq = dq * sm_scale
    dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :]
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# (BLOCK_M, BLOCK_N, num_warps, num_stages); forward and dq need BLOCK_M % BLOCK_N == 0, dkdv
# (whose BLOCK_N is the key tile) needs BLOCK_N % BLOCK_M == 0. Chosen by compiling each kernel
# ahead of time for sm_90a (bf16) and keeping configs that fit the 227 KB of shared memory and
# spill no or few registers (dkdv holds two fp32 BLOCK_N × E accumulators, hence 8 warps and
# short query tiles at E = 128). The first entry is the default when autotuning is off.
_FWD_CONFIGS = {
    "small": [(128, 64, 8, 4), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 4), (128, 32, 4, 4)],
    "e128": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 4)],
    "e256": [(64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2)],
}
_DKDV_CONFIGS = {
    "small": [(32, 128, 8, 3), (32, 128, 8, 4), (16, 128, 8, 3), (32, 64, 8, 3), (16, 64, 4, 3)],
    "e128": [(16, 128, 8, 3), (32, 128, 8, 2), (16, 64, 8, 3), (32, 64, 8, 3), (16, 64, 4, 3)],
    "e256": [(16, 64, 8, 2), (32, 64, 8, 2), (16, 32, 4, 2)],
}
_DQ_CONFIGS = {
    "small": [(128, 32, 4, 3), (128, 64, 8, 3), (64, 32, 4, 4), (64, 64, 4, 3), (128, 32, 8, 4)],
    "e128": [(128, 32, 8, 3), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 8, 4)],
    "e256": [(64, 32, 8, 2), (32, 32, 4, 2), (64, 16, 4, 2)],
}
# One fixed config per kernel in the interpreter: small, and with several tiles per diagonal
# block so the masked/unmasked split is exercised on tiny inputs.
_INTERP = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16)}


def _dim_class(e: int) -> str:
    return "small" if e <= 64 else ("e128" if e <= 128 else "e256")


_TUNERS: dict[tuple[str, str], object] = {}

# When False, the first config of each table runs without autotuning: the GPU tests set it so
# dozens of shapes cost one compile each instead of a tuning sweep each.
AUTOTUNE = True


def _tuned(kind: str, dim_class: str):
    # Built on first use (not at import) so the interpreter never sees an autotuner.
    if (kind, dim_class) not in _TUNERS:
        kernel, table = {
            "fwd": (_attn_fwd, _FWD_CONFIGS),
            "dkdv": (_attn_bwd_dkdv, _DKDV_CONFIGS),
            "dq": (_attn_bwd_dq, _DQ_CONFIGS),
        }[kind]
        configs = [
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in table[dim_class]
        ]
        key = ["HEAD_DIM", "CAUSAL", "WINDOWED", "GROUP", "T_BUCKET"]
        _TUNERS[kind, dim_class] = triton.autotune(configs=configs, key=key)(kernel)
    return _TUNERS[kind, dim_class]


def tuned_kernels() -> dict[tuple[str, str], object]:
    """The autotuners built so far, by (kernel, head-dim class); their ``cache`` holds winners."""
    return dict(_TUNERS)


def _launch(kind: str, kernel, grid_rows: int, grid_cols: int, m_axis: str, *args, **kw) -> None:
    # m_axis names the block size that tiles grid axis 0 (BLOCK_M for fwd/dq, BLOCK_N for dkdv).
    e = kw["HEAD_DIM"]
    if interpreting():
        ensure_interpreter_compat()
        bm, bn = _INTERP[kind]
        blocks = {"BLOCK_M": bm, "BLOCK_N": bn}
        grid = (triton.cdiv(grid_rows, blocks[m_axis]), grid_cols)
        kernel[grid](*args, **kw, **blocks)
        return
    if not AUTOTUNE:
        table = {"fwd": _FWD_CONFIGS, "dkdv": _DKDV_CONFIGS, "dq": _DQ_CONFIGS}[kind]
        configs = table[_dim_class(e)]
        for i, (bm, bn, warps, stages) in enumerate(configs):
            blocks = {"BLOCK_M": bm, "BLOCK_N": bn}
            grid = (triton.cdiv(grid_rows, blocks[m_axis]), grid_cols)
            try:
                kernel[grid](*args, **kw, **blocks, num_warps=warps, num_stages=stages)
                return
            except OutOfResources:  # e.g. float32 tiles need twice the shared memory
                if i == len(configs) - 1:
                    raise
    tuned = _tuned(kind, _dim_class(e))
    tuned[lambda meta: (triton.cdiv(grid_rows, meta[m_axis]), grid_cols)](*args, **kw)


def _bucket(t: int) -> int:
    # Autotune once per power-of-two length bucket, not once per exact length.
    return 1 << max(0, (t - 1).bit_length())


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """O (B, H, T, E) contiguous and L (B, H, T) float32 for 4-D q, k, v; ``window`` > 0
    (causal): each query sees itself and the window − 1 keys before it."""
    b, h, t_q, e = q.shape
    kv, t_k = k.shape[1], k.shape[2]
    out = torch.empty((b, h, t_q, e), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, t_q), dtype=torch.float32, device=q.device)
    _launch(
        "fwd", _attn_fwd, t_q, b * h, "BLOCK_M",
        q, k, v, out, lse, 1.0 / math.sqrt(e),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        h, h // kv, t_q, t_k, _bucket(max(t_q, t_k)), window,
        HEAD_DIM=e, CAUSAL=causal, WINDOWED=_windowed(causal, window, t_k),
    )  # fmt: skip
    return out, lse


def _windowed(causal: bool, window: int, t_k: int) -> bool:
    """Whether the kernels take the window path (a window shorter than the keys)."""
    if window and not causal:
        raise ValueError("flash attention: a sliding window needs causal attention")
    return 0 < window < t_k


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    causal: bool,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (contiguous, input dtype) from the saved O and L and the incoming dO."""
    b, h, t_q, e = q.shape
    kv, t_k = k.shape[1], k.shape[2]
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if dout.dtype != q.dtype:
        dout = dout.to(q.dtype)
    delta = torch.empty_like(lse)  # (B, H, T)
    block = 16 if interpreting() else 64
    _attn_bwd_delta[(triton.cdiv(t_q, block), b * h)](
        out, dout, delta,
        out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        h, t_q, HEAD_DIM=e, BLOCK_M=block,
    )  # fmt: skip
    dq = torch.empty((b, h, t_q, e), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, kv, t_k, e), dtype=k.dtype, device=q.device)
    dv = torch.empty((b, kv, t_k, e), dtype=v.dtype, device=q.device)
    scale = 1.0 / math.sqrt(e)
    bucket = _bucket(max(t_q, t_k))
    windowed = _windowed(causal, window, t_k)
    _launch(
        "dkdv", _attn_bwd_dkdv, t_k, b * kv, "BLOCK_N",
        q, k, v, dout, lse, delta, dk, dv, scale,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        h, kv, h // kv, t_q, t_k, bucket, window,
        HEAD_DIM=e, CAUSAL=causal, WINDOWED=windowed,
    )  # fmt: skip
    _launch(
        "dq", _attn_bwd_dq, t_q, b * h, "BLOCK_M",
        q, k, v, dout, lse, delta, dq, scale,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        h, h // kv, t_q, t_k, bucket, window,
        HEAD_DIM=e, CAUSAL=causal, WINDOWED=windowed,
    )  # fmt: skip
    return dq, dk, dv
