"""Triton kernels of the chunked gated delta rule (math, floor and public op in ``gated_delta.py``).

Layout, chunk tables, launch sizes and the kernels' shared prologues: ``_chunked_triton.py``
(packed tokens, a sequence-major chunk list, ragged last chunks).

Forward, three launches:
  1. ``_wy_fwd`` (chunks × heads, parallel): G = cumsum g in the chunk, A = strict-lower
     β_i e^{G_i−G_j} k_i·k_j, T = (I+A)⁻¹ by recursive doubling of diagonal blocks, W = T·diag(βe^G)·K and
     U = T·diag(β)·V (the WY / UT form of the chunk's delta-rule products); T itself is stored
     only when the backward re-runs this step (its ``_grad`` reads it; ``STORE_T``).
  2. ``_state_fwd`` (V-blocks × sequences·heads, sequential over chunks): stores each chunk's start
     state h, δ = U − W·h (the corrected values), h ← e^{G_last} h + (e^{G_last−G}K)ᵀδ.
  3. ``_output_fwd`` (V-blocks × chunks × heads, parallel; shared with the SSD path):
     o = s(e^G ⊙ Q h + (QKᵀ⊙Γ⊙M) δ).
Backward, after re-running 1–2 (nothing but q/k/v/g/β and the initial state is saved):
  4. ``_dv_local`` (parallel) then ``_state_bwd`` (sequential, reverse): stores dh (the
     gradient of each chunk's end state), dδ = s(QKᵀ⊙Γ⊙M)ᵀ dO + (e^{G_last−G}K) dh (the first
     term from ``_dv_local``), dh ← e^{G_last} dh + s(e^G Q)ᵀdO − Wᵀdδ.
  5. ``_grad`` (chunks × heads, parallel): dq, dk, dv, dβ, dg of one chunk from h, dh, δ, dδ.

Per-chunk cumulative decays G and the inverses T live in padded per-chunk buffers (NC, H, BT) and
(NC, H, BT, BT): padded rows then carry G = G_last (g = 0 there), so no e^{G_i − G_j} of a padded
row can overflow. Matmuls take the input dtype (bf16 on the GPU: tensor cores, fp32 accumulation);
float32 inputs use 3×TF32 dots (``PREC``: fp32-level accuracy on tensor cores; IEEE fp32 dots
unrolled into FMAs took ptxas past 15 minutes per kernel). States
stay float32 in registers; the per-chunk state snapshots are stored in the input dtype.
Launches name ``num_stages``: 2 or more for the sequential state kernels (the next chunk's
loads overlap this chunk's matmuls; the forward's three deep for 2-byte inputs), 1 elsewhere —
Triton's default of 3 would pipeline the short V loop of ``_grad`` into 256 KiB of shared
memory, more than an H100/H200 block may use (227 KiB).
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


# ------------------------------------------------------------------------------------ forward
@triton.jit
def _wy_fwd(
    K_ptr, V_ptr, G_in, B_ptr, GC, TINV, W_ptr, U_ptr, CHUNKS, CU,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    LOG_BT: tl.constexpr, STORE_T: tl.constexpr,
):  # fmt: skip
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    _c, _bos, _eos, rows, tt, mt = _chunk_of(CHUNKS, CU, i_c, BT)
    ks = tl.arange(0, BK)
    mk = ks < K
    DT = K_ptr.dtype.element_ty
    i_c = i_c.to(tl.int64)  # TINV holds NC·H·BT² floats: past 2³¹ at 2M tokens × 16 heads

    k = tl.load(_tok(K_ptr, tt, i_h, ks, H, K), mask=mt[:, None] & mk[None, :], other=0.0)
    g = tl.load(G_in + tt * H + i_h, mask=mt, other=0.0).to(tl.float32)
    b = tl.load(B_ptr + tt * H + i_h, mask=mt, other=0.0).to(tl.float32)
    G = tl.cumsum(g, 0)  # (BT,) padded rows keep G_last
    tl.store(GC + (i_c * H + i_h) * BT + rows, G)

    strict = rows[:, None] > rows[None, :]
    decay = tl.exp(tl.where(strict, G[:, None] - G[None, :], 0.0))
    kk = tl.dot(k, tl.trans(k), input_precision=PREC)  # (BT, BT)
    A = tl.where(strict, b[:, None] * kk * decay, 0.0)

    # T = (I + A)⁻¹ by recursive doubling: with T_b the inverse of I + A's diagonal b×b blocks,
    # each 2b-block [[X, 0], [Y, Z]] has inverse T_b − T_b·[[0, 0], [Y, 0]]·T_b, exactly. log2(BT)
    # steps of two BT×BT matmuls (tensor cores) instead of a BT-step row-by-row substitution.
    # The steps' operands in the input dtype, the sums float32: bf16 inputs take half the
    # tensor-core instructions of TF32 operands (_wy_fwd 455 → 351 µs at T = 8192 × 4, 16 heads,
    # H100; T is rounded to bf16 right after anyway), float32 ones stay 3×TF32 (``PREC``).
    Tm = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for s in tl.static_range(LOG_BT):
        half = 1 << s  # the block size before this step
        off = (rows[:, None] // (2 * half) == rows[None, :] // (2 * half)) & (
            rows[:, None] // half != rows[None, :] // half
        )
        TA = tl.dot(Tm.to(DT), tl.where(off, A, 0.0).to(DT), input_precision=PREC)
        Tm = Tm - tl.dot(TA.to(DT), Tm.to(DT), input_precision=PREC)
    if STORE_T:  # only the backward's _grad reads T; the forward's output needs W and U only
        tl.store(TINV + ((i_c * H + i_h) * BT + rows[:, None]) * BT + rows[None, :], Tm)

    Tc = Tm.to(DT)
    xw = (k * (b * tl.exp(G))[:, None]).to(DT)
    w = tl.dot(Tc, xw, input_precision=PREC)  # (BT, BK)
    tl.store(_tok(W_ptr, tt, i_h, ks, H, K), w.to(DT), mask=mt[:, None] & mk[None, :])
    for i_v in range(0, tl.cdiv(V, BV)):
        vs = i_v * BV + tl.arange(0, BV)
        m = mt[:, None] & (vs < V)[None, :]
        v = tl.load(_tok(V_ptr, tt, i_h, vs, H, V), mask=m, other=0.0)
        u = tl.dot(Tc, (v * b[:, None]).to(DT), input_precision=PREC)  # (BT, BV)
        tl.store(_tok(U_ptr, tt, i_h, vs, H, V), u.to(DT), mask=m)


@triton.jit
def _state_fwd(
    K_ptr, W_ptr, U_ptr, GC, H0, HS, VN, HT, CU, COFF,
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
        mtk = mt[:, None] & mk[None, :]
        mtv = mt[:, None] & mv[None, :]
        w = tl.load(_tok(W_ptr, tt, i_h, ks, H, K), mask=mtk, other=0.0)
        u = tl.load(_tok(U_ptr, tt, i_h, vs, H, V), mask=mtv, other=0.0)
        k = tl.load(_tok(K_ptr, tt, i_h, ks, H, K), mask=mtk, other=0.0)
        G = tl.load(GC + (i_c * H + i_h) * BT + rows)
        g_last = tl.load(GC + (i_c * H + i_h) * BT + BT - 1)
        vn = u.to(tl.float32) - tl.dot(w, h.to(DT), input_precision=PREC)  # (BT, BV)
        tl.store(_tok(VN, tt, i_h, vs, H, V), vn.to(DT), mask=mtv)
        # (e^{G_last−G}K)ᵀδ with the decay on δ's (BT, BV) tile, not on K's (BT, K) one: less
        # work on the recurrence's critical path, more so when BV < K.
        vd = (vn * tl.exp(g_last - G)[:, None]).to(DT)
        h = h * tl.exp(g_last) + tl.dot(tl.trans(k), vd, input_precision=PREC)
    if STORE_HT:
        tl.store(HT + (n * H + i_h).to(tl.int64) * K * V + state_offs, h, mask=mkv)


# ----------------------------------------------------------------------------------- backward
@triton.jit
def _dv_local(
    Q_ptr, K_ptr, GC, DO, DVN, CHUNKS, CU, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    # The chunk-local part of dδ, s·(QKᵀ⊙Γ⊙M)ᵀ dO, off the sequential recurrence's path.
    i_v = tl.program_id(0)
    i_c = tl.program_id(1)
    i_h = tl.program_id(2)
    _c, _bos, _eos, rows, tt, mt = _chunk_of(CHUNKS, CU, i_c, BT)
    ks = tl.arange(0, BK)
    vs = i_v * BV + tl.arange(0, BV)
    mtk = mt[:, None] & (ks < K)[None, :]
    mtv = mt[:, None] & (vs < V)[None, :]
    DT = Q_ptr.dtype.element_ty
    q = tl.load(_tok(Q_ptr, tt, i_h, ks, H, K), mask=mtk, other=0.0)
    k = tl.load(_tok(K_ptr, tt, i_h, ks, H, K), mask=mtk, other=0.0)
    do = tl.load(_tok(DO, tt, i_h, vs, H, V), mask=mtv, other=0.0)
    G = tl.load(GC + (i_c.to(tl.int64) * H + i_h) * BT + rows)
    # Pᵀ is upper triangular: entry (j, i) = k_j·q_i e^{G_i − G_j} for i ≥ j.
    upper = rows[:, None] <= rows[None, :]
    kq = tl.dot(k, tl.trans(q), input_precision=PREC)  # (BT, BT)
    Pt = tl.where(upper, kq * tl.exp(tl.where(upper, G[None, :] - G[:, None], 0.0)), 0.0)
    dvl = scale * tl.dot(Pt.to(DT), do.to(DT), input_precision=PREC)  # (BT, BV)
    tl.store(_tok(DVN, tt, i_h, vs, H, V), dvl, mask=mtv)


@triton.jit
def _state_bwd(
    Q_ptr, K_ptr, W_ptr, GC, DO, DHT, DHS, DVN, DH0, CU, COFF, scale,
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
        mtk = mt[:, None] & mk[None, :]
        mtv = mt[:, None] & mv[None, :]
        # Pointers written out rather than through _tok: ptxas then spills 88 bytes here, not 112
        # (sm_90, bf16, d = 128; every other kernel lowers the same either way).
        q = tl.load(Q_ptr + (tt[:, None] * H + i_h) * K + ks[None, :], mask=mtk, other=0.0)
        k = tl.load(K_ptr + (tt[:, None] * H + i_h) * K + ks[None, :], mask=mtk, other=0.0)
        w = tl.load(W_ptr + (tt[:, None] * H + i_h) * K + ks[None, :], mask=mtk, other=0.0)
        do = tl.load(DO + (tt[:, None] * H + i_h) * V + vs[None, :], mask=mtv, other=0.0)
        G = tl.load(GC + (i_c * H + i_h) * BT + rows)
        g_last = tl.load(GC + (i_c * H + i_h) * BT + BT - 1)
        # dδ = s·Pᵀ dO (chunk-local, from _dv_local) + (e^{G_last−G} K) dh; the row decays go on
        # the (BT, BV) tiles (the product here, dO below), not on the (BT, K) ones of K and Q.
        tok_v = (tt[:, None] * H + i_h) * V + vs[None, :]
        dvn = tl.load(DVN + tok_v, mask=mtv, other=0.0)
        dvn += tl.dot(k, dh.to(DT), input_precision=PREC) * tl.exp(g_last - G)[:, None]
        tl.store(DVN + tok_v, dvn, mask=mtv)
        dog = (do.to(tl.float32) * (scale * tl.exp(G))[:, None]).to(DT)
        dh = dh * tl.exp(g_last) + tl.dot(tl.trans(q), dog, input_precision=PREC)
        dh -= tl.dot(tl.trans(w), dvn.to(DT), input_precision=PREC)
    if STORE_DH0:
        tl.store(DH0 + (n * H + i_h).to(tl.int64) * K * V + state_offs, dh, mask=mkv)


@triton.jit
def _grad(
    Q_ptr, K_ptr, V_ptr, B_ptr, GC, TINV, HS, DHS, VN, DVN, DO,
    DQ, DK, DV, DB, DG, CHUNKS, CU, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    c, bos, eos, rows, tt, mt = _chunk_of(CHUNKS, CU, i_c, BT)
    last = tl.minimum(eos - bos - c * BT, BT) - 1  # the chunk's last real row
    ks = tl.arange(0, BK)
    mk = ks < K
    mtk = mt[:, None] & mk[None, :]
    DT = Q_ptr.dtype.element_ty
    base = i_c.to(tl.int64) * H + i_h

    q = tl.load(_tok(Q_ptr, tt, i_h, ks, H, K), mask=mtk, other=0.0)
    k = tl.load(_tok(K_ptr, tt, i_h, ks, H, K), mask=mtk, other=0.0)
    b = tl.load(B_ptr + tt * H + i_h, mask=mt, other=0.0).to(tl.float32)
    G = tl.load(GC + base * BT + rows)
    Tm = tl.load(TINV + (base * BT + rows[:, None]) * BT + rows[None, :])
    TtC = tl.trans(Tm).to(DT)
    g_last = tl.sum(tl.where(rows == BT - 1, G, 0.0), 0)
    eG = tl.exp(G)
    kdec = tl.exp(g_last - G)

    dqh = tl.zeros((BT, BK), dtype=tl.float32)  # dO hᵀ
    dP = tl.zeros((BT, BT), dtype=tl.float32)  # dO δᵀ
    dkt = tl.zeros((BT, BK), dtype=tl.float32)  # δ dhᵀ (gradient of e^{G_last−G} K)
    dW = tl.zeros((BT, BK), dtype=tl.float32)  # −dδ hᵀ
    dTu = tl.zeros((BT, BT), dtype=tl.float32)  # dδ (βV)ᵀ
    db = tl.zeros((BT,), dtype=tl.float32)
    dg_h = tl.sum(
        tl.zeros((BT,), dtype=tl.float32), 0
    )  # Σ h ⊙ dh (gradient of the e^{G_last} carried state)
    for i_v in range(0, tl.cdiv(V, BV)):
        vs = i_v * BV + tl.arange(0, BV)
        mv = vs < V
        mtv = mt[:, None] & mv[None, :]
        mkv = mk[:, None] & mv[None, :]
        state_offs = base * K * V + ks[:, None] * V + vs[None, :]
        h = tl.load(HS + state_offs, mask=mkv, other=0.0)
        dh = tl.load(DHS + state_offs, mask=mkv, other=0.0)
        tok_offs = (tt[:, None] * H + i_h) * V + vs[None, :]
        vn = tl.load(VN + tok_offs, mask=mtv, other=0.0)
        dvn = tl.load(DVN + tok_offs, mask=mtv, other=0.0)
        do = tl.load(DO + tok_offs, mask=mtv, other=0.0).to(DT)
        v = tl.load(V_ptr + tok_offs, mask=mtv, other=0.0).to(tl.float32)
        dvn_c = dvn.to(DT)
        dqh += tl.dot(do, tl.trans(h.to(DT)), input_precision=PREC)
        dP += tl.dot(do, tl.trans(vn), input_precision=PREC)
        dkt += tl.dot(vn, tl.trans(dh.to(DT)), input_precision=PREC)
        dW -= tl.dot(dvn_c, tl.trans(h.to(DT)), input_precision=PREC)
        dTu += tl.dot(dvn_c, tl.trans((v * b[:, None]).to(DT)), input_precision=PREC)
        dxu = tl.dot(TtC, dvn_c, input_precision=PREC)  # (BT, BV) Tᵀ dδ
        tl.store(DV + tok_offs, (dxu * b[:, None]).to(DV.dtype.element_ty), mask=mtv)
        db += tl.sum(dxu * v, 1)
        dg_h += tl.sum(tl.sum(h.to(tl.float32) * dh, 1), 0)

    # Output terms: O = s(e^G ⊙ Q h + (QKᵀ ⊙ Γ ⊙ M) δ).
    incl = rows[:, None] >= rows[None, :]
    gam = tl.exp(tl.where(incl, G[:, None] - G[None, :], 0.0))
    qk = tl.dot(q, tl.trans(k), input_precision=PREC)
    dPm = tl.where(incl, dP * scale * gam, 0.0)
    dPm_c = dPm.to(DT)
    dq = dqh * (scale * eG)[:, None] + tl.dot(dPm_c, k, input_precision=PREC)
    dk = tl.dot(tl.trans(dPm_c), q, input_precision=PREC)
    zp = dPm * qk
    dG = tl.sum(zp, 1) - tl.sum(zp, 0) + scale * eG * tl.sum(q.to(tl.float32) * dqh, 1)
    # Carried-state terms: h_end = e^{G_last} h + (e^{G_last−G} K)ᵀ δ.
    dk += dkt * kdec[:, None]
    zk = tl.sum(dkt * k.to(tl.float32), 1) * kdec
    dG -= zk
    dg_last = tl.sum(zk, 0) + tl.exp(g_last) * dg_h
    # WY terms: W = T diag(βe^G) K, so dX_w = Tᵀ dW.
    xw = k.to(tl.float32) * (b * eG)[:, None]
    dxw = tl.dot(TtC, dW.to(DT), input_precision=PREC)
    dk += dxw * (b * eG)[:, None]
    t = tl.sum(dxw * k.to(tl.float32), 1) * eG
    db += t
    dG += t * b
    # T = (I + A)⁻¹: dA = −Tᵀ dT Tᵀ with dT = dW X_wᵀ + dδ X_uᵀ.
    dT = tl.dot(dW.to(DT), tl.trans(xw.to(DT)), input_precision=PREC) + dTu
    dA = tl.dot(tl.dot(TtC, dT.to(DT), input_precision=PREC).to(DT), TtC, input_precision=PREC)
    strict = rows[:, None] > rows[None, :]
    sdec = tl.exp(tl.where(strict, G[:, None] - G[None, :], 0.0))
    kk = tl.dot(k, tl.trans(k), input_precision=PREC)
    Bm = tl.where(strict, kk * sdec, 0.0)
    dA = tl.where(strict, -dA, 0.0)
    db += tl.sum(dA * Bm, 1)
    dB = dA * b[:, None]
    E = (dB * sdec).to(DT)
    dk += tl.dot(E, k, input_precision=PREC) + tl.dot(tl.trans(E), k, input_precision=PREC)
    zb = dB * Bm
    dG += tl.sum(zb, 1) - tl.sum(zb, 0)
    dG += tl.where(rows == last, dg_last, 0.0)
    # G = cumsum g, so dg is the reverse cumulative sum of dG.
    dg = tl.sum(dG, 0) - tl.cumsum(dG, 0) + dG

    tok_k = (tt[:, None] * H + i_h) * K + ks[None, :]
    tl.store(DQ + tok_k, dq.to(DQ.dtype.element_ty), mask=mtk)
    tl.store(DK + tok_k, dk.to(DK.dtype.element_ty), mask=mtk)
    tl.store(DB + tt * H + i_h, db, mask=mt)
    tl.store(DG + tt * H + i_h, dg, mask=mt)


# ------------------------------------------------------------------------------------- launch
# The forward's state loop pipelines three chunks deep for 2-byte inputs (2.94 → 2.61 ms of the
# GDN forward at T = 65,536 on an H100, level at 8192); the backward's keeps ``state_stages``.
# Never unpipelined in bf16 (see ``state_stages``).
_FWD_STATE_STAGES = 3


def _wy_and_states(k, v, g, beta, cu, chunks, coff, nc, h0, store_ht, meta, store_t=True):
    N, H, K, V, BT = cu.numel() - 1, meta["H"], meta["K"], meta["V"], meta["BT"]
    f32 = dict(device=k.device, dtype=torch.float32)
    gc = torch.empty(nc, H, BT, **f32)  # padded per-chunk cumulative decays
    # the inverses (NC·H·BT² floats: 256 B per token and head at chunk 64), for the backward only
    tinv = torch.empty((nc, H, BT, BT) if store_t else (0,), **f32)
    w = torch.empty_like(k)
    u = torch.empty_like(v)
    _wy_fwd[(nc, H)](
        k, v, g, beta, gc, tinv, w, u, chunks, cu, **meta,
        LOG_BT=BT.bit_length() - 1, STORE_T=store_t, num_warps=4, num_stages=1,
    )  # fmt: skip
    hs = k.new_empty(nc, H, K, V)  # (NC, H, K, V) state at each chunk's start
    vn = torch.empty_like(v)
    ht = torch.empty(N, H, K, V, **f32) if store_ht else None
    sm = state_block(meta, N * H, k.device)
    stages = _FWD_STATE_STAGES if k.element_size() == 2 else state_stages(k)
    _state_fwd[(triton.cdiv(V, sm["BV"]), N * H)](
        k, w, u, gc, h0, hs, vn, ht, cu, coff, **sm,
        HAS_H0=h0 is not None, STORE_HT=store_ht, num_warps=4, num_stages=stages,
    )  # fmt: skip
    return gc, tinv, w, hs, vn, ht


def forward(q, k, v, g, beta, scale, h0, cu, chunk_size, store_ht, seq_len=0):
    """o (N_tok, H, V) in q's dtype and the final states (N, H, K, V) float32 (or None)."""
    prepare()
    meta = kernel_meta(q, v, launch_chunk(q, chunk_size))
    chunks, coff, nc = chunk_tables(cu, meta["BT"], seq_len)
    gc, _, _w, hs, vn, ht = _wy_and_states(
        k, v, g, beta, cu, chunks, coff, nc, h0, store_ht, meta, store_t=False
    )
    o = torch.empty_like(v)
    # 2-byte inputs: one program takes all of V up to 128, so QKᵀ is formed once per chunk, not
    # once per V block (1.020 → 1.005 ms of the forward at T = 8192 × 4 on an H100).
    if q.element_size() == 2:
        meta = dict(meta, BV=min(128, max(16, triton.next_power_of_2(meta["V"]))))
    grid = (triton.cdiv(meta["V"], meta["BV"]), nc, meta["H"])
    _output_fwd[grid](
        q, k, vn, gc, hs, o, chunks, cu, scale, **meta, CUMSUM_G=False, num_warps=4, num_stages=1
    )  # fmt: skip
    return o, ht


def backward(q, k, v, g, beta, scale, h0, cu, chunk_size, do, dht, seq_len=0):
    """(dq, dk, dv, dg, dβ, dh0): input gradients, recomputing the forward's chunk states."""
    prepare()
    meta = kernel_meta(q, v, launch_chunk(q, chunk_size))
    N, H, K, V = cu.numel() - 1, meta["H"], meta["K"], meta["V"]
    chunks, coff, nc = chunk_tables(cu, meta["BT"], seq_len)
    gc, tinv, w, hs, vn, _ = _wy_and_states(k, v, g, beta, cu, chunks, coff, nc, h0, False, meta)
    f32 = dict(device=q.device, dtype=torch.float32)
    dhs = torch.empty(nc, H, K, V, **f32)
    dvn = torch.empty(v.shape, **f32)
    dh0 = torch.empty(N, H, K, V, **f32) if h0 is not None else None
    _dv_local[(triton.cdiv(V, meta["BV"]), nc, H)](
        q, k, gc, do, dvn, chunks, cu, scale, **meta, num_warps=4, num_stages=1
    )
    sm = state_block(meta, N * H, k.device)
    _state_bwd[(triton.cdiv(V, sm["BV"]), N * H)](
        q, k, w, gc, do, dht, dhs, dvn, dh0, cu, coff, scale, **sm,
        HAS_DHT=dht is not None, STORE_DH0=h0 is not None, num_warps=4, num_stages=state_stages(k),
    )  # fmt: skip
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dbeta = torch.empty(beta.shape, **f32)
    dg = torch.empty(g.shape, **f32)
    _grad[(nc, H)](
        q, k, v, beta, gc, tinv, hs, dhs, vn, dvn, do, dq, dk, dv, dbeta, dg, chunks, cu, scale,
        **meta, num_warps=8, num_stages=1,
    )  # fmt: skip
    return dq, dk, dv, dg, dbeta, dh0


# --------------------------------------------------------------------------------- decoding
@triton.jit
def _step(
    Q_ptr, K_ptr, V_ptr, G_in, B_ptr, S_in, S_out, O_ptr, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DELTA: tl.constexpr,
):  # fmt: skip
    # One token of one sequence and head, on a K × BV slice of its state: one read and one write
    # of the state (the decode step is bound by the state's bytes).
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1).to(tl.int64)
    ks = tl.arange(0, BK)
    vs = i_v * BV + tl.arange(0, BV)
    mk = ks < K
    mv = vs < V
    mkv = mk[:, None] & mv[None, :]
    offs = i_nh * K * V + ks[:, None] * V + vs[None, :]
    S = tl.load(S_in + offs, mask=mkv, other=0.0).to(tl.float32)  # (BK, BV)
    q = tl.load(Q_ptr + i_nh * K + ks, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(K_ptr + i_nh * K + ks, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(V_ptr + i_nh * V + vs, mask=mv, other=0.0).to(tl.float32)
    S = S * tl.exp(tl.load(G_in + i_nh).to(tl.float32))
    if DELTA:
        beta = tl.load(B_ptr + i_nh).to(tl.float32)
        v = beta * (v - tl.sum(k[:, None] * S, 0))  # β(v − Sᵀk)
    S = S + k[:, None] * v[None, :]
    o = scale * tl.sum(q[:, None] * S, 0)  # (BV,)
    tl.store(S_out + offs, S, mask=mkv)
    tl.store(O_ptr + i_nh * V + vs, o.to(O_ptr.dtype.element_ty), mask=mv)


def step(q, k, v, g, beta, state, scale):
    """One decoding token: q, k (N, H, K), v (N, H, V), g, β (N, H) (β None: no delta rule),
    state (N, H, K, V) float32 → (o (N, H, V) in v's dtype, the new state)."""
    prepare()
    N, H, K = q.shape
    V = v.shape[-1]
    BK = max(16, triton.next_power_of_2(K))
    BV = max(16, min(32, triton.next_power_of_2(V)))
    new = torch.empty_like(state)
    o = torch.empty_like(v)
    _step[(triton.cdiv(V, BV), N * H)](
        q, k, v, g, beta, state, new, o, scale, H=H, K=K, V=V, BK=BK, BV=BV,
        DELTA=beta is not None, num_warps=4, num_stages=1,
    )  # fmt: skip
    return o, new
