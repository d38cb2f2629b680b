"""Fused kernels: FlashAttention-2, RMSNorm, linear + cross-entropy, RoPE, SwiGLU gate, AdamW,
the chunked gated delta rule (Gated DeltaNet), decayed linear attention and Mamba-2 SSD.

This is the public API.

Each op has a Triton fast path (GPU, or CPU under ``TRITON_INTERPRET=1``) and a plain-torch
reference. Importing this package never imports Triton; the Triton modules load on first use, and
inputs a kernel cannot handle raise :class:`KernelUnsupportedError` (a ``ValueError``) naming the
constraint, so callers can fall back (the model's ``auto`` backends use ``flash_supported``).
The Triton paths run as torch custom ops (``torch.ops.lmforge.*``, registered by ``_ops`` on
import), so ``torch.compile(fullgraph=True)`` traces a model that uses them in one graph.
"""

from lmforge.kernels._common import KernelUnsupportedError, triton_available
from lmforge.kernels.adamw import adamw_multi_tensor_, adamw_reference_, adamw_supported
from lmforge.kernels.cross_entropy import (
    fused_linear_cross_entropy,
    linear_cross_entropy_reference,
)
from lmforge.kernels.flash_attention import (
    FlashAttentionTorch,
    FlashAttentionTriton,
    attention_reference,
    flash_attention,
    flash_supported,
)
from lmforge.kernels.gated_delta import (
    gated_delta_chunked_torch,
    gated_delta_reference,
    gated_delta_rule,
    gated_delta_step,
)
from lmforge.kernels.rms_norm import (
    rms_norm,
    rms_norm_reference,
    rms_norm_supported,
)
from lmforge.kernels.rope import (
    rope,
    rope_packed,
    rope_packed_reference,
    rope_reference,
)
from lmforge.kernels.ssd import (
    linear_attention,
    linear_attention_chunked_torch,
    linear_attention_reference,
    linear_attention_step,
    ssd,
    ssd_reference,
    ssd_step,
)
from lmforge.kernels.swiglu import (
    swiglu,
    swiglu_packed,
    swiglu_packed_reference,
    swiglu_reference,
)

__all__ = [
    "FlashAttentionTorch",
    "FlashAttentionTriton",
    "KernelUnsupportedError",
    "adamw_multi_tensor_",
    "adamw_reference_",
    "adamw_supported",
    "attention_reference",
    "flash_attention",
    "flash_supported",
    "fused_linear_cross_entropy",
    "gated_delta_chunked_torch",
    "gated_delta_reference",
    "gated_delta_rule",
    "gated_delta_step",
    "linear_attention",
    "linear_attention_chunked_torch",
    "linear_attention_reference",
    "linear_attention_step",
    "linear_cross_entropy_reference",
    "rms_norm",
    "rms_norm_reference",
    "rms_norm_supported",
    "rope",
    "rope_packed",
    "rope_packed_reference",
    "rope_reference",
    "ssd",
    "ssd_reference",
    "ssd_step",
    "swiglu",
    "swiglu_packed",
    "swiglu_packed_reference",
    "swiglu_reference",
    "triton_available",
]
