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

Hybrid patterns (``model.layers``): each block's token mixer is counted by its letter
(:func:`mixer_parameters`, :func:`mixer_flops`: windows for W, top-k plus the indexer for S,
state-size terms for G, M and L), so the trainer's FLOPs/step hold for every pattern.

Exercised by ``pytest tests/test_accounting.py tests/test_accounting_hybrid.py`` (parameter counts against ``sum(p.numel())``,
FLOPs against ``torch.utils.flop_counter.FlopCounterMode`` and activations against the tensors
autograd actually saves).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from lmforge.model.config import ModelConfig
from lmforge.model.moe_config import MoEConfig

Precision = Literal["fp32", "bf16", "fp16"]

FLOP_COMPONENTS: tuple[str, ...] = (
    "embedding",
    "qkv",
    "attn_scores",
    "attn_values",
    "state",
    "indexer",
    "output_proj",
    "ffn",
    "lm_head",
    "mtp",
)
"""Keys of :func:`flops_breakdown`, in forward order."""

MIXER_COMPONENTS: tuple[str, ...] = (
    "qkv",
    "attn_scores",
    "attn_values",
    "state",
    "indexer",
    "output_proj",
)
"""The keys of :data:`FLOP_COMPONENTS` a block's token mixer fills (:func:`mixer_flops`)."""


# ---------------------------------------------------------------------------------------------
# Parameters


def _dims(cfg: ModelConfig) -> tuple[int, int, int, int, int, int]:
    """(D, E, H, K, V, L): model dim, head dim, heads, kv heads, vocab, layers."""
    return cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.kv_heads, cfg.vocab_size, cfg.n_layers


def _kv_producers(cfg: ModelConfig) -> int:
    """Layers that compute K/V or latents (all of them without CLA): ceil(L / kv_share_every)
    (CLA needs full-attention layers only)."""
    return -(-cfg.n_layers // cfg.kv_share_every)


def _attention_parameters(cfg: ModelConfig, n_layers: int, producers: int) -> tuple[int, int]:
    """(matmul weights, norm gains) of ``n_layers`` attention layers, ``producers`` of which
    compute K/V. MLA per layer: the q path ``D·H(N+R)`` (or ``D·Q + Q·H(N+R)``), ``D(C+R)``
    (producers), ``C·H(N+Ev)``, ``H·Ev·D``; gains: ``C`` (producers), ``Q``. GQA:
    ``D·H·E + H·E·D`` (+ ``D·H·E``: the output gate's W_gate), ``2·D·K·E`` (producers); gains
    under QK-norm: E (q), E (k, producers)."""
    d, e, h, k, _, _ = _dims(cfg)
    if cfg.attention_type != "mla":
        proj = d * h * e * (1 + cfg.attn_output_gate) + h * e * d
        gains = (n_layers + producers) * e * cfg.qk_norm
        return n_layers * proj + producers * 2 * d * k * e, gains
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
            ffn = _moe_layer_parameters(cfg, mc.n_experts)
        else:
            ffn = 3 * d * cfg.ffn_dim
        total += 3 * d + 2 * d * d + matmul + gains + ffn + 2 * d
    return total


def _softmax_attention_parameters(cfg: ModelConfig) -> tuple[int, int]:
    """(matmul weights, norm gains) of the A/W/S blocks' attention (GQA or MLA; with CLA only
    ceil(L / k) layers compute K/V or latents)."""
    n_attn = _attention_layers(cfg)
    producers = _kv_producers(cfg) if cfg.kv_share_every > 1 else n_attn
    return _attention_parameters(cfg, n_attn, producers)


def _other_mixer_parameters(cfg: ModelConfig, matmul_only: bool) -> int:
    """The S blocks' indexers and the linear mixers (G, M, L) of a hybrid pattern."""
    total = 0
    for kind in cfg.layer_types:
        if kind == "S":
            total += _indexer_parameters(cfg)
        elif kind not in "AW":
            total += mixer_parameters(cfg, kind, matmul_only=matmul_only)
    return total


def parameter_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter count per component (all layers summed); ``lm_head`` is 0 when tied.
    ``attention`` holds every block's token mixer (softmax attention, GQA or MLA, with S layers'
    indexers, and the linear mixers of a hybrid pattern); ``qk_norm`` the attention's norm
    gains (QK-norm's, or MLA's latent norms)."""
    d, _, _, _, v, n = _dims(cfg)
    attention, gains = _softmax_attention_parameters(cfg)
    return {
        "embedding": v * d,
        "attention": attention + _other_mixer_parameters(cfg, matmul_only=False),
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
    experts (and their gate) and the routed experts (all N, or the ones a token uses when
    ``active``). Exact for a dense model (no MoE layer: an integer-valued float)."""
    mc, d = cfg.moe, cfg.d_model
    n_moe = sum(mc.is_moe_layer(i) for i in range(cfg.n_layers))
    dense = (cfg.n_layers - n_moe) * 3 * d * cfg.ffn_dim
    routed = _experts_per_token(cfg) if active else mc.n_experts
    return dense + n_moe * _moe_layer_parameters(cfg, routed)


def _moe_layer_parameters(cfg: ModelConfig, routed: float) -> float:
    """One MoE layer with ``routed`` experts counted: the router (N·D), the shared experts and
    their gate (D, ``moe.shared_gate``), the routed experts (3·D·F each)."""
    mc, d = cfg.moe, cfg.d_model
    gate = d if mc.shared_gate else 0
    return mc.n_experts * d + gate + 3 * d * cfg.expert_dim * (mc.n_shared_experts + routed)


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes of KV cache one token takes across all layers (the engine's paged cache): 2·K·E
    (GQA) or C + R (MLA) per KV-producing layer (all of them, or ceil(L / kv_share_every) with
    CLA), through :func:`lmforge.model.cla.kv_bytes_per_token`. Linear-attention layers (constant
    state) count nothing, nor do W layers beside A/S layers (a ring per sequence, constant in
    its length); a DSA layer (S) counts its K/V and its E_I-wide indexer key."""
    from lmforge.model.cla import kv_bytes_per_token
    from lmforge.model.kv_cache import paged_kv_layers

    n_sparse = cfg.layer_types.count("S")
    n_attn = paged_kv_layers(cfg.layer_types) - n_sparse  # A and paged W layers
    if cfg.attention_type == "mla":
        return kv_bytes_per_token(
            "mla", n_layers=n_attn, kv_lora_rank=cfg.kv_lora_rank,
            qk_rope_head_dim=cfg.qk_rope_head_dim, kv_share_every=cfg.kv_share_every,
            dtype_bytes=dtype_bytes,
        )  # fmt: skip
    return n_sparse * cfg.dsa_index_dim * dtype_bytes + kv_bytes_per_token(
        "gqa", n_layers=n_attn + n_sparse, n_heads=cfg.n_heads, head_dim=int(cfg.head_dim),
        n_kv_heads=cfg.kv_heads, kv_share_every=cfg.kv_share_every, dtype_bytes=dtype_bytes,
    )  # fmt: skip


def active_parameter_count(cfg: ModelConfig, exclude_embeddings: bool = False) -> int:
    """Parameters one token's forward uses: the total minus the routed experts it skips
    (:func:`parameter_count` for a dense model)."""
    skipped = parameter_breakdown(cfg)["ffn"] - round(_ffn_parameters(cfg, active=True))
    return parameter_count(cfg, exclude_embeddings) - skipped


def matmul_parameters(cfg: ModelConfig) -> int:
    """N_matmul: weights used in matmuls (projections, FFN and the LM head, tied or not)."""
    parts = parameter_breakdown(cfg)
    attention, _ = _softmax_attention_parameters(cfg)
    mixers = attention + _other_mixer_parameters(cfg, matmul_only=True)
    return mixers + parts["ffn"] + cfg.vocab_size * cfg.d_model


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
    d, v = cfg.d_model, cfg.vocab_size
    attn_len = seq_len / 2 if causal else seq_len
    mixers = [mixer_flops(cfg, kind, seq_len, causal) for kind in cfg.layer_types]
    fwd = {
        "embedding": 0.0,  # a row lookup, no arithmetic
        **{c: sum(m.get(c, 0.0) for m in mixers) for c in MIXER_COMPONENTS},
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
    total = 0.0
    for j in range(cfg.mtp_depth):
        # module j's block is layer L + j: MoE or dense as the trunk's layer of that index
        # would be (after moe.first_dense_layers, at moe.every), counted as a one-layer model
        moe = cfg.moe.is_moe_layer(cfg.n_layers + j)
        mc = dataclasses.replace(cfg.moe, first_dense_layers=0, every=1) if moe else MoEConfig()
        one = dataclasses.replace(cfg, n_layers=1, mtp_depth=0, kv_share_every=1, moe=mc)
        per = flops_breakdown(one, int(attn_len), causal=False)
        keys = ("qkv", "attn_scores", "attn_values", "output_proj", "ffn")
        total += sum(per[k] for k in keys) + 2.0 * 2 * cfg.d_model * cfg.d_model + per["lm_head"]
    return total


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
# Hybrid layers: the token mixer of each block by its letter in ``model.layers``


def _attention_layers(cfg: ModelConfig) -> int:
    """Blocks whose mixer is softmax attention (A, W, S: the ones with QK-norm gains)."""
    return sum(kind in "AWS" for kind in cfg.layer_types)


def _linear_dims(cfg: ModelConfig) -> tuple[int, int]:
    """(heads, head width) of the L mixers (of a G mixer's q and k)."""
    return cfg.linear_dims[:2]


def _ssm_dims(cfg: ModelConfig) -> tuple[int, int, int]:
    """(inner width, heads, conv channels) of the M mixer (Mamba-2, one B/C group)."""
    inner = cfg.ssm_expand * cfg.d_model
    return inner, inner // cfg.ssm_head_dim, inner + 2 * cfg.ssm_state


def _indexer_parameters(cfg: ModelConfig) -> int:
    """An S block's lightning indexer: J query heads, one key, J weights (D -> J·E_I, E_I, J)."""
    j, ei = cfg.dsa_index_heads, cfg.dsa_index_dim
    return cfg.d_model * (j * ei + ei + j)


def mixer_parameters(cfg: ModelConfig, kind: str, matmul_only: bool = False) -> int:
    """Parameters of one block's token mixer of type ``kind`` (a letter of
    :data:`lmforge.model.config.LAYER_TYPES`), QK-norm gains excluded (``parameter_breakdown``
    counts them apart); ``matmul_only``: only the projection matrices (N_matmul's share)."""
    d, e, h, k = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.kv_heads
    w = cfg.conv_size
    if kind in "AWS":
        if cfg.attention_type == "mla":  # one MLA layer (every one a producer here)
            proj = _attention_parameters(cfg, 1, 1)[0]
        else:  # q (and the output gate's W_gate), k, v, o
            proj = d * h * e * (1 + cfg.attn_output_gate) + 2 * d * k * e + h * e * d
        return proj + (_indexer_parameters(cfg) if kind == "S" else 0)
    if kind == "G":  # q, k (D -> H_k·K), v, z (D -> H·V), β and decay (D -> H), o (H·V -> D)
        kh, kd, vh, vd = cfg.linear_dims
        key, value = kh * kd, vh * vd
        proj = 2 * d * key + 3 * d * value + 2 * d * vh
        # the conv over q|k|v, A_log and dt_bias per value head, the per-head output norm
        return proj if matmul_only else proj + (2 * key + value) * w + 2 * vh + vd
    if kind == "L":  # q, k, v (D -> H·E), o (H·E -> D)
        lh, le = _linear_dims(cfg)
        proj = 4 * d * lh * le
        return proj if matmul_only else proj + le  # + the per-head output norm
    if kind == "M":  # in-proj (D -> z|x B C|Δ), out-proj (inner -> D)
        inner, mh, conv = _ssm_dims(cfg)
        proj = d * (inner + conv + mh) + inner * d
        # the conv (weights and bias), A_log, dt_bias and the skip D per head, the gated norm
        return proj if matmul_only else proj + conv * (w + 1) + 3 * mh + inner
    raise ValueError(f"unknown layer type {kind!r}")


def _keys_seen(keys: int, seq_len: int, causal: bool) -> float:
    """Keys per query of a kernel that scores ``keys`` ≤ T of them (a band or a top-k): all of
    them, or with ``causal`` the band's area per row, k − k²/(2T) (T/2 at k = T, as full
    attention's causal halving)."""
    keys = min(keys, seq_len)
    return keys - keys * keys / (2 * seq_len) if causal else float(keys)


def mixer_flops(
    cfg: ModelConfig, kind: str, seq_len: int, causal: bool = False
) -> dict[str, float]:
    """Forward FLOPs per token of one block's token mixer of type ``kind``, by component
    (a subset of :data:`FLOP_COMPONENTS`).

    A: the T×T score and value matmuls (T/2 with ``causal``); W: min(window, T) keys per query
    (the band a windowed kernel computes); S: top-k keys per query plus the lightning indexer
    (its projections, J·E_I-wide scores against every key, and the weighted ReLU sum, 2·J per
    key). The linear mixers are counted in their recurrent form, the model's arithmetic per
    token (the chunked kernels do more in exchange for matmuls, as attention's causal kernels
    do less than the dense count): the "state" term is, per head with a K×V state, 4·K·V for
    L and M (write k vᵀ, read Sᵀ q) and 6·K·V for G (the delta rule also reads Sᵀ k; one
    state per value head with grouped value heads, ``linear_v_heads``); the short convolutions
    (2·channels·width) join "qkv". Gates, norms and decays are elementwise and not counted, as
    elsewhere in this module.
    """
    d, e, h, k = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.kv_heads
    if kind in "AWS":
        keys = {"A": seq_len, "W": cfg.window, "S": cfg.dsa_topk}[kind]
        seen = seq_len / 2 if causal and kind == "A" else _keys_seen(keys, seq_len, causal)
        # CLA: a share of the layers computes K/V (latents), the others reuse them
        producers = _kv_producers(cfg) / cfg.n_layers
        # q, k, v (and the output gate's x W_gate, counted here with the input projections)
        qkv = 2.0 * d * (h * e * (1 + cfg.attn_output_gate) + producers * 2 * k * e)
        qk_dim, v_dim = e, e
        if cfg.attention_type == "mla":  # explicit form: every latent up-projected once (kv_b)
            qk_dim, v_dim = cfg.mla.qk_head_dim, cfg.mla.v_head_dim
            m = cfg.mla
            q, c, r = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
            q_path = d * q + q * h * qk_dim if q else d * h * qk_dim
            qkv = 2.0 * (q_path + c * h * (m.qk_nope_head_dim + v_dim) + producers * d * (c + r))
        out = {
            "qkv": qkv,
            "attn_scores": 2.0 * h * qk_dim * seen,  # one query row against its keys
            "attn_values": 2.0 * h * v_dim * seen,
            "output_proj": 2.0 * h * v_dim * d,
        }
        if kind == "S":
            j, ei = cfg.dsa_index_heads, cfg.dsa_index_dim
            every = seq_len / 2 if causal else seq_len  # the indexer scores every past key
            out["indexer"] = 2.0 * d * (j * ei + ei + j) + 2.0 * j * ei * every + 2.0 * j * every
        return out
    w = cfg.conv_size
    if kind == "G":  # the state per value head: K × V (q and k repeated to the value heads)
        kh, kd, vh, vd = cfg.linear_dims
        key, value = kh * kd, vh * vd
        qkv = 2.0 * d * (2 * key + 2 * value + 2 * vh) + 2.0 * (2 * key + value) * w
        return {"qkv": qkv, "state": 6.0 * vh * kd * vd, "output_proj": 2.0 * value * d}
    if kind == "L":
        lh, le = _linear_dims(cfg)
        inner = lh * le
        return {"qkv": 6.0 * d * inner, "state": 4.0 * lh * le * le, "output_proj": 2.0 * inner * d}
    if kind == "M":
        inner, mh, conv = _ssm_dims(cfg)
        return {
            "qkv": 2.0 * d * (inner + conv + mh) + 2.0 * conv * w,
            "state": 4.0 * mh * cfg.ssm_state * cfg.ssm_head_dim,
            "output_proj": 2.0 * inner * d,
        }
    raise ValueError(f"unknown layer type {kind!r}")


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
