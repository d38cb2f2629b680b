"""Weights and config between lmforge and Hugging Face Llama / Qwen3 (/ DeepSeek-V3, Bamba,
Qwen3-Next) folders.

MLA models (``ModelConfig.attention_type = "mla"``) are DeepSeek-V3 folders, mapped by
:mod:`lmforge.hf.deepseek`; Mamba-2/attention hybrids (``model.layers`` of M and A letters) and
partial-rotary models are Bamba folders, mapped by :mod:`lmforge.hf.bamba`; Gated DeltaNet
hybrids (G and A) and gated-attention models are Qwen3-Next folders, mapped by
:mod:`lmforge.hf.qwen3_next`; the functions here dispatch to them.

An lmforge :class:`~lmforge.model.TransformerLM` is architecturally a Llama (pre-norm RMSNorm,
RoPE, SwiGLU, GQA, no biases); with ``qk_norm=True`` it is a Qwen3 (per-head RMSNorm on queries
and keys before RoPE). Conversion is a renaming of tensors plus one permutation:

- lmforge's RoPE rotates consecutive pairs ``(x[2i], x[2i+1])`` of a head vector; HF's
  ``rotate_half`` rotates ``(x[i], x[i + E/2])``. Both use the frequency θ^(-2i/E) for pair i, so
  reordering the E output rows of each head of ``q_proj``/``k_proj`` (and the E-sized q/k-norm
  gains) as ``[0, 2, 4, …, 1, 3, 5, …]`` turns one into the other; the attention scores
  ``q·k`` are unchanged because q and k are permuted alike. Import applies the inverse.

Names (lmforge → HF): ``token_embeddings`` → ``model.embed_tokens``; ``layers.i.attn.{q,k,v}_proj``
→ ``model.layers.i.self_attn.{q,k,v}_proj``; ``attn.output_proj`` → ``self_attn.o_proj``;
``attn.{q,k}_norm`` → ``self_attn.{q,k}_norm``; ``ffn.w1/w3/w2`` → ``mlp.gate/up/down_proj``;
``ln1``/``ln2`` → ``input_layernorm``/``post_attention_layernorm``; ``ln_final`` → ``model.norm``;
``lm_head`` → ``lm_head`` (omitted when tied: HF ties it on load).

transformers is not needed here (config.json is written and read as plain JSON); the tests use it
to check that logits agree. Exercised by ``pytest tests/test_hf_convert.py``,
``lmforge hf export`` and ``lmforge hf import``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lmforge.hf import _moe, bamba, qwen3_next
from lmforge.hf._rope import rope_permutation
from lmforge.model.config import ModelConfig
from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write_text

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "hf_config_to_model_config",
    "hf_to_lmforge_state",
    "lmforge_to_hf_state",
    "load_hf_state",
    "model_config_to_hf_config",
    "rope_permutation",
]

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",  # MoE models: lmforge.hf._moe
    "deepseek_v3": "DeepseekV3ForCausalLM",  # MLA models: lmforge.hf.deepseek
    "bamba": "BambaForCausalLM",  # Mamba-2 (M) / attention (A) hybrids: lmforge.hf.bamba
    "qwen3_next": "Qwen3NextForCausalLM",  # Gated DeltaNet (G) / attention: lmforge.hf.qwen3_next
}


def _check_llama_layers(cfg: ModelConfig) -> None:
    """Llama/Qwen3 hold full-attention layers only: other letters of model.layers are one line."""
    if not cfg.full_attention_only:
        other = sorted(set(cfg.layer_types) - {"A"})[0]
        raise LmforgeError(
            f"cannot export: model.layers {cfg.layers!r} has {other!r} layers; Hugging Face"
            " export maps full attention (A, Llama/Qwen3/DeepSeek-V3), Mamba-2 hybrids (M + A,"
            " Bamba) and Gated DeltaNet hybrids (G + A, Qwen3-Next) only"
        )


def _check_no_cla(cfg: ModelConfig) -> None:
    """Cross-layer KV sharing has no Hugging Face architecture: one line."""
    if cfg.kv_share_every > 1:
        raise LmforgeError(
            f"cannot export: model.kv_share_every = {cfg.kv_share_every} (cross-layer KV sharing)"
            " has no Hugging Face equivalent (each Llama/Qwen3/DeepSeek-V3/Bamba/Qwen3-Next"
            " layer computes its own keys and values)"
        )


def _permute_heads(
    w: torch.Tensor, n_heads: int, head_dim: int, order: torch.Tensor
) -> torch.Tensor:
    """Reorder the rows of each head of a (heads·E, ...) projection or an (E,) gain."""
    if w.dim() == 1:
        return w[order].contiguous()  # (E,)
    rest = w.shape[1:]
    w = w.reshape(n_heads, head_dim, *rest)  # (H, E, D)
    return w[:, order].reshape(n_heads * head_dim, *rest).contiguous()  # (H·E, D)


def _layer_names(cfg: ModelConfig, i: int) -> list[tuple[str, str]]:
    lm, hf = f"layers.{i}.", f"model.layers.{i}."
    pairs = [
        (lm + "attn.q_proj.weight", hf + "self_attn.q_proj.weight"),
        (lm + "attn.k_proj.weight", hf + "self_attn.k_proj.weight"),
        (lm + "attn.v_proj.weight", hf + "self_attn.v_proj.weight"),
        (lm + "attn.output_proj.weight", hf + "self_attn.o_proj.weight"),
        *_ffn_names(cfg, lm, hf, i),
        (lm + "ln1.weight", hf + "input_layernorm.weight"),
        (lm + "ln2.weight", hf + "post_attention_layernorm.weight"),
    ]
    if cfg.qk_norm:
        pairs += [
            (lm + "attn.q_norm.weight", hf + "self_attn.q_norm.weight"),
            (lm + "attn.k_norm.weight", hf + "self_attn.k_norm.weight"),
        ]
    return pairs


def _ffn_names(cfg: ModelConfig, lm: str, hf: str, i: int) -> list[tuple[str, str]]:
    if cfg.moe.is_moe_layer(i):  # the router; the experts are stacked (lmforge.hf._moe)
        return [(lm + "ffn.router.weight", hf + "mlp.gate.weight")]
    names = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
    return [(f"{lm}ffn.{a}.weight", f"{hf}mlp.{b}.weight") for a, b in names]


def _name_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    pairs = [("token_embeddings.weight", "model.embed_tokens.weight")]
    for i in range(cfg.n_layers):
        pairs += _layer_names(cfg, i)
    pairs.append(("ln_final.weight", "model.norm.weight"))
    if not cfg.tie_embeddings:
        pairs.append(("lm_head.weight", "lm_head.weight"))
    return pairs


def _rope_order(lm_name: str, cfg: ModelConfig) -> tuple[int, bool] | None:
    """(heads, is q/k-norm) for tensors whose rows follow the RoPE layout, else None."""
    if lm_name.endswith("attn.q_proj.weight"):
        return cfg.n_heads, False
    if lm_name.endswith("attn.k_proj.weight"):
        return cfg.kv_heads, False
    if lm_name.endswith(("attn.q_norm.weight", "attn.k_norm.weight")):
        return 1, True
    return None


def lmforge_to_hf_state(
    state: dict[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """An lmforge state dict renamed and RoPE-permuted into HF Llama/Qwen3 names (DeepSeek-V3
    names for an MLA model, :mod:`lmforge.hf.deepseek`)."""
    _check_no_cla(cfg)
    if cfg.attention_type == "mla":
        from lmforge.hf.deepseek import deepseek_state_to_hf

        return deepseek_state_to_hf(state, cfg)
    if qwen3_next.is_qwen3_next(cfg):
        return qwen3_next.qwen3_next_state_to_hf(state, cfg)
    if bamba.is_bamba(cfg):
        return bamba.bamba_state_to_hf(state, cfg)
    _check_llama_layers(cfg)
    perm = rope_permutation(cfg.head_dim)
    out = {}
    for lm_name, hf_name in _name_pairs(cfg):
        if lm_name not in state:
            raise LmforgeError(f"model state has no '{lm_name}' (not an lmforge TransformerLM?)")
        t = state[lm_name].detach().to("cpu")
        order = _rope_order(lm_name, cfg)
        if order is not None:
            t = _permute_heads(t, order[0], cfg.head_dim, perm)
        out[hf_name] = t.contiguous()
    if cfg.moe.enabled:
        out.update(_moe.experts_to_hf(state, cfg))
    return out


def hf_to_lmforge_state(
    hf_state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    source: str = "checkpoint",
    *,
    rope_interleave: bool = True,
    model_type: str | None = None,
) -> dict[str, torch.Tensor]:
    """HF Llama/Qwen3 tensors renamed and un-permuted into an lmforge state dict (fp32).

    Tensors HF keeps for itself (``rotary_emb.inv_freq``) are ignored; any other leftover (a bias,
    an extra norm) raises one line naming it, since lmforge has no place for it. An MLA ``cfg``
    reads DeepSeek-V3 names (``rope_interleave`` is its config.json flag); a Bamba folder
    (``model_type`` "bamba", or a ``cfg`` with M layers) Bamba names.
    """
    if model_type == "qwen3_next" or (model_type is None and qwen3_next.is_qwen3_next(cfg)):
        return qwen3_next.qwen3_next_state_from_hf(hf_state, cfg, source)
    if model_type == "bamba" or bamba.is_bamba(cfg):
        return bamba.bamba_state_from_hf(hf_state, cfg, source)
    if cfg.attention_type == "mla":
        from lmforge.hf.deepseek import deepseek_state_from_hf

        return deepseek_state_from_hf(hf_state, cfg, source, rope_interleave=rope_interleave)
    inv = torch.argsort(rope_permutation(cfg.head_dim))
    state: dict[str, torch.Tensor] = {}
    used = set()
    for lm_name, hf_name in _name_pairs(cfg):
        if hf_name not in hf_state:
            raise LmforgeError(f"{source}: tensor '{hf_name}' is missing")
        t = hf_state[hf_name].to(torch.float32)
        order = _rope_order(lm_name, cfg)
        if order is not None:
            t = _permute_heads(t, order[0], cfg.head_dim, inv)
        state[lm_name] = t.contiguous()
        used.add(hf_name)
    if cfg.moe.enabled:
        _moe.experts_from_hf(hf_state, cfg, state, used, source)
    if cfg.tie_embeddings:
        used.add("lm_head.weight")  # some tied checkpoints store the copy anyway
        state["lm_head.weight"] = state["token_embeddings.weight"]
    left = sorted(k for k in hf_state if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if left:
        what = "biases are" if any(k.endswith(".bias") for k in left) else "tensor is"
        raise LmforgeError(
            f"{source}: unsupported {what} present ('{left[0]}'"
            f"{f' and {len(left) - 1} more' if len(left) > 1 else ''}); lmforge models have none"
        )
    return state


def model_config_to_hf_config(cfg: ModelConfig, eos_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of the HF model equivalent to ``cfg`` (Llama, or Qwen3 with qk_norm,
    DeepSeek-V3 with MLA, Bamba with Mamba-2 layers or partial rotary)."""
    if cfg.attention_type == "mla":
        from lmforge.hf.deepseek import deepseek_config_to_hf

        return deepseek_config_to_hf(cfg, eos_token_id)  # (refuses CLA in its own words)
    _check_no_cla(cfg)
    if qwen3_next.is_qwen3_next(cfg):
        return qwen3_next.qwen3_next_config_to_hf(cfg, eos_token_id)
    if bamba.is_bamba(cfg):
        return bamba.bamba_config_to_hf(cfg, eos_token_id)
    _check_llama_layers(cfg)
    if cfg.logit_soft_cap is not None:
        raise LmforgeError(
            "cannot export: model.logit_soft_cap is set, and Llama/Qwen3 have no logit soft-cap"
        )
    model_type = "qwen3" if cfg.qk_norm else "llama"
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.context_length,
        "rms_norm_eps": cfg.norm_eps,
        # Both spellings: transformers ≥ 5 reads rope_parameters, 4.x reads rope_theta.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if cfg.rope_scaling == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_context,
        }
        out["rope_scaling"] = scaling
        out["rope_parameters"] = {**scaling, "rope_theta": cfg.rope_theta}
    if model_type == "llama":
        out["mlp_bias"] = False
    else:
        out["use_sliding_window"] = False
    if eos_token_id is not None:
        out["eos_token_id"] = eos_token_id
        out["bos_token_id"] = eos_token_id
    return _moe.hf_config(cfg, out) if cfg.moe.enabled else out


def _rope_options(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig RoPE fields (θ and Llama-3 scaling) from an HF config's rope keys."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    if isinstance(params, dict) and "full_attention" in params:
        params = params["full_attention"]
    out: dict[str, Any] = {}
    for spec in (params, scaling):
        rope_type = spec.get("rope_type", spec.get("type", "default")) if spec else "default"
        if rope_type == "llama3":
            try:
                out.update(
                    rope_scaling="llama3",
                    rope_scaling_factor=float(spec["factor"]),
                    rope_low_freq_factor=float(spec["low_freq_factor"]),
                    rope_high_freq_factor=float(spec["high_freq_factor"]),
                    rope_original_context=int(spec["original_max_position_embeddings"]),
                )
            except KeyError as e:
                raise LmforgeError(f"{where}: llama3 RoPE scaling lacks {e.args[0]!r}") from None
        elif rope_type not in ("default", None):
            raise LmforgeError(f"{where}: RoPE scaling type '{rope_type}' is not supported")
    if spec_partial := params.get("partial_rotary_factor", hf.get("partial_rotary_factor")):
        if float(spec_partial) != 1.0:
            raise LmforgeError(f"{where}: partial rotary embeddings are not supported")
    out["rope_theta"] = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    return out


def hf_config_to_model_config(
    hf: dict[str, Any], where: str = "config.json", context_length: int | None = None
) -> ModelConfig:
    """The lmforge :class:`ModelConfig` for an HF Llama/Qwen3 ``config.json`` dict.

    Anything lmforge cannot represent (another architecture, biases, sliding windows, RoPE
    scaling other than Llama 3's, an activation other than SiLU) raises one line naming it.
    ``context_length`` overrides ``max_position_embeddings`` (lmforge precomputes RoPE tables of
    that length per layer, which is large for 128k-context models).
    """
    model_type = hf.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise LmforgeError(
            f"{where}: model_type '{model_type}' is not supported "
            f"(supported: {', '.join(_ARCHITECTURES)})"
        )
    if model_type == "deepseek_v3":
        from lmforge.hf.deepseek import deepseek_config_from_hf

        return deepseek_config_from_hf(hf, where, context_length)
    if model_type == "bamba":
        return bamba.bamba_config_from_hf(hf, where, context_length)
    if model_type == "qwen3_next":
        return qwen3_next.qwen3_next_config_from_hf(hf, where, context_length)
    try:
        d_model = int(hf["hidden_size"])
        n_heads = int(hf["num_attention_heads"])
        n_layers = int(hf["num_hidden_layers"])
        vocab = int(hf["vocab_size"])
        d_ff = int(hf["intermediate_size"])
    except KeyError as e:
        raise LmforgeError(f"{where}: missing key {e.args[0]!r}") from None
    head_dim = int(hf.get("head_dim") or d_model // n_heads)
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise LmforgeError(f"{where}: hidden_act '{act}' is not supported (SwiGLU needs silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise LmforgeError(f"{where}: {key} = true is not supported (lmforge has no biases)")
    if hf.get("use_sliding_window") or (model_type == "llama" and hf.get("sliding_window")):
        raise LmforgeError(f"{where}: sliding-window attention is not supported")
    rope = _rope_options(hf, where)
    try:
        return ModelConfig(
            vocab_size=vocab,
            context_length=int(context_length or hf.get("max_position_embeddings", 2048)),
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=None if head_dim * n_heads == d_model else head_dim,
            d_ff=d_ff,
            **rope,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            moe=_moe.moe_from_hf(hf, where),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention="sdpa",
        )
    except ValueError as e:
        raise LmforgeError(f"{where}: {e}") from None


def load_hf_state(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of an HF folder: ``model.safetensors``, a sharded index, or ``pytorch_model.bin``.

    ``.bin`` files load with ``torch.load(weights_only=True)`` (no pickled code runs).
    """
    from safetensors.torch import load_file

    d = Path(folder)
    single = d / "model.safetensors"
    index = d / "model.safetensors.index.json"
    if single.is_file():
        return load_file(str(single))
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError):
            raise LmforgeError(f"{index}: not a safetensors index (no 'weight_map')") from None
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            if not (d / shard).is_file():
                raise LmforgeError(f"{index} names shard '{shard}', which is missing")
            state.update(load_file(str(d / shard)))
        return state
    bins = sorted(d.glob("pytorch_model*.bin"))
    if bins:
        state = {}
        for b in bins:
            state.update(torch.load(b, map_location="cpu", weights_only=True))
        return state
    raise LmforgeError(
        f"{d}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
    )


def _read_hf_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise LmforgeError(f"{folder}: config.json is missing (not a Hugging Face model folder)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise LmforgeError(f"{path}: not valid JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise LmforgeError(f"{path}: expected a JSON object")
    return data


def write_hf_config(out_dir: Path, cfg: ModelConfig, eos_token_id: int | None) -> None:
    """Write ``config.json`` (and ``generation_config.json`` when an EOS id is known)."""
    atomic_write_text(
        out_dir / "config.json",
        json.dumps(model_config_to_hf_config(cfg, eos_token_id), indent=2) + "\n",
    )
    if eos_token_id is not None:
        gen = {"bos_token_id": eos_token_id, "eos_token_id": eos_token_id}
        atomic_write_text(out_dir / "generation_config.json", json.dumps(gen, indent=2) + "\n")


def model_state_for_export(model: nn.Module) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, fp32 CPU state dict) of a TransformerLM, checking it is one."""
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig):
        raise LmforgeError("export_model needs an lmforge TransformerLM (with a ModelConfig)")
    state = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    return cfg, state
