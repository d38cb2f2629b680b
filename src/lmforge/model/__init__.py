"""The Transformer language model (single-device code; parallelism wraps it from outside).

This is the public API of ``lmforge.model``; everything else is internal. Shape legend used in
every file here: B batch, T sequence, S key/value slots, D model dim, H heads, K kv-heads,
E head dim, V vocab, F ffn dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from lmforge.model import accounting
    from lmforge.model.config import ModelConfig, default_d_ff
    from lmforge.model.context import Context, PagedKVCache, StepOps
    from lmforge.model.kv_cache import KVCache
    from lmforge.model.layers import (
        Embedding,
        Linear,
        RMSNorm,
        RotaryEmbedding,
        SwiGLU,
        scaled_dot_product_attention,
        silu,
        softmax,
    )
    from lmforge.model.linear_attention import (
        GatedDeltaNet,
        LinearAttention,
        Mamba2Mixer,
        RecurrentState,
    )
    from lmforge.model.moe import MoEFFN
    from lmforge.model.moe_config import MoEConfig
    from lmforge.model.presets import load_preset
    from lmforge.model.transformer import CausalSelfAttention, TransformerBlock, TransformerLM

__all__ = [
    "CausalSelfAttention",
    "Context",
    "Embedding",
    "GatedDeltaNet",
    "KVCache",
    "Linear",
    "LinearAttention",
    "Mamba2Mixer",
    "MoEConfig",
    "MoEFFN",
    "ModelConfig",
    "PagedKVCache",
    "RMSNorm",
    "RecurrentState",
    "RotaryEmbedding",
    "StepOps",
    "SwiGLU",
    "TransformerBlock",
    "TransformerLM",
    "accounting",
    "default_d_ff",
    "load_preset",
    "scaled_dot_product_attention",
    "silu",
    "softmax",
]

_EXPORTS = {
    "GatedDeltaNet": "linear_attention",
    "LinearAttention": "linear_attention",
    "Mamba2Mixer": "linear_attention",
    "RecurrentState": "linear_attention",
    "CausalSelfAttention": "transformer",
    "Context": "context",
    "PagedKVCache": "context",
    "StepOps": "context",
    "Embedding": "layers",
    "KVCache": "kv_cache",
    "Linear": "layers",
    "ModelConfig": "config",
    "MoEConfig": "moe_config",
    "MoEFFN": "moe",
    "RMSNorm": "layers",
    "RotaryEmbedding": "layers",
    "SwiGLU": "layers",
    "TransformerBlock": "transformer",
    "TransformerLM": "transformer",
    "accounting": "accounting",
    "default_d_ff": "config",
    "load_preset": "presets",
    "scaled_dot_product_attention": "layers",
    "silu": "layers",
    "softmax": "layers",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
