"""Weights and config between lmforge Mamba-2/attention hybrids and Hugging Face Bamba folders.

transformers' ``BambaForCausalLM`` (IBM's Bamba-9B) is a stack of pre-norm blocks, each a Mamba-2
mixer or Llama-style attention (the layers listed in ``attn_layer_indices``) followed by a SwiGLU
MLP — an lmforge :class:`~lmforge.model.TransformerLM` whose ``model.layers`` pattern has only M
and A letters. The pieces line up one to one:

=============================  ===========================================================
lmforge (layer i)              Bamba (``model.layers.i.``)
=============================  ===========================================================
``ln1`` / ``ln2``              ``input_layernorm`` / ``pre_ff_layernorm``
``ffn.w1/w3/w2``               ``feed_forward.gate_proj/up_proj/down_proj``
M: ``attn.in_proj``            ``mamba.in_proj`` (same split: z, x B C, Δ)
M: ``attn.conv.weight`` (C, W) ``mamba.conv1d.weight`` (C, 1, W); the bias as is
M: ``attn.A_log/dt_bias/D``    ``mamba.A_log/dt_bias/D``
M: ``attn.norm`` (gated)       ``mamba.norm`` (norm after the gate, one group)
M: ``attn.out_proj``           ``mamba.out_proj``
A: ``attn.{q,k,v}_proj``       ``self_attn.{q,k,v}_proj`` (q/k rows RoPE-permuted)
A: ``attn.output_proj``        ``self_attn.o_proj``
``ln_final``                   ``model.final_layernorm``
=============================  ===========================================================

Bamba rotates only the first ``partial_rotary_factor``·E dims of each head (0.5 unless
``rope_parameters`` says otherwise) in HF's rotate-half layout; lmforge's ``model.rotary_dim`` R
rotates the first R dims in its interleaved layout, so the rows of each q/k head are reordered as
``rope_permutation(R)`` followed by the R..E−1 pass-through rows. Its gated norm uses
``rms_norm_eps``: lmforge's ``model.ssm_norm_eps`` must equal ``model.norm_eps`` to export.

Not representable (one error line names it): ``mamba_n_groups`` > 1, biases (projections,
attention, MLP; a convolution without bias), a finite ``time_step_limit``, RoPE scaling, an
activation other than SiLU; on export, layer letters other than M and A, MLA, QK-norm, muP,
MoE, a logit soft-cap, MTP. Exercised by ``pytest tests/test_hf_hybrid.py``,
``lmforge hf export`` and ``lmforge hf import``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lmforge.hf._rope import partial_rope_order
from lmforge.model.config import ModelConfig
from lmforge.utils.errors import LmforgeError

__all__ = [
    "bamba_config_from_hf",
    "bamba_config_to_hf",
    "bamba_state_from_hf",
    "bamba_state_to_hf",
    "is_bamba",
]

_DEFAULTS = {  # BambaConfig's defaults, for keys a config.json leaves out
    "mamba_n_heads": 128,
    "mamba_d_head": "auto",
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 262144,
}
_BAMBA_PARTIAL_ROTARY = 0.5  # BambaConfig's hard-coded default when rope_parameters has none


def is_bamba(cfg: ModelConfig) -> bool:
    """Whether ``cfg`` exports as Bamba: it has Mamba-2 (M) layers, or partial rotary
    attention (Llama/Qwen3 rotate whole heads)."""
    partial = cfg.rotary_dim is not None and cfg.rotary_dim < cfg.head_dim
    return "M" in cfg.layer_types or partial


def _rotary_dim(cfg: ModelConfig) -> int:
    return int(cfg.head_dim if cfg.rotary_dim is None else cfg.rotary_dim)


def _rope_order(cfg: ModelConfig) -> torch.Tensor:
    return partial_rope_order(int(cfg.head_dim), _rotary_dim(cfg))


# ----------------------------------------------------------------------------------- config
def bamba_config_to_hf(cfg: ModelConfig, eos_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of the Bamba model equal to ``cfg``; one line for what Bamba lacks."""
    bad = sorted(set(cfg.layer_types) - {"M", "A"})
    if bad:
        raise LmforgeError(
            f"cannot export: model.layers {cfg.layers!r} has {bad[0]!r} layers, and Bamba has"
            " Mamba-2 (M) and attention (A) layers only"
        )
    for name, on in (
        ("model.attention_type = mla", cfg.attention_type == "mla"),
        ("model.qk_norm", cfg.qk_norm),
        ("model.mup", cfg.mup),
        ("model.logit_soft_cap", cfg.logit_soft_cap is not None),
        ("model.moe", cfg.moe.enabled),
        ("model.mtp_depth", cfg.mtp_depth > 0),
        ("model.rope_scaling", cfg.rope_scaling != "none"),
        ("model.mrope_sections", bool(cfg.mrope_sections)),
    ):
        if on:
            raise LmforgeError(f"cannot export as Bamba: {name} has no Bamba equivalent")
    if "M" in cfg.layer_types and cfg.ssm_norm_eps != cfg.norm_eps:
        raise LmforgeError(
            f"cannot export as Bamba: its gated norm uses rms_norm_eps, so model.ssm_norm_eps"
            f" ({cfg.ssm_norm_eps}) must equal model.norm_eps ({cfg.norm_eps})"
        )
    e, r = int(cfg.head_dim), _rotary_dim(cfg)
    factor = r / e
    if int(e * factor) != r:  # transformers rebuilds R as int(E · factor)
        raise LmforgeError(f"cannot export as Bamba: rotary_dim {r} is not int({e} · {factor})")
    out: dict[str, Any] = {
        "architectures": ["BambaForCausalLM"],
        "model_type": "bamba",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": e,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.context_length,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": factor,
        },
        "attn_layer_indices": [i for i, t in enumerate(cfg.layer_types) if t == "A"],
        "mamba_n_heads": cfg.ssm_expand * cfg.d_model // cfg.ssm_head_dim,
        "mamba_d_head": cfg.ssm_head_dim,
        "mamba_n_groups": 1,
        "mamba_d_state": cfg.ssm_state,
        "mamba_d_conv": cfg.conv_size,
        "mamba_expand": cfg.ssm_expand,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if eos_token_id is not None:
        out.update(eos_token_id=eos_token_id, bos_token_id=eos_token_id)
    return out


def _pattern(hf: dict[str, Any], n_layers: int, where: str) -> str:
    """model.layers for Bamba's ``attn_layer_indices``: A at those indices, M elsewhere."""
    idx = hf.get("attn_layer_indices") or []
    if not isinstance(idx, list) or not all(isinstance(i, int) for i in idx):
        raise LmforgeError(f"{where}: attn_layer_indices must be a list of layer indices")
    if any(not 0 <= i < n_layers for i in idx):
        raise LmforgeError(
            f"{where}: attn_layer_indices {idx} has an index outside 0..{n_layers - 1}"
        )
    return "".join("A" if i in idx else "M" for i in range(n_layers))


def _rope(hf: dict[str, Any], head_dim: int, where: str) -> tuple[float, int]:
    """(θ, rotary dims R) from Bamba's rope keys (partial rotary 0.5 unless set)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for spec in (params, scaling):
        kind = spec.get("rope_type", spec.get("type", "default")) if spec else "default"
        if kind not in ("default", None):
            raise LmforgeError(f"{where}: RoPE scaling type '{kind}' is not supported for Bamba")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    factor = _BAMBA_PARTIAL_ROTARY if factor is None else float(factor)
    r = int(head_dim * factor)
    if r < 2 or r % 2:
        raise LmforgeError(
            f"{where}: partial_rotary_factor {factor} rotates {r} of {head_dim} dims; lmforge"
            " needs an even number ≥ 2"
        )
    return theta, r


def _time_step_limit(limit: Any, where: str) -> tuple[float, float]:
    """Bamba's Δ clamp (low, high); transformers writes ∞ as ``{"__float__": "Infinity"}``."""

    def num(v: Any) -> float:
        return float(v["__float__"] if isinstance(v, dict) else v)

    try:
        lo, hi = limit
        return num(lo), num(hi)
    except (TypeError, ValueError, KeyError):
        raise LmforgeError(
            f"{where}: time_step_limit {limit!r} is not a (low, high) pair"
        ) from None


def bamba_config_from_hf(
    hf: dict[str, Any], where: str = "config.json", context_length: int | None = None
) -> ModelConfig:
    """The lmforge :class:`ModelConfig` (an M/A ``layers`` pattern) for a Bamba ``config.json``."""
    h = {**_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    try:
        d_model = int(h["hidden_size"])
        n_heads = int(h["num_attention_heads"])
        n_layers = int(h["num_hidden_layers"])
        vocab = int(h["vocab_size"])
        d_ff = int(h["intermediate_size"])
    except KeyError as e:
        raise LmforgeError(f"{where}: missing key {e.args[0]!r}") from None
    act = h.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise LmforgeError(f"{where}: hidden_act '{act}' is not supported (SwiGLU needs silu)")
    for key in ("attention_bias", "mlp_bias", "mamba_proj_bias"):
        if h.get(key):
            raise LmforgeError(f"{where}: {key} = true is not supported (lmforge has no biases)")
    if not h["mamba_conv_bias"]:
        raise LmforgeError(f"{where}: mamba_conv_bias = false is not supported (M layers have one)")
    if int(h["mamba_n_groups"]) != 1:
        raise LmforgeError(
            f"{where}: mamba_n_groups = {h['mamba_n_groups']} is not supported (lmforge's Mamba-2"
            " shares B and C across all heads: one group)"
        )
    limit = h.get("time_step_limit")
    if limit is not None:
        lo, hi = _time_step_limit(limit, where)
        if lo > 0 or not math.isinf(hi):
            raise LmforgeError(
                f"{where}: time_step_limit ({lo}, {hi}) is not supported (lmforge does not clamp Δ)"
            )
    expand = h["mamba_expand"]
    if int(expand) != expand:
        raise LmforgeError(f"{where}: mamba_expand = {expand} is not supported (an integer)")
    inner = int(expand) * d_model
    n_mamba = int(h["mamba_n_heads"])
    d_head = h["mamba_d_head"]
    d_head = inner // n_mamba if d_head == "auto" else int(d_head)
    if d_head * n_mamba != inner:
        raise LmforgeError(
            f"{where}: mamba_n_heads · mamba_d_head = {n_mamba}·{d_head} is not"
            f" mamba_expand · hidden_size = {inner}"
        )
    head_dim = int(h.get("head_dim") or d_model // n_heads)
    theta, rotary = _rope(h, head_dim, where)
    eps = float(h["rms_norm_eps"])
    try:
        return ModelConfig(
            vocab_size=vocab,
            context_length=int(context_length or h["max_position_embeddings"]),
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(h.get("num_key_value_heads") or n_heads),
            head_dim=None if head_dim * n_heads == d_model else head_dim,
            d_ff=d_ff,
            rope_theta=theta,
            rotary_dim=None if rotary == head_dim else rotary,
            norm_eps=eps,
            ssm_norm_eps=eps,
            tie_embeddings=bool(h.get("tie_word_embeddings", False)),
            layers=_pattern(h, n_layers, where),
            ssm_state=int(h["mamba_d_state"]),
            ssm_head_dim=d_head,
            ssm_expand=int(expand),
            conv_size=int(h["mamba_d_conv"]),
            attention="sdpa",
        )
    except ValueError as e:
        raise LmforgeError(f"{where}: {e}") from None


# ------------------------------------------------------------------------------------ state
_MAMBA = ("in_proj.weight", "A_log", "dt_bias", "D", "norm.weight", "out_proj.weight",
          "conv1d.bias")  # fmt: skip
_ATTN = (
    ("q_proj", "q_proj"),
    ("k_proj", "k_proj"),
    ("v_proj", "v_proj"),
    ("output_proj", "o_proj"),
)
_FFN = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))


def _name_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(lmforge name, Bamba name) of every tensor but the convolution weights."""
    pairs = [("token_embeddings.weight", "model.embed_tokens.weight")]
    for i, kind in enumerate(cfg.layer_types):
        lm, hf = f"layers.{i}.", f"model.layers.{i}."
        pairs += [(lm + "ln1.weight", hf + "input_layernorm.weight"),
                  (lm + "ln2.weight", hf + "pre_ff_layernorm.weight")]  # fmt: skip
        pairs += [(f"{lm}ffn.{a}.weight", f"{hf}feed_forward.{b}.weight") for a, b in _FFN]
        if kind == "M":
            pairs += [
                (lm + "attn." + n.replace("conv1d", "conv"), hf + "mamba." + n) for n in _MAMBA
            ]
        else:
            pairs += [(f"{lm}attn.{a}.weight", f"{hf}self_attn.{b}.weight") for a, b in _ATTN]
    pairs.append(("ln_final.weight", "model.final_layernorm.weight"))
    if not cfg.tie_embeddings:
        pairs.append(("lm_head.weight", "lm_head.weight"))
    return pairs


def _permute_qk(t: torch.Tensor, head_dim: int, order: torch.Tensor) -> torch.Tensor:
    rest = t.shape[1:]
    t = t.reshape(-1, head_dim, *rest)  # (H, E, D)
    return t[:, order].reshape(-1, *rest).contiguous()  # (H·E, D)


def _is_qk(lm_name: str) -> bool:
    return lm_name.endswith(("attn.q_proj.weight", "attn.k_proj.weight"))


def bamba_state_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """An lmforge M/A hybrid's state dict in Bamba's names and layouts (checks the config)."""
    bamba_config_to_hf(cfg)  # refuses what Bamba cannot hold, before any tensor is touched
    order = _rope_order(cfg)
    out = {}
    for lm_name, hf_name in _name_pairs(cfg):
        if lm_name not in state:
            raise LmforgeError(f"model state has no '{lm_name}' (not an lmforge TransformerLM?)")
        t = state[lm_name].detach().to("cpu")
        out[hf_name] = _permute_qk(t, int(cfg.head_dim), order) if _is_qk(lm_name) else t
    for i, kind in enumerate(cfg.layer_types):
        if kind == "M":
            w = state[f"layers.{i}.attn.conv.weight"].detach().to("cpu")  # (C, W)
            out[f"model.layers.{i}.mamba.conv1d.weight"] = w[:, None, :].contiguous()  # (C, 1, W)
    return {k: v.contiguous() for k, v in out.items()}


def bamba_state_from_hf(
    hf_state: dict[str, torch.Tensor], cfg: ModelConfig, source: str = "checkpoint"
) -> dict[str, torch.Tensor]:
    """Bamba tensors renamed and re-laid-out into an lmforge state dict (fp32); a tensor lmforge
    has no place for raises one line naming it."""
    inv = torch.argsort(_rope_order(cfg))
    state: dict[str, torch.Tensor] = {}
    used = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf_state:
            raise LmforgeError(f"{source}: tensor '{name}' is missing")
        used.add(name)
        return hf_state[name].to(torch.float32)

    for lm_name, hf_name in _name_pairs(cfg):
        t = take(hf_name)
        state[lm_name] = (
            _permute_qk(t, int(cfg.head_dim), inv) if _is_qk(lm_name) else t.contiguous()
        )
    for i, kind in enumerate(cfg.layer_types):
        if kind == "M":
            w = take(f"model.layers.{i}.mamba.conv1d.weight")  # (C, 1, W)
            if w.dim() != 3 or w.shape[1] != 1:
                raise LmforgeError(
                    f"{source}: model.layers.{i}.mamba.conv1d.weight has shape {tuple(w.shape)},"
                    " expected (channels, 1, width)"
                )
            state[f"layers.{i}.attn.conv.weight"] = w[:, 0].contiguous()  # (C, W)
    if cfg.tie_embeddings:
        used.add("lm_head.weight")  # some tied checkpoints store the copy anyway
        state["lm_head.weight"] = state["token_embeddings.weight"]
    left = sorted(k for k in hf_state if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if left:
        more = f" and {len(left) - 1} more" if len(left) > 1 else ""
        raise LmforgeError(
            f"{source}: unexpected tensor '{left[0]}'{more} (lmforge's Bamba mapping has no place"
            " for it)"
        )
    return state
