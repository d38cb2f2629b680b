"""Cross-layer KV sharing (CLA, Brandon et al. 2024) and the KV-cache size of each attention kind.

With ``kv_share_every = k`` layer ``i`` attends with the keys/values (or MLA latents) produced by
layer ``i − i mod k``: layers 0, k, 2k, … compute and cache KV, the k − 1 layers after each one
reuse it (their own K/V projections are absent). The engine then allocates cache only for the
producing layers, ``ceil(L / k)`` of them, and maps layer i to cache slot ``i // k``.

:func:`kv_bytes_per_token` is the one function for cache bytes per token (all layers), for
MHA (K = H), GQA (K < H), MLA (one latent of C + R values per token and layer, DeepSeek-V2/V3)
and any of them with CLA. Values per token and producing layer: MHA/GQA ``2·K·E``, MLA
``C + R``; DeepSeek-V2's rule C = 4E, R = E/2 gives 4.5·E, i.e. (C + R) / (2·(H/4)·E) = 9/H
of a GQA cache with groups of 4: at most a quarter from H = 36 heads on, which is why the ratio
to GQA-4 is quoted for DeepSeek-sized head counts and CLA closes the rest for small ones.

In the model: ``ModelConfig.kv_share_every`` (full-attention layers only, ``layers = A``), for
both attention kinds. GQA/MHA (:class:`lmforge.model.attention.CausalSelfAttention`): a consumer
has no ``k_proj``/``v_proj`` (nor QK-norm's ``k_norm``) and computes only its queries; it
attends with its producer's keys (after QK-norm and RoPE, as in the CLA paper) and values. MLA
(:class:`lmforge.model.mla.MultiHeadLatentAttention`): a consumer has no latent projection and
reads its producer's latents. In training :class:`lmforge.model.TransformerBlock` hands the
producer's K/V (latents) to the next k − 1 blocks; ``KVCache.for_model`` (``lmforge.generate``)
and the engine's ``new_kv_cache`` allocate the producing layers only, a consumer reading cache
layer i // k (its producer's pages, written earlier in the same step, in the eager, compiled and
CUDA-graph decode steps alike) and writing none. Not supported, one line each: hybrid layer
patterns, Hugging Face export (no HF architecture shares K/V across layers), tensor and
pipeline parallelism, pruning and the block-by-block calibrated quantization.
Exercised by ``pytest tests/test_mla_cla.py tests/test_mla_model.py tests/test_gqa_cla.py``.
"""

from __future__ import annotations

import math

from lmforge.utils.errors import LmforgeError

__all__ = [
    "kv_bytes_per_token",
    "kv_cache_index",
    "kv_cache_layers",
    "kv_producer_layers",
    "kv_source_layer",
]


def _check_share(kv_share_every: int) -> None:
    if (
        not isinstance(kv_share_every, int)
        or isinstance(kv_share_every, bool)
        or kv_share_every < 1
    ):
        raise LmforgeError(f"kv_share_every must be an integer >= 1, got {kv_share_every!r}")


def kv_source_layer(layer: int, kv_share_every: int) -> int:
    """The layer whose KV ``layer`` attends with (itself when it produces KV)."""
    _check_share(kv_share_every)
    return layer - layer % kv_share_every


def kv_producer_layers(n_layers: int, kv_share_every: int) -> list[int]:
    """The layers that compute and cache KV: 0, k, 2k, … below ``n_layers``."""
    _check_share(kv_share_every)
    return list(range(0, n_layers, kv_share_every))


def kv_cache_layers(n_layers: int, kv_share_every: int) -> int:
    """How many layers of cache the engine allocates: ceil(L / k)."""
    _check_share(kv_share_every)
    return math.ceil(n_layers / kv_share_every)


def kv_cache_index(layer: int, kv_share_every: int) -> int:
    """Layer ``layer``'s index into a cache holding only the producing layers."""
    _check_share(kv_share_every)
    return layer // kv_share_every


def kv_bytes_per_token(
    attention: str,
    *,
    n_layers: int,
    n_heads: int = 0,
    head_dim: int = 0,
    n_kv_heads: int | None = None,
    kv_lora_rank: int = 0,
    qk_rope_head_dim: int = 0,
    kv_share_every: int = 1,
    dtype_bytes: int = 2,
) -> int:
    """Bytes of KV cache one token takes across all layers.

    ``attention``: ``mha`` (K = H heads of ``head_dim``), ``gqa`` (``n_kv_heads`` K), or ``mla``
    (``kv_lora_rank`` + ``qk_rope_head_dim`` values); ``kv_share_every`` k > 1 counts only the
    ceil(L / k) producing layers (CLA); ``dtype_bytes`` 2 for bf16.
    """
    layers = kv_cache_layers(n_layers, kv_share_every)
    if attention == "mla":
        if kv_lora_rank <= 0 or qk_rope_head_dim < 0:
            raise LmforgeError("kv_bytes_per_token: mla needs kv_lora_rank > 0")
        per_layer = kv_lora_rank + qk_rope_head_dim
    elif attention in ("mha", "gqa"):
        k = n_heads if attention == "mha" or n_kv_heads is None else n_kv_heads
        if k <= 0 or head_dim <= 0:
            raise LmforgeError(f"kv_bytes_per_token: {attention} needs heads and head_dim > 0")
        per_layer = 2 * k * head_dim
    else:
        raise LmforgeError(
            f"kv_bytes_per_token: attention must be mha, gqa or mla, got {attention!r}"
        )
    return layers * per_layer * dtype_bytes
