"""RoPE on q/k and the paged KV write in one kernel, straight from the q/k/v GEMV's partial sums.

In the compiled decode step a layer's q/k/v projection is the decode GEMV
(:mod:`lmforge.serve._gemv_triton`), which leaves fp32 split-K partial sums P (SPLIT, S, N) with
N = (H + 2K)·E. Unfused, the step then adds them, rounds to the model dtype, rotates q and k
(an inductor kernel) and writes k and v into the pages (two ``index_copy`` kernels). Here one
program per (sequence, head) of all H + 2K heads does it all:

    y = round(Σ_s P[s, row, head·E : head·E + E])               (the GEMV's output, model dtype)
    QK-norm (Qwen3): q/k heads y = round(y / sqrt(mean(y²) + eps) · g)   (RMSNorm over E, fp32)
    q/k heads: out[2i] = y[2i]·cos − y[2i+1]·sin, out[2i+1] = y[2i+1]·cos + y[2i]·sin
               (cos/sin at the row's position, fp32: the model's RotaryEmbedding, interleaved)
    q heads -> q (S, H, E); k heads -> k_cache[slot]; v heads (not rotated) -> v_cache[slot]

The same fp32 products and roundings as the model's RMSNorm and RoPE, so the values equal the
unfused path's (up to the GPU's rsqrt and the order of the sum of squares).

Shape legend: S sequences, H heads, K kv-heads, E head dim. Exercised by
``pytest tests/test_serve_gemv.py`` (TRITON_INTERPRET=1 on CPU; ``-m gpu``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmforge.kernels._common import ensure_interpreter_compat, interpreting


@triton.jit
def _rope_kv_kernel(
    p_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    q_ptr,
    kc_ptr,
    vc_ptr,
    qn_ptr,
    kn_ptr,
    eps,
    S,
    stride_cos,
    stride_cslot,
    stride_chead,
    SPLIT: tl.constexpr,
    H: tl.constexpr,
    KV: tl.constexpr,
    HALF: tl.constexpr,
    HP: tl.constexpr,
    DTYPE: tl.constexpr,
    QK_NORM: tl.constexpr,
):
    s = tl.program_id(0)
    hd = tl.program_id(1)  # 0..H-1 q heads, H..H+K-1 k heads, then v heads
    n_cols = (H + 2 * KV) * 2 * HALF
    i = tl.arange(0, HP)  # (HP,) pair index
    ok = i < HALF
    col = s * n_cols + hd * 2 * HALF + 2 * i  # even element of each pair in row s
    even = tl.zeros([HP], dtype=tl.float32)
    odd = tl.zeros([HP], dtype=tl.float32)
    for sp in tl.static_range(SPLIT):
        even += tl.load(p_ptr + sp * S * n_cols + col, mask=ok, other=0.0)
        odd += tl.load(p_ptr + sp * S * n_cols + col + 1, mask=ok, other=0.0)
    # the GEMV's output in the model dtype, then RoPE in fp32 as the model computes it
    even = even.to(DTYPE).to(tl.float32)
    odd = odd.to(DTYPE).to(tl.float32)
    if hd < H + KV:
        if QK_NORM:  # RMSNorm over the head's E values with the q (or k) gain
            rinv = tl.rsqrt(tl.sum(even * even + odd * odd, axis=0) / (2 * HALF) + eps)
            if hd < H:
                g_even = tl.load(qn_ptr + 2 * i, mask=ok, other=0.0).to(tl.float32)
                g_odd = tl.load(qn_ptr + 2 * i + 1, mask=ok, other=0.0).to(tl.float32)
            else:
                g_even = tl.load(kn_ptr + 2 * i, mask=ok, other=0.0).to(tl.float32)
                g_odd = tl.load(kn_ptr + 2 * i + 1, mask=ok, other=0.0).to(tl.float32)
            even = (even * rinv * g_even).to(DTYPE).to(tl.float32)
            odd = (odd * rinv * g_odd).to(DTYPE).to(tl.float32)
        pos = tl.load(pos_ptr + s)
        c = tl.load(cos_ptr + pos * stride_cos + i, mask=ok, other=0.0)
        sn = tl.load(sin_ptr + pos * stride_cos + i, mask=ok, other=0.0)
        r_even = even * c - odd * sn
        r_odd = odd * c + even * sn
        if hd < H:
            dst = q_ptr + (s * H + hd) * 2 * HALF + 2 * i
            tl.store(dst, r_even.to(DTYPE), mask=ok)
            tl.store(dst + 1, r_odd.to(DTYPE), mask=ok)
        else:
            slot = tl.load(slot_ptr + s).to(tl.int64)
            dst = kc_ptr + slot * stride_cslot + (hd - H) * stride_chead + 2 * i
            tl.store(dst, r_even.to(kc_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + 1, r_odd.to(kc_ptr.dtype.element_ty), mask=ok)
    else:
        slot = tl.load(slot_ptr + s).to(tl.int64)
        dst = vc_ptr + slot * stride_cslot + (hd - H - KV) * stride_chead + 2 * i
        tl.store(dst, even.to(vc_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + 1, odd.to(vc_ptr.dtype.element_ty), mask=ok)


_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def rope_write_kv(
    partials: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    n_heads: int,
    dtype: torch.dtype,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """partials (SPLIT, S, (H + 2K)·E) fp32 of the packed q/k/v GEMV; cos/sin (T, E/2) fp32
    tables; positions, slots (S,); one layer's caches (NB, BS, K, E), written at ``slots`` ->
    rotated q (S, H, E) in ``dtype`` (the model's). ``q_norm``/``k_norm`` (E,): QK-norm gains
    (both or neither), RMSNorm with ``eps`` before RoPE."""
    if interpreting():
        ensure_interpreter_compat()
    split, s, n_cols = partials.shape
    _, _, kv_heads, e = k_cache.shape
    # plain rows only: a quantized cache (fp8/int8 + scale) is written by attention.write_kv
    assert k_cache.dtype not in (torch.float8_e4m3fn, torch.int8), k_cache.dtype
    assert n_cols == (n_heads + 2 * kv_heads) * e and e % 2 == 0, (partials.shape, k_cache.shape)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1)  # slot = block·BS + offset
    assert cos.stride(-1) == 1 and cos.stride() == sin.stride()
    partials = partials.contiguous()
    q = torch.empty((s, n_heads, e), device=partials.device, dtype=dtype)
    half = e // 2
    qk_norm = q_norm is not None
    assert qk_norm == (k_norm is not None)
    _rope_kv_kernel[(s, n_heads + 2 * kv_heads)](
        partials,
        cos,
        sin,
        positions,
        slots,
        q,
        k_cache,
        v_cache,
        q_norm if qk_norm else q,  # unused without QK-norm
        k_norm if qk_norm else q,
        eps,
        s,
        cos.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        SPLIT=split,
        H=n_heads,
        KV=kv_heads,
        HALF=half,
        HP=triton.next_power_of_2(half),
        DTYPE=_DTYPES[dtype],
        QK_NORM=qk_norm,
        num_warps=1,
    )
    return q
