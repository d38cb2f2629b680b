"""Mamba-2's SSD and decayed linear attention: chunked forward and backward, with references.

Math, per sequence and head (state S ∈ R^{K×V}, g_t ≤ 0 the log decay, scale s):
    S_t = e^{g_t} S_{t−1} + k_t v_tᵀ          o_t = s · S_tᵀ q_t
:func:`linear_attention` computes this for any g (g = 0: plain linear attention with the
identity feature map; g constant per head: RetNet's fixed decay). Mamba-2's SSD is the same
recurrence under its own names (scalar-times-identity A per head, groups of B/C shared by heads):
    q = C_t, k = B_t, v = Δ_t x_t, g = Δ_t A_h, s = 1, y_t = S_tᵀ C_t + D_h x_t        (:func:`ssd`)
Chunked (chunks of C tokens, G = cumsum g in a chunk, Γ_ij = e^{G_i − G_j}, M causal, S_0 the
state entering the chunk):
    O = s (e^G ⊙ Q S_0 + (QKᵀ ⊙ Γ ⊙ M) V)        S_C = e^{G_C} S_0 + (e^{G_C − G} K)ᵀ V
Backward: dS runs the recurrence in reverse (dS_0 = e^{G_C} dS_C + s (e^G ⊙ Q)ᵀ dO), then per
chunk dV = s (QKᵀ⊙Γ⊙M)ᵀ dO + (e^{G_C−G} K) dS_C, dQ, dK, dg (kernels: ``_ssd_triton.py``).

Floor (per token and head, K = V = d, chunk C): forward 4Cd + 4d² FLOPs (QKᵀ and PV at chunk
width; Q S and the state update at state width) ≈ 98 kFLOP at C = 64, d = 128; backward ≈ 2×
plus a recompute of the chunk states. Bytes as the gated delta rule's: ≈ 1 KiB of q, k, v, o per
token and head plus a bf16 K×V state snapshot per chunk. Linear in T.

Backends as :mod:`lmforge.kernels.gated_delta`: ``triton``, ``torch`` (chunked, autograd), and
the token-by-token ``reference``; decoding steps :func:`linear_attention_step` and
:func:`ssd_step`. Exercise: ``pytest tests/test_kernels_ssd.py``.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from lmforge.kernels._chunked import (
    acc_dtype,
    backward_fake,
    check_chunk_size,
    check_inputs,
    chunked_autograd,
    forward_fake,
    none_as_empty,
    per_sequence,
    resolve_backend,
    segments,
    triton_operands,
)
from lmforge.kernels._ops import _define


# ------------------------------------------------------------------------------- references
def linear_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None = None,
    *,
    scale: float = 1.0,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The decayed recurrence token by token (float32; float64 for float64 inputs)."""
    check_inputs(q, k, v, g, None, initial_state, cu_seqlens)

    def one(q, k, v, *g_S):  # one sequence: (T_n, H, ·), [g (T_n, H)], S (H, K, V)
        *g, S = g_S
        out = torch.empty_like(v)
        for t in range(q.shape[0]):
            if g:
                S = S * g[0][t].exp()[:, None, None]
            S = S + k[t][:, :, None] * v[t][:, None, :]
            out[t] = scale * torch.einsum("hk,hkv->hv", q[t], S)
        return out, S

    return per_sequence(
        one, q, k, v, [] if g is None else [g], initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
    )  # fmt: skip


def linear_attention_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    state: Tensor,
    *,
    scale: float = 1.0,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """One decoding step: q, k (N, H, K), v (N, H, V), g (N, H) or None, state (N, H, K, V).
    Returns (o (N, H, V) in v's dtype, the new state). ``triton`` (``auto`` on CUDA) is one fused
    kernel; ``torch`` / ``reference`` keep the state's dtype."""
    if resolve_backend(backend, q, k, v, state) == "triton":
        from lmforge.kernels import _gated_delta_triton

        q, k, v = (x.contiguous() for x in (q, k, v))
        g = torch.zeros(q.shape[:2], device=q.device) if g is None else g.float().contiguous()
        return _gated_delta_triton.step(q, k, v, g, None, state.float().contiguous(), float(scale))
    acc = state.dtype
    S = state if g is None else state * g.to(acc).exp()[..., None, None]  # (N, H, K, V)
    S = S + k.to(acc)[..., :, None] * v.to(acc)[..., None, :]
    o = scale * torch.einsum("nhk,nhkv->nhv", q.to(acc), S)  # (N, H, V)
    return o.to(v.dtype), S


def _chunk_torch_one(q, k, v, g, S, scale, C):
    """One sequence, chunked: q, k (T, H, K), v (T, H, V), g (T, H), S (H, K, V)."""
    outs = []
    for start in range(0, q.shape[0], C):
        sl = slice(start, start + C)
        qc, kc, vc = (x[sl].transpose(0, 1) for x in (q, k, v))  # (H, c, ·)
        G = g[sl].t().cumsum(-1)  # (H, c)
        c = qc.shape[1]
        incl = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        diff = (G[:, :, None] - G[:, None, :]).masked_fill(~incl, 0)  # (H, c, c)
        P = torch.where(incl, (qc @ kc.transpose(1, 2)) * diff.exp(), 0)
        outs.append(scale * (G.exp()[..., None] * (qc @ S) + P @ vc))  # (H, c, V)
        g_last = G[:, -1]
        kd = kc * (g_last[:, None] - G).exp()[..., None]
        S = g_last.exp()[:, None, None] * S + kd.transpose(1, 2) @ vc
    return torch.cat(outs, 1).transpose(0, 1), S  # (T, H, V)


def linear_attention_chunked_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None = None,
    *,
    scale: float = 1.0,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """The chunked algorithm in plain torch (differentiable through autograd)."""
    check_inputs(q, k, v, g, None, initial_state, cu_seqlens)
    gates = [torch.zeros(q.shape[:3], dtype=q.dtype, device=q.device) if g is None else g]
    return per_sequence(
        functools.partial(_chunk_torch_one, scale=scale, C=chunk_size), q, k, v, gates,
        initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )  # fmt: skip


# ------------------------------------------------------------------------------ Triton path
# Custom ops ``torch.ops.lmforge.decay_linear_attn_fwd`` / ``_bwd`` (see ``_ops`` and the gated
# delta rule's): q, k (N_tok, H, K), v (N_tok, H, V), g (N_tok, H) float32, h0 (N, H, K, V) or
# None, cu (N + 1,) int32; ht is (0,) when not asked for.
def _la_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    h0: Tensor | None,
    cu: Tensor,
    scale: float,
    chunk_size: int,
    store_ht: bool,
    seq_len: int,
) -> tuple[Tensor, Tensor]:
    from lmforge.kernels import _ssd_triton

    o, ht = _ssd_triton.forward(q, k, v, g, scale, h0, cu, chunk_size, store_ht, seq_len)
    return o, none_as_empty(ht, q)


# The fakes (output shapes for tracing) take the ops' arguments; the shared bodies are in
# ``_chunked``.
def _la_fwd_fake(q, k, v, g, h0, cu, scale, chunk_size, store_ht, seq_len):
    return forward_fake(q, v, cu, store_ht)


def _la_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    h0: Tensor | None,
    cu: Tensor,
    scale: float,
    chunk_size: int,
    seq_len: int,
    do: Tensor,
    dht: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    from lmforge.kernels import _ssd_triton

    dq, dk, dv, dg, dh0 = _ssd_triton.backward(
        q, k, v, g, scale, h0, cu, chunk_size, do.contiguous(),
        None if dht is None else dht.contiguous(), seq_len,
    )  # fmt: skip
    return dq, dk, dv, dg, none_as_empty(dh0, q)


def _la_bwd_fake(q, k, v, g, h0, cu, scale, chunk_size, seq_len, do, dht):
    return backward_fake([q, k, v, g], h0)


_la_setup, _la_backward = chunked_autograd(lambda: decay_linear_attn_bwd)
decay_linear_attn_fwd = _define(
    "decay_linear_attn_fwd", _la_fwd, _la_fwd_fake, _la_backward, _la_setup
)
decay_linear_attn_bwd = _define("decay_linear_attn_bwd", _la_bwd, _la_bwd_fake)


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None = None,
    *,
    scale: float = 1.0,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Chunked (decayed) linear attention S_t = e^{g_t} S_{t−1} + k_t v_tᵀ, o_t = s S_tᵀ q_t.

    q, k (B, T, H, K); v (B, T, H, V); g (B, T, H) log decays ≤ 0, or None for no decay;
    cu_seqlens (N + 1,) int32 offsets of packed sequences (then B = 1); initial_state
    (N, H, K, V). Returns (o (B, T, H, V) in v's dtype, final states (N, H, K, V) float32 when
    ``output_final_state``, else None). chunk_size: a power of two ≥ 16.
    """
    check_inputs(q, k, v, g, None, initial_state, cu_seqlens)
    check_chunk_size(chunk_size)
    kw = dict(
        scale=float(scale), initial_state=initial_state, output_final_state=output_final_state
    )
    backend = resolve_backend(backend, q, k, v)
    if backend == "reference":
        return linear_attention_reference(q, k, v, g, cu_seqlens=cu_seqlens, **kw)
    if backend == "torch":
        return linear_attention_chunked_torch(
            q, k, v, g, cu_seqlens=cu_seqlens, chunk_size=chunk_size, **kw
        )
    B, T, H, _ = q.shape
    if g is None:
        g = torch.zeros(B, T, H, device=q.device, dtype=torch.float32)
    (q2, k2, v2, g2), h0, cu, seq_len = triton_operands(q, k, v, [g], initial_state, cu_seqlens)
    o, ht = decay_linear_attn_fwd(
        q2, k2, v2, g2, h0, cu, float(scale), chunk_size, output_final_state, seq_len
    )
    return o.reshape(B, T, H, v.shape[-1]).to(v.dtype), ht if output_final_state else None


# ----------------------------------------------------------------------- Mamba-2 SSD naming
def _heads(x: Tensor, H: int) -> Tensor:
    # (B, T, G, N) → (B, T, H, N): head h reads group h // (H / G), as Mamba-2's ngroups.
    G = x.shape[2]
    if H % G:
        raise ValueError(f"the number of heads ({H}) must be a multiple of the groups ({G})")
    return x.repeat_interleave(H // G, dim=2)


def ssd(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    D: Tensor | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Mamba-2's state-space duality layer core, chunked.

    x (Bt, T, H, P) inputs; dt (Bt, T, H) positive step sizes (softplus already applied);
    A (H,) negative decay rates; B, C (Bt, T, G, N) input and output projections shared by
    H/G heads each; D (H,) skip. State (N_seq, H, N, P). Returns (y (Bt, T, H, P), final states
    or None). Gradients reach every input (dt and A through g = dt·A and v = dt·x).
    """
    H = x.shape[2]
    if dt.shape != x.shape[:3] or A.shape != (H,):
        raise ValueError(
            f"dt must be {tuple(x.shape[:3])} and A ({H},), got {tuple(dt.shape)} and {tuple(A.shape)}"
        )
    q, k = _heads(C, H), _heads(B, H)  # (Bt, T, H, N)
    v = x * dt[..., None]  # (Bt, T, H, P)
    g = dt.float() * A.float()  # (Bt, T, H)
    y, state = linear_attention(
        q, k, v.to(q.dtype), g, scale=1.0, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
        backend=backend,
    )  # fmt: skip
    if D is not None:
        y = y + (x * D[:, None]).to(y.dtype)
    return y.to(x.dtype), state


def ssd_reference(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    D: Tensor | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """SSD token by token in Mamba-2's terms: h_t = e^{Δ_t A} h_{t−1} + Δ_t B_t x_tᵀ,
    y_t = h_tᵀ C_t + D x_t (float32; float64 for float64 inputs)."""
    Bt, T, H, P = x.shape
    N = B.shape[-1]
    acc = acc_dtype(x)
    Bh, Ch = _heads(B, H).to(acc), _heads(C, H).to(acc)  # (Bt, T, H, N)
    xf, dtf, Af = x.to(acc), dt.to(acc), A.to(acc)
    y = torch.empty(Bt, T, H, P, dtype=acc, device=x.device)
    finals = []
    rows = [(b, 0, T) for b in range(Bt)] if cu_seqlens is None else [
        (0, s, e) for s, e in segments(cu_seqlens, 1, T)
    ]  # fmt: skip
    for i, (b, start, end) in enumerate(rows):
        h = (
            initial_state[i].to(acc)
            if initial_state is not None
            else torch.zeros(H, N, P, dtype=acc, device=x.device)
        )  # (H, N, P)
        for t in range(start, end):
            decay = torch.exp(dtf[b, t] * Af)  # (H,)
            h = decay[:, None, None] * h + dtf[b, t][:, None, None] * (
                Bh[b, t][:, :, None] * xf[b, t][:, None, :]
            )
            y[b, t] = torch.einsum("hn,hnp->hp", Ch[b, t], h)
            if D is not None:
                y[b, t] += D.to(acc)[:, None] * xf[b, t]
        finals.append(h)
    return y.to(x.dtype), torch.stack(finals) if output_final_state else None


def ssd_step(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    state: Tensor,
    *,
    D: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """One decoding step: x (N, H, P), dt (N, H), A (H,), B, C (N, G, N_s), state (N, H, N_s, P).
    Returns (y (N, H, P) in x's dtype, the new state); backends as :func:`linear_attention_step`."""
    H = x.shape[1]
    rep = H // B.shape[1]
    q, k = C.repeat_interleave(rep, 1), B.repeat_interleave(rep, 1)  # (N, H, N_s)
    v = x.to(state.dtype) * dt.to(state.dtype)[..., None]
    g = dt.to(state.dtype) * A.to(state.dtype)  # (N, H)
    y, state = linear_attention_step(q, k, v, g, state, backend=backend)
    if D is not None:
        y = y + D.to(state.dtype)[:, None] * x.to(state.dtype)
    return y.to(x.dtype), state
