"""FlashAttention-2: tiled exact attention with an online softmax, forward and backward.

Math (per query row i, keys j, scale s = 1/sqrt(E)):
    S_ij = s·q_i·k_j            P_ij = exp(S_ij − L_i)       L_i = log Σ_j exp(S_ij)
    O_i  = Σ_j P_ij v_j
Forward walks key/value tiles keeping a running max m, running sum l and an unnormalised
accumulator; it saves only O and the per-row logsumexp L (B × H × T) beside q, k, v — no T × T
tensor is ever materialised. Backward recomputes P tile by tile from L:
    D_i = Σ_e dO_ie·O_ie       dV_j = Σ_i P_ij dO_i      dP_ij = dO_i·v_j
    dS_ij = P_ij (dP_ij − D_i) dQ_i = s Σ_j dS_ij k_j   dK_j = s Σ_i dS_ij q_i
Causal masking is top-left aligned (key j visible to query i iff j ≤ i, as SDPA's ``is_causal``);
tiles entirely above the diagonal are skipped. A sliding window W (causal, Triton backend: the
W layers of ``model.layers`` train through it) narrows that to i − W < j ≤ i, and the tiles
wholly outside it are skipped too (compute O(T·W), not O(T²)). Grouped-query attention maps query head h to
key/value head h // (H / K) without repeating K/V in memory.

Two implementations share this algorithm:
  * :class:`FlashAttentionTorch` — plain PyTorch tiles; for CPU and for reading.
  * :class:`FlashAttentionTriton` — the Triton kernels in ``_flash_triton`` (GPU, or CPU through
    ``TRITON_INTERPRET=1``), run as the custom ops ``torch.ops.lmforge.flash_attn_fwd/bwd``
    (``py``) so that torch.compile traces :func:`flash_attention` without a graph break.
:func:`attention_reference` is the naive O(T²)-memory definition used by the tests (float64).

Shapes: q (…, H, T, E), k/v (…, K, S, E) with H % K == 0; 3-D inputs (N, T, E) treat N as heads
and 2-D inputs (T, E) a single head. Exercise: ``pytest tests/test_kernels.py -k attention``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from lmforge.kernels._common import KernelUnsupportedError, autocast_dtype, check_triton_tensors
from lmforge.kernels._ops import _define, _unit_stride


# -- the custom ops (torch.ops.lmforge.*) --------------------------------------------------
def _flash_attn_fwd(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, window: int = 0
) -> tuple[Tensor, Tensor]:
    from lmforge.kernels import _flash_triton

    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    return _flash_triton.forward(q, k, v, causal, window)


def _flash_attn_fwd_fake(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, window: int = 0
) -> tuple[Tensor, Tensor]:
    b, h, t, e = q.shape
    out = q.new_empty((b, h, t, e))  # (B, H, T, E)
    lse = q.new_empty((b, h, t), dtype=torch.float32)  # (B, H, T)
    return out, lse


def _flash_attn_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    causal: bool,
    window: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    from lmforge.kernels import _flash_triton

    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    return _flash_triton.backward(q, k, v, out.contiguous(), lse.contiguous(), dout, causal, window)


def _flash_attn_bwd_fake(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    causal: bool,
    window: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _flash_setup(ctx, inputs, output) -> None:
    q, k, v, causal, window = inputs  # (torch fills in the defaulted window)
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zero-filled dL for the logsumexp output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal = causal
    ctx.window = window


def _flash_backward(ctx, dout, _dlse):
    if dout is None:
        return None, None, None, None, None
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = flash_attn_bwd(q, k, v, out, lse, dout, ctx.causal, ctx.window)
    return dq, dk, dv, None, None


flash_attn_fwd = _define(
    "flash_attn_fwd", _flash_attn_fwd, _flash_attn_fwd_fake, _flash_backward, _flash_setup
)
flash_attn_bwd = _define("flash_attn_bwd", _flash_attn_bwd, _flash_attn_bwd_fake)


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    # (…, T, E) → (B, H, T, E) as a view whenever possible (leading dims merged into B).
    if x.dim() == 2:
        return x[None, None]
    if x.dim() == 3:
        return x[None]
    if x.dim() == 4:
        return x
    return x.reshape(-1, *x.shape[-3:])


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() < 2 or q.dim() != k.dim() or k.dim() != v.dim():
        raise KernelUnsupportedError(
            f"flash_attention: q, k, v must share a rank ≥ 2, got {q.dim()}, {k.dim()}, {v.dim()}"
        )
    if k.shape != v.shape:
        raise KernelUnsupportedError(
            f"flash_attention: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise KernelUnsupportedError(
            f"flash_attention: head dims differ: q {q.shape[-1]} vs k {k.shape[-1]}"
        )
    if q.dim() >= 4 and q.shape[:-3] != k.shape[:-3]:
        raise KernelUnsupportedError(
            f"flash_attention: batch dims differ: q {tuple(q.shape[:-3])} vs k {tuple(k.shape[:-3])}"
        )
    hq = q.shape[-3] if q.dim() >= 3 else 1
    hk = k.shape[-3] if k.dim() >= 3 else 1
    if hq % hk:
        raise KernelUnsupportedError(
            f"flash_attention: query heads ({hq}) must be a multiple of key/value heads ({hk})"
        )


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = True,
    window: int | None = None,
) -> torch.Tensor:
    """Naive softmax attention (materialises the T × S scores) in the inputs' dtype; with a
    ``window`` (causal), query i sees keys i − window < j ≤ i.

    Pass float64 tensors to get the ground truth the tests compare against. GQA is handled by
    repeating K/V heads, which is fine for a reference.
    """
    _check_shapes(q, k, v)
    q4, k4, v4 = _as_4d(q), _as_4d(k), _as_4d(v)
    group = q4.shape[1] // k4.shape[1]
    k4 = k4.repeat_interleave(group, dim=1)  # (B, H, S, E)
    v4 = v4.repeat_interleave(group, dim=1)  # (B, H, S, E)
    scores = (q4 @ k4.transpose(-1, -2)) / math.sqrt(q4.shape[-1])  # (B, H, T, S)
    if is_causal:
        t, s = scores.shape[-2:]
        keep = torch.ones(t, s, dtype=torch.bool, device=q.device).tril()
        if window is not None:
            keep &= torch.ones(t, s, dtype=torch.bool, device=q.device).triu(1 - window)
        scores = scores.masked_fill(~keep, float("-inf"))
    out = scores.softmax(-1) @ v4  # (B, H, T, E)
    return out.reshape(q.shape)


def _torch_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # q (B, K, G, T, E) grouped by key/value head; k, v (B, K, 1, S, E) broadcast over the group.
    acc_t = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(q.shape[-1])
    t_q, t_k = q.shape[-2], k.shape[-2]
    out = torch.empty(q.shape, dtype=acc_t, device=q.device)  # (B, K, G, T, E)
    lse = torch.empty(q.shape[:-1], dtype=acc_t, device=q.device)  # (B, K, G, T)
    for i0 in range(0, t_q, block):
        i1 = min(i0 + block, t_q)
        qi = q[..., i0:i1, :].to(acc_t) * scale  # (B, K, G, bq, E)
        m = torch.full(qi.shape[:-1], float("-inf"), dtype=acc_t, device=q.device)
        row_sum = torch.zeros_like(m)  # (B, K, G, bq)
        acc = torch.zeros_like(qi)  # (B, K, G, bq, E)
        j_end = min(t_k, i1) if causal else t_k  # tiles above the diagonal are skipped
        for j0 in range(0, j_end, block):
            j1 = min(j0 + block, t_k)
            s = qi @ k[..., j0:j1, :].to(acc_t).transpose(-1, -2)  # (B, K, G, bq, bk)
            if causal and j1 - 1 > i0:  # only tiles crossing the diagonal need a mask
                rows = torch.arange(i0, i1, device=q.device)[:, None]
                cols = torch.arange(j0, j1, device=q.device)[None, :]
                s = s.masked_fill(cols > rows, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])  # (B, K, G, bq, bk)
            alpha = torch.exp(m - m_new)  # rescales what was accumulated under the old max
            row_sum = row_sum * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v[..., j0:j1, :].to(acc_t)
            m = m_new
        out[..., i0:i1, :] = acc / row_sum[..., None]
        lse[..., i0:i1] = m + torch.log(row_sum)
    return out, lse


def _torch_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    causal: bool,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc_t = lse.dtype
    scale = 1.0 / math.sqrt(q.shape[-1])
    t_q, t_k = q.shape[-2], k.shape[-2]
    delta = (dout.to(acc_t) * out.to(acc_t)).sum(-1)  # (B, K, G, T): D = rowsum(dO∘O)
    dq = torch.zeros(q.shape, dtype=acc_t, device=q.device)  # (B, K, G, T, E)
    dk = torch.zeros(k.shape, dtype=acc_t, device=q.device)  # (B, K, 1, S, E)
    dv = torch.zeros(v.shape, dtype=acc_t, device=q.device)  # (B, K, 1, S, E)
    for j0 in range(0, t_k, block):
        j1 = min(j0 + block, t_k)
        kj = k[..., j0:j1, :].to(acc_t)  # (B, K, 1, bk, E)
        vj = v[..., j0:j1, :].to(acc_t)
        i_start = (j0 // block) * block if causal else 0  # rows above the tile see none of it
        for i0 in range(i_start, t_q, block):
            i1 = min(i0 + block, t_q)
            qi = q[..., i0:i1, :].to(acc_t)  # (B, K, G, bq, E)
            doi = dout[..., i0:i1, :].to(acc_t)
            p = torch.exp(scale * (qi @ kj.transpose(-1, -2)) - lse[..., i0:i1, None])
            if causal and j1 - 1 > i0:
                rows = torch.arange(i0, i1, device=q.device)[:, None]
                cols = torch.arange(j0, j1, device=q.device)[None, :]
                p = p.masked_fill(cols > rows, 0.0)  # (B, K, G, bq, bk)
            dv[..., j0:j1, :] += (p.transpose(-1, -2) @ doi).sum(2, keepdim=True)
            dp = doi @ vj.transpose(-1, -2)  # (B, K, G, bq, bk)
            ds = p * (dp - delta[..., i0:i1, None])
            dq[..., i0:i1, :] += scale * (ds @ kj)
            dk[..., j0:j1, :] += scale * (ds.transpose(-1, -2) @ qi).sum(2, keepdim=True)
    return dq, dk, dv


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    # (…) → q (B, K, G, T, E), k/v (B, K, 1, S, E): views, K/V never repeated.
    q4, k4, v4 = _as_4d(q), _as_4d(k), _as_4d(v)
    b, h, t, e = q4.shape
    kv = k4.shape[1]
    return q4.reshape(b, kv, h // kv, t, e), k4.unsqueeze(2), v4.unsqueeze(2)


class FlashAttentionTorch(torch.autograd.Function):
    """FlashAttention-2 in plain PyTorch tiles: ``FlashAttentionTorch.apply(q, k, v, is_causal)``.

    Simplification: tile loops run in Python (one tile size, no fused kernels), so it is slow; it
    exists to run anywhere (CPU, float64) and to read the algorithm. Saves q, k, v, O and L only,
    L with q's leading dims (``q.shape[:-1]``).
    """

    BLOCK = 64

    @staticmethod
    def forward(ctx, q, k, v, is_causal=True):  # type: ignore[override]
        _check_shapes(q, k, v)
        qg, kg, vg = _grouped(q, k, v)
        out, lse = _torch_forward(qg, kg, vg, bool(is_causal), FlashAttentionTorch.BLOCK)
        out = out.to(q.dtype)
        # L is saved with q's leading dims: (batch, queries) for q of shape (batch, queries, d).
        ctx.save_for_backward(q, k, v, out, lse.reshape(q.shape[:-1]))
        ctx.is_causal = bool(is_causal)
        return out.reshape(q.shape)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        qg, kg, vg = _grouped(q, k, v)
        lse = lse.reshape(out.shape[:-1])  # back to the grouped (B, K, G, T) layout
        dq, dk, dv = _torch_backward(
            qg, kg, vg, out, lse, dout.reshape(out.shape), ctx.is_causal, FlashAttentionTorch.BLOCK
        )
        return (
            dq.to(q.dtype).reshape(q.shape),
            dk.to(k.dtype).reshape(k.shape),
            dv.to(v.dtype).reshape(v.shape),
            None,
        )


def _check_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype | None = None
) -> None:
    # dtype: the common dtype q, k, v will have after a pending (autocast) cast.
    _check_shapes(q, k, v)
    check_triton_tensors("flash_attention", q, k, v, dtype=dtype)
    if dtype is None and not (q.dtype == k.dtype == v.dtype):
        raise KernelUnsupportedError(
            f"flash_attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}"
        )
    e = q.shape[-1]
    if e < 16 or e > 256 or e & (e - 1):
        raise KernelUnsupportedError(
            f"flash_attention: head dim {e} is not supported (a power of two in 16..256)"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise KernelUnsupportedError(
                f"flash_attention: {name} needs a contiguous head dim (stride 1), got strides "
                f"{t.stride()}"
            )
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise KernelUnsupportedError("flash_attention: empty sequence")


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 in Triton: ``FlashAttentionTriton.apply(q, k, v, is_causal)`` → O.

    Saves q, k, v, O and the logsumexp L (float32, with q's leading dims: (batch, queries) for q
    of shape (batch, queries, d)). Raises
    :class:`~lmforge.kernels.KernelUnsupportedError` for inputs it cannot handle (non-CUDA tensor
    outside the interpreter, dtype other than fp16/bf16/fp32, head dim not a power of two in
    16..256, head dim not contiguous). Runs the same custom ops as :func:`flash_attention`
    (``torch.ops.lmforge.flash_attn_fwd/bwd``); kept for callers of ``.apply``, while
    :func:`flash_attention` uses the ops' own autograd, which torch.compile can trace.
    Exercise: ``pytest -m gpu tests/test_kernels_gpu.py``.
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=True):  # type: ignore[override]
        _check_triton(q, k, v)
        q4, k4, v4 = _as_4d(q), _as_4d(k), _as_4d(v)
        out, lse = flash_attn_fwd(q4, k4, v4, bool(is_causal))
        # L is saved with q's leading dims: (batch, queries) for q of shape (batch, queries, d).
        ctx.save_for_backward(q4, k4, v4, out, lse.reshape(q.shape[:-1]))
        ctx.is_causal = bool(is_causal)
        ctx.shapes = (q.shape, k.shape, v.shape)
        return out.reshape(q.shape)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q4, k4, v4, out, lse = ctx.saved_tensors
        qs, ks, vs = ctx.shapes
        lse = lse.reshape(out.shape[:-1])  # (B, H, T) for the kernel
        dq, dk, dv = flash_attn_bwd(q4, k4, v4, out, lse, _as_4d(dout.reshape(qs)), ctx.is_causal)
        return dq.reshape(qs), dk.reshape(ks), dv.reshape(vs), None


def _autocast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    # Under autocast, attention runs in the autocast dtype (as torch SDPA does), so fp32 q/k
    # coming out of RoPE and a bf16 v still meet the kernel in one dtype.
    dtype = autocast_dtype(q.device.type)
    if dtype is None:
        return q, k, v
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in (q, k, v))


def flash_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`flash_attention` (Triton backend) accepts these inputs (the model's ``auto``
    test; autocast's dtype is taken into account)."""
    try:
        _check_triton(q, k, v, dtype=autocast_dtype(q.device.type))
    except KernelUnsupportedError:
        return False
    return True


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = True,
    backend: Literal["triton", "torch"] = "triton",
    window: int | None = None,
) -> torch.Tensor:
    """Exact attention O = softmax(q kᵀ/√E) v with FlashAttention-2 tiling; differentiable.

    q (B, H, T, E), k/v (B, K, S, E) with H % K == 0 (GQA), or (…, T, E) forms. ``backend``
    picks the Triton kernels or the pure-PyTorch tiles. ``window`` (causal, Triton backend):
    query i sees keys i − window < j ≤ i only, and the kernels skip the tiles outside it. Raises
    KernelUnsupportedError (a ValueError) for inputs the chosen backend cannot run. Under
    autocast the inputs are cast to the autocast dtype first (here, outside the op: custom ops
    do not see autocast). float32 inputs on a GPU run TF32 tensor-core dots (torch's
    ``allow_tf32`` precision, about 3 decimal digits per product; the interpreter computes in
    full float32): where the math cancels exactly (a window of 1, where dq and dk are 0) the
    error is TF32's on the cancelling terms.

    The Triton backend is the custom op ``torch.ops.lmforge.flash_attn_fwd`` (backward
    ``flash_attn_bwd``), so ``torch.compile(fullgraph=True)`` traces through it; the checks and
    reshapes around it are traced too. The torch backend is a graph break (Dynamo cannot trace
    its autograd.Function and runs it eagerly); it exists for CPU and for reading, not speed.
    No ``torch.compiler.disable`` marks it: that would import Dynamo, and with it Triton, when
    this package is imported.
    """
    q, k, v = _autocast(q, k, v)
    if window is not None and (window <= 0 or not is_causal or backend != "triton"):
        raise KernelUnsupportedError(
            f"flash_attention: a window ({window}) must be positive, causal, on the triton backend"
        )
    if backend == "triton":
        _check_triton(q, k, v)
        out, _ = flash_attn_fwd(_as_4d(q), _as_4d(k), _as_4d(v), bool(is_causal), window or 0)
        return out.reshape(q.shape)  # (…, H, T, E)
    if backend == "torch":
        return FlashAttentionTorch.apply(q, k, v, is_causal)
    raise KernelUnsupportedError(
        f"flash_attention: backend must be 'triton' or 'torch', got {backend!r}"
    )
