"""Launch bookkeeping and kernel prologues shared by the chunked linear-attention kernels
(``_gated_delta_triton.py``, ``_ssd_triton.py``).

Layout: every sequence is packed into one token axis (varlen, ``cu_seqlens``), q/k (N_tok, H, K),
v (N_tok, H, V), gates (N_tok, H); a batch of equal lengths is the case cu_seqlens = [0, T, 2T, ..].
Chunks of BT tokens never cross a sequence boundary (the last chunk of a sequence is ragged), and
the global chunk list is sequence-major, so chunk ``chunk_offsets[n] + c`` is chunk c of sequence n.
Two kinds of programs read it: chunk-parallel ones (one chunk and head, :func:`_chunk_of`) and the
sequential state recurrences (one V block of one sequence and head, :func:`_sequence_of`,
:func:`_state_tile`). The ``@triton.jit`` helpers are inlined into their callers. Offsets into
token-sized buffers are int64 (N_tok·H·d passes 2³¹ at 1M tokens × 16 heads × 128).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmforge.kernels._common import ensure_interpreter_compat, interpreting


# ----------------------------------------------------------------------------- kernel prologues
@triton.jit
def _chunk_of(CHUNKS, CU, i_c, BT: tl.constexpr):
    """Chunk ``i_c`` of the global list: (c its index in its sequence, bos, eos the sequence's
    token span, rows 0..BT−1, tt the rows' int64 token indices, mt the rows inside the sequence)."""
    n = tl.load(CHUNKS + 2 * i_c)
    c = tl.load(CHUNKS + 2 * i_c + 1)
    bos = tl.load(CU + n)
    eos = tl.load(CU + n + 1)
    rows = tl.arange(0, BT)
    tt = (bos + c * BT + rows).to(tl.int64)
    return c, bos, eos, rows, tt, tt < eos


@triton.jit
def _sequence_of(CU, COFF, i_nh, H: tl.constexpr, BT: tl.constexpr):
    """Program ``i_nh`` = sequence n, head i_h of a recurrence: (n, i_h, bos, eos, the global
    index of its first chunk, its number of chunks)."""
    n = i_nh // H
    i_h = i_nh % H
    bos = tl.load(CU + n)
    eos = tl.load(CU + n + 1)
    return n, i_h, bos, eos, tl.load(COFF + n), tl.cdiv(eos - bos, BT)


@triton.jit
def _state_tile(
    i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr
):  # fmt: skip
    """The (BK, BV) slice of a K×V state a program owns: (ks, vs, mk, mv, mkv, offsets in it)."""
    ks = tl.arange(0, BK)
    vs = i_v * BV + tl.arange(0, BV)
    mk = ks < K
    mv = vs < V
    return ks, vs, mk, mv, mk[:, None] & mv[None, :], ks[:, None] * V + vs[None, :]


@triton.jit
def _tok(P, tt, i_h, cols, H: tl.constexpr, W: tl.constexpr):
    """Pointers to rows ``tt`` (int64 token indices), head ``i_h``, columns ``cols`` of a
    (N_tok, H, W) buffer: a (len(tt), len(cols)) tile."""
    return P + (tt[:, None] * H + i_h) * W + cols[None, :]


# ------------------------------------------------------------------------------ shared kernel
@triton.jit
def _output_fwd(
    Q_ptr, K_ptr, V_ptr, G_ptr, HS, O_ptr, CHUNKS, CU, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    CUMSUM_G: tl.constexpr,
):  # fmt: skip
    """Both rules' output, one (V block, chunk, head) per program: o = s(e^G ⊙ Q h + (QKᵀ ⊙ Γ ⊙ M)
    V) from the chunk's start state h. V_ptr holds the values (decayed linear attention) or the
    delta rule's corrected values δ; G_ptr the per-token log decays g, summed here
    (``CUMSUM_G``), or the delta rule's per-chunk cumulative decays G (NC, H, BT)."""
    i_v = tl.program_id(0)
    i_c = tl.program_id(1)
    i_h = tl.program_id(2)
    _c, _bos, _eos, rows, tt, mt = _chunk_of(CHUNKS, CU, i_c, BT)
    ks = tl.arange(0, BK)
    vs = i_v * BV + tl.arange(0, BV)
    mk = ks < K
    mv = vs < V
    DT = Q_ptr.dtype.element_ty
    mtk = mt[:, None] & mk[None, :]
    mtv = mt[:, None] & mv[None, :]
    q = tl.load(_tok(Q_ptr, tt, i_h, ks, H, K), mask=mtk, other=0.0)
    k = tl.load(_tok(K_ptr, tt, i_h, ks, H, K), mask=mtk, other=0.0)
    v = tl.load(_tok(V_ptr, tt, i_h, vs, H, V), mask=mtv, other=0.0)
    if CUMSUM_G:  # padded rows load g = 0 and so carry G_last
        G = tl.cumsum(tl.load(G_ptr + tt * H + i_h, mask=mt, other=0.0).to(tl.float32), 0)
    else:
        G = tl.load(G_ptr + (i_c.to(tl.int64) * H + i_h) * BT + rows)
    h = tl.load(
        HS + (i_c.to(tl.int64) * H + i_h) * K * V + ks[:, None] * V + vs[None, :],
        mask=mk[:, None] & mv[None, :],
        other=0.0,
    )
    incl = rows[:, None] >= rows[None, :]
    qk = tl.dot(q, tl.trans(k), input_precision=PREC)  # (BT, BT)
    P = tl.where(incl, qk * tl.exp(tl.where(incl, G[:, None] - G[None, :], 0.0)), 0.0)
    o = tl.dot(q, h, input_precision=PREC) * tl.exp(G)[:, None]
    o += tl.dot(P.to(DT), v.to(DT), input_precision=PREC)
    tl.store(_tok(O_ptr, tt, i_h, vs, H, V), (o * scale).to(O_ptr.dtype.element_ty), mask=mtv)


# ------------------------------------------------------------------------------------- launch
def kernel_meta(q: torch.Tensor, v: torch.Tensor, chunk_size: int) -> dict:
    """The constexprs every kernel takes: H, K, V, chunk BT, blocks BK, BV and the dots' PREC."""
    K, V = q.shape[-1], v.shape[-1]
    BK = max(16, triton.next_power_of_2(K))
    return {
        "H": q.shape[1],
        "K": K,
        "V": V,
        "BT": chunk_size,
        "BK": BK,
        # float32 tiles take twice the shared memory: half the V block keeps _grad and the state
        # kernels within Hopper's 227 KiB per block.
        "BV": max(
            16, min(64 if BK <= 128 and q.dtype != torch.float32 else 32, triton.next_power_of_2(V))
        ),
        "PREC": "tf32x3" if q.dtype == torch.float32 else "tf32",
    }


def chunk_tables(
    cu_seqlens: torch.Tensor, chunk_size: int, seq_len: int = 0
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(chunks (NC, 2) int32 [sequence, chunk in it], chunk_offsets (N,) int32, NC) for the
    sequence-major global chunk list. ``seq_len`` > 0: every sequence has that length (a batch),
    and the tables are built on the device without reading ``cu_seqlens`` back; otherwise the
    offsets are read on the host once (the grid size depends on them)."""
    dev = cu_seqlens.device
    N = cu_seqlens.numel() - 1
    if seq_len > 0:
        per = -(-seq_len // chunk_size)
        idx = torch.arange(N * per, device=dev, dtype=torch.int32)  # (NC,)
        table = torch.stack([idx // per, idx % per], 1)  # (NC, 2)
        return table, torch.arange(N, device=dev, dtype=torch.int32) * per, N * per
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    counts = [-(-n // chunk_size) for n in lens]
    chunks = [(i, c) for i, m in enumerate(counts) for c in range(m)]
    offsets = [0]
    for m in counts[:-1]:
        offsets.append(offsets[-1] + m)
    table = torch.tensor(chunks, dtype=torch.int32, device=dev).reshape(-1, 2)  # (NC, 2)
    return table, torch.tensor(offsets, dtype=torch.int32, device=dev), len(chunks)


def launch_chunk(q: torch.Tensor, chunk_size: int) -> int:
    """The chunk the kernels run: float32 inputs (the validation path) in chunks of at most 32 on
    the GPU. With 64 the gated delta rule's float32 ``_grad`` needs 256 KiB of shared memory, and
    on triton 3.6 + H200 the float32 SSD test at chunk 64 (K = 16, V = 12: its ``_grad`` lowers to
    wgmma at 255 registers with spills) ended in an illegal memory access although every access is
    in bounds (``tests/test_kernels_bounds.py``). Results do not depend on the chunk size; bf16
    and fp16 (training) keep the requested one, and so does the CPU interpreter."""
    return min(chunk_size, 32) if q.dtype == torch.float32 and not interpreting() else chunk_size


def state_stages(x: torch.Tensor) -> int:
    """Pipelining the sequential chunk loop (next chunk's loads during this chunk's matmuls) fits
    in shared memory for 2-byte inputs; float32 (the validation path) runs unpipelined. Never 1
    for bf16: on triton 3.6 + H100 the unpipelined bf16 GDN state kernel was miscompiled (a
    wrong output at 4 warps, an illegal memory access at 8; benchmarks/RESULTS.md)."""
    return 1 if x.dtype == torch.float32 else 2


def state_block(meta: dict, n_programs: int, device: torch.device) -> dict:
    """The sequential state kernels run one program per (V block, sequence, head): with few long
    sequences, halve the V block so twice as many SMs share the recurrence."""
    if device.type != "cuda":
        return meta
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if meta["BV"] > 32 and n_programs * triton.cdiv(meta["V"], meta["BV"]) < 2 * sms:
        return dict(meta, BV=32)
    return meta


def prepare() -> None:
    """Before a launch: the interpreter's compatibility patches when running on the CPU."""
    if interpreting():
        ensure_interpreter_compat()
