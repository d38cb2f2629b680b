"""Linear-attention token mixers with a constant-size recurrent state: Gated DeltaNet, Mamba-2,
and plain (optionally RetNet-decayed) linear attention.

Each mixer maps (B, T, D) → (B, T, D) like attention, but carries a per-sequence state of fixed
size instead of a KV cache:
  * ``forward(x, cu_seqlens=None, state=None) -> (y, new_state)`` — training and prefill, through
    the chunked kernels (:mod:`lmforge.kernels.gated_delta`, :mod:`lmforge.kernels.ssd`; Triton on
    CUDA, the chunked torch path on CPU — ``backend`` picks); packed sequences via ``cu_seqlens``
    (then B = 1), and ``state`` continues sequences from an earlier call (prefill into a cache).
  * ``step(x_t, state) -> (y_t, new_state)`` — one decoding token per sequence, x_t (N, D);
    it is ``step_with(x_t, conv, recur)`` over the state's own tensors. ``step_with`` takes the
    conv state and reaches the matrix state through a :class:`Recurrence`, so the serving
    engine's decode (:func:`mix_paged`) updates its :class:`StatePool` slots in place through
    :class:`SlotOps` (torch index ops eagerly, mutating custom ops in the compiled step and its
    CUDA graphs: no host read, the slots a device tensor).
  * ``init_state(batch, dtype, device)`` — the zero state; :meth:`RecurrentState.nbytes` and
    ``state_bytes(dtype)`` give its size (constant in context length).
The state of a layer is a :class:`RecurrentState`: the short convolution's last W − 1 inputs
(N, C, W − 1) in the activation dtype and the SSM / fast-weight state (N, H, K, V) in float32.

Gated DeltaNet takes grouped value heads (Qwen3-Next's 16 q/k heads to 32 value heads, value
width ≠ key width allowed): q and k are repeated to the value heads before the kernels and the
decode step, so the state is (N, value heads, K, V). Simplifications: L layers have equal q/k/v
heads; Mamba-2's gated norm spans the whole inner width (one group). Exercise:
``pytest tests/test_linear_attention.py tests/test_serve_compiled_hybrid.py``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.kernels.gated_delta import gated_delta_rule, gated_delta_step
from lmforge.kernels.ssd import linear_attention, linear_attention_step, ssd
from lmforge.model.layers import Linear, RMSNorm


@dataclasses.dataclass
class RecurrentState:
    """One linear layer's decoding state for N sequences.

    conv: (N, C, W − 1) the last W − 1 inputs of the short causal convolution (oldest first), or
    None for a layer without one; ssm: (N, H, K, V) float32, the recurrent matrix state.
    """

    conv: Tensor | None
    ssm: Tensor

    def nbytes(self) -> int:
        """Bytes held for all N sequences."""
        conv = 0 if self.conv is None else self.conv.numel() * self.conv.element_size()
        return conv + self.ssm.numel() * self.ssm.element_size()


class Recurrence:
    """The matrix-state update of one decode token, as the mixers' :meth:`step_with` call it:
    ``recur(q, k, v, g, beta, scale) -> o``. q, k (N, H, K), v (N, H, V), g (N, H) log decay
    or None, beta (N, H) (the delta rule: Gated DeltaNet) or None (plain / decayed linear
    attention, Mamba-2's SSD) → o (N, H, V) in v's dtype; the state moves on as a side effect.

    This base class carries one batch's own state tensor (``ssm`` (N, H, K, V), replaced by the
    new state after each call: the reference loop). The engine's decode steps read and write
    their slots of the :class:`StatePool` instead (:class:`SlotOps`). ``dtype``: the state's,
    the precision the mixers compute the recurrence's inputs in."""

    def __init__(self, ssm: Tensor) -> None:
        self.ssm = ssm
        self.dtype = ssm.dtype

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor | None, scale: float
    ) -> Tensor:
        o, self.ssm = recurrence_step(q, k, v, g, beta, self.ssm, scale)
        return o


def recurrence_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor | None,
    state: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """One token of the recurrence (see :class:`Recurrence`): the gated delta rule with
    ``beta``, else (decayed) linear attention; their kernels' ``auto`` backend (Triton on
    CUDA). Returns (o, the new state)."""
    if beta is not None:
        assert g is not None
        return gated_delta_step(q, k, v, g, beta, state, scale=scale)
    return linear_attention_step(q, k, v, g, state, scale=scale)


# --------------------------------------------------------------------- short causal convolution
class ShortConv(nn.Module):
    """Depthwise causal 1-D convolution of width W with SiLU, over packed sequences, with state.

    ``weight`` is (C, W); tap W − 1 multiplies the current token. A sequence's first tokens see
    its conv state (the previous W − 1 inputs; zeros for a fresh sequence), never the previous
    sequence in the pack.
    """

    def __init__(self, channels: int, width: int = 4, bias: bool = False) -> None:
        super().__init__()
        self.channels, self.width = channels, width
        self.weight = nn.Parameter(torch.empty(channels, width))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform in ±1/√W, as ``nn.Conv1d`` for a depthwise kernel."""
        bound = 1.0 / math.sqrt(self.width)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: Tensor, cu: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
        """x (N_tok, C) packed tokens, cu (N + 1,) offsets, state (N, C, W − 1) or None.
        Returns (y (N_tok, C), the new state (N, C, W − 1))."""
        W, C = self.width, self.channels
        N = cu.numel() - 1
        n_tok = x.shape[0]
        lens = cu[1:] - cu[:-1]  # (N,)
        seq = torch.repeat_interleave(torch.arange(N, device=x.device), lens, output_size=n_tok)
        # Each sequence gets its W − 1 history rows in front: token t moves to t + (seq + 1)(W − 1).
        pos = torch.arange(n_tok, device=x.device) + (seq + 1) * (W - 1)  # (N_tok,)
        hist = (
            torch.zeros(N, W - 1, C, dtype=x.dtype, device=x.device)
            if state is None
            else state.transpose(1, 2).to(x.dtype)
        )  # (N, W − 1, C)
        hist_pos = (cu[:-1] + torch.arange(N, device=x.device) * (W - 1))[:, None] + torch.arange(
            W - 1, device=x.device
        )  # (N, W − 1)
        buf = x.new_empty(n_tok + N * (W - 1), C)
        buf[pos] = x
        buf[hist_pos.reshape(-1)] = hist.reshape(-1, C)
        taps = pos[:, None] - (W - 1) + torch.arange(W, device=x.device)  # (N_tok, W)
        y = (buf[taps] * self.weight.t().to(x.dtype)).sum(1)  # (N_tok, C)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        end = cu[1:] + torch.arange(1, N + 1, device=x.device) * (W - 1)  # one past each span
        new = buf[end[:, None] - (W - 1) + torch.arange(W - 1, device=x.device)]  # (N, W − 1, C)
        return F.silu(y), new.transpose(1, 2).contiguous()

    def step(self, x: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        """x (N, C) one token per sequence, state (N, C, W − 1) → (y (N, C), new state)."""
        window = torch.cat([state.to(x.dtype), x[:, :, None]], 2)  # (N, C, W)
        y = (window * self.weight.to(x.dtype)).sum(-1)  # (N, C)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return F.silu(y), window[:, :, 1:]


def _packed(x: Tensor, cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:
    """(B, T, C) → packed (B·T, C) and offsets (N + 1,) int32; a batch is N = B sequences."""
    B, T = x.shape[:2]
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch must be 1 (packed), got B = {B}")
        return x[0], cu_seqlens.to(device=x.device, dtype=torch.int32)
    cu = torch.arange(0, (B + 1) * T, T, device=x.device, dtype=torch.int32)  # (B + 1,)
    return x.reshape(B * T, -1), cu


def _log_uniform_dt_bias(n: int, dt_min: float = 1e-3, dt_max: float = 0.1) -> Tensor:
    # Mamba's init: Δ = softplus(bias) log-uniform in [dt_min, dt_max], so bias = softplus⁻¹(Δ).
    dt = torch.exp(torch.rand(n) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    return dt + torch.log(-torch.expm1(-dt))


class _StateMixer(nn.Module):
    """What the three mixers share: the zero state and its size from ``_state_dims``, and the
    Mamba-style decay parameters (``A_log``, ``dt_bias``) with their init, re-run by
    ``reset_parameters`` (a model built on the meta device materialises them uninitialised)."""

    n_heads: int

    def _state_dims(self) -> tuple[int, int]:
        """(K, V) of the per-head state matrix."""
        raise NotImplementedError

    def _decay_parameters(self, n_heads: int) -> None:
        self.A_log = nn.Parameter(torch.empty(n_heads))
        self.dt_bias = nn.Parameter(torch.empty(n_heads))
        self._reset_decay()

    def _reset_decay(self) -> None:
        # A = e^{A_log} uniform in [1, 16]; Δ = softplus(dt_bias) log-uniform in [1e-3, 0.1].
        with torch.no_grad():
            self.A_log.copy_(torch.log(torch.empty_like(self.A_log).uniform_(1, 16)))
            self.dt_bias.copy_(_log_uniform_dt_bias(self.dt_bias.numel()).to(self.dt_bias))

    def _step_size(self, raw: Tensor) -> Tensor:
        """Δ = softplus(raw + dt_bias) (…, H) float32, and the decay rates A = −e^{A_log} (H,):
        the log decay of a token is Δ·A ≤ 0."""
        return F.softplus(raw.float() + self.dt_bias.float()), -self.A_log.float().exp()

    def _convolve(
        self, x: Tensor, cu_seqlens: Tensor | None, state: RecurrentState | None
    ) -> tuple[Tensor, Tensor]:
        """The short causal convolution over (B, T, C) or packed (1, N_tok, C) inputs, continuing
        from ``state``: (the result (B, T, C), the new conv state (N, C, W − 1))."""
        flat, cu = _packed(x, cu_seqlens)  # (B·T, C)
        y, conv_state = self.conv(flat, cu, None if state is None else state.conv)
        return y.reshape(x.shape), conv_state

    def reset_parameters(self) -> None:
        """Re-initialise this module's own parameters (the projections, norms and convolution
        reset themselves)."""
        if hasattr(self, "A_log"):
            self._reset_decay()

    def init_state(
        self,
        batch: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> RecurrentState:
        """Zero state for ``batch`` fresh sequences: conv (batch, C, W − 1) in ``dtype`` (None
        without a convolution), SSM (batch, H, K, V) float32."""
        conv = None
        c = getattr(self, "conv", None)  # ShortConv, or None for a layer without one
        if c is not None:
            conv = torch.zeros(batch, c.channels, c.width - 1, dtype=dtype, device=device)
        K, V = self._state_dims()
        ssm = torch.zeros(batch, self.n_heads, K, V, dtype=torch.float32, device=device)
        return RecurrentState(conv, ssm)

    def state_bytes(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of one sequence's state (independent of its length)."""
        return self.init_state(1, dtype, "meta").nbytes()

    def step(self, x: Tensor, state: RecurrentState) -> tuple[Tensor, RecurrentState]:
        """x (N, D), one token per sequence → (y (N, D), new state): :meth:`step_with` over
        ``state``'s own tensors (the reference loop; the engine's decode steps call
        :meth:`step_with` with its slot states, :func:`mix_paged`)."""
        recur = Recurrence(state.ssm)
        y, conv = self.step_with(x, state.conv, recur)
        return y, RecurrentState(conv, recur.ssm)

    def step_with(
        self, x: Tensor, conv: Tensor | None, recur: Recurrence
    ) -> tuple[Tensor, Tensor | None]:
        """One decode token per sequence with the conv state given and the matrix state behind
        ``recur``: (y (N, D), the new conv state)."""
        raise NotImplementedError


# ------------------------------------------------------------------------------ Gated DeltaNet
def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(Σx² + eps) over the last dim: the q/k normalisation of FLA's Gated DeltaNet and
    Qwen3-Next (``F.normalize``'s x / max(‖x‖, eps) differs from it by ~eps/‖x‖² relative,
    1e-4 on near-zero post-SiLU vectors, which an imported Qwen3-Next's logits showed)."""
    return x / torch.sqrt(x.float().pow(2).sum(-1, keepdim=True) + eps).to(x.dtype)


class GatedDeltaNet(_StateMixer):
    """Gated DeltaNet token mixer (Yang et al. 2024; the layer of Qwen3-Next).

    q, k, v = SiLU(ShortConv(x W_q | x W_k | x W_v)) per head, q and k L2-normalised;
    β = σ(x W_β); g = −e^{A_log} · softplus(x W_a + dt_bias) (the log decay, ≤ 0);
    o = GatedDelta(q, k, v, g, β); y = (RMSNorm_head(o) ⊙ SiLU(x W_z)) W_o.

    Grouped value heads (Qwen3-Next's 16 q/k heads of width 128 to 32 value heads of 128):
    ``k_heads`` q/k heads of width ``head_dim`` (K), ``n_heads`` value heads of width
    ``v_head_dim`` (V), ``n_heads`` a multiple r of ``k_heads``. q/k head j serves value heads
    j·r … j·r + r − 1: q and k are repeated r times per head (``repeat_interleave``) after their
    L2 norm, so the kernels and the recurrent step see n_heads equal heads with K ≠ V allowed;
    β, the decay and the state (n_heads, K, V) are per value head, z and the output norm of
    width V. ``v_heads = v_head_dim = None``: the plain layer (r = 1, V = K).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int = 128,
        conv_size: int = 4,
        chunk_size: int = 64,
        backend: str = "auto",
        v_heads: int | None = None,
        v_head_dim: int | None = None,
    ) -> None:
        super().__init__()
        v_heads, v_head_dim = v_heads or n_heads, v_head_dim or head_dim
        if v_heads % n_heads:
            raise ValueError(f"Gated DeltaNet: {v_heads} value heads is not a multiple of the"
                             f" {n_heads} q/k heads")  # fmt: skip
        self.d_model, self.k_heads, self.head_dim = d_model, n_heads, head_dim
        self.n_heads, self.v_head_dim = v_heads, v_head_dim  # the state's heads: value heads
        self.chunk_size, self.backend = chunk_size, backend
        key, value = n_heads * head_dim, v_heads * v_head_dim
        self.q_proj = Linear(d_model, key)
        self.k_proj = Linear(d_model, key)
        self.v_proj = Linear(d_model, value)
        self.z_proj = Linear(d_model, value)
        self.b_proj = Linear(d_model, v_heads)
        self.a_proj = Linear(d_model, v_heads)
        self.conv = ShortConv(2 * key + value, conv_size)
        self._decay_parameters(v_heads)
        self.o_norm = RMSNorm(v_head_dim, eps=1e-6)
        self.o_proj = Linear(value, d_model)

    def _gates(self, x: Tensor) -> tuple[Tensor, Tensor]:
        beta = torch.sigmoid(self.b_proj(x).float())  # (..., H)
        dt, A = self._step_size(self.a_proj(x))
        g = A * dt
        return g, beta

    def _qkv(self, x: Tensor) -> Tensor:
        """x (..., D) → the conv's input q | k | v (..., 2·H_k·K + H·V)."""
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)

    def _heads(self, mixed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The conv's output (..., 2·H_k·K + H·V) → q, k (..., H, K) L2-normalised, each q/k
        head repeated for its group of value heads, and v (..., H, V)."""
        Hk, K, H = self.k_heads, self.head_dim, self.n_heads
        qk, v = mixed.split([2 * Hk * K, H * self.v_head_dim], -1)
        q, k = qk.unflatten(-1, (2, Hk, K)).unbind(-3)  # (..., H_k, K) each
        q, k = _l2norm(q), _l2norm(k)
        if H != Hk:  # grouped value heads: q/k head j serves value heads j·r … j·r + r − 1
            q, k = q.repeat_interleave(H // Hk, -2), k.repeat_interleave(H // Hk, -2)
        return q, k, v.unflatten(-1, (H, self.v_head_dim))

    def _out(self, o: Tensor, x: Tensor) -> Tensor:
        z = self.z_proj(x).unflatten(-1, (self.n_heads, self.v_head_dim))  # (..., H, V)
        o = self.o_norm(o) * F.silu(z.to(o.dtype))
        return self.o_proj(o.flatten(-2))  # (..., D)

    def forward(
        self, x: Tensor, cu_seqlens: Tensor | None = None, state: RecurrentState | None = None
    ) -> tuple[Tensor, RecurrentState]:
        """x (B, T, D) → (y (B, T, D), the state after the last token of every sequence)."""
        mixed, conv_state = self._convolve(self._qkv(x), cu_seqlens, state)
        q, k, v = self._heads(mixed)  # (B, T, H, K), (B, T, H, K), (B, T, H, V)
        g, beta = self._gates(x)  # (B, T, H)
        o, ssm = gated_delta_rule(
            q, k, v, g, beta, initial_state=None if state is None else state.ssm,
            output_final_state=True, cu_seqlens=cu_seqlens, chunk_size=self.chunk_size,
            backend=self.backend,
        )  # fmt: skip
        return self._out(o, x), RecurrentState(conv_state, ssm.float())

    def step_with(
        self, x: Tensor, conv: Tensor | None, recur: Recurrence
    ) -> tuple[Tensor, Tensor | None]:
        """x (N, D), one token per sequence, after conv state (N, C, W − 1); the recurrence
        through ``recur`` (see :class:`Recurrence`) → (y (N, D), the new conv state)."""
        mixed, conv_state = self.conv.step(self._qkv(x), conv)
        q, k, v = self._heads(mixed)  # (N, H, K), (N, H, K), (N, H, V)
        g, beta = self._gates(x)  # (N, H)
        return self._out(recur(q, k, v, g, beta, self.head_dim**-0.5), x), conv_state

    def _state_dims(self) -> tuple[int, int]:
        return self.head_dim, self.v_head_dim


# ------------------------------------------------------------------------------------- Mamba-2
class Mamba2Mixer(_StateMixer):
    """Mamba-2 mixer (Dao & Gu 2024): in-proj → [z | x B C | Δ], causal conv over x B C, SSD with
    a scalar decay per head, gated RMSNorm, out-proj.

    d_inner = expand · D split into H = d_inner / head_dim heads; B and C (d_state each) shared by
    all heads (one group); Δ = softplus(Δ_raw + dt_bias), A = −e^{A_log}; y = SSD + D ⊙ x;
    out = RMSNorm(y ⊙ SiLU(z)) W_out.
    """

    def __init__(
        self,
        d_model: int,
        d_state: int = 64,
        head_dim: int = 64,
        expand: int = 2,
        conv_size: int = 4,
        chunk_size: int = 64,
        backend: str = "auto",
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        d_inner = expand * d_model
        if d_inner % head_dim:
            raise ValueError(
                f"Mamba-2: expand·d_model = {d_inner} is not a multiple of head_dim = {head_dim}"
            )
        self.d_model, self.d_inner, self.d_state, self.head_dim = (
            d_model,
            d_inner,
            d_state,
            head_dim,
        )
        self.n_heads = d_inner // head_dim
        self.chunk_size, self.backend = chunk_size, backend
        self.conv_dim = d_inner + 2 * d_state
        self.in_proj = Linear(d_model, d_inner + self.conv_dim + self.n_heads)
        self.conv = ShortConv(self.conv_dim, conv_size, bias=True)
        self._decay_parameters(self.n_heads)
        self.D = nn.Parameter(torch.ones(self.n_heads))
        self.norm = RMSNorm(d_inner, eps=norm_eps)  # the gated norm (ModelConfig.ssm_norm_eps)
        self.out_proj = Linear(d_inner, d_model)

    def _split(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        zxbc_dt = self.in_proj(x)  # (..., d_inner + conv_dim + H)
        return zxbc_dt.split([self.d_inner, self.conv_dim, self.n_heads], -1)

    def _out(self, y: Tensor, z: Tensor) -> Tensor:
        y = self.norm(y.flatten(-2) * F.silu(z.to(y.dtype)))  # (..., d_inner)
        return self.out_proj(y)

    def forward(
        self, x: Tensor, cu_seqlens: Tensor | None = None, state: RecurrentState | None = None
    ) -> tuple[Tensor, RecurrentState]:
        """x (B, T, D) → (y (B, T, D), the state after the last token of every sequence)."""
        H, P, N = self.n_heads, self.head_dim, self.d_state
        z, xbc, dt = self._split(x)
        xbc, conv_state = self._convolve(xbc, cu_seqlens, state)
        xs, Bm, Cm = xbc.split([self.d_inner, N, N], -1)
        dt, A = self._step_size(dt)  # (B, T, H), (H,)
        y, ssm = ssd(
            xs.unflatten(-1, (H, P)), dt, A, Bm[:, :, None], Cm[:, :, None],
            D=self.D, initial_state=None if state is None else state.ssm, output_final_state=True,
            cu_seqlens=cu_seqlens, chunk_size=self.chunk_size, backend=self.backend,
        )  # fmt: skip
        return self._out(y, z), RecurrentState(conv_state, ssm.float())

    def step_with(
        self, x: Tensor, conv: Tensor | None, recur: Recurrence
    ) -> tuple[Tensor, Tensor | None]:
        """x (N, D), one token per sequence, after conv state (N, C, W − 1); the recurrence
        through ``recur`` → (y (N, D), the new conv state).

        SSD's step as linear attention (what :func:`~lmforge.kernels.ssd.ssd_step` computes):
        q = C, k = B (one group, every head), v = Δ·x, log decay Δ·A, scale 1, then + D ⊙ x;
        in the state's dtype (float32), as there."""
        H, P, N = self.n_heads, self.head_dim, self.d_state
        z, xbc, dt = self._split(x)
        xbc, conv_state = self.conv.step(xbc, conv)
        xs, Bm, Cm = xbc.split([self.d_inner, N, N], -1)
        dt, A = self._step_size(dt)  # (N, H), (H,)
        xs = xs.unflatten(-1, (H, P))  # (N, H, P)
        acc = recur.dtype
        q = Cm[:, None].expand(-1, H, -1)  # (N, H, N_s)
        k = Bm[:, None].expand(-1, H, -1)  # (N, H, N_s)
        v = xs.to(acc) * dt.to(acc)[..., None]  # (N, H, P)
        y = recur(q, k, v, dt.to(acc) * A.to(acc), None, 1.0)  # (N, H, P)
        y = y + self.D.to(acc)[:, None] * xs.to(acc)
        return self._out(y.to(x.dtype), z), conv_state

    def reset_parameters(self) -> None:
        """Decay parameters as Mamba-2 initialises them; the skip D at ones."""
        super().reset_parameters()
        with torch.no_grad():
            self.D.fill_(1.0)

    def _state_dims(self) -> tuple[int, int]:
        return self.d_state, self.head_dim


# --------------------------------------------------------------------- plain linear attention
class LinearAttention(_StateMixer):
    """Linear attention with the identity feature map: S_t = γ S_{t−1} + k_t v_tᵀ, o_t = S_tᵀ q_t/√E,
    per-head output RMSNorm (RetNet's group norm), then W_o.

    ``decay=True`` gives RetNet's fixed per-head decays γ_h = 1 − 2^{−5−h}; ``decay=False`` the
    undecayed sum (the special case g = 0 of the decayed kernel).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int = 64,
        decay: bool = True,
        chunk_size: int = 64,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.decay, self.chunk_size, self.backend = decay, chunk_size, backend
        inner = n_heads * head_dim
        self.q_proj = Linear(d_model, inner)
        self.k_proj = Linear(d_model, inner)
        self.v_proj = Linear(d_model, inner)
        self.o_norm = RMSNorm(head_dim, eps=1e-6)
        self.o_proj = Linear(inner, d_model)

    def log_decay(self, device: torch.device | None = None) -> Tensor | None:
        """(H,) float32 log γ_h, or None without decay."""
        if not self.decay:
            return None
        h = torch.arange(self.n_heads, device=device, dtype=torch.float32)
        return torch.log1p(-torch.exp2(-5.0 - h))

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        shape = (self.n_heads, self.head_dim)
        return tuple(p(x).unflatten(-1, shape) for p in (self.q_proj, self.k_proj, self.v_proj))

    def forward(
        self, x: Tensor, cu_seqlens: Tensor | None = None, state: RecurrentState | None = None
    ) -> tuple[Tensor, RecurrentState]:
        """x (B, T, D) → (y (B, T, D), the state after the last token of every sequence)."""
        q, k, v = self._qkv(x)  # (B, T, H, E)
        ld = self.log_decay(x.device)
        g = None if ld is None else ld.expand(*x.shape[:2], -1)  # (B, T, H)
        o, ssm = linear_attention(
            q, k, v, g, scale=self.head_dim**-0.5,
            initial_state=None if state is None else state.ssm, output_final_state=True,
            cu_seqlens=cu_seqlens, chunk_size=self.chunk_size, backend=self.backend,
        )  # fmt: skip
        return self.o_proj(self.o_norm(o).flatten(-2)), RecurrentState(None, ssm.float())

    def step_with(
        self, x: Tensor, conv: Tensor | None, recur: Recurrence
    ) -> tuple[Tensor, Tensor | None]:
        """x (N, D), one token per sequence (no conv state: ``conv`` is None); the recurrence
        through ``recur`` → (y (N, D), None)."""
        q, k, v = self._qkv(x)  # (N, H, E)
        ld = self.log_decay(x.device)
        g = None if ld is None else ld.expand(x.shape[0], -1)  # (N, H)
        o = recur(q, k, v, g, None, self.head_dim**-0.5)  # (N, H, E)
        return self.o_proj(self.o_norm(o).flatten(-2)), None

    def _state_dims(self) -> tuple[int, int]:
        return self.head_dim, self.head_dim


# ------------------------------------------------------------------- serving: states per slot
class StatePool:
    """The engine's recurrent states: a fixed number of slots per linear layer, sized at start.

    Layout: for every linear layer l (its block index), ``conv[l]`` (NS + 1, C, W − 1) in the
    activation dtype (absent for a layer without a convolution) and ``ssm[l]`` (NS + 1, H, K, V)
    float32, NS = ``num_slots``. A sequence holds one slot from admission to finish, abort or
    preemption (the scheduler's :class:`~lmforge.serve.scheduler.Scheduler` hands out slots
    0..NS − 1); a slot is zeroed when its sequence (re)starts at token 0. Row NS,
    :attr:`scratch_slot`, is never handed out: the padding rows of a CUDA graph and the
    compiled step's warm-up write there (as their KV goes to the cache's scratch block). Size
    per sequence is constant in its length (:meth:`bytes_per_slot`).

    Rings (``ring``: a pattern with W layers beside A/S layers,
    :func:`~lmforge.model.kv_cache.window_ring`): the W layers' keys and values, ``ring_k`` /
    ``ring_v`` (L_W, (NS + 1)·R, BS, K, E), slot s owning blocks s·R … s·R + R − 1. Position p
    of a sequence goes to its block s·R + (p // BS) mod R: the sequence's block table is that
    cycle (:meth:`ring_context`), so the paged window kernels read it unchanged, and R =
    ceil((chunk + window − 1) / BS) + 1 blocks hold every key a step's queries can see
    (``chunk``: the most tokens of one sequence in a step), whatever the sequence's length (or
    every block of the context where that is fewer: then nothing wraps).
    """

    def __init__(
        self,
        mixers: dict[int, nn.Module],
        num_slots: int,
        device: torch.device,
        dtype: torch.dtype,
        ring: tuple[int, int, int, int, int] | None = None,
    ) -> None:
        """``ring``: (W layers, blocks R per slot, block size BS, kv-heads K, head dim E)."""
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.conv: dict[int, Tensor] = {}
        self.ssm: dict[int, Tensor] = {}
        for layer, mixer in mixers.items():
            st = mixer.init_state(num_slots + 1, dtype, device)
            if st.conv is not None:
                self.conv[layer] = st.conv
            self.ssm[layer] = st.ssm
        self.ring_k = self.ring_v = None
        self.ring_blocks = 0
        if ring is not None:
            n_w, self.ring_blocks, bs, kv, e = ring
            shape = (n_w, (num_slots + 1) * self.ring_blocks, bs, kv, e)
            self.ring_k = torch.zeros(shape, device=device, dtype=dtype)
            self.ring_v = torch.zeros(shape, device=device, dtype=dtype)

    def bytes_per_slot(self) -> int:
        """Bytes of one sequence's states across all linear layers (and W layers' rings)."""
        total = sum(t[0].numel() * t.element_size() for t in self.conv.values())
        if self.ring_k is not None:
            total += 2 * self.ring_k[:, : self.ring_blocks].numel() * self.ring_k.element_size()
        return total + sum(t[0].numel() * t.element_size() for t in self.ssm.values())

    def ring_context(self, ctx: Any, slots: Tensor) -> Any:
        """``ctx`` (a :class:`~lmforge.model.context.Context`) as the W layers see it: their
        rings as the pages, each sequence's block table the cycle of its slot's R blocks (as
        wide as ``ctx``'s), its tokens' slots in that cycle. ``slots`` (S,) long: the step's
        state slots. Device ops only in a decode step (a compiled step or CUDA graph runs it);
        other steps read their token positions from the host lists."""
        assert self.ring_k is not None
        r, bs = self.ring_blocks, self.ring_k.shape[2]
        dev = slots.device
        width = ctx.block_tables.shape[1]
        tables = (slots[:, None] * r + torch.arange(width, device=dev) % r).to(torch.int32)
        if ctx.decode:
            tok_slots, pos = slots, ctx.ctx_lens.long() - 1  # (S,): one token per sequence
        else:
            q_lens, ends = list(ctx.q_lens), list(ctx.ctx_lens_list)
            tok_slots = torch.repeat_interleave(slots, torch.tensor(q_lens, device=dev))
            pos = torch.tensor(
                [p for n, end in zip(q_lens, ends, strict=True) for p in range(end - n, end)],
                device=dev,
            )  # (N,)
        flat = (tok_slots * r + (pos // bs) % r) * bs + pos % bs
        # (the prefill plan's tiles depend on the lengths only: it is kept)
        return dataclasses.replace(
            ctx, slots=flat, block_tables=tables, tables_list=None, k_cache=self.ring_k,
            v_cache=self.ring_v, ring=None,
        )  # fmt: skip

    def reset(self, slots: Tensor) -> None:
        """Zero the states of ``slots`` (long (n,)): their sequences start from token 0."""
        for t in (*self.conv.values(), *self.ssm.values()):
            t.index_fill_(0, slots, 0)

    def read(self, layer: int, slots: Tensor) -> RecurrentState:
        """Layer ``layer``'s states of ``slots`` (S,) as one batch of S sequences (copies)."""
        conv = self.conv.get(layer)
        return RecurrentState(None if conv is None else conv[slots], self.ssm[layer][slots])

    def write(self, layer: int, slots: Tensor, state: RecurrentState) -> None:
        """Store ``state`` (S sequences) back into ``slots``."""
        if state.conv is not None:
            self.conv[layer].index_copy_(0, slots, state.conv.to(self.conv[layer].dtype))
        self.ssm[layer].index_copy_(0, slots, state.ssm.float())


class SlotOps:
    """How a decode step's linear layers reach their slots of the :class:`StatePool`: the
    recurrence over the matrix states (read, update, write back) and the conv states' write.
    These are torch index ops (the eager step); the engine's compiled decode step
    (:mod:`lmforge.serve.compiled`) makes each one opaque mutating custom op, so the pool is
    updated in place (no functional copy of it) and a CUDA graph replays the slot indices from
    its static buffer."""

    def recur(
        self,
        pool: Tensor,
        slots: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor | None,
        beta: Tensor | None,
        scale: float,
    ) -> Tensor:
        """:func:`slot_recurrence`."""
        return slot_recurrence(pool, slots, q, k, v, g, beta, scale)

    def write_rows(self, pool: Tensor, slots: Tensor, rows: Tensor) -> None:
        """pool[slots] = rows (in the pool's dtype)."""
        pool.index_copy_(0, slots, rows.to(pool.dtype))


def slot_recurrence(
    pool: Tensor,
    slots: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor | None,
    scale: float,
) -> Tensor:
    """One token of :func:`recurrence_step` for S sequences whose matrix states are rows
    ``slots`` (S,) of ``pool`` (NS + 1, H, K, V): read, update, written back -> o (S, H, V)."""
    o, new = recurrence_step(q, k, v, g, beta, pool[slots], scale)
    pool.index_copy_(0, slots, new.to(pool.dtype))
    return o


class _SlotRecurrence(Recurrence):
    """:class:`Recurrence` over a step's slots of one layer's pool, through ``ops``."""

    def __init__(self, ops: SlotOps, pool: Tensor, slots: Tensor) -> None:
        self.ops, self.pool, self.slots = ops, pool, slots
        self.dtype = pool.dtype

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor | None, scale: float
    ) -> Tensor:
        return self.ops.recur(self.pool, self.slots, q, k, v, g, beta, scale)


@dataclasses.dataclass
class StepStates:
    """An engine step's view of the :class:`StatePool`: the slot of each of its S sequences.

    Read by :func:`mix_paged` through ``Context.states``."""

    pool: StatePool
    slots: Tensor
    "(S,) long state slot of each sequence of the step, in step order"
    ops: SlotOps = dataclasses.field(default_factory=SlotOps)
    "how decode steps read and write the slots (the compiled step's custom ops, or torch's)"


def mix_paged(
    mixer: nn.Module, layer: int, x: Tensor, states: StepStates, q_lens: list[int] | None
) -> Tensor:
    """A linear mixer over one engine step's flat tokens x (1, N, D) -> (1, N, D).

    Decode steps (one token per sequence, ``q_lens`` None or all 1) run the mixer's
    ``step_with`` on the slots' conv states, the recurrence reading and writing the slots'
    matrix states through ``states.ops`` (no host read: the slots are a device tensor, so a
    compiled or graph-captured step replays them); other steps (prefill chunks, mixed with
    decodes) run its chunked ``forward`` over the packed sequences (``cu_seqlens`` from
    ``q_lens``), each starting from its slot's state. The final states go back to the slots,
    so the next chunk or token continues from them."""
    pool, slots = states.pool, states.slots
    if q_lens is None or all(n == 1 for n in q_lens):
        conv_pool = pool.conv.get(layer)
        conv = None if conv_pool is None else conv_pool[slots]  # (S, C, W − 1)
        recur = _SlotRecurrence(states.ops, pool.ssm[layer], slots)
        y, new_conv = mixer.step_with(x[0], conv, recur)  # (S, D)
        if conv_pool is not None:
            states.ops.write_rows(conv_pool, slots, new_conv)
        return y[None]  # (1, S, D) = (1, N, D)
    cu = torch.tensor([0, *q_lens], device=x.device).cumsum(0).to(torch.int32)  # (S + 1,)
    y, new = mixer(x, cu, pool.read(layer, slots))  # (1, N, D)
    pool.write(layer, slots, new)
    return y


def mix_cached(
    mixer: nn.Module, state: RecurrentState, x: Tensor, valid: Tensor
) -> tuple[Tensor, RecurrentState]:
    """A linear mixer in the reference decoding loop (``lmforge.generate``'s contiguous cache).

    x (B, T, D) with ``valid`` (B, T) bool (False: left padding or a finished row's filler):
    only valid tokens enter the recurrence, in order, continuing each row's ``state``; padding
    outputs are zero (nothing reads them). Returns (y (B, T, D), the new state)."""
    B, T, D = x.shape
    if T == 1:  # one token per row: step all rows, keep the old state where it was padding
        y, new = mixer.step(x[:, 0], state)  # (B, D)
        keep = valid[:, 0]
        ssm = torch.where(keep[:, None, None, None], new.ssm, state.ssm)
        conv = None
        if new.conv is not None:
            conv = torch.where(keep[:, None, None], new.conv.to(state.conv.dtype), state.conv)
        return (y * keep[:, None].to(y.dtype))[:, None], RecurrentState(conv, ssm)
    counts = valid.sum(1)  # (B,)
    rows = (counts > 0).nonzero().flatten()  # rows with at least one real token
    cu = torch.cat([counts.new_zeros(1), counts[rows].cumsum(0)]).to(torch.int32)  # (R + 1,)
    packed = x[valid][None]  # (1, N_tok, D) row-major: each row's real tokens in order
    conv = None if state.conv is None else state.conv[rows]
    y_p, new = mixer(packed, cu, RecurrentState(conv, state.ssm[rows]))  # (1, N_tok, D)
    y = x.new_zeros(B, T, D)
    y[valid] = y_p[0].to(y.dtype)
    ssm = state.ssm.clone()
    ssm[rows] = new.ssm.float()
    if state.conv is not None:
        conv = state.conv.clone()
        conv[rows] = new.conv.to(conv.dtype)
    return y, RecurrentState(conv, ssm)
