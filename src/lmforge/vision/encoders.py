"""The vision transformer, the text encoder and the dual-encoder (CLIP/SigLIP) model.

Both towers are stacks of the same pre-norm block built from lmforge's layers (``Linear``,
``RMSNorm``, ``SwiGLU``): ``x + attn(norm(x))`` then ``+ mlp(norm(x))``. The ViT attends
bidirectionally over [CLS] + patches; the text encoder attends causally (as CLIP's does) and
pools the hidden state at each row's EOS, so padding after the EOS never reaches the pooled
feature. Positions are learned absolute embeddings (ViT and CLIP both use them).

Attention backends: ``sdpa`` (torch's fused kernel) and ``reference``
(:func:`lmforge.model.scaled_dot_product_attention`, explicit mask); tests check they agree.

Shape legend: B batch, N patches, L text tokens, T any sequence, D width, H heads, E head dim,
P patch pixels (3·p·p), C joint embedding dim.
Exercised by ``pytest tests/test_vision_models.py``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.model.layers import (
    Embedding,
    Linear,
    RMSNorm,
    SwiGLU,
    _trunc_normal_,
    scaled_dot_product_attention,
)


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """Shape of the vision transformer (``[vision]`` in a vision TOML)."""

    image_size: int = 64
    "input side in pixels (square images)"
    patch_size: int = 8
    "patch side in pixels; image_size must be a multiple"
    d_model: int = 128
    "width"
    n_layers: int = 4
    "blocks"
    n_heads: int = 4
    "attention heads"
    d_ff: int | None = None
    "SwiGLU hidden size (None = 8/3·d_model rounded up to 64)"
    pool: Literal["cls", "attn"] = "cls"
    "pooled feature: the class token's output, or attention pooling (a learned query)"
    attention: Literal["sdpa", "reference"] = "sdpa"
    "attention backend"

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size ({self.image_size}) must be a multiple of patch_size ({self.patch_size})"
            )
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )

    @property
    def n_patches(self) -> int:
        """Patches per image (N)."""
        return (self.image_size // self.patch_size) ** 2


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """Shape of the text encoder (``[text]`` in a vision TOML); vocab_size comes from the tokenizer."""

    context_length: int = 48
    "tokens per caption, BOS and EOS included (longer captions are truncated)"
    d_model: int = 128
    "width"
    n_layers: int = 4
    "blocks"
    n_heads: int = 4
    "attention heads"
    d_ff: int | None = None
    "SwiGLU hidden size (None = 8/3·d_model rounded up to 64)"
    attention: Literal["sdpa", "reference"] = "sdpa"
    "attention backend"

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )


class SelfAttention(nn.Module):
    """Multi-head self-attention, bidirectional or causal, optionally with a key padding mask."""

    def __init__(self, d_model: int, n_heads: int, causal: bool, backend: str = "sdpa") -> None:
        super().__init__()
        self.n_heads, self.causal, self.backend = n_heads, causal, backend
        self.qkv = Linear(d_model, 3 * d_model)
        self.out = Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, D) -> (B, T, D); ``key_mask`` (B, T) bool, False = key not attended."""
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)  # 3 × (B, H, T, E)
        mask = None
        if self.causal:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()  # (T, T)
        if key_mask is not None:
            km = key_mask[:, None, None, :]  # (B, 1, 1, T)
            mask = km if mask is None else mask & km  # (B, 1, T, T)
        if self.backend == "reference":
            o = scaled_dot_product_attention(q, k, v, mask)  # (B, H, T, E)
        elif mask is None:
            o = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, E)
        elif key_mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, E)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, E)
        return self.out(o.transpose(1, 2).reshape(b, t, d))  # (B, T, D)


class EncoderBlock(nn.Module):
    """Pre-norm Transformer block: ``x + attn(norm1(x))``, then ``+ mlp(norm2(x))``."""

    def __init__(
        self, d_model: int, n_heads: int, d_ff: int | None, causal: bool, backend: str = "sdpa"
    ) -> None:
        super().__init__()
        self.norm1 = RMSNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads, causal, backend)
        self.norm2 = RMSNorm(d_model)
        self.mlp = SwiGLU(d_model, d_ff)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, D) -> (B, T, D)."""
        x = x + self.attn(self.norm1(x), key_mask)
        return x + self.mlp(self.norm2(x))


class AttentionPool(nn.Module):
    """Attention pooling (SigLIP's MAP head, simplified): one learned query attends over the tokens."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.query = nn.Parameter(torch.empty(1, 1, d_model))
        self.kv = Linear(d_model, 2 * d_model)
        self.out = Linear(d_model, d_model)
        _trunc_normal_(self.query, 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, D)."""
        b, t, d = x.shape
        h = self.n_heads
        q = self.query.expand(b, 1, d).view(b, 1, h, d // h).transpose(1, 2)  # (B, H, 1, E)
        k, v = self.kv(x).view(b, t, 2, h, d // h).permute(2, 0, 3, 1, 4)  # 2 × (B, H, T, E)
        o = F.scaled_dot_product_attention(q, k, v)  # (B, H, 1, E)
        return self.out(o.transpose(1, 2).reshape(b, d))  # (B, D)


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, 3, S, S) -> (B, N, 3·p·p): non-overlapping patches in row-major order, each flattened
    channel-major (the layout of a stride-p conv's (D, 3, p, p) weight)."""
    b, c, s, _ = images.shape
    g = s // patch_size
    x = images.view(b, c, g, patch_size, g, patch_size)  # (B, 3, g, p, g, p)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, g * g, c * patch_size**2)  # (B, N, P)


class ViT(nn.Module):
    """Vision transformer: patch embedding + [CLS] + learned positions → blocks → final norm.

    ``forward`` returns ``(pooled (B, D), patch tokens (B, N, D))``; the patch tokens (after the
    final norm) are what a VLM projects into its LM.
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.patch_embed = Linear(3 * config.patch_size**2, d)
        self.cls_token = nn.Parameter(torch.empty(1, 1, d))
        self.pos_embed = nn.Parameter(torch.empty(1, config.n_patches + 1, d))
        self.blocks = nn.ModuleList(
            EncoderBlock(d, config.n_heads, config.d_ff, False, config.attention)
            for _ in range(config.n_layers)
        )
        self.norm = RMSNorm(d)
        self.pool = AttentionPool(d, config.n_heads) if config.pool == "attn" else None
        _trunc_normal_(self.cls_token, 0.02)
        _trunc_normal_(self.pos_embed, 0.02)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 3, S, S) normalised pixels -> (pooled (B, D), patches (B, N, D))."""
        x = self.patch_embed(patchify(images, self.config.patch_size))  # (B, N, D)
        cls = self.cls_token.expand(x.shape[0], 1, -1)  # (B, 1, D)
        x = torch.cat([cls, x], dim=1) + self.pos_embed  # (B, 1+N, D)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        pooled = x[:, 0] if self.pool is None else self.pool(x[:, 1:])  # (B, D)
        return pooled, x[:, 1:]


class TextEncoder(nn.Module):
    """Causal Transformer over caption tokens, pooled at each row's first EOS (CLIP's choice)."""

    def __init__(self, config: TextConfig, vocab_size: int, eos_id: int) -> None:
        super().__init__()
        self.config, self.eos_id = config, eos_id
        d = config.d_model
        self.token_embed = Embedding(vocab_size, d)
        self.pos_embed = nn.Parameter(torch.empty(1, config.context_length, d))
        self.blocks = nn.ModuleList(
            EncoderBlock(d, config.n_heads, config.d_ff, True, config.attention)
            for _ in range(config.n_layers)
        )
        self.norm = RMSNorm(d)
        _trunc_normal_(self.token_embed.weight, 0.02)
        _trunc_normal_(self.pos_embed, 0.01)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, L) long -> (B, D) at the first EOS of each row (the last token when a row has none)."""
        b, length = tokens.shape
        x = self.token_embed(tokens) + self.pos_embed[:, :length]  # (B, L, D)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        is_eos = tokens == self.eos_id  # (B, L)
        last = torch.full((b,), length - 1, device=tokens.device)
        first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), last)  # (B,)
        return x[torch.arange(b, device=tokens.device), first_eos]  # (B, D)


class DualEncoder(nn.Module):
    """CLIP/SigLIP: two towers, linear heads into a joint C-dim space, a learned logit scale
    (stored as log, CLIP's init 1/0.07 or SigLIP's 10) and a learned bias (used by SigLIP only).
    """

    def __init__(
        self,
        vision: ViTConfig,
        text: TextConfig,
        vocab_size: int,
        eos_id: int,
        embed_dim: int = 128,
        loss: str = "clip",
    ) -> None:
        super().__init__()
        self.vision = ViT(vision)
        self.text = TextEncoder(text, vocab_size, eos_id)
        self.image_proj = Linear(vision.d_model, embed_dim)
        self.text_proj = Linear(text.d_model, embed_dim)
        init_scale, init_bias = (1 / 0.07, 0.0) if loss == "clip" else (10.0, -10.0)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(init_scale)))
        self.logit_bias = nn.Parameter(torch.tensor(init_bias))

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) -> unit-norm (B, C)."""
        return F.normalize(self.image_proj(self.vision(images)[0]), dim=-1)

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, L) -> unit-norm (B, C)."""
        return F.normalize(self.text_proj(self.text(tokens)), dim=-1)

    def forward(
        self, images: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit-norm image and text features, (B, C) each."""
        return self.encode_image(images), self.encode_text(tokens)
