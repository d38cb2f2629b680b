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

Not yet wired into ``lmforge hf import/export`` (see the wiring plan in
:mod:`lmforge.model.mla`). Exercised by ``pytest tests/test_mla_hf.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lmforge.hf.convert import rope_permutation
from lmforge.model.mla import MLAConfig
from lmforge.utils.errors import LmforgeError

__all__ = ["mla_config_from_hf", "mla_state_from_hf", "mla_state_to_hf"]

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
