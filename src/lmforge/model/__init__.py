"""The Transformer language model (single-device code; parallelism wraps it from outside).

This is the public API of ``lmforge.model``; everything else is internal. Shape legend used in
every file here: B batch, T sequence, S key/value slots, D model dim, H heads, K kv-heads,
E head dim, V vocab, F ffn dim.
"""

# ruff: noqa: F401 (the imports for type checkers below are the names __all__ exports)

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
    from lmforge.model.mla import MLAConfig, MultiHeadLatentAttention, PagedLatentCache
    from lmforge.model.moe import MoEFFN
    from lmforge.model.moe_config import MoEConfig
    from lmforge.model.mtp import MTPDraft, MultiTokenPrediction, mtp_draft, mtp_loss
    from lmforge.model.presets import load_preset
    from lmforge.model.sparse_attention import SparseAttention, add_indexer, set_dsa_stage
    from lmforge.model.transformer import CausalSelfAttention, TransformerBlock, TransformerLM


# name → defining module (a module's own name exports the module), imported on first access.
_EXPORTS = {
    name: module
    for module, names in {
        "accounting": "accounting",
        "config": "ModelConfig default_d_ff",
        "context": "Context PagedKVCache StepOps",
        "kv_cache": "KVCache",
        "layers": "Embedding Linear RMSNorm RotaryEmbedding SwiGLU scaled_dot_product_attention "
        "silu softmax",
        "linear_attention": "GatedDeltaNet LinearAttention Mamba2Mixer RecurrentState",
        "mla": "MLAConfig MultiHeadLatentAttention PagedLatentCache",
        "moe": "MoEFFN",
        "moe_config": "MoEConfig",
        "mtp": "MTPDraft MultiTokenPrediction mtp_draft mtp_loss",
        "presets": "load_preset",
        "sparse_attention": "SparseAttention add_indexer set_dsa_stage",
        "transformer": "CausalSelfAttention TransformerBlock TransformerLM",
    }.items()
    for name in names.split()
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
