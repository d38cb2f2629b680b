"""Exact parameter counts, FLOPs per token and a memory model of :class:`TransformerLM`.

Pure functions of a :class:`ModelConfig` (no model is built), so the trainer, the parallelism
planner and the scaling code can all size a model before allocating it. Derived quantities come
from here and nowhere else.

FLOP convention (used for MFU): a matmul of (m×k)·(k×n) costs 2·m·k·n; the backward pass costs
twice the forward (one matmul for the input gradient, one for the weight gradient). Elementwise
work (norms, softmax, SiLU, RoPE, residual adds) and the embedding lookup are not counted. The
attention terms count the full T×T score matrix a dense kernel computes, as PaLM's MFU definition
does (pass ``causal=True`` to halve them, as causal-aware FlashAttention benchmarks do). The
familiar approximation results exactly (for a dense model; an MoE model counts the *active*
weights, :func:`active_parameter_count`, so MFU is computed on active FLOPs)::

    flops_per_token(cfg, T, backward=True) == 6·N_matmul + 12·L·H·E·T

with N_matmul the weights that take part in matmuls (every Linear, the LM head included even when
tied; not the embedding lookup, not the norm gains) — see :func:`matmul_parameters`.

Exercised by ``pytest tests/test_accounting.py`` (parameter counts against ``sum(p.numel())``,
FLOPs against ``torch.utils.flop_counter.FlopCounterMode`` and activations against the tensors
autograd actually saves).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from lmforge.model.config import ModelConfig

Precision = Literal["fp32", "bf16", "fp16"]

FLOP_COMPONENTS: tuple[str, ...] = (
    "embedding",
    "qkv",
    "attn_scores",
    "attn_values",
    "output_proj",
    "ffn",
    "lm_head",
    "mtp",
)
"""Keys of :func:`flops_breakdown`, in forward order."""


# ---------------------------------------------------------------------------------------------
# Parameters


def _dims(cfg: ModelConfig) -> tuple[int, int, int, int, int, int]:
    """(D, E, H, K, V, L): model dim, head dim, heads, kv heads, vocab, layers."""
    return cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.kv_heads, cfg.vocab_size, cfg.n_layers


def _mla_producers(cfg: ModelConfig) -> int:
    """MLA layers that compute latents (all of them without CLA): ceil(L / kv_share_every)."""
    return -(-cfg.n_layers // cfg.kv_share_every)


def _attention_parameters(cfg: ModelConfig, n_layers: int, producers: int) -> tuple[int, int]:
    """(matmul weights, norm gains) of ``n_layers`` attention layers, ``producers`` of which
    compute K/V. MLA per layer: the q path ``D·H(N+R)`` (or ``D·Q + Q·H(N+R)``), ``D(C+R)``
    (producers), ``C·H(N+Ev)``, ``H·Ev·D``; gains: ``C`` (producers), ``Q``. GQA:
    ``D·H·E + 2·D·K·E + H·E·D``; gains: 2E under QK-norm."""
    d, e, h, k, _, _ = _dims(cfg)
    if cfg.attention_type != "mla":
        return n_layers * (d * h * e + 2 * d * k * e + h * e * d), n_layers * 2 * e * cfg.qk_norm
    m = cfg.mla
    c, r, q = m.kv_lora_rank, m.qk_rope_head_dim, m.q_lora_rank
    q_path = d * q + q * h * m.qk_head_dim if q else d * h * m.qk_head_dim
    per_layer = q_path + c * h * (m.qk_nope_head_dim + m.v_head_dim) + h * m.v_head_dim * d
    return n_layers * per_layer + producers * d * (c + r), n_layers * q + producers * c


def _mtp_parameters(cfg: ModelConfig) -> int:
    """MTP modules: per depth two input norms, the 2D -> D projection, one full-attention
    block (its FFN MoE or dense as layer L + k's) and the output norm."""
    if not cfg.mtp_depth:
        return 0
    d, total = cfg.d_model, 0
    mc = cfg.moe
    for j in range(cfg.mtp_depth):
        matmul, gains = _attention_parameters(cfg, 1, 1)
        if mc.is_moe_layer(cfg.n_layers + j):
            ffn = mc.n_experts * d + 3 * d * cfg.expert_dim * (mc.n_shared_experts + mc.n_experts)
        else:
            ffn = 3 * d * cfg.ffn_dim
        total += 3 * d + 2 * d * d + matmul + gains + ffn + 2 * d
    return total


def parameter_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter count per component (all layers summed); ``lm_head`` is 0 when tied.
    ``qk_norm`` holds the attention's norm gains (QK-norm's, or MLA's latent norms)."""
    d, _, _, _, v, n = _dims(cfg)
    attention, gains = _attention_parameters(cfg, n, _mla_producers(cfg))
    return {
        "embedding": v * d,
        "attention": attention,
        "qk_norm": gains,
        "ffn": int(_ffn_parameters(cfg, active=False)),
        "norms": n * 2 * d + d,
        "lm_head": 0 if cfg.tie_embeddings else v * d,
        "mtp": _mtp_parameters(cfg),
    }


def parameter_count(cfg: ModelConfig, exclude_embeddings: bool = False) -> int:
    """Exact number of distinct parameters, as ``TransformerLM(cfg).num_parameters(...)``."""
    parts = parameter_breakdown(cfg)
    total = sum(parts.values())
    return total - parts["embedding"] if exclude_embeddings else total


def _experts_per_token(cfg: ModelConfig) -> float:
    """Routed experts a token runs through on average: top_k (token choice; capacity-dropped
    choices are computed and weighed 0 by lmforge's kernels), capacity_factor · top_k for
    expert choice (N experts × C slots over M tokens)."""
    mc = cfg.moe
    return mc.top_k * (mc.capacity_factor if mc.routing == "expert_choice" else 1.0)


def _ffn_parameters(cfg: ModelConfig, active: bool) -> float:
    """FFN weights of all layers: dense SwiGLUs, and per MoE layer the router (N·D), the shared
    experts and the routed experts (all N, or the ones a token uses when ``active``). Exact for
    a dense model (no MoE layer: an integer-valued float)."""
    mc, d = cfg.moe, cfg.d_model
    n_moe = sum(mc.is_moe_layer(i) for i in range(cfg.n_layers))
    dense = (cfg.n_layers - n_moe) * 3 * d * cfg.ffn_dim
    routed = _experts_per_token(cfg) if active else mc.n_experts
    per_moe = mc.n_experts * d + 3 * d * cfg.expert_dim * (mc.n_shared_experts + routed)
    return dense + n_moe * per_moe


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes of KV cache one token takes across all layers (the engine's paged cache): 2·K·E
    per layer (GQA) or C + R per KV-producing layer (MLA, ceil(L / kv_share_every) of them),
    through :func:`lmforge.model.cla.kv_bytes_per_token`. Linear-attention layers (constant
    state) count nothing."""
    from lmforge.model.cla import kv_bytes_per_token

    n_attn = sum(kind in "AW" for kind in cfg.layer_types)
    if cfg.attention_type == "mla":
        return kv_bytes_per_token(
            "mla", n_layers=n_attn, kv_lora_rank=cfg.kv_lora_rank,
            qk_rope_head_dim=cfg.qk_rope_head_dim, kv_share_every=cfg.kv_share_every,
            dtype_bytes=dtype_bytes,
        )  # fmt: skip
    return kv_bytes_per_token(
        "gqa", n_layers=n_attn, n_heads=cfg.n_heads, head_dim=int(cfg.head_dim),
        n_kv_heads=cfg.kv_heads, dtype_bytes=dtype_bytes,
    )  # fmt: skip


def active_parameter_count(cfg: ModelConfig, exclude_embeddings: bool = False) -> int:
    """Parameters one token's forward uses: the total minus the routed experts it skips
    (:func:`parameter_count` for a dense model)."""
    skipped = parameter_breakdown(cfg)["ffn"] - round(_ffn_parameters(cfg, active=True))
    return parameter_count(cfg, exclude_embeddings) - skipped


def matmul_parameters(cfg: ModelConfig) -> int:
    """N_matmul: weights used in matmuls (projections, FFN and the LM head, tied or not)."""
    parts = parameter_breakdown(cfg)
    return parts["attention"] + parts["ffn"] + cfg.vocab_size * cfg.d_model


# ---------------------------------------------------------------------------------------------
# FLOPs


def flops_breakdown(
    cfg: ModelConfig, seq_len: int, backward: bool = False, causal: bool = False
) -> dict[str, float]:
    """FLOPs per token per component (:data:`FLOP_COMPONENTS`), all layers summed.

    ``seq_len`` is the length of the sequences the tokens belong to (attention work grows with
    it). ``backward=True`` gives forward + backward (3× forward); ``causal=True`` halves the two
    attention terms (the work a causal kernel can skip).
    """
    d, e, h, k, v, n = _dims(cfg)
    attn_len = seq_len / 2 if causal else seq_len
    qk_dim, v_dim = e, e
    if cfg.attention_type == "mla":  # explicit form: every latent up-projected once (kv_b)
        qk_dim, v_dim = cfg.mla.qk_head_dim, cfg.mla.v_head_dim
        matmul, _ = _attention_parameters(cfg, n, _mla_producers(cfg))
        qkv = 2.0 * (matmul - n * h * v_dim * d)
    else:
        qkv = 2.0 * n * d * (h * e + 2 * k * e)
    fwd = {
        "embedding": 0.0,  # a row lookup, no arithmetic
        "qkv": qkv,
        "attn_scores": 2.0 * n * h * qk_dim * attn_len,  # one query row against T keys
        "attn_values": 2.0 * n * h * v_dim * attn_len,
        "output_proj": 2.0 * n * h * v_dim * d,
        # MoE: the active weights (top-k routed + shared experts + router) per token.
        "ffn": 2.0 * _ffn_parameters(cfg, active=True),
        "lm_head": 2.0 * d * v,
        # MTP (training): per depth the 2D -> D projection, one block, the shared LM head.
        "mtp": _mtp_flops(cfg, attn_len),
    }
    factor = 3.0 if backward else 1.0
    return {name: factor * value for name, value in fwd.items()}


def _mtp_flops(cfg: ModelConfig, attn_len: float) -> float:
    """Forward FLOPs per token of the MTP modules (dense FFN counted in full, MoE active)."""
    if not cfg.mtp_depth:
        return 0.0
    one = dataclasses.replace(cfg, n_layers=1, mtp_depth=0, kv_share_every=1)
    per = flops_breakdown(one, int(attn_len), causal=False)
    block = sum(per[key] for key in ("qkv", "attn_scores", "attn_values", "output_proj", "ffn"))
    return cfg.mtp_depth * (block + 2.0 * 2 * cfg.d_model * cfg.d_model + per["lm_head"])


def flops_per_token(
    cfg: ModelConfig, seq_len: int, backward: bool = True, causal: bool = False
) -> float:
    """Model FLOPs per token: ``6·N_matmul + 12·L·H·E·T`` with backward, a third of it without."""
    return sum(flops_breakdown(cfg, seq_len, backward, causal).values())


def model_flops_utilization(
    tokens_per_s: float, cfg: ModelConfig, seq_len: int, peak_flops: float
) -> float:
    """MFU: achieved model FLOP/s (training, forward + backward) over the hardware peak.

    ``peak_flops`` is the dense peak of all devices together (e.g. 989e12 per H100/H200 in bf16).
    Recomputation from activation checkpointing is not counted (that would be HFU).
    """
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    return tokens_per_s * flops_per_token(cfg, seq_len, backward=True) / peak_flops


# ---------------------------------------------------------------------------------------------
# Memory


@dataclasses.dataclass(frozen=True)
class Sharding:
    """How one model replica's training state and activations are split over GPUs.

    The factors applied on top of the one-device model of :func:`memory_estimate`: tensor and
    pipeline parallelism divide the parameters (and so their gradients and optimizer state) by
    tp·pp (even split, simplification); ZeRO stage ``zero`` over the ``dp`` replicas divides,
    from stage 1, the optimizer state (moments and fp32 master weights), from stage 2 also the
    gradients, from stage 3 (FSDP) also the weights. Activations: tp divides the per-head and
    FFN tensors (Megatron's column/row split, no sequence parallelism, so the d-wide norm and
    matmul inputs are replicated) and the vocabulary-parallel logits; a pipeline stage holds
    n_layers/pp blocks and the activations of ``in_flight`` micro-batches (1F1B: up to pp), and
    the figures are the last stage's (it also holds the LM head's input and the loss's logits).
    """

    dp: int = 1
    "data-parallel replicas"
    tp: int = 1
    "tensor-parallel degree"
    pp: int = 1
    "pipeline stages"
    zero: int = 0
    "ZeRO stage over dp: 0 (DDP), 1 (optimizer state), 2 (+ gradients), 3 (+ weights, FSDP)"
    in_flight: int = 1
    "micro-batches whose activations one pipeline stage holds at once"

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"Sharding.{name} must be ≥ 1, got {getattr(self, name)}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"Sharding.zero must be 0, 1, 2 or 3, got {self.zero}")


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of one training step's persistent state and saved activations (one GPU)."""

    parameters: int
    "the weights the model computes with: fp32, or bf16/fp16 with master weights"
    gradients: int
    "gradients, in the weights' dtype"
    optimizer: int
    "optimizer state (AdamW: two fp32 moments), plus the fp32 master weights when those are on"
    activations: int
    "tensors saved for backward, including the loss's logits and autocast weight copies"

    @property
    def total(self) -> int:
        """Sum of the four parts (allocator fragmentation and workspaces not included)."""
        return self.parameters + self.gradients + self.optimizer + self.activations


_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _layer_activation_bytes(
    cfg: ModelConfig,
    batch_size: int,
    seq_len: int,
    precision: Precision,
    fused_attention: bool,
    tp: int = 1,
) -> float:
    """Bytes one block saves for backward per token (reference norm/FFN code paths); the
    per-head and FFN terms divided by ``tp``, the d-wide ones replicated."""
    a = _BYTES[precision]
    autocast = precision != "fp32"
    d, e, h, k, f = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.kv_heads, cfg.ffn_dim
    # RMSNorm (fp32 math on the fp32 residual): its input, the normalised x and 1/rms.
    norm = 4 * (2 * d + 1)
    # The matmul inputs: autocast makes one bf16 copy per consuming matmul (q, k, v; w1, w3).
    attn_in = a * d * (3 if autocast else 1)
    ffn_in = a * d * (2 if autocast else 1)
    qk_norm = 4 * (2 * h * e + h + 2 * k * e + k) if cfg.qk_norm else 0
    # RoPE keeps, for q and for k, the gathered cos (fp32, (T, E/2)) and the signed sin pairs
    # ((T, E/2, 2)), shared by the rows of the batch.
    rope = 2 * 4 * (e // 2 + e) / batch_size
    if fused_attention:
        # q, k, v, the output and the fp32 log-sum-exp per head.
        attn = a * (2 * h * e + 2 * k * e) + 4 * h
    else:
        # q and the repeated k, v, plus the T-long score rows: masked scores and exp (fp32),
        # probabilities (compute dtype), and the row max.
        attn = a * 3 * h * e + (8 + a) * h * seq_len + 4 * h
    # RoPE's output keeps q's (B, T, H, E) memory order, and so does the fused attention's
    # output: output_proj's input is then a view of the tensor attention saved. The reference
    # attention's (B, H, T, E) output is copied by the reshape.
    out_proj_in = 0 if fused_attention else a * h * e
    # SwiGLU: w1 x, sigmoid(w1 x), silu(w1 x), w3 x and their product (w2's input).
    ffn = a * 5 * f
    sharded = (qk_norm + attn + out_proj_in + ffn) / tp
    return norm + attn_in + rope + norm + ffn_in + sharded


def activation_bytes(
    cfg: ModelConfig,
    batch_size: int,
    seq_len: int,
    precision: Precision = "bf16",
    activation_checkpointing: bool = False,
    fused_attention: bool | None = None,
    include_loss: bool = True,
    sharding: Sharding | None = None,
    master_weights: bool = False,
) -> int:
    """Bytes of activations saved for backward by one forward of ``batch_size × seq_len`` tokens.

    A model of what autograd keeps on the reference code paths (RMSNorm, SwiGLU, RoPE as written
    in :mod:`lmforge.model.layers`), checked against the measured saved tensors in the tests.
    ``precision`` is the autocast dtype (master weights stay fp32, so the residual stream and
    norms are fp32). ``fused_attention`` (default: any backend but ``reference``) means the
    T×T scores are not stored. ``include_loss`` adds the fp32 log-probabilities (V per token) a
    full-logit cross-entropy keeps. With ``activation_checkpointing`` each block keeps only its
    input and one block's activations exist at a time (during its recomputation).
    Under autocast over fp32 weights, autocast's low-precision copies of the matmul weights are
    saved too; with ``master_weights`` (the matmul weights themselves bf16, embeddings and norm
    gains fp32, so the residual stream stays fp32: ``lmforge.train.wrap.bf16_weight_copies``)
    there are none. ``sharding``: one GPU's share (:class:`Sharding`).
    Simplifications: masks, position ids and allocator rounding are ignored; the fused Triton
    RMSNorm, RoPE, SwiGLU and loss kernels save less than modelled; MoE layers are counted as
    dense SwiGLUs of width F.
    """
    sh = sharding or Sharding()
    if fused_attention is None:
        fused_attention = cfg.attention != "reference"
    tokens = batch_size * seq_len
    per_layer = _layer_activation_bytes(cfg, batch_size, seq_len, precision, fused_attention, sh.tp)
    a = _BYTES[precision]
    d = cfg.d_model
    layers = cfg.n_layers / sh.pp  # this stage's blocks (even split)
    final = 4 * (2 * d + 1) + a * d + 8  # ln_final, the LM head's input, the token ids (int64)
    loss = 4 * cfg.vocab_size / sh.tp if include_loss else 0
    if activation_checkpointing:
        blocks = layers * 4 * d + per_layer  # every block input (fp32), one block live
    else:
        blocks = layers * per_layer
    live_blocks = 1 if activation_checkpointing else layers
    copies = 0.0
    if precision != "fp32" and not master_weights:
        # autocast's bf16/fp16 copies of the matmul weights, saved for backward.
        head = cfg.vocab_size * d
        per_block = (matmul_parameters(cfg) - head) / cfg.n_layers
        copies = a * (head + per_block * live_blocks) / sh.tp
    return int(sh.in_flight * tokens * (blocks + final + loss) + copies)


def memory_estimate(
    cfg: ModelConfig,
    batch_size: int,
    seq_len: int,
    precision: Precision = "bf16",
    activation_checkpointing: bool = False,
    optimizer_states: int = 2,
    fused_attention: bool | None = None,
    *,
    master_weights: bool = False,
    sharding: Sharding | None = None,
    n_params: float | None = None,
) -> MemoryEstimate:
    """Training memory per GPU: weights, gradients, optimizer state and activations — the one
    memory model (``lmforge bench model`` and the planner, ``lmforge plan``, both read it).

    Per parameter: without ``master_weights`` (lmforge's default: fp32 parameters under
    autocast) 4 bytes of weights, 4 of gradients and 4·``optimizer_states`` of optimizer state
    (AdamW: 2, SGD with momentum: 1) = 16 for AdamW; with ``master_weights`` (the model in
    ``precision``, fp32 masters in the optimizer) 2 + 2 + 4·(``optimizer_states`` + 1) = 16,
    the ZeRO paper's accounting. ``sharding`` (default one device) divides each part as
    :class:`Sharding` says. Activations as in :func:`activation_bytes`. ``n_params`` replaces
    the exact count of ``cfg`` in the state terms (the planner's models given by size only).
    """
    sh = sharding or Sharding()
    n = (parameter_count(cfg) if n_params is None else n_params) / (sh.tp * sh.pp)
    low = _BYTES[precision] if master_weights else 4
    weights, grads = low * n, low * n
    optim = 4 * (optimizer_states + (1 if master_weights else 0)) * n
    if sh.zero >= 1:
        optim /= sh.dp
    if sh.zero >= 2:
        grads /= sh.dp
    if sh.zero >= 3:
        weights /= sh.dp
    acts = activation_bytes(
        cfg,
        batch_size,
        seq_len,
        precision,
        activation_checkpointing,
        fused_attention,
        sharding=sh,
        master_weights=master_weights,
    )
    return MemoryEstimate(
        parameters=int(weights), gradients=int(grads), optimizer=int(optim), activations=acts
    )
