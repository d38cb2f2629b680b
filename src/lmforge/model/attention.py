"""Softmax self-attention: :class:`CausalSelfAttention` (grouped-query heads, QK-norm, RoPE or
MRoPE, sliding windows), the block's attention for the A and W letters of ``model.layers``
and the base of DSA's sparse attention (:mod:`lmforge.model.sparse_attention`).

Its own module so that the mixers built on it and :func:`lmforge.model.transformer.token_mixer`,
which builds them, import it without importing each other. Shape legend as in
:mod:`lmforge.model.layers`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.kernels import (
    flash_attention,
    flash_supported,
    rms_norm,
    rms_norm_supported,
    rope,
    rope_packed,
)
from lmforge.model import mup
from lmforge.model.config import ModelConfig
from lmforge.model.context import Context
from lmforge.model.kv_cache import KVCache
from lmforge.model.layers import (
    Linear,
    RMSNorm,
    RotaryEmbedding,
    _bare,
    _cat_weights,
    _fusable,
    project,
    scaled_dot_product_attention,
)
from lmforge.utils.errors import LmforgeError

__all__ = [
    "CausalSelfAttention",
    "PartialRotaryEmbedding",
    "sliding_window_mask",
]


def _kernel_runs_on(x: torch.Tensor) -> bool:
    """Whether a Triton kernel takes input x: a CUDA tensor (or the CPU interpreter under
    ``TRITON_INTERPRET=1``) whose matmul-output dtype (autocast's for an fp32 x under autocast)
    is fp16/bf16/fp32."""
    from lmforge.kernels._common import interpreting

    dtype = x.dtype
    if torch.is_autocast_enabled(x.device.type) and dtype == torch.float32:
        dtype = torch.get_autocast_dtype(x.device.type)
    fits = dtype in (torch.float16, torch.bfloat16, torch.float32)
    return fits and (x.is_cuda or interpreting())


def _linear(m: nn.Module, x: torch.Tensor, context: Context | None) -> torch.Tensor:
    """``m(x)``, on the step's own matmul kernel (the decode GEMV) where the context has one
    and m has no hooks (skipping its ``__call__`` changes nothing): a plain Linear's weight, or
    another linear (a quantized one) handed to the step whole."""
    if context is not None:
        if _fusable(m):
            y = context.ops.matmul(x, m.weight)
        else:
            y = context.ops.module_matmul(m, x) if _bare(m) else None
        if y is not None:
            return y
    return m(x)


def _packed_matmul(x: torch.Tensor, w: torch.Tensor, context: Context) -> torch.Tensor:
    """x @ wᵀ for a packed weight (several projections' rows in one tensor)."""
    y = context.ops.matmul(x, w)
    return project(x, w) if y is None else y


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


class _Norm(RMSNorm):
    """RMSNorm with a selectable backend: the reference math or lmforge's fused Triton kernel."""

    def __init__(self, d_model: int, eps: float, backend: str = "reference") -> None:
        super().__init__(d_model, eps)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., D)."""
        if self.backend == "triton" and rms_norm_supported(x, self.weight):
            # Under autocast the norm's consumers are matmuls that would cast its output to the
            # autocast dtype anyway: the kernel writes that dtype directly (one bf16 write
            # instead of an fp32 write, a read and a bf16 write). Values are identical.
            out_dtype = None
            if x.dtype == torch.float32 and torch.is_autocast_enabled(x.device.type):
                out_dtype = torch.get_autocast_dtype(x.device.type)
            return rms_norm(x, self.weight, self.eps, out_dtype)
        return super().forward(x)


class CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention with grouped-query heads, optional QK-norm and RoPE.

    ``q_proj`` maps D -> H·E, ``k_proj``/``v_proj`` map D -> K·E (K = ``n_kv_heads`` ≤ H, query
    head h reads kv-head h // (H/K)), ``output_proj`` maps H·E -> D. QK-norm (when enabled) is an
    RMSNorm over each head vector with one E-sized gain shared by all heads, applied before RoPE.

    Cross-layer KV sharing (``kv_share_every`` k > 1, :mod:`lmforge.model.cla`): a consumer
    (``produces_kv`` False) has no ``k_proj``/``v_proj``/``k_norm``; it attends with the keys
    (after QK-norm and RoPE) and values of its producer, layer ``layer_idx − layer_idx mod k``:
    in training those the producer returned (``shared``, through :class:`TransformerBlock`),
    with a cache the producer's cache layer ``kv_index`` / pages ``cache_index``, which it
    reads and never writes.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int = 0,
        window: int | None = None,
        *,
        produces_kv: bool = True,
        kv_index: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.window = window  # sliding window: each query sees itself and window − 1 earlier keys
        self.produces_kv = produces_kv
        # the contiguous KVCache's layer (the producer's under CLA, else layer_idx)
        self.kv_index = layer_idx if kv_index is None else kv_index
        # the engine's paged cache holds K/V layers only: this layer's page index there (a W
        # layer beside A/S layers: its index among the W layers' rings, ``ring`` True)
        self.cache_index = self.kv_index
        self.ring = False
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        # a plain int: a derived head_dim is an int subclass (config._DerivedHeadDim), which
        # torch 2.11's Dynamo cannot pass to view() and broke the compiled model at every layer
        self.head_dim = int(config.head_dim)
        d, e = config.d_model, self.head_dim
        self.q_proj = Linear(d, self.n_heads * e)
        if produces_kv:  # a CLA consumer reads its producer's K/V
            self.k_proj = Linear(d, self.n_kv_heads * e)
            self.v_proj = Linear(d, self.n_kv_heads * e)
        self.output_proj = Linear(self.n_heads * e, d)
        if config.attn_output_gate:  # Qwen3-Next: output × σ(x W_gate) before output_proj
            self.gate_proj = Linear(d, self.n_heads * e)
        if config.qk_norm:
            self.q_norm = _Norm(e, config.norm_eps, config.norm)
            if produces_kv:
                self.k_norm = _Norm(e, config.norm_eps, config.norm)
        scaling = None
        if config.rope_scaling == "llama3":
            scaling = (
                config.rope_scaling_factor,
                config.rope_low_freq_factor,
                config.rope_high_freq_factor,
                config.rope_original_context,
            )
        if config.rotary_dim is not None and config.rotary_dim < e:
            self.rope: RotaryEmbedding = PartialRotaryEmbedding(
                config.rope_theta, e, config.context_length, config.rotary_dim, scaling
            )
        else:
            self.rope = RotaryEmbedding(
                config.rope_theta,
                e,
                config.context_length,
                llama3_scaling=scaling,
                mrope_sections=config.mrope_sections,
            )
        self.rope_backend = config.rope
        self.backend = config.attention
        self._sdpa_gqa = _torch_version() >= (2, 5)

    def forward(
        self,
        x: torch.Tensor,
        token_positions: torch.Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        context: Context | None = None,
        shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """(B, T, D) -> (B, T, D). ``token_positions`` is (T,) or (B, T); default 0..T-1; with
        MRoPE (``config.mrope_sections``) also (3, B, T), a 3-vector position per token.

        With a paged ``context`` (an engine step, B = 1, T = the step's N flat tokens) the
        positions are the context's and the keys/values go to its pages; everything up to the
        attention core (projections, QK-norm, RoPE, muP's q scale) is the same code. A CLA
        consumer without a context takes its producer's K/V as ``shared`` (see
        :meth:`attend_shared`)."""
        return self.attend_shared(x, token_positions, shared, kv_cache=kv_cache,
                                  context=context)[0]  # fmt: skip

    def attend_shared(
        self,
        x: torch.Tensor,
        token_positions: torch.Tensor | None,
        shared: tuple[torch.Tensor, torch.Tensor] | None,
        *,
        kv_cache: KVCache | None = None,
        context: Context | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """:meth:`forward`, also returning the keys and values (B, K, S, E) each (keys after
        QK-norm and RoPE) the layer attended with: its own (a producer; with a cache, every
        filled slot) or ``shared`` (a CLA consumer, which computes queries only). What
        :class:`~lmforge.model.transformer.TransformerBlock` hands from a producer to the next
        k − 1 layers; None in an engine step (a consumer reads its producer's pages there)."""
        b, t, _ = x.shape
        h, e = self.n_heads, self.head_dim
        if context is not None:
            o = None  # a fused kernel has no window: W layers take the masked path below
            if self.window is None:
                o = context.ops.fused_attention(self, x.view(t, -1), context)  # (N, H, E)
            if o is not None:
                o = self._gated(o.reshape(b, t, h * e), x, context)  # (1, N, H·E)
                return _linear(self.output_proj, o, context), None  # (1, N, D)
            token_positions = context.positions
        q, k, v = self._project(x, token_positions, kv_cache, context)  # (B, H|K, T, E)
        if context is not None:  # the step's flat tokens: (1, H|K, N, E) -> (N, H|K, E)
            q = q[0].transpose(0, 1)
            if k is not None and v is not None:
                k, v = k[0].transpose(0, 1), v[0].transpose(0, 1)
            if self.window is not None:  # the pages' keys within the window (torch path)
                wctx = context
                if self.ring:  # this layer's K/V live in per-sequence rings (StatePool)
                    if context.ring is None:
                        raise LmforgeError(
                            f"layer {self.layer_idx} (W beside A/S layers) keeps its keys in "
                            "per-sequence rings: the step context has none"
                        )
                    wctx = context.ring
                out = context.ops.attend_window(self.cache_index, q, k, v, wctx, self.window)
            else:  # a CLA consumer (k, v None) reads its producer's pages, writes none
                out = context.ops.attend(self.cache_index, q, k, v, context)  # (N, H, E)
            out = self._gated(out.reshape(b, t, h * e), x, context)  # (1, N, H·E)
            return _linear(self.output_proj, out, context), None  # (1, N, D)
        if k is None or v is None:  # a CLA consumer: its producer's keys/values
            if shared is None:
                src = self.layer_idx - self.layer_idx % self.config.kv_share_every
                raise LmforgeError(
                    f"layer {self.layer_idx} attends with layer {src}'s keys/values (model."
                    "kv_share_every > 1): pass them as shared, or run TransformerLM.forward"
                )
            k, v = shared
        elif kv_cache is not None:
            k, v = kv_cache.update(self.kv_index, k, v)  # (B, K, S', E)
        if kv_cache is None:
            out = self._causal(q, k, v)  # (B, H, T, E)
        else:
            mask = kv_cache.mask if self.window is None else kv_cache.window_mask(self.window)
            out = self._masked(q, k, v, mask)  # (B, H, T, E)
        out = out.transpose(1, 2).reshape(b, t, h * e)  # (B, T, H·E)
        return self.output_proj(self._gated(out, x, None)), (k, v)  # (B, T, D)

    def _project(
        self,
        x: torch.Tensor,
        token_positions: torch.Tensor | None,
        kv_cache: KVCache | None,
        context: Context | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """x (B, T, D) -> q (B, H, T, E) and k, v (B, K, T, E) (None for a CLA consumer):
        projections, QK-norm, RoPE (or MRoPE) and muP's q scale."""
        b, t, _ = x.shape
        h, k_heads, e = self.n_heads, self.n_kv_heads, self.head_dim
        fused_rope = self._use_fused_rope(x, token_positions, kv_cache)
        k: torch.Tensor | None
        v: torch.Tensor | None
        if fused_rope and self._use_packed_rope():
            # q and k as one GEMM; one launch rotates them out of its (B, T, (H+K)·E) output.
            w = _cat_weights([self.q_proj.weight, self.k_proj.weight])  # ((H+K)·E, D)
            cos, sin = self.rope.cos[:t], self.rope.sin[:t]  # (T, E/2)
            q, k = rope_packed(project(x, w), cos, sin, h, k_heads)
            v = self.v_proj(x).view(b, t, k_heads, e)  # (B, T, K, E)
        else:
            q, k, v = self._qkv(x, context)  # (B, T, H·E|K·E|K·E); k, v None for a consumer
            q = q.view(b, t, h, e)  # (B, T, H, E)
            if k is not None and v is not None:
                k = k.view(b, t, k_heads, e)  # (B, T, K, E)
                v = v.view(b, t, k_heads, e)  # (B, T, K, E)
            if self.config.qk_norm:
                q = self.q_norm(q)
                k = None if k is None else self.k_norm(k)
            if fused_rope:  # positions 0..T-1, rotated in the (B, T, H|K, E) layout: no copy
                cos, sin = self.rope.cos[:t], self.rope.sin[:t]  # (T, E/2)
                q = rope(q, cos, sin, seq_dim=-3)
                k = None if k is None else rope(k, cos, sin, seq_dim=-3)
        q = q.transpose(1, 2)  # (B, H, T, E)
        if k is not None and v is not None:
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, K, T, E)
        if not fused_rope:
            if token_positions is None:
                token_positions = torch.arange(t, device=x.device)  # (T,)
            if token_positions.dim() == 3:  # MRoPE (3, B, T): each section its own component
                pos3 = token_positions[:, :, None, :]  # (3, B, 1, T) broadcasts over heads
                q = self.rope.rotate_3d(q, pos3)
                k = None if k is None else self.rope.rotate_3d(k, pos3)
            else:
                if token_positions.dim() == 2:
                    token_positions = token_positions[:, None, :]  # (B, 1, T): over heads
                q = self.rope(q, token_positions)
                k = None if k is None else self.rope(k, token_positions)
        if self.config.mup:  # muP's 1/E attention: q carries sqrt(E_base/E) on top of 1/sqrt(E)
            q = q * mup.q_scale(self.config)
        return q, k, v

    def _gated(self, out: torch.Tensor, x: torch.Tensor, context: Context | None) -> torch.Tensor:
        """Qwen3-Next's output gate (``config.attn_output_gate``): out (B, T, H·E) ⊙ σ(x W_gate);
        out unchanged without it."""
        if not self.config.attn_output_gate:
            return out
        return out * torch.sigmoid(_linear(self.gate_proj, x, context)).to(out.dtype)

    def _qkv(
        self, x: torch.Tensor, context: Context | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """q, k, v projections of x (…, D): (…, H·E), (…, K·E), (…, K·E) (k, v None for a CLA
        consumer); in an engine step one matmul against its packed q/k/v weights where it has
        them."""
        if not self.produces_kv:
            return _linear(self.q_proj, x, context), None, None
        if context is not None:
            w = context.ops.packed(self.layer_idx)[0]
            q_proj, k_proj, v_proj = self.q_proj, self.k_proj, self.v_proj
            qkv = None
            if isinstance(w, torch.Tensor) and _fusable(q_proj, k_proj, v_proj):
                qkv = _packed_matmul(x, w, context)  # (…, (H+2K)·E)
            elif isinstance(w, nn.Module) and _bare(q_proj) and _bare(k_proj) and _bare(v_proj):
                qkv = _linear(w, x, context)  # quantized q/k/v stacked into one module
            if qkv is not None:
                e, k_dim = self.head_dim, self.n_kv_heads * self.head_dim
                q, k, v = qkv.split([self.n_heads * e, k_dim, k_dim], dim=-1)
                return q, k, v
            return (
                _linear(q_proj, x, context),
                _linear(k_proj, x, context),
                _linear(v_proj, x, context),
            )
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def _use_fused_rope(
        self, x: torch.Tensor, token_positions: torch.Tensor | None, kv_cache: KVCache | None
    ) -> bool:
        # The kernels rotate positions 0..T-1 only, in the projections' (B, T, H, E) layout.
        return (
            self.rope_backend in ("triton", "packed")
            and token_positions is None
            and kv_cache is None  # (a paged context sets token_positions)
            and _kernel_runs_on(x)
        )

    def _use_packed_rope(self) -> bool:
        # q and k from one GEMM unless QK-norm sits between projection and rotation or the two
        # modules cannot be merged (hooks, dtypes).
        return (
            self.rope_backend == "packed"
            and self.produces_kv
            and not self.config.qk_norm
            and _fusable(self.q_proj, self.k_proj)
        )

    def _repeat_kv(self, kv: torch.Tensor) -> torch.Tensor:
        """(B, K, S, E) -> (B, H, S, E): each kv-head serves H/K consecutive query heads."""
        groups = self.n_heads // self.n_kv_heads
        return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = q.shape[-2]
        if self.window is not None and self.window < t:
            # lmforge's flash kernel skips the tiles outside the window (torch's SDPA has no
            # window: under it a W layer would cost full attention); where the kernel does not
            # run (CPU) or the backend is the reference, an explicit (T, T) mask
            if self.backend != "reference" and flash_supported(q, k, v):
                return flash_attention(q, k, v, is_causal=True, window=self.window)
            return self._masked(q, k, v, sliding_window_mask(t, self.window, q.device))
        if self.backend == "flash" and flash_supported(q, k, v):
            return flash_attention(q, k, v, is_causal=True)
        if self.backend != "reference":
            return self._sdpa(q, k, v, None)
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()  # (T, T)
        return scaled_dot_product_attention(q, self._repeat_kv(k), self._repeat_kv(v), mask)

    def _masked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        if self.backend == "reference":
            return scaled_dot_product_attention(q, self._repeat_kv(k), self._repeat_kv(v), mask)
        return self._sdpa(q, k, v, mask)

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        gqa = self.n_kv_heads != self.n_heads
        kwargs: dict[str, Any] = {}
        if gqa and self._sdpa_gqa:
            kwargs["enable_gqa"] = True
        elif gqa:
            k, v = self._repeat_kv(k), self._repeat_kv(v)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)


class PartialRotaryEmbedding(RotaryEmbedding):
    """RoPE on the first ``rotary_dim`` dims R of each head only (``ModelConfig.rotary_dim``;
    GPT-NeoX's, Bamba's and Qwen3-Next's "partial rotary").

    Pairs i < R/2 turn at θ^(−2i/R) (llama3 scaling applies to those), the other pairs get
    frequency 0 (cos 1, sin 0): the tables keep their (T, E/2) shape, so every RoPE path that
    reads them (the reference, the Triton kernels, the engine's) passes those dims through
    unchanged with no code of its own.
    """

    def __init__(
        self,
        theta: float,
        d_k: int,
        max_seq_len: int,
        rotary_dim: int,
        llama3_scaling: tuple[float, float, float, int] | None = None,
    ) -> None:
        if rotary_dim % 2 or not 2 <= rotary_dim <= d_k:
            raise ValueError(f"rotary_dim must be even and in [2, {d_k}], got {rotary_dim}")
        self.rotary_dim = rotary_dim  # read by reset_parameters, which __init__ calls
        super().__init__(theta, d_k, max_seq_len, llama3_scaling=llama3_scaling)

    def reset_parameters(self) -> None:
        """(Re)compute the tables: R/2 rotating pairs, then identity pairs."""
        device = self.cos.device
        if device.type == "meta":
            return
        r2 = self.rotary_dim // 2
        rot = RotaryEmbedding(self.theta, self.rotary_dim, self.max_seq_len, device,
                              self.llama3_scaling)  # fmt: skip
        with torch.no_grad():
            self.cos[:, :r2], self.sin[:, :r2] = rot.cos, rot.sin  # (T, R/2)
            self.cos[:, r2:], self.sin[:, r2:] = 1.0, 0.0  # (T, E/2 − R/2): no rotation


def sliding_window_mask(t: int, window: int, device: torch.device | None = None) -> torch.Tensor:
    """(T, T) bool, True where query i may attend key j: j ≤ i and i − j < ``window``."""
    i = torch.arange(t, device=device)
    d = i[:, None] - i[None, :]  # (T, T) query minus key position
    return (d >= 0) & (d < window)
