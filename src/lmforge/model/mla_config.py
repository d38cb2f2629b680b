"""The shape of one multi-head latent attention layer (:mod:`lmforge.model.mla`).

Apart from the module so that :class:`~lmforge.model.ModelConfig` can build and validate it
without importing the layers (as :mod:`lmforge.model.moe_config` does for MoE).
Exercised by ``pytest tests/test_mla.py tests/test_mla_model.py``.
"""

from __future__ import annotations

import dataclasses
import math

from lmforge.utils.errors import LmforgeError

__all__ = ["MLAConfig"]


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Shape of one multi-head latent attention layer (DeepSeek-V2/V3 names)."""

    d_model: int
    "residual stream width D"
    n_heads: int
    "query heads H (MLA has no kv-heads: every head reads the one latent)"
    kv_lora_rank: int = 512
    "latent width C: the cached, RMS-normalised compression of K and V"
    q_lora_rank: int = 0
    "low-rank query width Q (0 = full-rank query projection D -> H·(N+R))"
    qk_nope_head_dim: int = 128
    "per-head query/key dims without position N (the part absorbed into the latent)"
    qk_rope_head_dim: int = 64
    "decoupled RoPE dims R (one rope key shared by all heads, cached beside the latent)"
    v_head_dim: int = 128
    "per-head value width Ev"
    rope_theta: float = 10000.0
    "RoPE base θ"
    norm_eps: float = 1e-6
    "epsilon of the latent RMSNorms (DeepSeek uses 1e-6)"
    max_seq_len: int = 4096
    "longest position the RoPE tables cover"
    backend: str = "sdpa"
    "explicit-form attention core: reference (own math, full score matrix) or sdpa (torch's)"

    @property
    def qk_head_dim(self) -> int:
        """N + R: the width a query and a key are compared over."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """C + R: values cached per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1 / sqrt(N + R), in both forms."""
        return 1.0 / math.sqrt(self.qk_head_dim)

    @property
    def num_parameters(self) -> int:
        """Parameters of one layer: q path, kv_a (D -> C+R), its norm, kv_b, output."""
        d, h, c, r = self.d_model, self.n_heads, self.kv_lora_rank, self.qk_rope_head_dim
        qk, q = self.qk_head_dim, self.q_lora_rank
        q_path = d * q + q + q * h * qk if q else d * h * qk
        return (
            q_path
            + d * (c + r)
            + c
            + c * h * (self.qk_nope_head_dim + self.v_head_dim)
            + (h * self.v_head_dim * d)
        )

    def validate(self) -> MLAConfig:
        """Raise one :class:`LmforgeError` line for a shape that cannot work; return self."""
        ints = (
            "d_model",
            "n_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "max_seq_len",
        )
        for name in ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise LmforgeError(f"MLA: {name} must be a positive integer, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise LmforgeError(
                f"MLA: qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}"
            )
        # A rank above D cannot compress: W_DKV x has rank <= D whatever C is.
        if self.kv_lora_rank > self.d_model:
            raise LmforgeError(
                f"MLA: kv_lora_rank ({self.kv_lora_rank}) must not exceed d_model"
                f" ({self.d_model}); the latent is a compression of x"
            )
        up = self.n_heads * (self.qk_nope_head_dim + self.v_head_dim)
        if self.kv_lora_rank >= up:
            raise LmforgeError(
                f"MLA: kv_lora_rank ({self.kv_lora_rank}) must be below"
                f" n_heads·(qk_nope_head_dim + v_head_dim) = {up}, else caching the latent"
                " saves nothing over caching K and V"
            )
        q = self.q_lora_rank
        if not isinstance(q, int) or isinstance(q, bool) or q < 0 or q > self.d_model:
            raise LmforgeError(
                f"MLA: q_lora_rank must be 0 (full-rank query) or 1..d_model ({self.d_model}),"
                f" got {q!r}"
            )
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise LmforgeError("MLA: rope_theta and norm_eps must be positive")
        if self.backend not in ("reference", "sdpa"):
            raise LmforgeError(f"MLA: backend must be reference or sdpa, got {self.backend!r}")
        return self
