"""Gated DeltaNet: the chunked gated delta rule, forward and backward, with its references.

Math, per sequence and head (state S ∈ R^{K×V}, decay γ_t = e^{g_t} with g_t ≤ 0, β_t ∈ (0, 1),
scale s, q/k usually L2-normalised by the caller — ``normalize_qk`` does it here):
    S_t = γ_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ          o_t = s · S_tᵀ q_t
Chunked (chunks of C tokens; G = cumsum g inside a chunk, Γ_ij = e^{G_i − G_j}, S_0 the state
entering the chunk): writing S_i = e^{g_i} S_{i−1} + k_i δ_iᵀ with δ_i = β_i (v_i − e^{g_i} S_{i−1}ᵀ k_i),
the δ's solve a unit lower-triangular system (I + A) δ = β⊙V − β e^G ⊙ K S_0 with
A_ij = β_i Γ_ij k_i·k_j (j < i). With T = (I + A)⁻¹ (the UT transform) and the WY factors
W = T diag(βe^G) K, U = T diag(β) V:
    δ = U − W S_0        O = s (e^G ⊙ Q S_0 + (QKᵀ ⊙ Γ ⊙ M) δ)        S_C = e^{G_C} S_0 + (e^{G_C−G} K)ᵀ δ
so everything inside a chunk is matmuls and only the K×V state crosses chunks. The backward runs
the same recurrence in reverse for dS and differentiates the chunk-local products; derivation
and kernels in ``_gated_delta_triton.py``.

Floor (per token and head, K = V = d, chunk C): forward ≈ 6Cd + 4Cd + 6d² FLOPs (QKᵀ, KKᵀ, W, U,
Pδ at chunk width; W S, state update and Q S at state width) ≈ 180 kFLOP at C = 64, d = 128 —
linear in T; the backward does ≈ 2.5× that (plus a recompute of the forward's WY factors and
states). Bytes: q, k, v, o in bf16 and g, β in fp32 (≈ 1 KiB at d = 128) plus one bf16 K×V
state snapshot per chunk (2d²/C = 512 B per token). At B·T = 32k tokens and 16 heads both floors
are ≈ 0.2 ms on an H200 (≈ 95 GFLOP; ≈ 0.8 GB).

Backends: ``triton`` (GPU, or CPU under ``TRITON_INTERPRET=1``), ``torch`` (the same chunked
algorithm in plain torch, differentiated by autograd: the CPU path of the layers), and the
readable token-by-token recurrence :func:`gated_delta_reference`. One-token decoding:
:func:`gated_delta_step`. Exercise: ``pytest tests/test_kernels_gated_delta.py``; on the GPU
``pytest -m gpu tests/test_kernels_gated_delta.py`` and ``python benchmarks/linear_attention.py``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from lmforge.kernels._chunked import (
    backward_fake,
    check_chunk_size,
    check_inputs,
    chunked_autograd,
    forward_fake,
    none_as_empty,
    per_sequence,
    resolve_backend,
    triton_operands,
)
from lmforge.kernels._ops import _define


# ------------------------------------------------------------------------------- references
def gated_delta_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The recurrence token by token, in float32 (float64 for float64 inputs). Shapes as
    :func:`gated_delta_rule`; returns (o in v's dtype, final states (N, H, K, V) or None)."""
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    s = q.shape[-1] ** -0.5 if scale is None else scale

    def one(q, k, v, g, b, S):  # one sequence: (T_n, H, ·), S (H, K, V)
        out = torch.empty_like(v)
        for t in range(q.shape[0]):
            S = S * g[t].exp()[:, None, None]
            kS = torch.einsum("hk,hkv->hv", k[t], S)  # (H, V) what the state recalls for k_t
            S = S + torch.einsum("hk,hv->hkv", k[t], b[t][:, None] * (v[t] - kS))
            out[t] = s * torch.einsum("hk,hkv->hv", q[t], S)
        return out, S

    return per_sequence(
        one, q, k, v, [g, beta], initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
    )  # fmt: skip


def gated_delta_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """One decoding step for N sequences: q, k (N, H, K), v (N, H, V), g, β (N, H), state
    (N, H, K, V) float32. Returns (o (N, H, V) in v's dtype, the new state). ``triton`` (the
    ``auto`` choice on CUDA) is one fused kernel reading and writing the state once; ``torch``
    and ``reference`` are the same math in torch (the state's dtype, e.g. float64, kept)."""
    s = q.shape[-1] ** -0.5 if scale is None else scale
    if resolve_backend(backend, q, k, v, state) == "triton":
        from lmforge.kernels import _gated_delta_triton

        q, k, v = (x.contiguous() for x in (q, k, v))
        g, beta = g.float().contiguous(), beta.float().contiguous()
        return _gated_delta_triton.step(q, k, v, g, beta, state.float().contiguous(), s)
    acc = state.dtype
    qf, kf, vf, gf, bf = (x.to(acc) for x in (q, k, v, g, beta))
    S = state * gf.exp()[..., None, None]  # (N, H, K, V)
    kS = torch.einsum("nhk,nhkv->nhv", kf, S)
    S = S + kf[..., :, None] * (bf[..., None] * (vf - kS))[..., None, :]
    o = s * torch.einsum("nhk,nhkv->nhv", qf, S)  # (N, H, V)
    return o.to(v.dtype), S


def _chunk_torch_one(q, k, v, g, b, S, scale, C):
    """One sequence, chunked: q, k (T, H, K), v (T, H, V), g, b (T, H), S (H, K, V)."""
    outs = []
    for start in range(0, q.shape[0], C):
        sl = slice(start, start + C)
        qc, kc, vc = (x[sl].transpose(0, 1) for x in (q, k, v))  # (H, c, ·)
        gc, bc = g[sl].t(), b[sl].t()  # (H, c)
        c = qc.shape[1]
        G = gc.cumsum(-1)
        diff = G[:, :, None] - G[:, None, :]  # (H, c, c)
        ones = torch.ones(c, c, dtype=torch.bool, device=q.device)
        strict, incl = ones.tril(-1), ones.tril()
        A = torch.where(
            strict,
            bc[:, :, None] * (kc @ kc.transpose(1, 2)) * diff.masked_fill(~strict, 0).exp(),
            0,
        )
        eye = torch.eye(c, dtype=q.dtype, device=q.device)
        T = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False)  # (I + A)⁻¹
        W = T @ (kc * (bc * G.exp())[..., None])  # (H, c, K)
        U = T @ (vc * bc[..., None])  # (H, c, V)
        delta = U - W @ S
        P = torch.where(incl, (qc @ kc.transpose(1, 2)) * diff.masked_fill(~incl, 0).exp(), 0)
        outs.append(scale * (G.exp()[..., None] * (qc @ S) + P @ delta))  # (H, c, V)
        g_last = G[:, -1]
        kd = kc * (g_last[:, None] - G).exp()[..., None]
        S = g_last.exp()[:, None, None] * S + kd.transpose(1, 2) @ delta
    return torch.cat(outs, 1).transpose(0, 1), S  # (T, H, V)


def gated_delta_chunked_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """The chunked WY algorithm in plain torch (float32, float64 for float64 inputs),
    differentiable through autograd; same signature and results as :func:`gated_delta_rule`."""
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    s = q.shape[-1] ** -0.5 if scale is None else scale
    return per_sequence(
        functools.partial(_chunk_torch_one, scale=s, C=chunk_size), q, k, v, [g, beta],
        initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )  # fmt: skip


# ------------------------------------------------------------------------------ Triton path
# The Triton path is a pair of torch custom ops (``torch.ops.lmforge.gated_delta_fwd`` / ``_bwd``,
# see ``_ops``): the forward's registered autograd — the role of an autograd.Function — saves the
# inputs and calls the backward op, and torch.compile sees one node instead of a graph break.
# Over packed tensors: q, k (N_tok, H, K), v (N_tok, H, V), g, β (N_tok, H) float32, h0
# (N, H, K, V) float32 or None, cu (N + 1,) int32; ht is (0,) when not asked for.
def _gdn_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    h0: Tensor | None,
    cu: Tensor,
    scale: float,
    chunk_size: int,
    store_ht: bool,
    seq_len: int,
) -> tuple[Tensor, Tensor]:
    from lmforge.kernels import _gated_delta_triton

    o, ht = _gated_delta_triton.forward(
        q, k, v, g, beta, scale, h0, cu, chunk_size, store_ht, seq_len
    )
    return o, none_as_empty(ht, q)


# The fakes (output shapes for tracing) take the ops' arguments; the shared bodies are in
# ``_chunked``.
def _gdn_fwd_fake(q, k, v, g, beta, h0, cu, scale, chunk_size, store_ht, seq_len):
    return forward_fake(q, v, cu, store_ht)


def _gdn_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    h0: Tensor | None,
    cu: Tensor,
    scale: float,
    chunk_size: int,
    seq_len: int,
    do: Tensor,
    dht: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    from lmforge.kernels import _gated_delta_triton

    dq, dk, dv, dg, db, dh0 = _gated_delta_triton.backward(
        q, k, v, g, beta, scale, h0, cu, chunk_size, do.contiguous(),
        None if dht is None else dht.contiguous(), seq_len,
    )  # fmt: skip
    return dq, dk, dv, dg, db, none_as_empty(dh0, q)


def _gdn_bwd_fake(q, k, v, g, beta, h0, cu, scale, chunk_size, seq_len, do, dht):
    return backward_fake([q, k, v, g, beta], h0)


_gdn_setup, _gdn_backward = chunked_autograd(lambda: gated_delta_bwd)
gated_delta_fwd = _define("gated_delta_fwd", _gdn_fwd, _gdn_fwd_fake, _gdn_backward, _gdn_setup)
gated_delta_bwd = _define("gated_delta_bwd", _gdn_bwd, _gdn_bwd_fake)


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
    normalize_qk: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Chunked gated delta rule over a batch or packed sequences.

    q, k (B, T, H, K); v (B, T, H, V); g (B, T, H) log decays (≤ 0); beta (B, T, H) in (0, 1);
    scale defaults to K^-½; cu_seqlens (N + 1,) int32 offsets of N packed sequences (then B = 1);
    initial_state (N, H, K, V). Returns (o (B, T, H, V) in v's dtype, final states (N, H, K, V)
    float32 — float64 for float64 inputs on the torch paths — when ``output_final_state``, else None). ``normalize_qk`` L2-normalises q and k
    (differentiably) first, as Gated DeltaNet does. chunk_size: 16, 32 or 64 (a power of two).
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    check_chunk_size(chunk_size)
    if normalize_qk:
        q, k = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
    s = q.shape[-1] ** -0.5 if scale is None else float(scale)
    kw = dict(scale=s, initial_state=initial_state, output_final_state=output_final_state)
    backend = resolve_backend(backend, q, k, v)
    if backend == "reference":
        return gated_delta_reference(q, k, v, g, beta, cu_seqlens=cu_seqlens, **kw)
    if backend == "torch":
        return gated_delta_chunked_torch(
            q, k, v, g, beta, cu_seqlens=cu_seqlens, chunk_size=chunk_size, **kw
        )
    B, T, H, _ = q.shape
    (q2, k2, v2, g2, b2), h0, cu, seq_len = triton_operands(
        q, k, v, [g, beta], initial_state, cu_seqlens
    )
    o, ht = gated_delta_fwd(q2, k2, v2, g2, b2, h0, cu, s, chunk_size, output_final_state, seq_len)
    return o.reshape(B, T, H, v.shape[-1]).to(v.dtype), ht if output_final_state else None
