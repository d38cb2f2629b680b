"""The model's configuration branch (``[model]`` in a run TOML)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from lmforge.model.mla_config import MLAConfig
from lmforge.model.moe_config import MoEConfig
from lmforge.utils.errors import LmforgeError


def default_d_ff(d_model: int, multiple_of: int = 64) -> int:
    """SwiGLU hidden size: 8/3 · d_model rounded up to a multiple of ``multiple_of``."""
    return multiple_of * math.ceil(8 * d_model / 3 / multiple_of)


LAYER_TYPES = "AWGMLS"


class _DerivedHeadDim(int):
    """``head_dim`` resolved from d_model / n_heads (the field was left at None).

    An int for every use, but marked: ``dataclasses.replace(cfg, d_model=...)`` passes the old
    resolved value back to ``__init__``, and the mark makes ``__post_init__`` derive it again from
    the new shape instead of freezing a stale head dim.
    """


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
    head_dim: int | None = None
    "per-head width E (None = d_model / n_heads; Qwen3-0.6B has 128 at d_model 1024, 16 heads);"
    " read back it is always the resolved int"
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
    rope_scaling: Literal["none", "llama3"] = "none"
    "RoPE frequency scaling for long contexts: none, or Llama 3.1's llama3 (low frequencies"
    " divided by rope_scaling_factor, high ones kept, a smooth blend between)"
    rope_scaling_factor: float = 8.0
    "llama3 scaling: factor the low frequencies are divided by"
    rope_low_freq_factor: float = 1.0
    "llama3 scaling: wavelengths above rope_original_context / this are fully scaled"
    rope_high_freq_factor: float = 4.0
    "llama3 scaling: wavelengths below rope_original_context / this are kept"
    rope_original_context: int = 8192
    "llama3 scaling: the context length the model was pre-trained with"
    attention: Literal["reference", "sdpa", "flash", "auto"] = "sdpa"
    "attention backend: reference (own math), sdpa (torch's; cuDNN's kernel on an H200), flash"
    " (lmforge's Triton FlashAttention-2), auto = the measured-best here (sdpa; see"
    " lmforge.model.fastpath). W layers (sliding window) take lmforge's windowed flash kernel"
    " under every backend but reference wherever it runs (SDPA has no window), else a mask"
    norm: Literal["reference", "triton", "auto"] = "reference"
    "RMSNorm backend: reference (own math, compiler-fused) or lmforge's Triton kernel; auto ="
    " the measured-best here (reference)"
    rope: Literal["reference", "triton", "packed", "auto"] = "reference"
    "RoPE backend: reference (own math, compiler-fused), triton (lmforge's kernel on q and k in"
    " the projections' layout, before the head transpose; training and prefill without explicit"
    " positions or a KV cache), packed (q and k from one GEMM against cat([Wq, Wk]), rotated in"
    " one launch; triton under QK-norm); auto = packed on CUDA (59.9 vs 61.1 ms/step for the"
    " reference, GPT-2-small on an H200), else reference"
    swiglu: Literal["reference", "triton", "auto"] = "reference"
    "SwiGLU gate backend: reference (own math, compiler-fused) or lmforge's Triton gate on one"
    " packed matmul output (w1 and w3 as one GEMM; the gate's backward writes that GEMM's"
    " gradient directly); auto = triton on CUDA (56.4 vs 56.8 ms/step on an H200), else reference"
    residual_dtype: Literal["param", "autocast"] = "param"
    "dtype of the residual stream (the sum the blocks add into): param = the embedding's (fp32"
    " master weights keep an fp32 stream under autocast, as nanoGPT does); autocast = under"
    " autocast the stream is held in its dtype (bf16), as bf16 training stacks hold activations:"
    " the norms and residual adds then read and write half the bytes. No effect without autocast"
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    "mixture-of-experts feed-forward (default: dense; e.g. --model.moe.n_experts=8)"
    mup: bool = False
    "muP (Yang et al., Tensor Programs V) for Adam: hidden matrices' LR × base/d_model, logits ×"
    " base/d_model, attention scale sqrt(E_base)/E instead of 1/sqrt(E); identical to the standard"
    " model at d_model = mup_base_width and head_dim = mup_base_head_dim (lmforge.model.mup)"
    mup_base_width: int = 256
    "muP: the width whose hyperparameters transfer (multipliers are 1 there)"
    mup_base_head_dim: int = 64
    "muP: the head width at which the attention scale is the standard 1/sqrt(E)"
    attention_type: Literal["gqa", "mla"] = "gqa"
    "what A layers compute: gqa (grouped-query attention, n_kv_heads) or mla (DeepSeek-V2/V3"
    " multi-head latent attention: one cached latent of kv_lora_rank + qk_rope_head_dim values"
    " per token; lmforge.model.mla). The backend is the attention field (flash resolves to sdpa)"
    kv_lora_rank: int = 512
    "mla: latent width C (the cached compression of K and V)"
    q_lora_rank: int = 0
    "mla: low-rank query width (0 = a full-rank query projection)"
    qk_nope_head_dim: int = 128
    "mla: per-head query/key dims without position"
    qk_rope_head_dim: int = 64
    "mla: decoupled RoPE dims (one rope key shared by the heads, cached beside the latent)"
    v_head_dim: int = 128
    "mla: per-head value width"
    kv_share_every: int = 1
    "cross-layer KV sharing (CLA, full-attention layers only): layers i·k produce the K/V (GQA,"
    " MHA) or the latent (MLA), the k − 1 after each reuse it (1 = off; lmforge.model.cla)"
    mtp_depth: int = 0
    "multi-token prediction modules (DeepSeek-V3; 0 = none): depth k predicts token t+k+1,"
    " trained with weight mtp_weight (lmforge.model.mtp)"
    mtp_weight: float = 0.3
    "multi-token prediction: λ, the MTP loss's weight beside the main loss"
    layers: str = "A"
    "token mixer of each block, one letter per block, the pattern repeated to n_layers: A full"
    " attention, W sliding-window attention (model.window), G Gated DeltaNet, M Mamba-2 (SSD),"
    " L linear attention, S DeepSeek sparse attention (model.dsa_*); e.g. GGGA = 3:1 Gated"
    " DeltaNet:attention (lmforge.model.linear_attention)"
    window: int = 4096
    "W layers: each query attends to itself and the window − 1 tokens before it"
    linear_heads: int | None = None
    "G and L layers: heads (None = n_heads)"
    linear_head_dim: int | None = None
    "G and L layers: per-head width of q, k and v (None = head_dim); state (heads, E, E) per sequence"
    linear_v_heads: int | None = None
    "G layers: value heads (None = linear_heads), a multiple of the q/k heads: each q/k head serves"
    " linear_v_heads / linear_heads consecutive value heads (Qwen3-Next: 16 q/k, 32 value heads);"
    " β, the decay and the state are per value head"
    linear_v_head_dim: int | None = None
    "G layers: per-head width of v, z and the output norm (None = linear_head_dim); state"
    " (linear_v_heads, linear_head_dim, linear_v_head_dim) per sequence"
    linear_decay: bool = True
    "L layers: RetNet's fixed per-head decays 1 − 2^(−5−h) (false: the undecayed sum)"
    ssm_state: int = 64
    "M layers: Mamba-2 state size N (width of B and C, one group)"
    ssm_head_dim: int = 64
    "M layers: Mamba-2 head width P; heads = ssm_expand·d_model / P"
    ssm_expand: int = 2
    "M layers: Mamba-2 inner width = ssm_expand·d_model"
    conv_size: int = 4
    "G and M layers: width of the short causal convolution (≥ 2)"
    dsa_topk: int = 2048
    "S layers: keys each query attends to, the top-k of the lightning indexer's scores"
    dsa_index_heads: int = 4
    "S layers: heads of the lightning indexer"
    dsa_index_dim: int = 64
    "S layers: per-head width of the lightning indexer's queries and its one key (even, RoPE)"
    mrope_sections: tuple[int, ...] = ()
    "multimodal RoPE (Qwen2-VL's MRoPE): rotary frequencies split into (temporal, height, width)"
    " sections summing to head_dim / 2, each rotated by its own component of a token's 3-vector"
    " position (lmforge.vision.mrope_positions); empty = plain 1D RoPE. Text tokens (p, p, p)"
    " rotate exactly as with 1D RoPE"
    rotary_dim: int | None = None
    "partial rotary (GPT-NeoX, Bamba, Qwen3-Next): only the first rotary_dim dims of each head"
    " rotate, at frequencies θ^(−2i/rotary_dim); the rest pass through (None = all head_dim)"
    ssm_norm_eps: float = 1e-6
    "M layers: epsilon of the gated RMSNorm before the out-projection (Bamba uses rms_norm_eps)"
    attn_output_gate: bool = False
    "A and W layers: Qwen3-Next's gated attention, the attention output times σ(x W_gate) per"
    " channel before the output projection (one more H·E × D matrix per layer)"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.head_dim is None or isinstance(self.head_dim, _DerivedHeadDim):
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
                    " (or set head_dim)"
                )
            object.__setattr__(self, "head_dim", _DerivedHeadDim(self.d_model // self.n_heads))
        elif self.head_dim <= 0:
            raise ValueError(f"head_dim must be positive or unset, got {self.head_dim}")
        if self.head_dim % 2:
            raise ValueError(f"head dim ({self.head_dim}) must be even for RoPE")
        if self.rope_scaling not in ("none", "llama3"):
            raise ValueError(f"rope_scaling must be none or llama3, got {self.rope_scaling!r}")
        if self.rope_scaling == "llama3" and not (
            self.rope_scaling_factor >= 1.0
            and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
            and self.rope_original_context > 0
        ):
            raise ValueError(
                "llama3 RoPE scaling needs rope_scaling_factor >= 1, 0 < rope_low_freq_factor <"
                " rope_high_freq_factor and rope_original_context > 0"
            )
        kv = self.kv_heads
        if kv <= 0 or self.n_heads % kv:
            raise ValueError(f"n_kv_heads ({kv}) must divide n_heads ({self.n_heads})")
        if self.d_ff is not None and self.d_ff <= 0:
            raise ValueError(f"d_ff must be positive, got {self.d_ff}")
        if self.logit_soft_cap is not None and self.logit_soft_cap <= 0:
            raise ValueError(f"logit_soft_cap must be positive or unset, got {self.logit_soft_cap}")
        if self.attention not in ("reference", "sdpa", "flash", "auto"):
            raise ValueError(
                f"attention must be reference, sdpa, flash or auto, got {self.attention!r}"
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
        self._check_layers()
        self._check_mla()
        self._check_mrope()
        self._check_rotary_dim()
        self._check_output_gate()

    def _check_rotary_dim(self) -> None:
        r = self.rotary_dim
        if r is None:
            return
        if not isinstance(r, int) or isinstance(r, bool) or r < 2 or r % 2 or r > self.head_dim:
            raise ValueError(
                f"rotary_dim must be an even integer in [2, head_dim = {self.head_dim}] or unset,"
                f" got {r!r}"
            )
        if self.attention_type != "gqa" or self.mrope_sections:
            raise ValueError("rotary_dim (partial rotary) needs attention_type = gqa and no MRoPE")

    def _check_output_gate(self) -> None:
        if self.attn_output_gate and (self.attention_type != "gqa" or "S" in self.layers):
            raise ValueError("attn_output_gate needs attention_type = gqa and no S (sparse) layers")

    def _check_mrope(self) -> None:
        sections = self.mrope_sections
        if not sections:
            return
        if (
            len(sections) != 3
            or any(s < 0 for s in sections)
            or sum(sections) != self.head_dim // 2
        ):
            raise ValueError(
                f"mrope_sections {list(sections)} must be 3 non-negative sizes (temporal, height,"
                f" width) summing to head_dim / 2 = {self.head_dim // 2}"
            )
        if self.attention_type != "gqa" or "S" in self.layers:
            raise ValueError("mrope_sections needs attention_type = gqa and no S (sparse) layers")

    def _check_mla(self) -> None:
        if self.attention_type not in ("gqa", "mla"):
            raise ValueError(f"attention_type must be gqa or mla, got {self.attention_type!r}")
        if not isinstance(self.mtp_depth, int) or self.mtp_depth < 0:
            raise ValueError(f"mtp_depth must be an integer >= 0, got {self.mtp_depth!r}")
        k = self.moe.first_dense_layers
        if self.moe.enabled and k >= self.n_layers and not self.mtp_depth:
            # MTP blocks come after the trunk and are MoE: only then may every trunk layer be dense
            raise ValueError(
                f"moe.first_dense_layers ({k}) >= n_layers ({self.n_layers}) leaves no MoE layer"
                " (set moe.n_experts = 0 for a dense model)"
            )
        if not self.mtp_weight >= 0:
            raise ValueError(f"mtp_weight must be >= 0, got {self.mtp_weight!r}")
        k = self.kv_share_every
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"kv_share_every must be an integer >= 1, got {k!r}")
        if k > 1 and set(self.layers) != {"A"}:
            raise ValueError(
                f"kv_share_every > 1 (cross-layer KV sharing) needs full-attention layers only"
                f" (layers = A), got layers = {self.layers!r}"
            )
        if self.attention_type != "mla":
            return
        for name, on in (
            ("rope_scaling", self.rope_scaling != "none"),
            ("qk_norm", self.qk_norm),
            ("mup", self.mup),
            ("layers with W (sliding window)", "W" in self.layers),
        ):
            if on:
                raise ValueError(f"attention_type = mla does not support {name}")
        try:
            self.mla.validate()
        except LmforgeError as e:
            raise ValueError(str(e)) from None

    @property
    def mla(self) -> MLAConfig:
        """The :class:`~lmforge.model.mla.MLAConfig` of every MLA layer (one builder)."""
        return MLAConfig(
            d_model=self.d_model,
            n_heads=self.n_heads,
            kv_lora_rank=self.kv_lora_rank,
            q_lora_rank=self.q_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            rope_theta=self.rope_theta,
            norm_eps=self.norm_eps,
            max_seq_len=self.context_length,
            backend="reference" if self.attention == "reference" else "sdpa",
        )

    def _check_layers(self) -> None:
        if not isinstance(self.layers, str) or not self.layers:
            raise ValueError(
                f"layers must be a non-empty pattern of {LAYER_TYPES}, got {self.layers!r}"
            )
        bad = sorted(set(self.layers) - set(LAYER_TYPES))
        if bad:
            raise ValueError(
                f"layers {self.layers!r}: unknown layer type {bad[0]!r} (A full attention, W sliding"
                " window, G Gated DeltaNet, M Mamba-2, L linear attention, S sparse attention)"
            )
        if self.window <= 0:
            raise ValueError(f"window must be positive, got {self.window}")
        for name in ("linear_heads", "linear_head_dim", "linear_v_heads", "linear_v_head_dim"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or unset, got {value}")
        kh, kd, vh, vd = self.linear_dims
        if vh % kh:
            raise ValueError(
                f"linear_v_heads ({vh}) must be a multiple of the q/k heads linear_heads ({kh})"
            )
        if (vh, vd) != (kh, kd) and "L" in self.layers:
            raise ValueError(
                "linear_v_heads / linear_v_head_dim (grouped value heads) are for G layers only;"
                " L layers have equal q, k and v heads"
            )
        for name in ("ssm_state", "ssm_head_dim", "ssm_expand"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if "M" in self.layers and (self.ssm_expand * self.d_model) % self.ssm_head_dim:
            raise ValueError(
                f"ssm_head_dim ({self.ssm_head_dim}) must divide ssm_expand·d_model"
                f" ({self.ssm_expand * self.d_model})"
            )
        if not self.ssm_norm_eps > 0:
            raise ValueError(f"ssm_norm_eps must be positive, got {self.ssm_norm_eps}")
        if self.conv_size < 2:
            raise ValueError(f"conv_size must be at least 2, got {self.conv_size}")
        for name in ("dsa_topk", "dsa_index_heads", "dsa_index_dim"):
            if getattr(self, name) < 1 or (name == "dsa_index_dim" and self.dsa_index_dim % 2):
                raise ValueError(
                    f"{name} must be ≥ 1 (dsa_index_dim even), got {getattr(self, name)}"
                )

    @property
    def layer_types(self) -> tuple[str, ...]:
        """The token mixer letter of every block: ``layers`` repeated to ``n_layers``."""
        reps = -(-self.n_layers // len(self.layers))
        return tuple((self.layers * reps)[: self.n_layers])

    @property
    def linear_dims(self) -> tuple[int, int, int, int]:
        """(q/k heads, q/k head width, value heads, value head width) of the G layers; L layers
        use the first two for q, k and v."""
        kh = self.linear_heads or self.n_heads
        kd = self.linear_head_dim or int(self.head_dim)
        return kh, kd, self.linear_v_heads or kh, self.linear_v_head_dim or kd

    @property
    def full_attention_only(self) -> bool:
        """Whether every block is full attention (the layers the serving engine runs)."""
        return set(self.layer_types) == {"A"}

    @property
    def kv_heads(self) -> int:
        """Resolved number of key/value heads K."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_dim(self) -> int:
        """Resolved SwiGLU hidden size F."""
        return default_d_ff(self.d_model) if self.d_ff is None else self.d_ff

    @property
    def expert_dim(self) -> int:
        """Resolved hidden size of one MoE expert (``moe.expert_d_ff``, default F)."""
        return self.ffn_dim if self.moe.expert_d_ff is None else self.moe.expert_d_ff
