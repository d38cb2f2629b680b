"""The decoder-only Transformer LM: GQA attention with RoPE, pre-norm blocks, SwiGLU, RMSNorm.

Single-device code. Kernels, ``torch.compile``, activation checkpointing and parallelism are applied
from outside: every block is a self-contained module called as ``block(x, token_positions)`` that
takes and returns tensors only, so a wrapper can replace ``model.layers[i]``.

Shape legend: B batch, T sequence, S key/value slots, D model dim, H query heads, K kv-heads,
E head dim, V vocab, F ffn dim.

Attention backends (``ModelConfig.attention``):

- ``reference``: :func:`lmforge.model.scaled_dot_product_attention` with an explicit causal mask
  (K/V heads repeated for GQA);
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``, with
  ``enable_gqa`` on torch ≥ 2.5 (K/V repeated before that);
- ``cudnn``: the same SDPA call with cuDNN's fused attention put first in torch's backend order
  (``torch.nn.attention.sdpa_kernel(..., set_priority=True)``); where cuDNN does not take the
  input (CPU, a layout or head dim it lacks) torch picks its next backend as ``sdpa`` would;
- ``flash``: ``lmforge.kernels.flash_attention(q, k, v, is_causal=True)`` (lmforge's Triton
  FlashAttention), resolved when the model is built;
- ``auto``: ``flash`` when ``lmforge.kernels.flash_supported(q, k, v)`` says so, else ``sdpa``.

With a :class:`~lmforge.model.KVCache` every backend but ``reference`` uses torch SDPA with the
cache's boolean mask (prefill of padded prompts and one-token decode are both just masked
attention over the filled slots).

RoPE backends (``ModelConfig.rope``): ``reference`` (:class:`lmforge.model.RotaryEmbedding`),
``triton`` (``lmforge.kernels.rope`` on q and k as the projections lay them out, (B, T, H, E),
before the head transpose; used when positions are 0..T-1 and there is no KV cache), ``packed``
(q and k from one matmul against ``cat([Wq, Wk])``, rotated by ``lmforge.kernels.rope_packed``
in one launch into separate q and k, its backward writing that matmul's gradient directly;
``triton`` where the projections cannot be fused or QK-norm sits between them and RoPE),
``auto`` (``packed`` on CUDA).

RMSNorm backends (``ModelConfig.norm``): ``reference`` (:class:`lmforge.model.RMSNorm`),
``triton`` (``lmforge.kernels.rms_norm``), ``auto`` (the kernel where
``lmforge.kernels.rms_norm_supported`` accepts the input, i.e. on CUDA; else the reference).

Exercised by ``pytest tests/test_model.py`` (and ``pytest -m gpu tests/test_model.py`` for the
Triton backends).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.model import mup
from lmforge.model.config import ModelConfig
from lmforge.model.kv_cache import KVCache
from lmforge.model.layers import (
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    _cat_weights,
    _fusable,
    _trunc_normal_,
    project,
    scaled_dot_product_attention,
)
from lmforge.utils.errors import LmforgeError


def _kernel(name: str) -> Callable[..., Any] | None:
    """``lmforge.kernels.<name>`` or None when the kernels package does not provide it."""
    try:
        module = importlib.import_module("lmforge.kernels")
    except ImportError:
        return None
    return getattr(module, name, None)


def _triton_runs_on(x: torch.Tensor, available: Callable[[], bool] | None) -> bool:
    """Whether an ``auto`` backend takes its Triton kernel for input x: CUDA, the 'triton'
    package present, and the dtype of the matmul output the kernel reads (autocast's for an
    fp32 x under autocast, else x's) one of fp16/bf16/fp32."""
    dtype = x.dtype
    if torch.is_autocast_enabled(x.device.type) and dtype == torch.float32:
        dtype = torch.get_autocast_dtype(x.device.type)
    fits = dtype in (torch.float16, torch.bfloat16, torch.float32)
    return x.is_cuda and fits and available is not None and available()


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


class _Norm(RMSNorm):
    """RMSNorm with a selectable backend: the reference math or lmforge's fused Triton kernel."""

    def __init__(self, d_model: int, eps: float, backend: str = "reference") -> None:
        super().__init__(d_model, eps)
        self.backend = backend
        self._fused: Callable[..., torch.Tensor] | None = None
        self._supported: Callable[..., bool] | None = None
        if backend in ("triton", "auto"):
            self._fused = _kernel("rms_norm")
            self._supported = _kernel("rms_norm_supported")
            if self._fused is None and backend == "triton":
                raise LmforgeError(
                    "model.norm = 'triton' needs lmforge.kernels.rms_norm, which is not available"
                )

    def _use_fused(self, x: torch.Tensor) -> bool:
        if self._fused is None:
            return False
        if self.backend == "triton":
            return True
        if self._supported is not None:
            return self._supported(x, self.weight)
        return x.is_cuda

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., D)."""
        if self._use_fused(x):
            # Under autocast the norm's consumers are matmuls that would cast its output to the
            # autocast dtype anyway: the kernel writes that dtype directly (one bf16 write
            # instead of an fp32 write, a read and a bf16 write). Values are identical.
            out_dtype = None
            if x.dtype == torch.float32 and torch.is_autocast_enabled(x.device.type):
                out_dtype = torch.get_autocast_dtype(x.device.type)
            return self._fused(x, self.weight, self.eps, out_dtype)
        return super().forward(x)


class _FFN(SwiGLU):
    """SwiGLU with a selectable gate backend: the reference (compiler-fused) math, or one matmul
    against ``cat([w1, w3])`` whose packed (…, 2F) output goes through lmforge's Triton gate,
    forward and backward — the backward writes the gradient of that matmul's output directly,
    so neither the split nor its concatenation in backward costs a copy."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config.d_model, config.ffn_dim, fused=config.fused_projections)
        self.backend = config.swiglu
        self._packed: Callable[..., torch.Tensor] | None = None
        self._triton_available: Callable[[], bool] | None = None
        if self.backend in ("triton", "auto"):
            self._packed = _kernel("swiglu_packed")
            self._triton_available = _kernel("triton_available")
            if self._packed is None and self.backend == "triton":
                raise LmforgeError(
                    "model.swiglu = 'triton' needs lmforge.kernels.swiglu_packed, "
                    "which is not available"
                )

    def _use_packed(self, x: torch.Tensor) -> bool:
        if self._packed is None or not _fusable(self.w1, self.w3):
            return False
        if self.backend == "triton":
            return True
        return _triton_runs_on(x, self._triton_available)  # auto: the kernel where it runs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., D)."""
        if not self._use_packed(x):
            return super().forward(x)
        assert self._packed is not None
        w13 = _cat_weights([self.w1.weight, self.w3.weight])  # (2F, D)
        return self.w2(self._packed(project(x, w13, self.w1)))  # (…, 2F) -> (…, F) -> (…, D)


class CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention with grouped-query heads, optional QK-norm and RoPE.

    ``q_proj`` maps D -> H·E, ``k_proj``/``v_proj`` map D -> K·E (K = ``n_kv_heads`` ≤ H, query
    head h reads kv-head h // (H/K)), ``output_proj`` maps H·E -> D. QK-norm (when enabled) is an
    RMSNorm over each head vector with one E-sized gain shared by all heads, applied before RoPE.

    With ``config.fused_projections`` (attribute ``fused_projections``, default off) q, k and v
    come from one matmul against ``cat([q_proj.weight, k_proj.weight, v_proj.weight])``, split
    afterwards: one larger GEMM instead of three, forward and backward, and one autocast cast of
    the input instead of three. The concatenation copies the three weights each call (written by
    the cast autocast does anyway) and its backward hands each named weight its own rows of the
    gradient, so parameters and state dicts are unchanged. When the modules carry hooks (tensor
    parallelism) or the weights differ in dtype/device, the three modules are called as before
    (rule: :func:`lmforge.model.layers._fusable`).
    """

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        self.fused_projections = config.fused_projections
        d, e = config.d_model, config.head_dim
        self.q_proj = Linear(d, self.n_heads * e)
        self.k_proj = Linear(d, self.n_kv_heads * e)
        self.v_proj = Linear(d, self.n_kv_heads * e)
        self.output_proj = Linear(self.n_heads * e, d)
        if config.qk_norm:
            self.q_norm = _Norm(e, config.norm_eps, config.norm)
            self.k_norm = _Norm(e, config.norm_eps, config.norm)
        self.rope = RotaryEmbedding(config.rope_theta, e, config.context_length)
        self._rope_fused: Callable[..., torch.Tensor] | None = None
        self._rope_packed: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        self._triton_available: Callable[[], bool] | None = None
        if config.rope in ("triton", "packed", "auto"):
            self._rope_fused = _kernel("rope")
            self._triton_available = _kernel("triton_available")
            if config.rope != "triton":
                self._rope_packed = _kernel("rope_packed")
            if config.rope != "auto" and (self._rope_fused is None or (
                config.rope == "packed" and self._rope_packed is None
            )):  # fmt: skip
                raise LmforgeError(
                    f"model.rope = {config.rope!r} needs lmforge.kernels.rope and rope_packed, "
                    "which are not available"
                )
        self.backend = config.attention
        self._sdpa_gqa = _torch_version() >= (2, 5)
        self._flash: Callable[..., torch.Tensor] | None = None
        self._flash_supported: Callable[..., bool] | None = None
        if self.backend in ("flash", "auto"):
            self._flash = _kernel("flash_attention")
            self._flash_supported = _kernel("flash_supported")
            if self.backend == "flash" and self._flash is None:
                raise LmforgeError(
                    "model.attention = 'flash' needs lmforge.kernels.flash_attention, "
                    "which is not available (use 'sdpa' or 'auto')"
                )

    def forward(
        self,
        x: torch.Tensor,
        token_positions: torch.Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """(B, T, D) -> (B, T, D). ``token_positions`` is (T,) or (B, T); default 0..T-1."""
        b, t, _ = x.shape
        h, k_heads, e = self.n_heads, self.n_kv_heads, self.head_dim
        fused_rope = self._use_fused_rope(x, token_positions, kv_cache)
        if fused_rope and self._use_packed_rope():
            # q and k as one GEMM; one launch rotates them out of its (B, T, (H+K)·E) output.
            w = _cat_weights([self.q_proj.weight, self.k_proj.weight])  # ((H+K)·E, D)
            cos, sin = self.rope.cos[:t], self.rope.sin[:t]  # (T, E/2)
            assert self._rope_packed is not None
            q, k = self._rope_packed(project(x, w, self.q_proj), cos, sin, h, k_heads)
            v = self.v_proj(x).view(b, t, k_heads, e)  # (B, T, K, E)
        else:
            q, k, v = self._qkv(x)  # (B, T, H·E), (B, T, K·E), (B, T, K·E)
            q = q.view(b, t, h, e)  # (B, T, H, E)
            k = k.view(b, t, k_heads, e)  # (B, T, K, E)
            v = v.view(b, t, k_heads, e)  # (B, T, K, E)
            if self.config.qk_norm:
                q = self.q_norm(q)
                k = self.k_norm(k)
            if fused_rope:  # positions 0..T-1, rotated in the (B, T, H|K, E) layout: no copy
                cos, sin = self.rope.cos[:t], self.rope.sin[:t]  # (T, E/2)
                q = self._rope_fused(q, cos, sin, seq_dim=-3)
                k = self._rope_fused(k, cos, sin, seq_dim=-3)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|K, T, E)
        if not fused_rope:
            if token_positions is None:
                token_positions = torch.arange(t, device=x.device)  # (T,)
            if token_positions.dim() == 2:
                token_positions = token_positions[:, None, :]  # (B, 1, T) broadcasts over heads
            q = self.rope(q, token_positions)
            k = self.rope(k, token_positions)
        if self.config.mup:  # muP's 1/E attention: q carries sqrt(E_base/E) on top of 1/sqrt(E)
            q = q * mup.q_scale(self.config)
        if kv_cache is None:
            out = self._causal(q, k, v)  # (B, H, T, E)
        else:
            k_all, v_all = kv_cache.update(self.layer_idx, k, v)  # (B, K, S, E)
            out = self._masked(q, k_all, v_all, kv_cache.mask)  # (B, H, T, E)
        out = out.transpose(1, 2).reshape(b, t, h * e)  # (B, T, H·E)
        return self.output_proj(out)  # (B, T, D)

    def _use_fused_rope(
        self, x: torch.Tensor, token_positions: torch.Tensor | None, kv_cache: KVCache | None
    ) -> bool:
        if self._rope_fused is None or token_positions is not None or kv_cache is not None:
            return False
        if self.config.rope in ("triton", "packed"):
            return True
        return _triton_runs_on(x, self._triton_available)  # auto: the kernel where it runs

    def _use_packed_rope(self) -> bool:
        # Once the rotation runs in Triton: q and k from one GEMM unless the layer asks for the
        # separate path (QK-norm between projection and rotation, fused q/k/v projections) or
        # the two modules cannot be merged (hooks, dtypes).
        return (
            self._rope_packed is not None
            and not self.config.qk_norm
            and not self.fused_projections
            and _fusable(self.q_proj, self.k_proj)
        )

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, D) -> q (B, T, H·E), k and v (B, T, K·E): one GEMM when equivalent, else three."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if not (self.fused_projections and _fusable(*projs)):
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        weights = [p.weight for p in projs]
        w = _cat_weights(weights)  # (H·E + 2·K·E, D)
        qkv = project(x, w, self.q_proj)  # (B, T, H·E + 2·K·E)
        q, k, v = qkv.split([wt.shape[0] for wt in weights], dim=-1)  # (B, T, H·E|K·E|K·E)
        return q, k, v

    def _repeat_kv(self, kv: torch.Tensor) -> torch.Tensor:
        """(B, K, S, E) -> (B, H, S, E): each kv-head serves H/K consecutive query heads."""
        groups = self.n_heads // self.n_kv_heads
        return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        backend = self.backend
        if backend == "auto":
            ok = self._flash is not None and (
                self._flash_supported is None or self._flash_supported(q, k, v)
            )
            backend = "flash" if ok else "sdpa"
        if backend == "flash":
            assert self._flash is not None
            return self._flash(q, k, v, is_causal=True)
        if backend == "sdpa":
            return self._sdpa(q, k, v, None)
        if backend == "cudnn":
            with _cudnn_first():
                return self._sdpa(q, k, v, None)
        t = q.shape[-2]
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


def _cudnn_first() -> Any:
    """A context in which torch SDPA tries cuDNN attention before its other backends."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    return sdpa_kernel(order, set_priority=True)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln1(x))``, then ``+ ffn(ln2(x))``."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.ln1 = _Norm(config.d_model, config.norm_eps, config.norm)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln2 = _Norm(config.d_model, config.norm_eps, config.norm)
        self.ffn = _FFN(config)

    def forward(
        self,
        x: torch.Tensor,
        token_positions: torch.Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """(B, T, D) -> (B, T, D)."""
        x = x + self.attn(self.ln1(x), token_positions, kv_cache=kv_cache)
        return x + self.ffn(self.ln2(x))


def _tied_state_dict_hook(
    module: TransformerLM, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    # Tied: both keys are kept (checkpoints look the same tied or not), but as separate tensors
    # so safetensors, which refuses aliased storage, can save them.
    if module.config.tie_embeddings:
        emb, head = prefix + "token_embeddings.weight", prefix + "lm_head.weight"
        if emb in state_dict and head in state_dict:
            value = state_dict[emb]
            if not isinstance(value, nn.Parameter):
                state_dict[head] = value.clone()


def _tied_load_hook(
    module: TransformerLM,
    state_dict: dict[str, Any],
    prefix: str,
    *args: Any,
) -> None:
    # A tied checkpoint written elsewhere (e.g. Hugging Face) may carry only the embedding.
    if module.config.tie_embeddings:
        emb, head = prefix + "token_embeddings.weight", prefix + "lm_head.weight"
        if emb in state_dict and head not in state_dict:
            state_dict[head] = state_dict[emb]


class TransformerLM(nn.Module):
    """Token embeddings → N pre-norm blocks → final RMSNorm → LM head (→ optional soft-cap).

    Weight tying (``config.tie_embeddings``): ``lm_head.weight`` IS ``token_embeddings.weight``
    (one Parameter, counted once by ``parameters()``). ``state_dict()`` still holds both keys, the
    LM-head entry being a copy of the embedding, so checkpoints have the same keys tied or untied
    and safetensors can write them; ``load_state_dict`` accepts a tied checkpoint with only
    ``token_embeddings.weight``. The shared matrix is initialised like the LM head (σ =
    sqrt(2/(V+D))) rather than like an embedding (σ = 1), which would make the initial logits
    ~sqrt(D) times too large.

    Construction builds the modules on the meta device, materialises them on ``device`` and calls
    :meth:`reset_parameters`; so ``torch.manual_seed(s); TransformerLM(cfg)`` and a meta-built model
    after ``to_empty(device)`` + ``torch.manual_seed(s)`` + ``reset_parameters()`` are identical.

    Exercised by ``pytest tests/test_model.py``.
    """

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        with torch.device("meta"):
            self.token_embeddings = Embedding(config.vocab_size, config.d_model)
            self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layers))
            self.ln_final = _Norm(config.d_model, config.norm_eps, config.norm)
            self.lm_head = Linear(config.d_model, config.vocab_size)
        target = torch.device("cpu") if device is None else torch.device(device)
        if target.type != "meta":
            self.to_empty(device=target)
        self.tie_weights()
        if dtype is not None:
            self.to(dtype=dtype)
        self.reset_parameters()
        self.register_state_dict_post_hook(_tied_state_dict_hook)
        self.register_load_state_dict_pre_hook(_tied_load_hook)

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the embedding Parameter when tied (again after ``to_empty``)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.token_embeddings.weight

    def reset_parameters(self) -> None:
        """Initialise every parameter and RoPE table (deterministic under ``torch.manual_seed``)."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()
        if self.config.tie_embeddings:
            _trunc_normal_(self.lm_head.weight, self.lm_head.init_std)

    def forward_hidden(
        self,
        idx: torch.Tensor,
        token_positions: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        valid_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (B, T) -> hidden states after ``ln_final`` (B, T, D).

        ``token_positions`` (T,) or (B, T) default to 0..T-1, or with a ``kv_cache`` to each row's
        next positions. ``valid_mask`` (B, T) bool marks real tokens (False = padding) and is only
        used with a ``kv_cache`` (see :class:`~lmforge.model.KVCache`).
        """
        _, t = idx.shape
        if kv_cache is not None:
            positions, _ = kv_cache.begin(t, valid_mask)  # (B, T)
            if token_positions is None:
                token_positions = positions
        else:
            if valid_mask is not None:
                raise ValueError("valid_mask is only supported together with a kv_cache")
            if t > self.config.context_length:
                raise ValueError(
                    f"sequence length {t} exceeds context_length {self.config.context_length}"
                )
        x = self.residual_stream(self.token_embeddings(idx))  # (B, T, D)
        for layer in self.layers:
            if kv_cache is None:
                x = layer(x, token_positions)  # (B, T, D)
            else:
                x = layer(x, token_positions, kv_cache=kv_cache)  # (B, T, D)
        h = self.ln_final(x)  # (B, T, D)
        if self.config.mup:  # muP's logit multiplier, here so the fused loss sees it too
            h = h * mup.output_multiplier(self.config)
        return h

    def residual_stream(self, x: torch.Tensor) -> torch.Tensor:
        """x (…, D) in the residual stream's dtype: unchanged, or with
        ``config.residual_dtype = "autocast"`` under autocast, cast to autocast's dtype."""
        if self.config.residual_dtype == "autocast" and x.is_floating_point():
            dev = x.device.type
            if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
                return x.to(torch.get_autocast_dtype(dev))
        return x

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states (..., D) -> logits (..., V): LM head, then the soft-cap when set."""
        logits = self.lm_head(h)  # (..., V)
        cap = self.config.logit_soft_cap
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        return logits

    def forward(
        self,
        idx: torch.Tensor,
        token_positions: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        valid_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (B, T) long -> logits (B, T, V). Arguments as in :meth:`forward_hidden`."""
        h = self.forward_hidden(idx, token_positions, kv_cache, valid_mask)  # (B, T, D)
        return self.logits_from_hidden(h)  # (B, T, V)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameters; ``exclude_embeddings`` drops the token-embedding matrix.

        When tied the LM head is that same matrix, so it is dropped too; an untied LM head counts.
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.token_embeddings.weight.numel()
        return total
