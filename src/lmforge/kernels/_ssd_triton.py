"""Triton kernels of chunked scalar-decay linear attention (Mamba-2 SSD; math in ``ssd.py``).

Layout, chunk tables and prologues as the gated delta rule's (``_chunked_triton.py``). With a
scalar decay per head and token there is no triangular solve, so each kernel recomputes G = cumsum g of its chunk from g (padded rows load g = 0 and so carry G_last):
  1. ``_state_fwd`` (V-blocks × sequences·heads, sequential over chunks): stores each chunk's
     start state h; h ← e^{G_last} h + (e^{G_last−G} K)ᵀ V.
  2. ``_output_fwd`` (V-blocks × chunks × heads; the gated delta rule's, ``CUMSUM_G``):
     o = s(e^G ⊙ Q h + (QKᵀ ⊙ Γ ⊙ M) V).
  3. ``_state_bwd`` (sequential, reverse): stores dh, the gradient of each chunk's end state;
     dh ← e^{G_last} dh + s (e^G ⊙ Q)ᵀ dO; the gradient of the initial state is the last dh.
  4. ``_grad`` (chunks × heads): dv = s (QKᵀ⊙Γ⊙M)ᵀ dO + (e^{G_last−G} K) dh, then dq, dk, dg.
Matmul operands in the input dtype (bf16 on the GPU), fp32 accumulation and states; float32
inputs use 3×TF32 dots (fp32-level accuracy on tensor cores) in chunks of at most 32 on the GPU
(``_chunked_triton.launch_chunk`` says why).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmforge.kernels._chunked_triton import (
    _chunk_of,
    _output_fwd,
    _sequence_of,
    _state_tile,
    _tok,
    chunk_tables,
    kernel_meta,
    launch_chunk,
    prepare,
    state_block,
    state_stages,
)


@triton.jit
def _state_fwd(
    K_ptr, V_ptr, G_in, H0, HS, HT, CU, COFF,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
):  # fmt: skip
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    n, i_h, bos, eos, coff, n_chunks = _sequence_of(CU, COFF, i_nh, H, BT)
    rows = tl.arange(0, BT)
    ks, vs, mk, mv, mkv, state_offs = _state_tile(i_v, K, V, BK, BV)
    DT = K_ptr.dtype.element_ty

    h = tl.zeros((BK, BV), dtype=tl.float32)
    if HAS_H0:
        h += tl.load(H0 + (n * H + i_h).to(tl.int64) * K * V + state_offs, mask=mkv, other=0.0)
    for c in range(0, n_chunks):
        i_c = (coff + c).to(tl.int64)
        tl.store(HS + (i_c * H + i_h) * K * V + state_offs, h.to(DT), mask=mkv)
        tt = (bos + c * BT + rows).to(tl.int64)
        mt = tt < eos
        k = tl.load(
            _tok(K_ptr, tt, i_h, ks, H, K),
            mask=mt[:, None] & mk[None, :],
            other=0.0,
        )
        v = tl.load(
            _tok(V_ptr, tt, i_h, vs, H, V),
            mask=mt[:, None] & mv[None, :],
            other=0.0,
        )
        G = tl.cumsum(tl.load(G_in + tt * H + i_h, mask=mt, other=0.0).to(tl.float32), 0)
        g_last = tl.sum(tl.where(rows == BT - 1, G, 0.0), 0)
        # the row decays on the (BT, BV) tile of V rather than on K's (BT, K) one
        vd = (v.to(tl.float32) * tl.exp(g_last - G)[:, None]).to(DT)
        h = h * tl.exp(g_last) + tl.dot(tl.trans(k), vd, input_precision=PREC)
    if STORE_HT:
        tl.store(HT + (n * H + i_h).to(tl.int64) * K * V + state_offs, h, mask=mkv)


@triton.jit
def _state_bwd(
    Q_ptr, G_in, DO, DHT, DHS, DH0, CU, COFF, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
):  # fmt: skip
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    n, i_h, bos, eos, coff, n_chunks = _sequence_of(CU, COFF, i_nh, H, BT)
    rows = tl.arange(0, BT)
    ks, vs, mk, mv, mkv, state_offs = _state_tile(i_v, K, V, BK, BV)
    DT = Q_ptr.dtype.element_ty

    dh = tl.zeros((BK, BV), dtype=tl.float32)
    if HAS_DHT:
        dh += tl.load(DHT + (n * H + i_h).to(tl.int64) * K * V + state_offs, mask=mkv, other=0.0)
    for r in range(0, n_chunks):
        c = n_chunks - 1 - r
        i_c = (coff + c).to(tl.int64)
        tl.store(DHS + (i_c * H + i_h) * K * V + state_offs, dh, mask=mkv)
        tt = (bos + c * BT + rows).to(tl.int64)
        mt = tt < eos
        q = tl.load(
            _tok(Q_ptr, tt, i_h, ks, H, K),
            mask=mt[:, None] & mk[None, :],
            other=0.0,
        )
        do = tl.load(
            _tok(DO, tt, i_h, vs, H, V),
            mask=mt[:, None] & mv[None, :],
            other=0.0,
        )
        G = tl.cumsum(tl.load(G_in + tt * H + i_h, mask=mt, other=0.0).to(tl.float32), 0)
        g_last = tl.sum(tl.where(rows == BT - 1, G, 0.0), 0)
        dog = (do.to(tl.float32) * (scale * tl.exp(G))[:, None]).to(DT)
        dh = dh * tl.exp(g_last) + tl.dot(tl.trans(q), dog, input_precision=PREC)
    if STORE_DH0:
        tl.store(DH0 + (n * H + i_h).to(tl.int64) * K * V + state_offs, dh, mask=mkv)


@triton.jit
def _grad(
    Q_ptr, K_ptr, V_ptr, G_in, HS, DHS, DO, DQ, DK, DV, DG, CHUNKS, CU, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    c, bos, eos, rows, tt, mt = _chunk_of(CHUNKS, CU, i_c, BT)
    last = tl.minimum(eos - bos - c * BT, BT) - 1
    ks = tl.arange(0, BK)
    mk = ks < K
    mtk = mt[:, None] & mk[None, :]
    DT = Q_ptr.dtype.element_ty
    base = i_c.to(tl.int64) * H + i_h

    q = tl.load(_tok(Q_ptr, tt, i_h, ks, H, K), mask=mtk, other=0.0)
    k = tl.load(_tok(K_ptr, tt, i_h, ks, H, K), mask=mtk, other=0.0)
    G = tl.cumsum(tl.load(G_in + tt * H + i_h, mask=mt, other=0.0).to(tl.float32), 0)
    g_last = tl.sum(tl.where(rows == BT - 1, G, 0.0), 0)
    eG = tl.exp(G)
    kdec = tl.exp(g_last - G)
    kd = (k * kdec[:, None]).to(DT)
    incl = rows[:, None] >= rows[None, :]
    gam = tl.exp(tl.where(incl, G[:, None] - G[None, :], 0.0))
    qk = tl.dot(q, tl.trans(k), input_precision=PREC)  # (BT, BT)
    Pt = tl.trans(tl.where(incl, qk * gam, 0.0)).to(DT)

    dqh = tl.zeros((BT, BK), dtype=tl.float32)  # dO hᵀ
    dP = tl.zeros((BT, BT), dtype=tl.float32)  # dO Vᵀ
    dkt = tl.zeros((BT, BK), dtype=tl.float32)  # V dhᵀ
    dg_h = tl.sum(tl.zeros((BT,), dtype=tl.float32), 0)  # Σ h ⊙ dh
    for i_v in range(0, tl.cdiv(V, BV)):
        vs = i_v * BV + tl.arange(0, BV)
        mv = vs < V
        mtv = mt[:, None] & mv[None, :]
        mkv = mk[:, None] & mv[None, :]
        state_offs = base * K * V + ks[:, None] * V + vs[None, :]
        h = tl.load(HS + state_offs, mask=mkv, other=0.0)
        dh = tl.load(DHS + state_offs, mask=mkv, other=0.0)
        tok_offs = (tt[:, None] * H + i_h) * V + vs[None, :]
        v = tl.load(V_ptr + tok_offs, mask=mtv, other=0.0).to(DT)
        do = tl.load(DO + tok_offs, mask=mtv, other=0.0).to(DT)
        dqh += tl.dot(do, tl.trans(h.to(DT)), input_precision=PREC)
        dP += tl.dot(do, tl.trans(v), input_precision=PREC)
        dkt += tl.dot(v, tl.trans(dh.to(DT)), input_precision=PREC)
        dv = scale * tl.dot(Pt, do, input_precision=PREC)
        dv += tl.dot(kd, dh.to(DT), input_precision=PREC)
        tl.store(DV + tok_offs, dv.to(DV.dtype.element_ty), mask=mtv)
        dg_h += tl.sum(tl.sum(h.to(tl.float32) * dh, 1), 0)

    dPm = tl.where(incl, dP * scale * gam, 0.0)
    dPm_c = dPm.to(DT)
    dq = dqh * (scale * eG)[:, None] + tl.dot(dPm_c, k, input_precision=PREC)
    dk = tl.dot(tl.trans(dPm_c), q, input_precision=PREC) + dkt * kdec[:, None]
    zp = dPm * qk
    zk = tl.sum(dkt * k.to(tl.float32), 1) * kdec
    dG = tl.sum(zp, 1) - tl.sum(zp, 0) + scale * eG * tl.sum(q.to(tl.float32) * dqh, 1) - zk
    dG += tl.where(rows == last, tl.sum(zk, 0) + tl.exp(g_last) * dg_h, 0.0)
    dg = tl.sum(dG, 0) - tl.cumsum(dG, 0) + dG  # G = cumsum g

    tok_k = (tt[:, None] * H + i_h) * K + ks[None, :]
    tl.store(DQ + tok_k, dq.to(DQ.dtype.element_ty), mask=mtk)
    tl.store(DK + tok_k, dk.to(DK.dtype.element_ty), mask=mtk)
    tl.store(DG + tt * H + i_h, dg, mask=mt)


def _states(k, v, g, cu, coff, nc, h0, store_ht, meta):
    N, H, K, V = cu.numel() - 1, meta["H"], meta["K"], meta["V"]
    hs = k.new_empty(nc, H, K, V)  # (NC, H, K, V) state at each chunk's start
    ht = torch.empty(N, H, K, V, device=k.device, dtype=torch.float32) if store_ht else None
    sm = state_block(meta, N * H, k.device)
    _state_fwd[(triton.cdiv(V, sm["BV"]), N * H)](
        k, v, g, h0, hs, ht, cu, coff, **sm,
        HAS_H0=h0 is not None, STORE_HT=store_ht, num_warps=4, num_stages=state_stages(k),
    )  # fmt: skip
    return hs, ht


def forward(q, k, v, g, scale, h0, cu, chunk_size, store_ht, seq_len=0):
    """o (N_tok, H, V) in q's dtype and the final states (N, H, K, V) float32 (or None)."""
    prepare()
    meta = kernel_meta(q, v, launch_chunk(q, chunk_size))
    chunks, coff, nc = chunk_tables(cu, meta["BT"], seq_len)
    hs, ht = _states(k, v, g, cu, coff, nc, h0, store_ht, meta)
    o = torch.empty_like(v)
    grid = (triton.cdiv(meta["V"], meta["BV"]), nc, meta["H"])
    _output_fwd[grid](
        q, k, v, g, hs, o, chunks, cu, scale, **meta, CUMSUM_G=True, num_warps=4, num_stages=1
    )  # fmt: skip
    return o, ht


def backward(q, k, v, g, scale, h0, cu, chunk_size, do, dht, seq_len=0):
    """(dq, dk, dv, dg, dh0), recomputing the forward's chunk states."""
    prepare()
    meta = kernel_meta(q, v, launch_chunk(q, chunk_size))
    N, H, K, V = cu.numel() - 1, meta["H"], meta["K"], meta["V"]
    chunks, coff, nc = chunk_tables(cu, meta["BT"], seq_len)
    hs, _ = _states(k, v, g, cu, coff, nc, h0, False, meta)
    f32 = dict(device=q.device, dtype=torch.float32)
    dhs = torch.empty(nc, H, K, V, **f32)
    dh0 = torch.empty(N, H, K, V, **f32) if h0 is not None else None
    sm = state_block(meta, N * H, k.device)
    _state_bwd[(triton.cdiv(V, sm["BV"]), N * H)](
        q, g, do, dht, dhs, dh0, cu, coff, scale, **sm,
        HAS_DHT=dht is not None, STORE_DH0=h0 is not None, num_warps=4, num_stages=state_stages(k),
    )  # fmt: skip
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dg = torch.empty(g.shape, **f32)
    _grad[(nc, H)](
        q, k, v, g, hs, dhs, do, dq, dk, dv, dg, chunks, cu, scale, **meta, num_warps=8, num_stages=1
    )  # fmt: skip
    return dq, dk, dv, dg, dh0
