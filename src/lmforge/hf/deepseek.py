"""DeepSeek-V2/V3 multi-head latent attention weights between transformers and lmforge.

Maps one ``DeepseekV3Attention`` (transformers' ``modeling_deepseek_v3``) onto
:class:`lmforge.model.mla.MultiHeadLatentAttention` and back:

=========================  =====================
HF (``self_attn.``)        lmforge
=========================  =====================
q_proj (q_lora_rank None)  q_proj
q_a_proj                   q_a_proj
q_a_layernorm              q_a_norm
q_b_proj                   q_b_proj
kv_a_proj_with_mqa         kv_a_proj
kv_a_layernorm             kv_a_norm
kv_b_proj                  kv_b_proj
o_proj                     output_proj
=========================  =====================

RoPE: lmforge rotates consecutive pairs ``(x[2i], x[2i+1])`` of the R rope dims. transformers'
``rope_interleave=True`` (DeepSeek-V3's default and DeepSeek's own reference code) rotates the
same pairs (its ``apply_rotary_pos_emb_interleave`` then writes them out de-interleaved, for
q and k alike, which leaves q·k unchanged): the weights map as they are. With
``rope_interleave=False`` HF pairs ``x[i]`` with ``x[i + R/2]`` (rotate-half), so the rope rows
of ``q_b_proj``/``q_proj`` (per head) and of ``kv_a_proj_with_mqa`` (its last R rows) are
permuted (:func:`lmforge.hf.convert.rope_permutation`). Refused with one line: YaRN or any
other RoPE scaling (its ``mscale²`` softmax factor is not modelled), ``attention_bias``.

Whole models (``lmforge hf import/export`` dispatch here for ``model_type = deepseek_v3`` and
``ModelConfig(attention_type="mla")``): embeddings, norms, the dense SwiGLU MLPs and the LM head
are named as for Llama (:mod:`lmforge.hf.convert`); MTP module k (``mtp.layers.k.``) is
DeepSeek-V3's ``model.layers.{L + k}.`` with ``enorm``, ``hnorm``, ``eh_proj``, the block's own
names and ``shared_head.norm`` (checkpoints also carry copies of the embedding and head there,
``embed_tokens`` and ``shared_head.head``: written on export, checked to be present and skipped on
import). transformers' ``DeepseekV3ForCausalLM`` does not run MTP modules (it ignores those keys),
so their round trip is tested by name.

MoE (``first_k_dense_replace < num_hidden_layers``; lmforge ``model.moe`` with ``score =
"sigmoid"``): ``DeepseekV3MoE`` of layer i (and of every MTP module: its index L + k is past the
dense layers) is :class:`lmforge.model.moe.MoEFFN`:

=======================================  ===========================================
HF (``model.layers.i.mlp.``)             lmforge (``layers.i.ffn.``)
=======================================  ===========================================
gate.weight                              router.weight
gate.e_score_correction_bias             expert_bias (selects experts, never weighs)
experts.e.{gate,up,down}_proj.weight     w1[e], w3[e], w2[e] (fused gate_up_proj too)
shared_experts.{gate,up,down}_proj       shared.{w1,w3,w2} (width n_shared · F)
=======================================  ===========================================

config.json ↔ ``model.moe``: n_routed_experts ↔ n_experts, num_experts_per_tok ↔ top_k,
moe_intermediate_size ↔ expert_d_ff, n_shared_experts, first_k_dense_replace ↔
first_dense_layers, n_group ↔ n_groups, topk_group ↔ top_groups, routed_scaling_factor ↔
routed_scale, norm_topk_prob ↔ norm_top_k, aux_loss_alpha ↔ aux_loss_coef (a training option;
DeepSeek's is sequence-wise, lmforge's batch-wise). ``bias_update_rate`` (DeepSeek's γ, training
only) is not stored: set it to keep aux-loss-free balancing while fine-tuning. Refused in one
line: a scoring_func other than sigmoid, a topk_method other than noaux_tc, moe_layer_freq ≠ 1;
on export softmax scores, non-token-choice routings, ``moe.every > 1``, fewer than 2 experts per
group, MoE only in the MTP modules, a gated shared expert (``moe.shared_gate``). Also refused: cross-layer sharing, a logit soft-cap.

Exercised by ``pytest tests/test_mla_hf.py tests/test_deepseek_moe_hf.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lmforge.hf._moe import stacked_from_hf, stacked_to_hf
from lmforge.hf._rope import rope_permutation
from lmforge.model.config import ModelConfig
from lmforge.model.mla import MLAConfig
from lmforge.model.moe_config import MoEConfig
from lmforge.utils.errors import LmforgeError

__all__ = [
    "deepseek_config_from_hf",
    "deepseek_config_to_hf",
    "deepseek_state_from_hf",
    "deepseek_state_to_hf",
    "mla_config_from_hf",
    "mla_state_from_hf",
    "mla_state_to_hf",
    "mtp_depth_present",
]

_NAMES = {  # HF suffix -> lmforge suffix
    "q_proj.weight": "q_proj.weight",
    "q_a_proj.weight": "q_a_proj.weight",
    "q_a_layernorm.weight": "q_a_norm.weight",
    "q_b_proj.weight": "q_b_proj.weight",
    "kv_a_proj_with_mqa.weight": "kv_a_proj.weight",
    "kv_a_layernorm.weight": "kv_a_norm.weight",
    "kv_b_proj.weight": "kv_b_proj.weight",
    "o_proj.weight": "output_proj.weight",
}


def _get(hf: Any, key: str, default: Any = None) -> Any:
    return hf.get(key, default) if isinstance(hf, Mapping) else getattr(hf, key, default)


def mla_config_from_hf(hf: Any, *, where: str = "DeepSeek config") -> MLAConfig:
    """The :class:`MLAConfig` of a ``DeepseekV3Config`` (object or ``config.json`` dict);
    unsupported options are one :class:`LmforgeError` line naming ``where``."""
    if _get(hf, "attention_bias", False):
        raise LmforgeError(f"{where}: attention_bias=true is not supported by lmforge's MLA")
    rope = _get(hf, "rope_parameters") or _get(hf, "rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise LmforgeError(
            f"{where}: RoPE scaling '{rope_type}' (e.g. DeepSeek-V3's YaRN with its mscale) is not"
            " supported by lmforge's MLA"
        )
    theta = rope.get("rope_theta", _get(hf, "rope_theta", 10000.0))
    try:
        cfg = MLAConfig(
            d_model=int(_get(hf, "hidden_size")),
            n_heads=int(_get(hf, "num_attention_heads")),
            kv_lora_rank=int(_get(hf, "kv_lora_rank")),
            q_lora_rank=int(_get(hf, "q_lora_rank") or 0),
            qk_nope_head_dim=int(_get(hf, "qk_nope_head_dim")),
            qk_rope_head_dim=int(_get(hf, "qk_rope_head_dim")),
            v_head_dim=int(_get(hf, "v_head_dim")),
            rope_theta=float(theta),
            norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)),
            max_seq_len=int(_get(hf, "max_position_embeddings", 4096)),
        )
    except (TypeError, ValueError) as e:
        raise LmforgeError(f"{where}: missing or malformed MLA field ({e})") from None
    try:
        return cfg.validate()
    except LmforgeError as e:
        raise LmforgeError(f"{where}: {e}") from None


def _rope_rows(cfg: MLAConfig, name: str) -> tuple[int, int, int] | None:
    """(heads, rows per head, first rope row within a head) of a tensor with rope rows."""
    if name in ("q_proj.weight", "q_b_proj.weight"):
        return cfg.n_heads, cfg.qk_head_dim, cfg.qk_nope_head_dim
    if name == "kv_a_proj.weight":
        return 1, cfg.latent_dim, cfg.kv_lora_rank
    return None


def _permute_rope(t: torch.Tensor, cfg: MLAConfig, name: str, order: torch.Tensor) -> torch.Tensor:
    spec = _rope_rows(cfg, name)
    if spec is None:
        return t
    heads, rows, first = spec
    w = t.reshape(heads, rows, -1).clone()  # (H, N+R, D_in)
    w[:, first:] = w[:, first:][:, order]
    return w.reshape(t.shape)


def mla_state_from_hf(
    hf_state: Mapping[str, torch.Tensor],
    cfg: MLAConfig,
    *,
    rope_interleave: bool = True,
    prefix: str = "",
) -> dict[str, torch.Tensor]:
    """The lmforge state dict of one MLA layer from HF tensors named ``prefix + <hf name>``
    (e.g. ``model.layers.3.self_attn.``); fp32. A missing tensor is one LmforgeError line."""
    inv = torch.argsort(rope_permutation(cfg.qk_rope_head_dim))
    names = dict(_NAMES)
    if cfg.q_lora_rank:
        del names["q_proj.weight"]
    else:
        for k in ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"):
            del names[k]
    out = {}
    for hf_name, lm_name in names.items():
        key = prefix + hf_name
        if key not in hf_state:
            raise LmforgeError(f"DeepSeek MLA weights: missing tensor '{key}'")
        t = hf_state[key].float()
        if not rope_interleave:
            t = _permute_rope(t, cfg, lm_name, inv)
        out[lm_name] = t.contiguous()
    return out


def mla_state_to_hf(
    state: Mapping[str, torch.Tensor],
    cfg: MLAConfig,
    *,
    rope_interleave: bool = True,
    prefix: str = "",
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`mla_state_from_hf`: an MLA module's state dict in HF names."""
    perm = rope_permutation(cfg.qk_rope_head_dim)
    out = {}
    for hf_name, lm_name in _NAMES.items():
        if lm_name not in state:
            continue
        t = state[lm_name]
        if not rope_interleave:
            t = _permute_rope(t, cfg, lm_name, perm)
        out[prefix + hf_name] = t.contiguous()
    return out


# ---- whole DeepSeek-V3-style models --------------------------------------------------------


def deepseek_config_to_hf(cfg: ModelConfig, eos_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of the ``DeepseekV3ForCausalLM`` equal to an MLA ``cfg``: its MoE
    keys from ``cfg.moe`` (:func:`_moe_to_hf`; a dense model writes ``first_k_dense_replace =
    num_hidden_layers``); what DeepSeek-V3 cannot represent is one line."""
    for what, bad in (
        (
            "model.kv_share_every > 1 (DeepSeek-V3 has no cross-layer sharing)",
            cfg.kv_share_every > 1,
        ),
        ("model.logit_soft_cap", cfg.logit_soft_cap is not None),
        ("model.layers other than A", set(cfg.layers) != {"A"}),
    ):
        if bad:
            raise LmforgeError(f"cannot export as DeepSeek-V3: {what} is set")
    out: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "moe_intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank or None,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        **_moe_to_hf(cfg),
        "num_nextn_predict_layers": cfg.mtp_depth,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.context_length,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "rope_interleave": True,  # lmforge's own layout: the weights map unpermuted
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if eos_token_id is not None:
        out["eos_token_id"] = eos_token_id
        out["bos_token_id"] = eos_token_id
    return out


def _moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The MoE keys of ``config.json`` (a dense model's when no block of ``cfg`` is MoE)."""
    mc = cfg.moe
    if not any(mc.is_moe_layer(i) for i in range(cfg.n_layers + cfg.mtp_depth)):
        return {
            "first_k_dense_replace": cfg.n_layers,
            "n_routed_experts": 1,
            "n_shared_experts": 0,
            "num_experts_per_tok": 1,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.0,
        }
    for what, bad in (
        (
            f"model.moe.score = '{mc.score}' (DeepSeek-V3's router is sigmoid)",
            mc.score != "sigmoid",
        ),
        (f"model.moe.routing = '{mc.routing}' (DeepSeek-V3: top-k)", mc.routing != "token_choice"),
        ("model.moe.shared_gate (DeepSeek-V3's shared experts are not gated)", mc.shared_gate),
        ("model.moe.every > 1 (DeepSeek-V3: every layer past the dense ones is MoE)", mc.every > 1),
        (
            "fewer than 2 experts per group (DeepSeek-V3 scores a group by its top-2 experts)",
            mc.n_experts // mc.n_groups < 2,
        ),
        (
            "model.moe.first_dense_layers >= model.n_layers with MoE MTP modules (DeepSeek-V3"
            " reads that as a dense model)",
            mc.first_dense_layers >= cfg.n_layers,
        ),
    ):
        if bad:
            raise LmforgeError(f"cannot export as DeepSeek-V3: {what}")
    return {
        "first_k_dense_replace": mc.first_dense_layers,
        "moe_intermediate_size": cfg.expert_dim,
        "n_routed_experts": mc.n_experts,
        "n_shared_experts": mc.n_shared_experts,
        "num_experts_per_tok": mc.top_k,
        "n_group": mc.n_groups,
        "topk_group": mc.top_groups,
        "routed_scaling_factor": mc.routed_scale,
        "norm_topk_prob": mc.norm_top_k,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "moe_layer_freq": 1,
        "aux_loss_alpha": mc.aux_loss_coef,
    }


def _moe_from_hf(hf: Mapping[str, Any], n_layers: int, where: str) -> MoEConfig:
    """``model.moe`` of a DeepSeek-V3 ``config.json``: dense (the default) when no trunk layer
    is MoE. A key config.json leaves out takes transformers' ``DeepseekV3Config`` default (what
    transformers itself would run), not lmforge's."""
    first = int(_number(hf, "first_k_dense_replace", where, 3))
    n = int(hf.get("n_routed_experts") or 0)
    if first >= n_layers or n == 0:
        return MoEConfig()
    for key, want in (
        ("scoring_func", "sigmoid"),
        ("topk_method", "noaux_tc"),
        ("moe_layer_freq", 1),
    ):
        if key in hf and hf[key] != want:
            raise LmforgeError(
                f"{where}: {key} = {hf[key]!r} is not supported (lmforge and transformers'"
                f" DeepseekV3 route with {key} = {want!r})"
            )
    try:
        return MoEConfig(
            n_experts=n,
            top_k=_number(hf, "num_experts_per_tok", where),
            n_shared_experts=_number(hf, "n_shared_experts", where, 1),
            expert_d_ff=_number(hf, "moe_intermediate_size", where),
            first_dense_layers=first,
            score="sigmoid",
            norm_top_k=bool(hf.get("norm_topk_prob", True)),
            routed_scale=float(_number(hf, "routed_scaling_factor", where, 2.5, float)),
            n_groups=_number(hf, "n_group", where, 8),
            top_groups=_number(hf, "topk_group", where, 4),
            aux_loss_coef=float(_number(hf, "aux_loss_alpha", where, 0.0, float)),
        )
    except ValueError as e:
        raise LmforgeError(f"{where}: {e}") from None


def _number(
    hf: Mapping[str, Any], key: str, where: str, default: Any = None, kind: type = int
) -> Any:
    """``hf[key]`` as ``kind`` (``default`` when absent or null; none: required), else one line."""
    value = hf.get(key)
    if value is None and default is not None:
        return default
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise LmforgeError(f"{where}: {key} = {value!r} is missing or not a number") from None


def deepseek_config_from_hf(
    hf: Mapping[str, Any], where: str = "config.json", context_length: int | None = None
) -> ModelConfig:
    """The lmforge :class:`ModelConfig` of a DeepSeek-V3 ``config.json`` dict (one line for
    anything lmforge cannot represent)."""
    mla = mla_config_from_hf(hf, where=where)
    n_layers = int(hf.get("num_hidden_layers", 0))
    moe = _moe_from_hf(hf, n_layers, where)
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise LmforgeError(f"{where}: hidden_act '{act}' is not supported (SwiGLU needs silu)")
    d, h = mla.d_model, mla.n_heads
    try:
        return ModelConfig(
            vocab_size=int(hf["vocab_size"]),
            context_length=int(context_length or hf.get("max_position_embeddings", 2048)),
            d_model=d,
            n_layers=n_layers,
            n_heads=h,
            head_dim=None if d % h == 0 and (d // h) % 2 == 0 else mla.v_head_dim,
            d_ff=int(hf["intermediate_size"]),
            rope_theta=mla.rope_theta,
            norm_eps=mla.norm_eps,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention="sdpa",
            attention_type="mla",
            kv_lora_rank=mla.kv_lora_rank,
            q_lora_rank=mla.q_lora_rank,
            qk_nope_head_dim=mla.qk_nope_head_dim,
            qk_rope_head_dim=mla.qk_rope_head_dim,
            v_head_dim=mla.v_head_dim,
            mtp_depth=int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0),
            moe=moe,
        )
    except KeyError as e:
        raise LmforgeError(f"{where}: missing key {e.args[0]!r}") from None
    except ValueError as e:
        raise LmforgeError(f"{where}: {e}") from None


_DENSE = {  # lmforge FFN suffix -> HF suffix (a dense SwiGLU, a block's or the shared experts')
    "w1.weight": "gate_proj.weight",
    "w3.weight": "up_proj.weight",
    "w2.weight": "down_proj.weight",
}
_MTP = {  # lmforge MTP-module suffix -> HF suffix of model.layers.{L + k}
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "proj.weight": "eh_proj.weight",
    "norm_out.weight": "shared_head.norm.weight",
}
_MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # the shared emb/head, again


def _blocks(cfg: ModelConfig) -> list[tuple[int, str, str]]:
    """(layer index, lmforge prefix, HF prefix) of every block, the MTP modules' included."""
    out = [(i, f"layers.{i}.", f"model.layers.{i}.") for i in range(cfg.n_layers)]
    for k in range(cfg.mtp_depth):
        i = cfg.n_layers + k
        out.append((i, f"mtp.layers.{k}.block.", f"model.layers.{i}."))
    return out


def _block_pairs(cfg: ModelConfig, i: int, lm: str, hf: str) -> list[tuple[str, str]]:
    """(lmforge, HF) names of block ``i``'s norms and FFN (an MoE layer's stacked experts
    aside: :func:`_expert_prefixes`)."""
    pairs = [(lm + "ln1.weight", hf + "input_layernorm.weight")]
    pairs.append((lm + "ln2.weight", hf + "post_attention_layernorm.weight"))
    if not cfg.moe.is_moe_layer(i):
        return pairs + [(f"{lm}ffn.{a}", f"{hf}mlp.{b}") for a, b in _DENSE.items()]
    pairs.append((lm + "ffn.router.weight", hf + "mlp.gate.weight"))
    pairs.append((lm + "ffn.expert_bias", hf + "mlp.gate.e_score_correction_bias"))
    if cfg.moe.n_shared_experts:
        pairs += [(f"{lm}ffn.shared.{a}", f"{hf}mlp.shared_experts.{b}") for a, b in _DENSE.items()]
    return pairs


def _expert_prefixes(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(lmforge ``…ffn.``, HF ``…mlp.experts.``) of every MoE block."""
    return [
        (lm + "ffn.", hf + "mlp.experts.") for i, lm, hf in _blocks(cfg) if cfg.moe.is_moe_layer(i)
    ]


def _pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(lmforge, HF) names of every tensor but the attention's (mapped by the MLA functions)
    and the stacked experts' (:mod:`lmforge.hf._moe`)."""
    pairs = [("token_embeddings.weight", "model.embed_tokens.weight")]
    for i, lm, hf in _blocks(cfg):
        if i >= cfg.n_layers:  # an MTP module: its own norms and projection, then its block
            mtp = f"mtp.layers.{i - cfg.n_layers}."
            pairs += [(mtp + a, hf + b) for a, b in _MTP.items()]
        pairs += _block_pairs(cfg, i, lm, hf)
    pairs.append(("ln_final.weight", "model.norm.weight"))
    if not cfg.tie_embeddings:
        pairs.append(("lm_head.weight", "lm_head.weight"))
    return pairs


def _empty_shared(cfg: ModelConfig, hf: str) -> dict[str, torch.Tensor]:
    """The zero-width shared experts transformers builds (and saves) for n_shared_experts = 0."""
    d = cfg.d_model
    return {
        hf + "mlp.shared_experts.gate_proj.weight": torch.zeros(0, d),
        hf + "mlp.shared_experts.up_proj.weight": torch.zeros(0, d),
        hf + "mlp.shared_experts.down_proj.weight": torch.zeros(d, 0),
    }


def _attention_prefixes(cfg: ModelConfig) -> list[tuple[str, str]]:
    out = [(f"layers.{i}.attn.", f"model.layers.{i}.self_attn.") for i in range(cfg.n_layers)]
    for k in range(cfg.mtp_depth):
        out.append((f"mtp.layers.{k}.block.attn.", f"model.layers.{cfg.n_layers + k}.self_attn."))
    return out


def deepseek_state_to_hf(
    state: Mapping[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """An MLA TransformerLM's state dict in DeepSeek-V3 names (``rope_interleave=True``)."""
    deepseek_config_to_hf(cfg)  # refuses what DeepSeek-V3 cannot represent, before any copy
    out: dict[str, torch.Tensor] = {}
    for lm_name, hf_name in _pairs(cfg):
        if lm_name not in state:
            raise LmforgeError(f"model state has no '{lm_name}' (not an lmforge MLA model?)")
        out[hf_name] = state[lm_name].detach().to("cpu").contiguous()
    for lm, hf in _expert_prefixes(cfg):
        out.update(stacked_to_hf(state, lm, hf))
        if not cfg.moe.n_shared_experts:
            out.update(_empty_shared(cfg, hf.removesuffix("mlp.experts.")))
    for lm, hf in _attention_prefixes(cfg):
        sub = {k[len(lm) :]: v.detach().to("cpu") for k, v in state.items() if k.startswith(lm)}
        out.update(mla_state_to_hf(sub, cfg.mla, prefix=hf))
    head = state["lm_head.weight"] if "lm_head.weight" in state else None
    for k in range(cfg.mtp_depth):
        hf = f"model.layers.{cfg.n_layers + k}."
        out[hf + "embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
        w = out["model.embed_tokens.weight"] if head is None else head.detach().to("cpu")
        out[hf + "shared_head.head.weight"] = w.clone().contiguous()
    return out


def deepseek_state_from_hf(
    hf_state: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    source: str = "checkpoint",
    *,
    rope_interleave: bool = True,
) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 tensors as an lmforge MLA state dict (fp32); a missing tensor or one lmforge
    has no place for is one line naming it."""
    state: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for lm_name, hf_name in _pairs(cfg):
        if hf_name not in hf_state:
            raise LmforgeError(f"{source}: tensor '{hf_name}' is missing")
        state[lm_name] = hf_state[hf_name].to(torch.float32).contiguous()
        used.add(hf_name)
    for lm, hf in _expert_prefixes(cfg):
        stacked_from_hf(hf_state, cfg.moe.n_experts, lm, hf, state, used, source)
        if not cfg.moe.n_shared_experts:  # transformers' zero-width shared experts
            empty = _empty_shared(cfg, hf.removesuffix("mlp.experts."))
            used.update(k for k in empty if k in hf_state and hf_state[k].numel() == 0)
    for lm, hf in _attention_prefixes(cfg):
        try:
            sub = mla_state_from_hf(hf_state, cfg.mla, rope_interleave=rope_interleave, prefix=hf)
        except LmforgeError as e:
            raise LmforgeError(f"{source}: {e}") from None
        state.update({lm + k: v for k, v in sub.items()})
        used.update(hf + n for n in _NAMES if hf + n in hf_state)
    for k in range(cfg.mtp_depth):
        used.update(f"model.layers.{cfg.n_layers + k}.{n}" for n in _MTP_COPIES)
    if cfg.tie_embeddings:
        used.add("lm_head.weight")
        state["lm_head.weight"] = state["token_embeddings.weight"]
    left = sorted(k for k in hf_state if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if left:
        more = f" and {len(left) - 1} more" if len(left) > 1 else ""
        raise LmforgeError(f"{source}: unsupported tensor present ('{left[0]}'{more})")
    return state


def mtp_depth_present(hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> int:
    """How many of the ``cfg.mtp_depth`` MTP modules the tensors hold (leading ones):
    transformers saves DeepSeek-V3 models without them even when config.json counts one."""
    k = 0
    while k < cfg.mtp_depth and f"model.layers.{cfg.n_layers + k}.eh_proj.weight" in hf_state:
        k += 1
    return k
