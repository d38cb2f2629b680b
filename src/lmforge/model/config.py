"""The model's configuration branch (``[model]`` in a run TOML)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal


def default_d_ff(d_model: int, multiple_of: int = 64) -> int:
    """SwiGLU hidden size: 8/3 · d_model rounded up to a multiple of ``multiple_of``."""
    return multiple_of * math.ceil(8 * d_model / 3 / multiple_of)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and options of a decoder-only Transformer LM (pre-norm, RoPE, SwiGLU, GQA)."""

    vocab_size: int = 50304
    "vocabulary size (embedding rows and LM-head outputs)"
    context_length: int = 1024
    "longest sequence the RoPE tables cover"
    d_model: int = 768
    "residual stream width"
    n_layers: int = 12
    "number of Transformer blocks"
    n_heads: int = 12
    "query heads"
    n_kv_heads: int | None = None
    "key/value heads for grouped-query attention (None = n_heads)"
    d_ff: int | None = None
    "SwiGLU hidden size (None = 8/3·d_model rounded up to a multiple of 64)"
    rope_theta: float = 10000.0
    "RoPE base θ"
    norm_eps: float = 1e-5
    "RMSNorm epsilon"
    qk_norm: bool = False
    "RMS-normalise queries and keys per head before RoPE"
    tie_embeddings: bool = False
    "share the token-embedding matrix with the LM head"
    logit_soft_cap: float | None = None
    "cap logits to ±c via c·tanh(x/c) (None = off)"
    attention: Literal["reference", "sdpa", "cudnn", "flash", "auto"] = "sdpa"
    "attention backend: reference (own math), sdpa (torch's default choice), cudnn (torch SDPA"
    " with its cuDNN kernel first, for torch builds or GPUs whose default picks another; torch"
    " 2.11 on an H200 already picks cuDNN for sdpa), flash (lmforge Triton), auto"
    norm: Literal["reference", "triton", "auto"] = "reference"
    "RMSNorm backend: reference (own math) or lmforge's fused Triton kernel"
    rope: Literal["reference", "triton", "packed", "auto"] = "reference"
    "RoPE backend: reference (own math, compiler-fused) or lmforge's Triton kernel, which"
    " rotates q and k in the layout the projections write, before the head transpose (training"
    " and prefill without explicit positions or a KV cache; otherwise the reference); packed ="
    " the kernel with q and k from one GEMM against cat([Wq, Wk]), rotated out of its output in"
    " one launch (its backward writes that GEMM's gradient directly; triton where QK-norm or"
    " fused_projections is on); auto = packed on CUDA. GPT-2-small on an H200: 55.7 vs 55.9"
    " ms/step for triton"
    swiglu: Literal["reference", "triton", "auto"] = "reference"
    "SwiGLU gate backend: reference (own math, compiler-fused) or lmforge's Triton gate on one"
    " packed matmul output (w1 and w3 as one GEMM; the gate's backward writes that GEMM's"
    " gradient directly, no concatenation); auto = the kernel on CUDA. GPT-2-small on an H200:"
    " 56.4 vs 56.8 ms/step (the w1/w3 GEMMs at 726-800 instead of 689-766 TFLOP/s)"
    residual_dtype: Literal["param", "autocast"] = "param"
    "dtype of the residual stream (the sum the blocks add into): param = the embedding's (fp32"
    " master weights keep an fp32 stream under autocast, as nanoGPT does); autocast = under"
    " autocast the stream is held in its dtype (bf16), as bf16 training stacks hold activations:"
    " the norms and residual adds then read and write half the bytes. No effect without autocast"
    fused_projections: bool = False
    "one matmul for q/k/v and one for SwiGLU's w1/w3 (same weights and names). Off by default:"
    " on an H200 (GPT-2-small, batch 32, compiled) it measured 59.2 vs 57.1 ms/step, at 12.77 vs"
    " 11.65 GiB: the GEMMs get faster, but q and k become strided copies before RoPE, backward"
    " concatenates dq/dk/dv and w1/w3's gradients, and the qkv output is kept whole. swiglu ="
    " 'auto' fuses w1/w3 alone without those copies"
    mup: bool = False
    "muP (Yang et al., Tensor Programs V) for Adam: hidden matrices' LR × base/d_model, logits ×"
    " base/d_model, attention scale sqrt(E_base)/E instead of 1/sqrt(E); identical to the standard"
    " model at d_model = mup_base_width and head_dim = mup_base_head_dim (lmforge.model.mup)"
    mup_base_width: int = 256
    "muP: the width whose hyperparameters transfer (multipliers are 1 there)"
    mup_base_head_dim: int = 64
    "muP: the head width at which the attention scale is the standard 1/sqrt(E)"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("head dim (d_model / n_heads) must be even for RoPE")
        kv = self.kv_heads
        if kv <= 0 or self.n_heads % kv:
            raise ValueError(f"n_kv_heads ({kv}) must divide n_heads ({self.n_heads})")
        if self.d_ff is not None and self.d_ff <= 0:
            raise ValueError(f"d_ff must be positive, got {self.d_ff}")
        if self.logit_soft_cap is not None and self.logit_soft_cap <= 0:
            raise ValueError(f"logit_soft_cap must be positive or unset, got {self.logit_soft_cap}")
        if self.attention not in ("reference", "sdpa", "cudnn", "flash", "auto"):
            raise ValueError(
                f"attention must be reference, sdpa, cudnn, flash or auto, got {self.attention!r}"
            )
        if self.norm not in ("reference", "triton", "auto"):
            raise ValueError(f"norm must be reference, triton or auto, got {self.norm!r}")
        if self.residual_dtype not in ("param", "autocast"):
            raise ValueError(
                f"residual_dtype must be param or autocast, got {self.residual_dtype!r}"
            )
        if self.rope not in ("reference", "triton", "packed", "auto"):
            raise ValueError(f"rope must be reference, triton, packed or auto, got {self.rope!r}")
        if self.mup_base_width <= 0 or self.mup_base_head_dim <= 0:
            raise ValueError("mup_base_width and mup_base_head_dim must be positive")
        if self.swiglu not in ("reference", "triton", "auto"):
            raise ValueError(f"swiglu must be reference, triton or auto, got {self.swiglu!r}")

    @property
    def head_dim(self) -> int:
        """Per-head width E = d_model / n_heads."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Resolved number of key/value heads K."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_dim(self) -> int:
        """Resolved SwiGLU hidden size F."""
        return default_d_ff(self.d_model) if self.d_ff is None else self.d_ff
