"""Triton kernel of the multi-tensor AdamW update (see adamw.py).

One launch updates every tensor: each program owns one chunk (SLICES consecutive BLOCK-sized
slices) of one tensor, found through two small tables (chunk → tensor index, chunk → first
element); the tensors' addresses
come from per-tensor pointer tables (int64), so parameters, gradients and moments stay where
they are (no flat buffer, no copies). With master weights the gradients may be bf16/fp16 (those
of the model's low-precision copies) and the kernel also writes each copy from the new fp32
value: 2 + 24 + 2 bytes a parameter instead of 4 + 24, and no cast kernels around the model.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lmforge.kernels._common import ensure_interpreter_compat, interpreting

# Launch: BLOCK elements per slice, SLICES slices per program, WARPS warps. What limits the
# kernel is how many programs an SM holds while others wait on their table loads: 4096 × 8 warps
# needs 170 registers a thread, so one program per SM; 2048 × 8 and 1024 × 4 need 64 (ptxas -v
# for sm_90a, tests/test_kernels_sm90.py). GPT-2-small's update alone on an H200 (RESULTS.md,
# seventh session): 4096×8×1 1.510 ms, 2048×8×1 1.129, 2048×8×4 1.157, 1024×4×1 1.093 (1.03×
# the 28 B/param floor), 1024×4×8 1.132; torch's fused AdamW 1.296.
BLOCK = 1024
WARPS = 4
SLICES = 1


@triton.jit
def _pow_int(base, e):
    # base ** e for a non-negative integer e (int64 scalar), by squaring: exact enough in
    # float64 (a few ulps) that the float32 coefficients below round as torch's pow gives them.
    r = base * 0.0 + 1.0
    b = base
    while e > 0:
        if e % 2 == 1:
            r = r * b
        b = b * b
        e = e // 2
    return r


@triton.jit
def _slice_update(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    offs,
    n,
    scale,
    w,
    b2f,
    one_m_b2,
    sqrt_bc2,
    eps,
    decay,
    neg_step,
    c_ptr,
    MASKED: tl.constexpr,
    HAS_COPY: tl.constexpr,
):
    # Gradients in their own dtype (a bf16 copy's gradient is upcast exactly, as autocast's
    # cast backward would), everything else in float32.
    if MASKED:
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    else:  # a whole slice: no mask, so the accesses vectorise
        g = tl.load(g_ptr + offs).to(tl.float32) * scale
        m = tl.load(m_ptr + offs)
        v = tl.load(v_ptr + offs)
        p = tl.load(p_ptr + offs)
    # torch.lerp's two forms (the one for weights below one half is exact at weight 0).
    if w < 0.5:
        m_new = m + w * (g - m)
    else:
        m_new = g - (g - m) * (1.0 - w)
    v_new = v * b2f + g * g * one_m_b2
    denom = tl.div_rn(tl.sqrt_rn(v_new), sqrt_bc2) + eps
    p_new = p * decay + tl.div_rn(m_new, denom) * neg_step
    if MASKED:
        tl.store(m_ptr + offs, m_new, mask=mask)
        tl.store(v_ptr + offs, v_new, mask=mask)
        tl.store(p_ptr + offs, p_new, mask=mask)
        if HAS_COPY:  # the model's low-precision weight: the new master, rounded to nearest even
            tl.store(c_ptr + offs, p_new.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(m_ptr + offs, m_new)
        tl.store(v_ptr + offs, v_new)
        tl.store(p_ptr + offs, p_new)
        if HAS_COPY:
            tl.store(c_ptr + offs, p_new.to(c_ptr.dtype.element_ty))


@triton.jit
def _adamw_multi(
    P_TAB,  # int64 (n,) addresses of the fp32 parameters (16-byte aligned: checked on the host)
    G_TAB,  # gradients (G_DTYPE)
    M_TAB,  # first moments (fp32)
    V_TAB,  # second moments (fp32)
    T_TAB,  # step counts (0-d float64 each), read before this step's increment
    C_TAB,  # the parameters' low-precision copies (C_DTYPE), written after the update; unused
    # unless HAS_COPY
    NUMEL,  # int64 (n,)
    CHUNK_TENSOR,  # int32 (chunks,): the tensor each program updates
    CHUNK_START,  # int64 (chunks,): the first element of its chunk (BLOCK·SLICES elements)
    HP,  # float64 (5,): lr, weight decay, beta1, beta2, eps
    OK,  # bool (): apply the update at all
    SCALE,  # fp32 (): factor on every gradient (clipping)
    BLOCK: tl.constexpr,
    SLICES: tl.constexpr,
    G_DTYPE: tl.constexpr,
    C_DTYPE: tl.constexpr,
    HAS_COPY: tl.constexpr,
):
    pid = tl.program_id(0)
    ok = tl.load(OK)
    if ok != 0:
        tid = tl.load(CHUNK_TENSOR + pid)
        start = tl.multiple_of(tl.load(CHUNK_START + pid), BLOCK * SLICES)
        n = tl.load(NUMEL + tid)
        # Alignment hints: addresses loaded from memory carry none, and without them every
        # access would be a scalar 4-byte load.
        p_ptr = tl.multiple_of(tl.load(P_TAB + tid).to(tl.pointer_type(tl.float32)), 16)
        g_ptr = tl.multiple_of(tl.load(G_TAB + tid).to(tl.pointer_type(G_DTYPE)), 16)
        m_ptr = tl.multiple_of(tl.load(M_TAB + tid).to(tl.pointer_type(tl.float32)), 16)
        v_ptr = tl.multiple_of(tl.load(V_TAB + tid).to(tl.pointer_type(tl.float32)), 16)
        t_ptr = tl.load(T_TAB + tid).to(tl.pointer_type(tl.float64))
        if HAS_COPY:
            c_ptr = tl.multiple_of(tl.load(C_TAB + tid).to(tl.pointer_type(C_DTYPE)), 16)
        else:
            c_ptr = p_ptr.to(tl.pointer_type(C_DTYPE))  # never written
        # Per-tensor scalars in float64 (as the host or torch.pow computes them), then rounded
        # once to float32 — the operation order of lmforge.train.optim._adamw_gated_update.
        lr = tl.load(HP)
        wd = tl.load(HP + 1)
        b1 = tl.load(HP + 2)
        b2 = tl.load(HP + 3)
        eps = tl.load(HP + 4).to(tl.float32)
        t_new = (tl.load(t_ptr) + 1.0).to(tl.int64)
        decay = (1.0 - lr * wd).to(tl.float32)
        neg_step = (-lr / (1.0 - _pow_int(b1, t_new))).to(tl.float32)
        sqrt_bc2 = tl.sqrt(1.0 - _pow_int(b2, t_new)).to(tl.float32)
        w = (1.0 - b1).to(tl.float32)
        b2f = b2.to(tl.float32)
        one_m_b2 = (1.0 - b2).to(tl.float32)
        scale = tl.load(SCALE)
        # The chunk's start goes into the (scalar) base addresses and the offsets stay int32:
        # int64 offsets per element would make every address a 64-bit vector of registers.
        p_ptr, g_ptr, m_ptr, v_ptr = p_ptr + start, g_ptr + start, m_ptr + start, v_ptr + start
        c_ptr = c_ptr + start
        offs = tl.arange(0, BLOCK)
        n = n - start  # elements left from the chunk's start
        # SLICES consecutive BLOCK slices of one tensor per program: the loads of the tables and
        # the scalar math above are paid once per chunk.
        for i in tl.static_range(SLICES):
            if (i + 1) * BLOCK <= n:
                _slice_update(
                    p_ptr + i * BLOCK, g_ptr + i * BLOCK, m_ptr + i * BLOCK, v_ptr + i * BLOCK,
                    offs, n, scale, w, b2f, one_m_b2, sqrt_bc2, eps, decay, neg_step,
                    c_ptr + i * BLOCK, MASKED=False, HAS_COPY=HAS_COPY,
                )  # fmt: skip
            elif i * BLOCK < n:
                _slice_update(
                    p_ptr + i * BLOCK, g_ptr + i * BLOCK, m_ptr + i * BLOCK, v_ptr + i * BLOCK,
                    offs, n - i * BLOCK, scale, w, b2f, one_m_b2, sqrt_bc2, eps, decay, neg_step,
                    c_ptr + i * BLOCK, MASKED=True, HAS_COPY=HAS_COPY,
                )  # fmt: skip


_TL_DTYPES = {"float32": tl.float32, "bfloat16": tl.bfloat16, "float16": tl.float16}


def launch(
    tables, numel, chunk_tensor, chunk_start, hp, ok, scale, g_dtype: str, c_dtype: str | None
) -> None:
    """One launch over every chunk; ``tables`` is the (5, n) int64 address table (p, g, m, v, t),
    or (6, n) with the copies' addresses last when ``c_dtype`` names their dtype; ``g_dtype``
    names the gradients' ("float32", "bfloat16" or "float16")."""
    if interpreting():
        ensure_interpreter_compat()
    grid = (chunk_tensor.numel(),)
    has_copy = c_dtype is not None
    _adamw_multi[grid](
        tables[0],
        tables[1],
        tables[2],
        tables[3],
        tables[4],
        tables[5] if has_copy else tables[4],
        numel,
        chunk_tensor,
        chunk_start,
        hp,
        ok,
        scale,
        BLOCK=BLOCK,
        SLICES=SLICES,
        G_DTYPE=_TL_DTYPES[g_dtype],
        C_DTYPE=_TL_DTYPES[c_dtype or "bfloat16"],
        HAS_COPY=has_copy,
        num_warps=WARPS,
    )
