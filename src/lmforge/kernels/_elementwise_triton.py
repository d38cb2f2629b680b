"""Triton kernels of the elementwise fusions: the SwiGLU gate and RoPE (see swiglu.py, rope.py).

All operate on contiguous buffers — in flat BLOCK-sized slices (SwiGLU on separate a, b), in
(row, column block) tiles (SwiGLU on one packed [a | b] buffer) or in (rows × E/2) pair tiles
(RoPE) — computing in float32 and storing in the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmforge.kernels._common import ensure_interpreter_compat, interpreting

_BLOCK = 4096


# n stays specialised (divisible-by-16 hint) so the `offs < n` mask is constant over 16-element
# groups and the accesses vectorise to 16 bytes (unspecialised: predicated 2-byte accesses).
@triton.jit
def _swiglu_fwd(A, B, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    y = a * tl.sigmoid(a) * b
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(A, B, DY, DA, DB, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a)
    da = dy * b * sig * (1.0 + a * (1.0 - sig))
    db = dy * a * sig
    tl.store(DA + offs, da.to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offs, db.to(DB.dtype.element_ty), mask=mask)


def _launch_args(n: int) -> tuple[tuple[int], dict]:
    if interpreting():
        ensure_interpreter_compat()
    return (triton.cdiv(n, _BLOCK),), {"BLOCK": _BLOCK, "num_warps": 8}


def swiglu_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a)·b for contiguous a, b."""
    y = torch.empty_like(a)
    grid, kw = _launch_args(a.numel())
    _swiglu_fwd[grid](a, b, y, a.numel(), **kw)
    return y


def swiglu_backward(
    a: torch.Tensor, b: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db) for contiguous a, b, dy."""
    da, db = torch.empty_like(a), torch.empty_like(b)
    grid, kw = _launch_args(a.numel())
    _swiglu_bwd[grid](a, b, dy, da, db, a.numel(), **kw)
    return da, db


# Packed gate: one (rows, 2F) buffer holds a = w1 x in its first F columns and b = w3 x in the
# last F (the output of one GEMM against cat([w1, w3])). One program per (ROWS rows, column
# block): ROWS > 1 when F is small (an MoE expert's F = 256 gave 262,144 one-warp programs, 1.7×
# the time of the same bytes in the dense layer's launch on an H200). F stays specialised
# (divisible by 16) so both halves' accesses vectorise.
@triton.jit
def _packed_halves(AB, R, F, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    # This program's rows × column block of a and b (float32) from packed [a | b] rows.
    row = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None]  # (ROWS, 1)
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]  # (1, BLOCK)
    mask = (row < R) & (cols < F)
    a_ptr = AB + row * (2 * F) + cols
    a = tl.load(a_ptr, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(a_ptr + F, mask=mask, other=0.0).to(tl.float32)
    return row, cols, mask, a, b


@triton.jit
def _swiglu_packed_fwd(AB, Y, R, F, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    row, cols, mask, a, b = _packed_halves(AB, R, F, BLOCK, ROWS)
    tl.store(Y + row * F + cols, (a * tl.sigmoid(a) * b).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_packed_bwd(AB, DY, DAB, R, F, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    row, cols, mask, a, b = _packed_halves(AB, R, F, BLOCK, ROWS)
    dy = tl.load(DY + row * F + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a)
    da = dy * b * sig * (1.0 + a * (1.0 - sig))
    db = dy * a * sig
    d_ptr = DAB + row * (2 * F) + cols
    tl.store(d_ptr, da.to(DAB.dtype.element_ty), mask=mask)
    tl.store(d_ptr + F, db.to(DAB.dtype.element_ty), mask=mask)


# Packed launch: 2048 elements (up to 2048 columns of one row, or several rows of a short F) per
# program, 4 warps (16 elements a thread, as the flat kernels' 4096 × 8 warps).
_PACKED_BLOCK = 2048
_PACKED_WARPS = 4


def _packed_launch(rows: int, f: int) -> tuple[tuple[int, int], dict]:
    if interpreting():
        ensure_interpreter_compat()
    block = min(_PACKED_BLOCK, triton.next_power_of_2(f))
    per = max(1, min(_PACKED_BLOCK // block, triton.next_power_of_2(rows)))  # rows per program
    warps = _PACKED_WARPS if block * per >= 512 else 1
    grid = (triton.cdiv(rows, per), triton.cdiv(f, block))
    return grid, {"BLOCK": block, "ROWS": per, "num_warps": warps}


def swiglu_packed_forward(ab: torch.Tensor) -> torch.Tensor:
    """silu(a)·b for contiguous ab (…, 2F) = [a | b]; returns (…, F)."""
    f = ab.shape[-1] // 2
    rows = ab.numel() // (2 * f)
    y = ab.new_empty((*ab.shape[:-1], f))
    grid, kw = _packed_launch(rows, f)
    _swiglu_packed_fwd[grid](ab, y, rows, f, **kw)
    return y


def swiglu_packed_backward(ab: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """[da | db] (…, 2F) for contiguous ab (…, 2F) and dy (…, F)."""
    f = ab.shape[-1] // 2
    rows = ab.numel() // (2 * f)
    dab = torch.empty_like(ab)
    grid, kw = _packed_launch(rows, f)
    _swiglu_packed_bwd[grid](ab, dy, dab, rows, f, **kw)
    return dab


# The rotation of every RoPE kernel: (x0·c − x1·s, x0·s + x1·c) in float32, s already signed,
# as a (…, 2) join. The FMAs are written out so that every kernel and launch rounds alike: left
# to contract x0·c − x1·s itself, the compiler fuses whichever product LLVM's canonicalisation
# puts first, which varied with the layout (the commutative sum's operands swapped for some
# tiles; an fp32 sin that reaches the arithmetic through shared memory hides SIGN's negation),
# so kernels differed in the last bit on an H200. The forms are the ones the contraction gave
# the per-row kernels for bf16/fp16: fma(x0, c, −x1·s), and fma(x0, s, x1·c) for SIGN = 1 but
# fma(x1, c, x0·s) for SIGN = −1. `* -1.0` is an exact sign flip (unary minus is 0 − x). The
# interpreter's fma rounds twice, which is the unfused arithmetic.
@triton.jit
def _rotate(x0, x1, c, s, SIGN: tl.constexpr):
    y0 = tl.fma(x0, c, (x1 * s) * -1.0)
    if SIGN > 0:
        y1 = tl.fma(x0, s, x1 * c)
    else:
        y1 = tl.fma(x1, c, x0 * s)
    return tl.join(y0, y1)


@triton.jit(do_not_specialize=["rows", "T"])  # HALF specialised: vector loads and stores
def _rope(
    X, C, S, Y, rows, T, HALF, HEADS, SIGN: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):  # fmt: skip
    # X, Y: (rows, 2·HALF) contiguous, row r at position (r // HEADS) % T — (…, T, E) with
    # HEADS = 1, (…, T, H, E) with HEADS = H; C, S: (T, HALF) float32.
    # Whole rows are loaded and stored contiguously (16-byte accesses); the (x[2i], x[2i+1])
    # pairs are separated and re-interleaved in registers. (Loading even and odd elements as
    # two stride-2 accesses instead measured 14× slower on an H200: RESULTS.md.)
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    i = tl.arange(0, BLOCK_H)
    j = tl.arange(0, 2 * BLOCK_H)
    row_ok = r[:, None] < rows
    t = (r // HEADS) % T
    cs_mask = row_ok & (i[None, :] < HALF)
    c = tl.load(C + t[:, None] * HALF + i[None, :], mask=cs_mask, other=0.0)
    s = tl.load(S + t[:, None] * HALF + i[None, :], mask=cs_mask, other=0.0) * SIGN
    offs = r[:, None] * (2 * HALF) + j[None, :]
    x_mask = row_ok & (j[None, :] < 2 * HALF)
    x = tl.load(X + offs, mask=x_mask, other=0.0).to(tl.float32)  # (ROWS, 2·BLOCK_H)
    x0, x1 = tl.split(tl.reshape(x, (ROWS, BLOCK_H, 2)))  # even and odd elements
    y = _rotate(x0, x1, c, s, SIGN)  # (ROWS, BLOCK_H, 2)
    tl.store(Y + offs, tl.reshape(y, (ROWS, 2 * BLOCK_H)).to(Y.dtype.element_ty), mask=x_mask)


# RoPE launch: elements per program and warps. benchmarks/rope_bench.py sweeps them; on an H200
# (q and k of GPT-2-small, fwd + inverse, RESULTS.md fifth session) 2048 × 4 warps 0.119 ms
# (1.22× the copy-bandwidth floor), 4096 × 4 0.125, 8192 × 8 0.129.
ROPE_ELEMS = 2048
ROPE_WARPS = 4


def rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inverse: bool,
    heads: int = 1,
    *,
    config: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Rotate pairs of contiguous x by float32 cos/sin (T, E/2); inverse: by −θ. x is
    (…, T, E) for ``heads`` = 1, (…, T, heads, E) otherwise. ``config`` = (elements per
    program, warps) overrides the launch (for sweeps)."""
    if interpreting():
        ensure_interpreter_compat()
    elems, warps = config or (ROPE_ELEMS, ROPE_WARPS)
    t, e = cos.shape[0], x.shape[-1]
    rows = x.numel() // e
    half = e // 2
    block_h = triton.next_power_of_2(half)
    n_rows = max(1, min(128, elems // (2 * block_h)))
    y = torch.empty_like(x)
    _rope[(triton.cdiv(rows, n_rows),)](
        x, cos, sin, y, rows, t, half, heads,
        SIGN=-1.0 if inverse else 1.0, ROWS=n_rows, BLOCK_H=block_h, num_warps=warps,
    )  # fmt: skip
    return y


# Packed RoPE: q and k of one matmul against cat([Wq, Wk]), a (tokens, NQ + NK, E) buffer, on
# one side; q (tokens, NQ, E) and k (tokens, NK, E) as separate contiguous buffers on the other.
# TO_SPLIT (forward): rotate the packed rows into q and k; otherwise (backward, inverse
# rotation): rotate dq and dk back into one packed gradient — the gradient of that matmul's
# output, with no concatenation. Row r of the packed side is head r % (NQ + NK) of token
# r // (NQ + NK), at position token % T.
@triton.jit(do_not_specialize=["rows", "T"])  # HALF specialised: vector loads and stores
def _rope_packed(
    P, Q, K, C, S, rows, T, HALF, NQ, NK, SIGN: tl.constexpr, TO_SPLIT: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    i = tl.arange(0, BLOCK_H)
    j = tl.arange(0, 2 * BLOCK_H)
    row_ok = r[:, None] < rows
    token = r // (NQ + NK)
    head = r % (NQ + NK)
    t = token % T
    is_q = (head < NQ)[:, None]
    cs_mask = row_ok & (i[None, :] < HALF)
    c = tl.load(C + t[:, None] * HALF + i[None, :], mask=cs_mask, other=0.0)
    s = tl.load(S + t[:, None] * HALF + i[None, :], mask=cs_mask, other=0.0) * SIGN
    x_mask = row_ok & (j[None, :] < 2 * HALF)
    p_offs = r[:, None] * (2 * HALF) + j[None, :]
    q_offs = (token * NQ + head)[:, None] * (2 * HALF) + j[None, :]
    k_offs = (token * NK + head - NQ)[:, None] * (2 * HALF) + j[None, :]
    if TO_SPLIT:
        x = tl.load(P + p_offs, mask=x_mask, other=0.0).to(tl.float32)
    else:
        xq = tl.load(Q + q_offs, mask=x_mask & is_q, other=0.0)
        xk = tl.load(K + k_offs, mask=x_mask & (~is_q), other=0.0)
        x = tl.where(is_q, xq, xk).to(tl.float32)
    x0, x1 = tl.split(tl.reshape(x, (ROWS, BLOCK_H, 2)))  # even and odd elements
    y = tl.reshape(_rotate(x0, x1, c, s, SIGN), (ROWS, 2 * BLOCK_H))
    if TO_SPLIT:
        tl.store(Q + q_offs, y.to(Q.dtype.element_ty), mask=x_mask & is_q)
        tl.store(K + k_offs, y.to(K.dtype.element_ty), mask=x_mask & (~is_q))
    else:
        tl.store(P + p_offs, y.to(P.dtype.element_ty), mask=x_mask)


# Token-block launch of packed RoPE. One program: BT consecutive tokens × HG consecutive heads of
# one side (q or k), a (BT, HG, E) tile. Why: cos/sin are loaded once per token and reused for
# the HG heads in registers (tokens lead the tile, so Triton's layout spreads threads over
# tokens and pairs and gives each thread all HG heads of its token) instead of once per row;
# the q/k choice is one scalar branch per program, so a full tile's loads and stores are
# unpredicated 16-byte accesses issued together (the per-row launch masked half the lanes of
# both q and k accesses); token and head come from one int32 division per program, not int64
# divisions per row. Programs run head group fastest, so neighbours read adjacent stretches of
# the packed buffer and share cos/sin in L2.
@triton.jit
def _rope_tokens_tile(
    P, X, C, S, tok, n_tok, T, HALF, heads, nh, h0, p_h0, SIGN: tl.constexpr,
    TO_SPLIT: tl.constexpr, BT: tl.constexpr, HG: tl.constexpr, BLOCK_H: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    # X: the side's own buffer (Q or K, nh heads a token); its heads h0 … h0 + HG − 1 are heads
    # p_h0 … of the packed buffer (heads a token). MASKED: the ragged edges (last token block,
    # a partial head group, E/2 below BLOCK_H); otherwise every access is unpredicated.
    hh = tl.arange(0, HG)
    i = tl.arange(0, BLOCK_H)
    j = tl.arange(0, 2 * BLOCK_H)
    cs_offs = (tok % T)[:, None] * HALF + i[None, :]  # (BT, BLOCK_H)
    tok64 = tok.to(tl.int64)[:, None]
    p_offs = ((tok64 * heads + p_h0 + hh[None, :]) * (2 * HALF))[:, :, None] + j[None, None, :]
    x_offs = ((tok64 * nh + h0 + hh[None, :]) * (2 * HALF))[:, :, None] + j[None, None, :]
    if MASKED:
        tok_ok = tok < n_tok
        cs_mask = tok_ok[:, None] & (i[None, :] < HALF)
        c = tl.load(C + cs_offs, mask=cs_mask, other=0.0)
        s = tl.load(S + cs_offs, mask=cs_mask, other=0.0) * SIGN
        row_ok = tok_ok[:, None] & (h0 + hh[None, :] < nh)
        x_mask = row_ok[:, :, None] & (j[None, None, :] < 2 * HALF)
        if TO_SPLIT:
            x = tl.load(P + p_offs, mask=x_mask, other=0.0)
        else:
            x = tl.load(X + x_offs, mask=x_mask, other=0.0)
    else:
        c = tl.load(C + cs_offs)
        s = tl.load(S + cs_offs) * SIGN
        if TO_SPLIT:
            x = tl.load(P + p_offs)
        else:
            x = tl.load(X + x_offs)
    x0, x1 = tl.split(tl.reshape(x.to(tl.float32), (BT, HG, BLOCK_H, 2)))
    c = c[:, None, :]  # broadcast over the heads
    s = s[:, None, :]
    y = tl.reshape(_rotate(x0, x1, c, s, SIGN), (BT, HG, 2 * BLOCK_H))
    if TO_SPLIT:
        if MASKED:
            tl.store(X + x_offs, y.to(X.dtype.element_ty), mask=x_mask)
        else:
            tl.store(X + x_offs, y.to(X.dtype.element_ty))
    else:
        if MASKED:
            tl.store(P + p_offs, y.to(P.dtype.element_ty), mask=x_mask)
        else:
            tl.store(P + p_offs, y.to(P.dtype.element_ty))


@triton.jit(do_not_specialize=["n_tok", "T"])  # HALF specialised: vector loads and stores
def _rope_packed_tokens(
    P, Q, K, C, S, n_tok, T, HALF, NQ, NK, SIGN: tl.constexpr, TO_SPLIT: tl.constexpr,
    BT: tl.constexpr, HG: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    gq = tl.cdiv(NQ, HG)
    groups = gq + tl.cdiv(NK, HG)
    pid = tl.program_id(0)
    tb = pid // groups
    g = pid % groups
    X = Q
    nh = NQ
    h0 = g * HG
    p_h0 = h0
    if g >= gq:  # a k head group: head groups never straddle q and k
        X = K
        nh = NK
        h0 = (g - gq) * HG
        p_h0 = NQ + h0
    tok = tb * BT + tl.arange(0, BT)
    if (tb * BT + BT <= n_tok) & (h0 + HG <= nh) & (HALF == BLOCK_H):
        _rope_tokens_tile(P, X, C, S, tok, n_tok, T, HALF, NQ + NK, nh, h0, p_h0, SIGN, TO_SPLIT,
                          BT, HG, BLOCK_H, MASKED=False)  # fmt: skip
    else:
        _rope_tokens_tile(P, X, C, S, tok, n_tok, T, HALF, NQ + NK, nh, h0, p_h0, SIGN, TO_SPLIT,
                          BT, HG, BLOCK_H, MASKED=True)  # fmt: skip


# Packed RoPE launch: tiles of ROPE_PACKED_TOKENS tokens × ROPE_PACKED_HEADS heads at E = 64 (the
# same number of elements at other E: more tokens for narrower heads, fewer for wider), powers
# of two, ROPE_PACKED_WARPS warps; ROPE_PACKED_TOKENS = 0 selects the per-row `_rope_packed`
# (ROPE_ELEMS elements a program) for A/B runs. On an H200 (32768 tokens × (12 + 12) heads,
# E = 64, bf16, kernel time under CUDA graphs, against a 49.3 µs copy of the same bytes): per-row
# 56.7 / 57.0 µs (fwd / bwd); 4 × 4, 1 warp 50.2 / 49.9; 8 × 2, 1 warp 50.4 / 50.1; 16 × 4,
# 4 warps 51.2 / 51.1; 8 × 4, 2 warps 51.1 / 50.9; at 512 elements (4 × 2 or 2 × 4, 1 warp)
# 61.2 / 61.1, too little in flight per SM (32 resident programs at most). 4 × 4, 1 warp was
# also the best or within 1% at 12 + 4 heads, at 32 + 8 heads of E = 128 (as 2 × 4), and in fp32.
ROPE_PACKED_TOKENS = 4
ROPE_PACKED_HEADS = 4
ROPE_PACKED_WARPS = 1


def _tokens_launch(n_tok: int, n_q: int, n_k: int, block_h: int) -> tuple[int, int, int, int]:
    # (programs, BT, HG, warps). HG: up to ROPE_PACKED_HEADS, never above the larger side's head
    # count (a group is all-q or all-k; a wider one would only be masked), with BT grown to keep
    # the tile's elements, since smaller tiles fall off the cliff above. BT: no more than the
    # tokens there are. Warps: at least 1024 elements each (32 a thread).
    hg = min(ROPE_PACKED_HEADS, triton.next_power_of_2(max(n_q, n_k)))
    bt = max(1, ROPE_PACKED_TOKENS * ROPE_PACKED_HEADS * 64 // (hg * 2 * block_h))
    bt = min(bt, triton.next_power_of_2(max(1, n_tok)))
    warps = max(1, min(ROPE_PACKED_WARPS, hg * bt * 2 * block_h // 1024))
    groups = triton.cdiv(n_q, hg) + triton.cdiv(n_k, hg)
    return triton.cdiv(n_tok, bt) * groups, bt, hg, warps


def rope_packed(
    packed: torch.Tensor | None,
    q: torch.Tensor | None,
    k: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_q: int,
    n_k: int,
    inverse: bool,
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """With ``packed`` (…, T, (n_q + n_k)·E) contiguous: rotate into new q (…, T, n_q, E) and
    k (…, T, n_k, E). With ``q`` and ``k`` (contiguous, those shapes) instead: rotate into a new
    packed buffer. cos/sin (T, E/2) float32; inverse rotates by −θ."""
    if interpreting():
        ensure_interpreter_compat()
    t, half = cos.shape
    e = 2 * half
    block_h = triton.next_power_of_2(half)
    to_split = packed is not None
    if to_split:
        lead = packed.shape[:-1]
        q = packed.new_empty((*lead, n_q, e))
        k = packed.new_empty((*lead, n_k, e))
    else:
        lead = q.shape[:-2]
        packed = q.new_empty((*lead, (n_q + n_k) * e))
    rows = packed.numel() // e
    sign = -1.0 if inverse else 1.0
    if ROPE_PACKED_TOKENS:
        n_tok = rows // (n_q + n_k)
        programs, bt, hg, warps = _tokens_launch(n_tok, n_q, n_k, block_h)
        _rope_packed_tokens[(programs,)](
            packed, q, k, cos, sin, n_tok, t, half, n_q, n_k, SIGN=sign, TO_SPLIT=to_split,
            BT=bt, HG=hg, BLOCK_H=block_h, num_warps=warps,
        )  # fmt: skip
    else:
        n_rows = max(1, min(128, ROPE_ELEMS // (2 * block_h)))
        _rope_packed[(triton.cdiv(rows, n_rows),)](
            packed, q, k, cos, sin, rows, t, half, n_q, n_k, SIGN=sign, TO_SPLIT=to_split,
            ROWS=n_rows, BLOCK_H=block_h, num_warps=ROPE_WARPS,
        )  # fmt: skip
    return (q, k) if to_split else packed
