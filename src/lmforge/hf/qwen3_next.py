"""Weights and config between lmforge Gated DeltaNet/attention hybrids and Hugging Face
Qwen3-Next folders (transformers' ``Qwen3NextForCausalLM``: grouped value heads, dense or MoE
MLP layers).

A Qwen3-Next block is ``layer_types[i]``: "linear_attention" (Gated DeltaNet, lmforge's G) or
"full_attention" (lmforge's A with ``qk_norm``, ``attn_output_gate`` and partial rotary
``rotary_dim``), then a SwiGLU MLP or a sparse MoE block. The mapping, per layer i (G: H_k
q/k heads of width K, H value heads of width V, r = H / H_k value heads per q/k head):

==================================  ==========================================================
lmforge                             Qwen3-Next (``model.layers.i.``)
==================================  ==========================================================
``ln1`` / ``ln2``, ``ln_final``     ``input_layernorm`` / ``post_attention_layernorm``,
                                    ``model.norm``: zero-centred, lmforge gain = 1 + w
``ffn.w1/w3/w2``                    ``mlp.gate_proj/up_proj/down_proj``
A: ``attn.q_proj`` + ``gate_proj``  ``self_attn.q_proj``: per head [query E | gate E]
A: ``attn.k_proj/v_proj``           ``self_attn.k_proj/v_proj`` (q/k rows RoPE-permuted)
A: ``attn.q_norm/k_norm``           ``self_attn.q_norm/k_norm`` (1 + w, permuted alike)
A: ``attn.output_proj``             ``self_attn.o_proj``
G: ``attn.{q,k,v,z}_proj``          ``linear_attn.in_proj_qkvz``: per q/k head j
                                    [q K | k K | v r·V | z r·V] (value heads j·r … j·r + r − 1)
G: ``attn.{b,a}_proj``              ``linear_attn.in_proj_ba``: per q/k head [β r | a r]
G: ``attn.conv.weight`` (C, W)      ``linear_attn.conv1d.weight`` (C, 1, W), no bias; C =
                                    2·H_k·K + H·V over q | k | v
G: ``attn.A_log/dt_bias``           ``linear_attn.A_log/dt_bias`` (per value head)
G: ``attn.o_norm`` / ``o_proj``     ``linear_attn.norm`` (plain gain, width V) / ``out_proj``
MoE: ``ffn.router``                 ``mlp.gate`` (softmax, top-k, ``norm_topk_prob``)
MoE: ``ffn.w1/w3/w2`` [e]           ``mlp.experts.e.gate_proj/up_proj/down_proj`` (fused
                                    ``gate_up_proj`` / ``down_proj`` read too)
MoE: ``ffn.shared.w1/w3/w2``        ``mlp.shared_expert.gate_proj/up_proj/down_proj``
MoE: ``ffn.shared_gate``            ``mlp.shared_expert_gate`` (σ(x W_g) times the shared one)
==================================  ==========================================================

config.json ↔ lmforge: ``linear_num_key_heads`` / ``linear_key_head_dim`` ↔ ``linear_heads`` /
``linear_head_dim``, ``linear_num_value_heads`` / ``linear_value_head_dim`` ↔
``linear_v_heads`` / ``linear_v_head_dim``; MoE layers (``num_experts`` > 0, layer i not in
``mlp_only_layers`` and (i + 1) % ``decoder_sparse_step`` = 0) ↔ ``model.moe`` with
``num_experts`` ↔ ``n_experts``, ``num_experts_per_tok`` ↔ ``top_k``,
``moe_intermediate_size`` ↔ ``expert_d_ff``, ``shared_expert_intermediate_size`` ↔
``n_shared_experts`` · ``expert_d_ff`` with ``shared_gate``, ``norm_topk_prob`` ↔
``norm_top_k``, ``decoder_sparse_step`` ↔ ``every``, ``mlp_only_layers = [0, …, k − 1]`` ↔
``first_dense_layers = k``, ``router_aux_loss_coef`` ↔ ``aux_loss_coef``.

Partial rotary: Qwen3-Next rotates the first ``partial_rotary_factor``·E dims (0.25 unless set)
in HF's rotate-half layout; the q/k rows are reordered as in :mod:`lmforge.hf.bamba`. The
GDN's q/k L2 norm is x/sqrt(‖x‖² + 1e-6) in both. Checkpoints' multi-token-prediction tensors
(``mtp.*``) are skipped on import, as transformers skips them.

Not representable (one error line names it): ``linear_num_value_heads`` not a multiple of
``linear_num_key_heads``, an ``mlp_only_layers`` other than the first k layers of the
``decoder_sparse_step`` pattern, a ``shared_expert_intermediate_size`` that is not a positive
multiple of ``moe_intermediate_size``, biases, RoPE scaling, ``rms_norm_eps`` ≠ 1e-6
(lmforge's GDN output norm has that eps); on export, layer letters other than G and A, no
QK-norm or no output gate, MLA, muP, a logit soft-cap, MTP, and MoE layers unlike Qwen3-Next's
(sigmoid scores, a routing other than dropless top-k, group-limited routing, a routed scale,
a non-zero expert selection bias, or no gated shared expert: ``moe.n_shared_experts`` ≥ 1 and
``moe.shared_gate``). Exercised by ``pytest tests/test_hf_hybrid.py``, ``lmforge hf export``
and ``lmforge hf import``.
"""

from __future__ import annotations

from typing import Any

import torch

from lmforge.hf._moe import stacked_from_hf, stacked_to_hf
from lmforge.hf._rope import partial_rope_order
from lmforge.model.config import ModelConfig
from lmforge.model.moe_config import MoEConfig
from lmforge.utils.errors import LmforgeError

__all__ = [
    "is_qwen3_next",
    "qwen3_next_config_from_hf",
    "qwen3_next_config_to_hf",
    "qwen3_next_state_from_hf",
    "qwen3_next_state_to_hf",
]

_GDN_NORM_EPS = 1e-6  # GatedDeltaNet's o_norm eps (lmforge.model.linear_attention)
_PARTIAL_ROTARY = 0.25  # Qwen3NextConfig's default when rope_parameters has none


def is_qwen3_next(cfg: ModelConfig) -> bool:
    """Whether ``cfg`` exports as Qwen3-Next: it has Gated DeltaNet (G) layers, or gated
    attention (``attn_output_gate``)."""
    return "G" in cfg.layer_types or cfg.attn_output_gate


# ----------------------------------------------------------------------------------- config
def qwen3_next_config_to_hf(cfg: ModelConfig, eos_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of the Qwen3-Next model equal to ``cfg``; one line for what it lacks."""
    bad = sorted(set(cfg.layer_types) - {"G", "A"})
    if bad:
        raise LmforgeError(
            f"cannot export: model.layers {cfg.layers!r} has {bad[0]!r} layers, and Qwen3-Next"
            " has Gated DeltaNet (G) and attention (A) layers only"
        )
    for name, on in (
        ("model.attention_type = mla", cfg.attention_type == "mla"),
        ("model.mup", cfg.mup),
        ("model.logit_soft_cap", cfg.logit_soft_cap is not None),
        ("model.mtp_depth", cfg.mtp_depth > 0),
        ("model.rope_scaling", cfg.rope_scaling != "none"),
        ("model.mrope_sections", bool(cfg.mrope_sections)),
    ):
        if on:
            raise LmforgeError(f"cannot export as Qwen3-Next: {name} has no Qwen3-Next equivalent")
    if "A" in cfg.layer_types and not (cfg.qk_norm and cfg.attn_output_gate):
        raise LmforgeError(
            "cannot export as Qwen3-Next: its attention always has QK-norm and an output gate"
            " (model.qk_norm and model.attn_output_gate must be on)"
        )
    if cfg.norm_eps != _GDN_NORM_EPS:
        raise LmforgeError(
            f"cannot export as Qwen3-Next: one rms_norm_eps serves its block norms and its GDN"
            f" output norm (1e-6 in lmforge), so model.norm_eps must be 1e-6, not {cfg.norm_eps}"
        )
    e = int(cfg.head_dim)
    r = e if cfg.rotary_dim is None else cfg.rotary_dim
    factor = r / e
    if int(e * factor) != r:
        raise LmforgeError(f"cannot export as Qwen3-Next: rotary_dim {r} is not int({e}·{factor})")
    k_heads, k_dim, v_heads, v_dim = cfg.linear_dims
    out: dict[str, Any] = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
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
        "layer_types": [
            "linear_attention" if t == "G" else "full_attention" for t in cfg.layer_types
        ],
        "linear_conv_kernel_dim": cfg.conv_size,
        "linear_key_head_dim": k_dim,
        "linear_value_head_dim": v_dim,
        "linear_num_key_heads": k_heads,
        "linear_num_value_heads": v_heads,
        **_moe_to_hf(cfg),
        "attention_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if eos_token_id is not None:
        out.update(eos_token_id=eos_token_id, bos_token_id=eos_token_id)
    return out


def _moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The MoE keys of ``config.json`` (every MLP dense in ``mlp_only_layers`` for a dense
    model); one line for an MoE option Qwen3-Next's sparse block has no place for."""
    mc = cfg.moe
    if not mc.enabled:
        return {"mlp_only_layers": list(range(cfg.n_layers))}  # every MLP dense
    for what, bad in (
        (f"model.moe.score = '{mc.score}' (Qwen3-Next's router is softmax)", mc.score != "softmax"),
        (f"model.moe.routing = '{mc.routing}' (Qwen3-Next: top-k)", mc.routing != "token_choice"),
        ("model.moe.n_groups > 1 (Qwen3-Next has no group-limited routing)", mc.n_groups > 1),
        ("model.moe.routed_scale != 1 (Qwen3-Next does not scale)", mc.routed_scale != 1.0),
        (
            "model.moe without a gated shared expert (Qwen3-Next's MoE layers always have one:"
            " model.moe.n_shared_experts >= 1 and model.moe.shared_gate)",
            not (mc.n_shared_experts and mc.shared_gate),
        ),
    ):
        if bad:
            raise LmforgeError(f"cannot export as Qwen3-Next: {what}")
    return {
        "num_experts": mc.n_experts,
        "num_experts_per_tok": mc.top_k,
        "moe_intermediate_size": cfg.expert_dim,
        "shared_expert_intermediate_size": mc.n_shared_experts * cfg.expert_dim,
        "norm_topk_prob": mc.norm_top_k,
        "decoder_sparse_step": mc.every,
        "mlp_only_layers": list(range(min(mc.first_dense_layers, cfg.n_layers))),
        "router_aux_loss_coef": mc.aux_loss_coef,
        "output_router_logits": False,
    }


def _moe_from_hf(h: dict[str, Any], n_layers: int, where: str) -> MoEConfig:
    """``model.moe`` of a Qwen3-Next ``config.json`` (dense when no layer is MoE); a key it
    leaves out takes transformers' ``Qwen3NextConfig`` default."""
    n = int(h.get("num_experts", 512))
    step = int(h.get("decoder_sparse_step", 1))
    only = list(h.get("mlp_only_layers") or [])
    sparse = [i for i in range(n_layers) if i not in only and n > 0 and (i + 1) % step == 0]
    if not sparse:
        return MoEConfig()
    # lmforge: MoE where i >= first_dense_layers and (i + 1) % every == 0; the smallest such k
    first = next(
        (k for k in range(sparse[0] + 1)
         if sparse == [i for i in range(k, n_layers) if (i + 1) % step == 0]),
        None,
    )  # fmt: skip
    if first is None:
        raise LmforgeError(
            f"{where}: mlp_only_layers {only} is not supported (lmforge keeps only the first k"
            " layers dense, model.moe.first_dense_layers, beside decoder_sparse_step)"
        )
    f = int(h.get("moe_intermediate_size", 512))
    shared = int(h.get("shared_expert_intermediate_size", 512))
    if f <= 0 or shared <= 0 or shared % f:
        raise LmforgeError(
            f"{where}: shared_expert_intermediate_size {shared} is not a positive multiple of"
            f" moe_intermediate_size {f} (lmforge's shared experts are n_shared_experts ×"
            " expert_d_ff wide)"
        )
    try:
        return MoEConfig(
            n_experts=n,
            top_k=int(h.get("num_experts_per_tok", 10)),
            n_shared_experts=shared // f,
            shared_gate=True,
            expert_d_ff=f,
            every=step,
            first_dense_layers=first,
            score="softmax",
            norm_top_k=bool(h.get("norm_topk_prob", True)),
            aux_loss_coef=float(h.get("router_aux_loss_coef", 0.001)),
        )
    except ValueError as e:
        raise LmforgeError(f"{where}: {e}") from None


def _pattern(h: dict[str, Any], n_layers: int, where: str) -> str:
    types = h.get("layer_types")
    if types is None:  # Qwen3NextConfig's default: every full_attention_interval-th layer
        every = int(h.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(n_layers)]  # fmt: skip
    letters = {"linear_attention": "G", "full_attention": "A"}
    if not isinstance(types, list) or len(types) != n_layers or not set(types) <= set(letters):
        raise LmforgeError(
            f"{where}: layer_types must list {n_layers} of linear_attention / full_attention"
        )
    return "".join(letters[t] for t in types)


def _rope(h: dict[str, Any], head_dim: int, where: str) -> tuple[float, int]:
    params = h.get("rope_parameters") or {}
    for spec in (params, h.get("rope_scaling") or {}):
        kind = spec.get("rope_type", spec.get("type", "default")) if spec else "default"
        if kind not in ("default", None):
            raise LmforgeError(f"{where}: RoPE scaling type '{kind}' is not supported")
    theta = float(params.get("rope_theta", h.get("rope_theta", 10000.0)))
    factor = params.get("partial_rotary_factor", h.get("partial_rotary_factor"))
    factor = _PARTIAL_ROTARY if factor is None else float(factor)
    r = int(head_dim * factor)
    if r < 2 or r % 2:
        raise LmforgeError(
            f"{where}: partial_rotary_factor {factor} rotates {r} of {head_dim} dims; lmforge"
            " needs an even number ≥ 2"
        )
    return theta, r


def qwen3_next_config_from_hf(
    hf: dict[str, Any], where: str = "config.json", context_length: int | None = None
) -> ModelConfig:
    """The lmforge :class:`ModelConfig` (a G/A ``layers`` pattern) for a Qwen3-Next
    ``config.json``."""
    h = {k: v for k, v in hf.items() if v is not None}
    try:
        d_model = int(h["hidden_size"])
        n_heads = int(h["num_attention_heads"])
        n_layers = int(h["num_hidden_layers"])
        vocab = int(h["vocab_size"])
        d_ff = int(h["intermediate_size"])
    except KeyError as e:
        raise LmforgeError(f"{where}: missing key {e.args[0]!r}") from None
    if h.get("hidden_act", "silu") not in ("silu", "swish"):
        raise LmforgeError(f"{where}: hidden_act '{h['hidden_act']}' is not supported")
    if h.get("attention_bias"):
        raise LmforgeError(
            f"{where}: attention_bias = true is not supported (lmforge has no biases)"
        )
    k_heads, v_heads = (
        int(h.get("linear_num_key_heads", 16)),
        int(h.get("linear_num_value_heads", 32)),
    )
    k_dim, v_dim = int(h.get("linear_key_head_dim", 128)), int(h.get("linear_value_head_dim", 128))
    if k_heads <= 0 or v_heads % k_heads:
        raise LmforgeError(
            f"{where}: linear_num_value_heads ({v_heads}) is not a multiple of"
            f" linear_num_key_heads ({k_heads})"
        )
    moe = _moe_from_hf(h, n_layers, where)
    eps = float(h.get("rms_norm_eps", 1e-6))
    pattern = _pattern(h, n_layers, where)
    if eps != _GDN_NORM_EPS:
        raise LmforgeError(
            f"{where}: rms_norm_eps = {eps} is not supported (lmforge's GDN output norm uses 1e-6)"
        )
    head_dim = int(h.get("head_dim") or d_model // n_heads)
    theta, rotary = _rope(h, head_dim, where)
    try:
        return ModelConfig(
            vocab_size=vocab,
            context_length=int(context_length or h.get("max_position_embeddings", 32768)),
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(h.get("num_key_value_heads") or n_heads),
            head_dim=None if head_dim * n_heads == d_model else head_dim,
            d_ff=d_ff,
            rope_theta=theta,
            rotary_dim=None if rotary == head_dim else rotary,
            norm_eps=eps,
            qk_norm=True,
            attn_output_gate=True,
            tie_embeddings=bool(h.get("tie_word_embeddings", False)),
            layers=pattern,
            linear_heads=None if k_heads == n_heads else k_heads,
            linear_head_dim=None if k_dim == head_dim else k_dim,
            linear_v_heads=None if v_heads == k_heads else v_heads,
            linear_v_head_dim=None if v_dim == k_dim else v_dim,
            conv_size=int(h.get("linear_conv_kernel_dim", 4)),
            attention="sdpa",
            moe=moe,
        )
    except ValueError as e:
        raise LmforgeError(f"{where}: {e}") from None


# ------------------------------------------------------------------------------------ state
_FFN = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))


def _plain_pairs(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    """(lmforge name, Qwen3-Next name, zero-centred gain) of the tensors renamed one to one
    (an MoE layer's stacked experts aside)."""
    pairs = [("token_embeddings.weight", "model.embed_tokens.weight", False)]
    for i, kind in enumerate(cfg.layer_types):
        lm, hf = f"layers.{i}.", f"model.layers.{i}."
        pairs += [(lm + "ln1.weight", hf + "input_layernorm.weight", True),
                  (lm + "ln2.weight", hf + "post_attention_layernorm.weight", True)]  # fmt: skip
        if not cfg.moe.is_moe_layer(i):
            pairs += [(f"{lm}ffn.{a}.weight", f"{hf}mlp.{b}.weight", False) for a, b in _FFN]
        else:  # the router, the shared expert and its gate (the experts: _expert_prefixes)
            pairs += [
                (lm + "ffn.router.weight", hf + "mlp.gate.weight", False),
                (lm + "ffn.shared_gate.weight", hf + "mlp.shared_expert_gate.weight", False),
            ]
            pairs += [(f"{lm}ffn.shared.{a}.weight", f"{hf}mlp.shared_expert.{b}.weight", False)
                      for a, b in _FFN]  # fmt: skip
        if kind == "G":
            g = hf + "linear_attn."
            pairs += [(lm + "attn.A_log", g + "A_log", False),
                      (lm + "attn.dt_bias", g + "dt_bias", False),
                      (lm + "attn.o_norm.weight", g + "norm.weight", False),
                      (lm + "attn.o_proj.weight", g + "out_proj.weight", False)]  # fmt: skip
        else:
            a = hf + "self_attn."
            pairs += [(lm + "attn.v_proj.weight", a + "v_proj.weight", False),
                      (lm + "attn.output_proj.weight", a + "o_proj.weight", False)]  # fmt: skip
    pairs.append(("ln_final.weight", "model.norm.weight", True))
    if not cfg.tie_embeddings:
        pairs.append(("lm_head.weight", "lm_head.weight", False))
    return pairs


def _expert_prefixes(cfg: ModelConfig) -> list[tuple[int, str, str]]:
    """(layer, lmforge ``layers.i.ffn.``, HF ``model.layers.i.mlp.experts.``) of every MoE
    layer."""
    return [(i, f"layers.{i}.ffn.", f"model.layers.{i}.mlp.experts.")
            for i in range(cfg.n_layers) if cfg.moe.is_moe_layer(i)]  # fmt: skip


def _rows(t: torch.Tensor, head_dim: int, order: torch.Tensor) -> torch.Tensor:
    """Reorder the rows of each head of a (heads·E, D) projection, or an (E,) gain."""
    if t.dim() == 1:
        return t[order].contiguous()  # (E,)
    return t.reshape(-1, head_dim, t.shape[1])[:, order].reshape(t.shape).contiguous()


def qwen3_next_state_to_hf(
    state: dict[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """An lmforge G/A hybrid's state dict in Qwen3-Next's names and layouts."""
    qwen3_next_config_to_hf(cfg)  # refuses what Qwen3-Next cannot hold, first

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise LmforgeError(f"model state has no '{name}' (not an lmforge TransformerLM?)")
        return state[name].detach().to("cpu", torch.float32)

    out = {}
    for lm_name, hf_name, centred in _plain_pairs(cfg):
        t = get(lm_name)
        out[hf_name] = t - 1.0 if centred else t
    for i, lm, hf in _expert_prefixes(cfg):
        bias = state.get(lm + "expert_bias")
        if bias is not None and bool(bias.abs().sum() > 0):
            raise LmforgeError(
                f"cannot export as Qwen3-Next: layer {i} has a non-zero expert selection bias"
                " (aux-loss-free balancing), which Qwen3-Next's router has no place for"
            )
        out.update(stacked_to_hf({k: get(lm + k) for k in ("w1", "w2", "w3")}, "", hf))
    e = int(cfg.head_dim)
    order = partial_rope_order(e, e if cfg.rotary_dim is None else cfg.rotary_dim)
    k_heads, _, v_heads, _ = cfg.linear_dims
    r = v_heads // k_heads  # value heads per q/k head
    for i, kind in enumerate(cfg.layer_types):
        lm, hf = f"layers.{i}.attn.", f"model.layers.{i}."
        if kind == "A":
            q = _rows(get(lm + "q_proj.weight"), e, order).reshape(cfg.n_heads, e, -1)  # (H, E, D)
            gate = get(lm + "gate_proj.weight").reshape(cfg.n_heads, e, -1)  # (H, E, D)
            out[hf + "self_attn.q_proj.weight"] = torch.cat([q, gate], 1).flatten(0, 1)  # (2HE, D)
            out[hf + "self_attn.k_proj.weight"] = _rows(get(lm + "k_proj.weight"), e, order)
            for n in ("q_norm", "k_norm"):
                out[f"{hf}self_attn.{n}.weight"] = _rows(get(f"{lm}{n}.weight"), e, order) - 1.0
        else:  # per q/k head j: [q K | k K | v r·V | z r·V], [β r | a r]
            parts = [get(f"{lm}{p}_proj.weight").reshape(k_heads, -1, cfg.d_model) for p in "qkvz"]
            out[hf + "linear_attn.in_proj_qkvz.weight"] = torch.cat(parts, 1).flatten(0, 1)
            ba = [get(f"{lm}{p}_proj.weight").reshape(k_heads, r, -1) for p in "ba"]  # (H_k, r, D)
            out[hf + "linear_attn.in_proj_ba.weight"] = torch.cat(ba, 1).flatten(0, 1)  # (2H, D)
            conv = get(lm + "conv.weight")  # (2·H_k·K + H·V, W)
            out[hf + "linear_attn.conv1d.weight"] = conv[:, None, :]  # (C, 1, W)
    return {k: v.contiguous() for k, v in out.items()}


def qwen3_next_state_from_hf(
    hf_state: dict[str, torch.Tensor], cfg: ModelConfig, source: str = "checkpoint"
) -> dict[str, torch.Tensor]:
    """Qwen3-Next tensors renamed and re-laid-out into an lmforge state dict (fp32); a tensor
    lmforge has no place for (a bias) raises one line naming it. The multi-token-prediction
    module's tensors (``mtp.*``) are skipped, as transformers skips them."""
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf_state:
            raise LmforgeError(f"{source}: tensor '{name}' is missing")
        used.add(name)
        return hf_state[name].to(torch.float32)

    state: dict[str, torch.Tensor] = {}
    for lm_name, hf_name, centred in _plain_pairs(cfg):
        t = take(hf_name)
        state[lm_name] = (1.0 + t) if centred else t.contiguous()
    for _, lm, hf in _expert_prefixes(cfg):
        stacked_from_hf(hf_state, cfg.moe.n_experts, lm, hf, state, used, source)
        state[lm + "expert_bias"] = torch.zeros(cfg.moe.n_experts)
    e = int(cfg.head_dim)
    inv = torch.argsort(partial_rope_order(e, e if cfg.rotary_dim is None else cfg.rotary_dim))
    k_heads, k_dim, v_heads, v_dim = cfg.linear_dims
    r = v_heads // k_heads  # value heads per q/k head
    for i, kind in enumerate(cfg.layer_types):
        lm, hf = f"layers.{i}.attn.", f"model.layers.{i}."
        if kind == "A":
            qg = take(hf + "self_attn.q_proj.weight").reshape(cfg.n_heads, 2 * e, -1)  # (H, 2E, D)
            q, gate = qg[:, :e].flatten(0, 1), qg[:, e:].flatten(0, 1)  # (H·E, D) each
            state[lm + "q_proj.weight"] = _rows(q, e, inv)
            state[lm + "gate_proj.weight"] = gate.contiguous()
            state[lm + "k_proj.weight"] = _rows(take(hf + "self_attn.k_proj.weight"), e, inv)
            for n in ("q_norm", "k_norm"):
                state[f"{lm}{n}.weight"] = _rows(1.0 + take(f"{hf}self_attn.{n}.weight"), e, inv)
        else:
            widths = [k_dim, k_dim, r * v_dim, r * v_dim]
            qkvz = take(hf + "linear_attn.in_proj_qkvz.weight")
            if qkvz.shape[0] != k_heads * sum(widths):
                raise LmforgeError(
                    f"{source}: {hf}linear_attn.in_proj_qkvz.weight has {qkvz.shape[0]} rows,"
                    f" expected {k_heads * sum(widths)} ({k_heads} q/k heads × {sum(widths)})"
                )
            qkvz = qkvz.reshape(k_heads, sum(widths), -1).split(widths, 1)
            for p, t in zip("qkvz", qkvz, strict=True):
                state[f"{lm}{p}_proj.weight"] = t.flatten(0, 1).contiguous()
            ba = take(hf + "linear_attn.in_proj_ba.weight").reshape(k_heads, 2 * r, -1)
            state[lm + "b_proj.weight"] = ba[:, :r].flatten(0, 1).contiguous()  # (H, D)
            state[lm + "a_proj.weight"] = ba[:, r:].flatten(0, 1).contiguous()
            conv = take(hf + "linear_attn.conv1d.weight")
            if conv.dim() != 3 or conv.shape[1] != 1:
                raise LmforgeError(
                    f"{source}: {hf}linear_attn.conv1d.weight has shape {tuple(conv.shape)},"
                    " expected (channels, 1, width)"
                )
            state[lm + "conv.weight"] = conv[:, 0].contiguous()  # (2·H_k·K + H·V, W)
    if cfg.tie_embeddings:
        used.add("lm_head.weight")
        state["lm_head.weight"] = state["token_embeddings.weight"]
    left = sorted(
        k for k in hf_state
        if k not in used and not k.endswith("rotary_emb.inv_freq") and not k.startswith("mtp.")
    )  # fmt: skip
    if left:
        more = f" and {len(left) - 1} more" if len(left) > 1 else ""
        raise LmforgeError(
            f"{source}: unexpected tensor '{left[0]}'{more} (lmforge's Qwen3-Next mapping has no"
            " place for it)"
        )
    return state
