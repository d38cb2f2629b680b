"""The decoder-only Transformer LM: GQA attention with RoPE, pre-norm blocks, SwiGLU, RMSNorm.

Single-device code. Kernels, ``torch.compile``, activation checkpointing and parallelism are applied
from outside: every block is a self-contained module called as ``block(x, token_positions)`` that
takes and returns tensors only, so a wrapper can replace ``model.layers[i]``.

``TransformerLM.forward`` is lmforge's only forward: training calls it plainly, the reference
generation loop with a contiguous :class:`~lmforge.model.KVCache`, and the serving engine (its
eager, compiled and CUDA-graph steps, speculative decoding) with a paged per-step
:class:`~lmforge.model.context.Context`; the attention module reads and writes that cache
through the context's kernels (``ops``), everything else (muP, QK-norm, soft-cap, tied head,
GQA, head dim, RoPE scaling, MoE) is the same code in all three.

Shape legend: B batch, T sequence, S key/value slots, D model dim, H query heads, K kv-heads,
E head dim, V vocab, F ffn dim.

Backends (``ModelConfig.attention``, ``norm``, ``rope``, ``swiglu``): each module is built with a
concrete backend; ``auto`` is resolved once, at construction, by
:func:`lmforge.model.fastpath.resolve_backends` for the device the model is built on (the
measured-best path there), so the trainer's :class:`~lmforge.train.FastPath` and a model built on
its own agree. A Triton backend still falls back to its reference per call where the kernel does
not apply (a CPU tensor, explicit positions, a KV cache, hooks on the projections).

- attention: ``reference`` (:func:`lmforge.model.scaled_dot_product_attention`, explicit causal
  mask, K/V repeated for GQA), ``sdpa`` (``F.scaled_dot_product_attention(is_causal=True)``, which
  picks cuDNN's kernel on an H200), ``flash`` (lmforge's Triton FlashAttention-2 where
  ``flash_supported`` accepts the input, else sdpa). With a :class:`~lmforge.model.KVCache` every
  backend but ``reference`` uses torch SDPA with the cache's boolean mask.
- norm: ``reference`` (:class:`lmforge.model.RMSNorm`) or ``triton`` (``lmforge.kernels.rms_norm``).
- rope: ``reference`` (:class:`lmforge.model.RotaryEmbedding`), ``triton`` (``lmforge.kernels.rope``
  on q and k as the projections lay them out, (B, T, H, E), before the head transpose), ``packed``
  (q and k from one matmul against ``cat([Wq, Wk])``, rotated by ``lmforge.kernels.rope_packed`` in
  one launch, its backward writing that matmul's gradient directly; ``triton`` under QK-norm).
- swiglu: ``reference`` (:class:`lmforge.model.SwiGLU`) or ``triton`` (one GEMM against
  ``cat([w1, w3])`` through ``lmforge.kernels.swiglu_packed``).

Attention kind (``ModelConfig.attention_type``): ``gqa`` (:class:`CausalSelfAttention`) or
``mla`` (:class:`~lmforge.model.mla.MultiHeadLatentAttention`, DeepSeek-V2/V3: explicit form in
training, absorbed form over the KV cache and the engine's paged latent cache). With
``kv_share_every`` k > 1 (CLA, Brandon et al. 2024; full-attention layers only) layer i reuses
the keys and values (GQA/MHA: after QK-norm and RoPE; MLA: the latents) of layer i − i mod k,
which alone computes and caches them (:mod:`lmforge.model.cla`).
``mtp_depth`` > 0 builds DeepSeek-V3's multi-token-prediction modules as ``self.mtp``
(:mod:`lmforge.model.mtp`); the forward never runs them (the main logits are unchanged), the
training objective and the speculative proposer do.

Layer pattern (``ModelConfig.layers``, e.g. ``"GGGA"`` repeated to ``n_layers``): each block's
token mixer is full attention (A), sliding-window attention (W, ``model.window``; an explicit
(T, T) mask through SDPA, the flash kernel having no window), Gated DeltaNet (G), Mamba-2 (M) or
linear attention (L) from :mod:`lmforge.model.linear_attention` (chunked Triton kernels on CUDA,
the chunked torch path on CPU). Training, evaluation, the reference decoding loop (a
:class:`~lmforge.model.KVCache`: window masks, per-layer recurrent states) and the engine (a
window mask over the pages, per-sequence state slots ``Context.states``) run every letter; S
layers keep their indexer keys beside their K/V there (the cache's ``index_k``, the engine's
``Context.index_cache`` pages) and select their top-k keys as in training.

Exercised by ``pytest tests/test_model.py tests/test_hybrid.py`` (and ``pytest -m gpu`` on them for
the Triton backends).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from lmforge.kernels import (
    swiglu_packed,
)
from lmforge.model import mup
from lmforge.model.attention import (
    CausalSelfAttention,
    _kernel_runs_on,
    _linear,
    _Norm,
    _packed_matmul,
)
from lmforge.model.config import ModelConfig
from lmforge.model.context import Context
from lmforge.model.fastpath import resolve_backends
from lmforge.model.kv_cache import KVCache, paged_kv_layers, window_ring
from lmforge.model.layers import (
    Embedding,
    Linear,
    SwiGLU,
    _bare,
    _cat_weights,
    _fusable,
    _trunc_normal_,
    project,
    silu,
)
from lmforge.model.linear_attention import (
    GatedDeltaNet,
    LinearAttention,
    Mamba2Mixer,
    mix_cached,
    mix_paged,
)
from lmforge.model.mla import MultiHeadLatentAttention
from lmforge.model.moe import MoEFFN
from lmforge.model.mtp import MultiTokenPrediction
from lmforge.utils.errors import LmforgeError


class _FFN(SwiGLU):
    """SwiGLU with a selectable gate backend: the reference (compiler-fused) math, or one matmul
    against ``cat([w1, w3])`` whose packed (…, 2F) output goes through lmforge's Triton gate,
    forward and backward — the backward writes the gradient of that matmul's output directly,
    so neither the split nor its concatenation in backward costs a copy."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__(config.d_model, config.ffn_dim)
        self.backend = config.swiglu
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor, context: Context | None = None) -> torch.Tensor:
        """(..., D) -> (..., D)."""
        if context is not None:  # an engine step: its packed w1/w3 and matmul kernel, if any
            w13 = context.ops.packed(self.layer_idx)[1]
            fusable = _fusable(self.w1, self.w3)
            if isinstance(w13, torch.Tensor) and fusable:
                gate, up = _packed_matmul(x, w13, context).chunk(2, dim=-1)  # (…, F) each
                return _linear(self.w2, silu(gate) * up, context)  # (…, F) -> (…, D)
            if isinstance(w13, nn.Module) and _bare(self.w1) and _bare(self.w3):  # quantized
                gate, up = _linear(w13, x, context).chunk(2, dim=-1)  # (…, F) each
                return _linear(self.w2, silu(gate) * up, context)
            if not fusable:  # e.g. quantized: each on the step's kernel (SwiGLU.forward's math)
                gate, up = _linear(self.w1, x, context), _linear(self.w3, x, context)
                return _linear(self.w2, silu(gate) * up, context)
        if not (self.backend == "triton" and _kernel_runs_on(x) and _fusable(self.w1, self.w3)):
            return super().forward(x)
        w13 = _cat_weights([self.w1.weight, self.w3.weight])  # (2F, D)
        return self.w2(swiglu_packed(project(x, w13)))  # (…, 2F) -> (…, F) -> (…, D)


def _mrope_component_first(token_positions: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """3-vector positions (3, B, T) or (B, T, 3) as (3, B, T); only for an MRoPE model."""
    if not config.mrope_sections:
        raise ValueError("3-vector token_positions need MRoPE (model.mrope_sections)")
    if token_positions.shape[0] == 3:
        return token_positions
    if token_positions.shape[-1] == 3:
        return token_positions.permute(2, 0, 1)  # (B, T, 3) -> (3, B, T)
    raise ValueError(
        f"MRoPE token_positions must be (3, B, T) or (B, T, 3), got {tuple(token_positions.shape)}"
    )


def token_mixer(config: ModelConfig, layer_idx: int) -> nn.Module:
    """The token mixer of block ``layer_idx``, by its letter in ``config.layer_types``:
    A full attention, W sliding-window attention, G Gated DeltaNet, M Mamba-2, L linear attention,
    S DeepSeek sparse attention (:mod:`lmforge.model.sparse_attention`).
    Linear mixers run their chunked kernels (Triton on CUDA, the chunked torch path on CPU)."""
    # blocks past n_layers (multi-token-prediction modules) are full attention: no recurrent state
    kind = config.layer_types[layer_idx] if layer_idx < len(config.layer_types) else "A"
    if kind == "A" and config.attention_type == "mla":
        # CLA: layer i reads the latents of layer i − i mod k (cache index i // k).
        k = config.kv_share_every
        return MultiHeadLatentAttention(
            config.mla, layer_idx, produces_kv=layer_idx % k == 0, cache_index=layer_idx // k
        )
    if kind in "AW":
        # CLA (full attention only): layer i attends with the K/V of layer i − i mod k, cached
        # at index i // k (the identity for k = 1)
        k = config.kv_share_every
        attn = CausalSelfAttention(
            config, layer_idx, config.window if kind == "W" else None,
            produces_kv=layer_idx % k == 0, kv_index=layer_idx // k,
        )  # fmt: skip
        # linear layers have no pages: skip them (the identity for a full-attention model)
        attn.cache_index = layer_idx // k - (
            min(layer_idx, len(config.layer_types)) - paged_kv_layers(config.layer_types, layer_idx)
        )
        if kind == "W" and window_ring(config.layer_types):  # W beside A/S: a ring per sequence
            attn.ring = True
            attn.cache_index = config.layer_types[:layer_idx].count("W")
        return attn
    if kind == "S":  # DeepSeek sparse attention (a CausalSelfAttention with a top-k indexer)
        from lmforge.model.sparse_attention import SparseAttention

        return SparseAttention(config, layer_idx)
    heads, head_dim, v_heads, v_head_dim = config.linear_dims
    if kind == "G":
        return GatedDeltaNet(config.d_model, heads, head_dim, conv_size=config.conv_size,
                             v_heads=v_heads, v_head_dim=v_head_dim)  # fmt: skip
    if kind == "M":
        return Mamba2Mixer(
            config.d_model, d_state=config.ssm_state, head_dim=config.ssm_head_dim,
            expand=config.ssm_expand, conv_size=config.conv_size, norm_eps=config.ssm_norm_eps,
        )  # fmt: skip
    return LinearAttention(config.d_model, heads, head_dim, decay=config.linear_decay)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln1(x))``, then ``+ ffn(ln2(x))``.

    ``attn`` is the block's token mixer (:func:`token_mixer`): attention (GQA or MLA), full or
    windowed, or a linear-attention mixer with a constant-size state, which takes no positions
    (order comes from its recurrence) and runs each batch row as one sequence.

    Cross-layer KV sharing (``kv_share_every`` > 1): outside an engine step the block returns
    ``(x, shared)``, what its attention produced or was given as ``shared``, so
    :class:`TransformerLM` hands it to the next k − 1 blocks: MLA's latents (B, T, C + R)
    (without a cache; with one the consumers read the producer's cache rows), GQA's keys and
    values ((B, K, S, E) each, keys after QK-norm and RoPE; with a cache every filled slot, so
    a stand-in cache that stores nothing, as packed SFT's, works too). In an engine step the
    consumers read the producer's pages.
    """

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.ln1 = _Norm(config.d_model, config.norm_eps, config.norm)
        self.attn = token_mixer(config, layer_idx)
        self.recurrent = not isinstance(self.attn, (CausalSelfAttention, MultiHeadLatentAttention))
        self.shares_kv = config.kv_share_every > 1 and not self.recurrent
        self.ln2 = _Norm(config.d_model, config.norm_eps, config.norm)
        moe = config.moe.is_moe_layer(layer_idx)
        self.ffn: nn.Module = MoEFFN(config, layer_idx) if moe else _FFN(config, layer_idx)

    def forward(
        self,
        x: torch.Tensor,
        token_positions: torch.Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        context: Context | None = None,
        shared: Any = None,
    ) -> Any:
        """(B, T, D) -> (B, T, D); a CLA block outside an engine step -> ((B, T, D), shared)."""
        if self.recurrent:  # a linear mixer: its state lives in the cache or the step's slots
            h = self.ln1(x)
            if context is not None:
                if context.states is None:
                    raise LmforgeError(
                        "linear layers (G, M, L) need the engine's recurrent-state slots "
                        "(Context.states); this step has none"
                    )
                y = mix_paged(self.attn, self.layer_idx, h, context.states, context.q_lens)
            elif kv_cache is not None:
                state = kv_cache.states.get(self.layer_idx)
                if state is None:
                    state = self.attn.init_state(x.shape[0], h.dtype, x.device)
                assert kv_cache.new_valid is not None
                y, kv_cache.states[self.layer_idx] = mix_cached(
                    self.attn, state, h, kv_cache.new_valid
                )
            else:
                y = self.attn(h)[0]
            x = x + y
            return x + self.ffn(self.ln2(x))
        if self.shares_kv and context is None and isinstance(self.attn, CausalSelfAttention):
            y, shared = self.attn.attend_shared(self.ln1(x), token_positions, shared,
                                                kv_cache=kv_cache)  # fmt: skip
            x = x + y
            return x + self.ffn(self.ln2(x)), shared  # shared: (K, V) (B, K, S, E) each
        if self.shares_kv and kv_cache is None and context is None:
            h = self.ln1(x)
            if self.attn.produces_kv:
                shared = self.attn.compress_kv(h, token_positions)  # (B, T, C+R)
            x = x + self.attn.attend_explicit(h, token_positions, shared)
            return x + self.ffn(self.ln2(x)), shared
        if context is None:
            x = x + self.attn(self.ln1(x), token_positions, kv_cache=kv_cache)
            return x + self.ffn(self.ln2(x))
        x = x + self.attn(self.ln1(x), context=context)
        y = self.ln2(x)
        return x + (self.ffn(y, context) if isinstance(self.ffn, _FFN) else self.ffn(y))


def _mtp_modules(config: ModelConfig) -> MultiTokenPrediction:
    """DeepSeek-V3's MTP modules; module k's block is a full-attention block of the model's own
    kind (index n_layers + k, as DeepSeek-V3's checkpoints number them) that produces its own
    keys/latents (no CLA: it runs alone)."""
    block_cfg = dataclasses.replace(
        config, layers="A", kv_share_every=1, n_layers=config.n_layers + config.mtp_depth
    )
    return MultiTokenPrediction(
        config.d_model,
        config.mtp_depth,
        lambda k: TransformerBlock(block_cfg, config.n_layers + k),
        config.norm_eps,
    )


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
        target = torch.device("cpu") if device is None else torch.device(device)
        # "auto" backends become the measured-best concrete ones for the device built on.
        config = resolve_backends(config, target.type)
        self.config = config
        with torch.device("meta"):
            self.token_embeddings = Embedding(config.vocab_size, config.d_model)
            self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layers))
            self.ln_final = _Norm(config.d_model, config.norm_eps, config.norm)
            self.lm_head = Linear(config.d_model, config.vocab_size)
            self.mtp = _mtp_modules(config) if config.mtp_depth else None
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
        *,
        context: Context | None = None,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (B, T) -> hidden states after ``ln_final`` (B, T, D).

        ``token_positions`` (T,) or (B, T) default to 0..T-1, or with a ``kv_cache`` to each row's
        next positions; with MRoPE (``config.mrope_sections``) they may be 3-vectors, (3, B, T)
        (Qwen2-VL's layout, also when B = T = 3) or (B, T, 3), e.g. from
        :func:`lmforge.vision.mrope_positions`. ``valid_mask`` (B, T) bool marks real tokens (False = padding) and is only
        used with a ``kv_cache`` (see :class:`~lmforge.model.KVCache`). With a paged ``context``
        (:class:`~lmforge.model.context.Context`, one engine step) idx is (1, N), the step's
        tokens flattened, and the result (1, S, D) holds only the rows ``context.last_rows``
        (every row when None). ``input_embeds`` (B, T, D) replaces the token-embedding lookup
        (a VLM's spliced image tokens, :mod:`lmforge.vision`); idx still gives B, T.
        """
        _, t = idx.shape
        if token_positions is not None and token_positions.dim() == 3:
            token_positions = _mrope_component_first(token_positions, self.config)  # (3, B, T)
        x = self.token_embeddings(idx) if input_embeds is None else input_embeds  # (B, T, D)
        if context is not None:
            x = self.residual_stream(x)  # (1, N, D)
            for layer in self.layers:
                x = layer(x, context=context)  # (1, N, D)
            if context.last_rows is not None:  # only each sequence's last token is sampled
                x = x[:, context.last_rows]  # (1, S, D)
            return self.final_hidden(x)
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
        x = self.residual_stream(x)  # (B, T, D)
        shared: Any = None  # CLA: the K/V (latents) the current group of k blocks attends with
        gqa_cla = self.config.kv_share_every > 1 and self.config.attention_type != "mla"
        for layer in self.layers:
            if gqa_cla:  # (B, T, D), ((B, K, S, E), (B, K, S, E))
                x, shared = layer(x, token_positions, kv_cache=kv_cache, shared=shared)
            elif kv_cache is None and self.config.kv_share_every > 1:
                x, shared = layer(x, token_positions, shared=shared)  # (B, T, D), (B, T, C+R)
            elif kv_cache is None:
                x = layer(x, token_positions)  # (B, T, D)
            else:
                x = layer(x, token_positions, kv_cache=kv_cache)  # (B, T, D)
        return self.final_hidden(x)

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The last residual stream (…, D) -> the LM head's input (…, D): ``ln_final`` (and
        muP's output multiplier); what :meth:`forward_hidden` returns and MTP modules read."""
        h = self.ln_final(x)  # (…, D)
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

    def logits_from_hidden(self, h: torch.Tensor, context: Context | None = None) -> torch.Tensor:
        """Hidden states (..., D) -> logits (..., V): LM head (on an engine step's matmul kernel
        where its ``context`` has one), then the soft-cap when set."""
        logits = _linear(self.lm_head, h, context)  # (..., V)
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
        *,
        context: Context | None = None,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (B, T) long -> logits (B, T, V). Arguments as in :meth:`forward_hidden`;
        with a paged ``context``, (1, N) -> (1, S, V) (see there)."""
        h = self.forward_hidden(
            idx, token_positions, kv_cache, valid_mask, context=context, input_embeds=input_embeds
        )
        return self.logits_from_hidden(h, context)  # (B, T, V)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameters; ``exclude_embeddings`` drops the token-embedding matrix.

        When tied the LM head is that same matrix, so it is dropped too; an untied LM head counts.
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.token_embeddings.weight.numel()
        return total
