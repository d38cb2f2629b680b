"""Qwen3-MoE interop for MoE models (the MoE half of :mod:`lmforge.hf.convert`).

lmforge's MoE (``model.moe``) with softmax scores, dropless token choice, no shared experts and
QK-norm is Qwen3-MoE (``Qwen3MoeForCausalLM``): ``layers.i.ffn.router.weight`` →
``model.layers.i.mlp.gate.weight``; expert e of the stacked ``ffn.w1`` / ``w3`` / ``w2`` →
``mlp.experts.e.gate_proj`` / ``up_proj`` / ``down_proj`` (the hub's per-expert layout, which
transformers ≥ 5 fuses on load); ``moe.every`` ↔ ``decoder_sparse_step``; ``norm_top_k`` ↔
``norm_topk_prob``; dense layers keep ``mlp.{gate,up,down}_proj`` with ``intermediate_size``.
Import also accepts the fused layout (``mlp.experts.gate_up_proj`` (N, 2F, D),
``mlp.experts.down_proj`` (N, D, F)). Exercised by ``pytest tests/test_moe_hf.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from lmforge.model.config import ModelConfig
from lmforge.model.moe_config import MoEConfig
from lmforge.utils.errors import LmforgeError

_PROJ = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))


def check_exportable(cfg: ModelConfig) -> None:
    """Raise one line for an MoE option Qwen3-MoE has no place for."""
    mc = cfg.moe
    problems = [
        (not cfg.qk_norm, "model.qk_norm = false (Qwen3-MoE always RMS-normalises q and k)"),
        (mc.n_shared_experts > 0, "model.moe.n_shared_experts > 0 (Qwen3-MoE has none)"),
        (mc.score != "softmax", f"model.moe.score = '{mc.score}' (Qwen3-MoE uses softmax)"),
        (mc.routing != "token_choice", f"model.moe.routing = '{mc.routing}' (Qwen3-MoE: top-k)"),
    ]
    for bad, what in problems:
        if bad:
            raise LmforgeError(f"cannot export as Qwen3-MoE: {what}")


def experts_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The per-expert HF tensors of every MoE layer (router names are in the shared table).
    Checks first that Qwen3-MoE can represent ``cfg`` (before an export writes anything)."""
    check_exportable(cfg)
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.n_layers):
        if not cfg.moe.is_moe_layer(i):
            continue
        bias = state.get(f"layers.{i}.ffn.expert_bias")
        if bias is not None and bool(bias.abs().sum() > 0):
            raise LmforgeError(
                f"cannot export as Qwen3-MoE: layer {i} has a non-zero expert selection bias "
                "(aux-loss-free balancing), which Qwen3-MoE's router has no place for"
            )
        for lm, hf in _PROJ:
            w = state[f"layers.{i}.ffn.{lm}"].detach().to("cpu")  # (N, F, D) or (N, D, F)
            for e in range(w.shape[0]):
                out[f"model.layers.{i}.mlp.experts.{e}.{hf}.weight"] = w[e].contiguous()
    return out


def experts_from_hf(
    hf_state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    used: set[str],
    source: str,
) -> None:
    """Fill ``state`` with every MoE layer's stacked experts (and a zero bias) from HF tensors,
    per-expert or fused; the names read are added to ``used``."""
    n = cfg.moe.n_experts
    for i in range(cfg.n_layers):
        if not cfg.moe.is_moe_layer(i):
            continue
        pre = f"model.layers.{i}.mlp.experts."
        fused = pre + "gate_up_proj"
        if fused in hf_state:
            gate_up = hf_state[fused].to(torch.float32)  # (N, 2F, D)
            f = gate_up.shape[1] // 2
            state[f"layers.{i}.ffn.w1"] = gate_up[:, :f].contiguous()
            state[f"layers.{i}.ffn.w3"] = gate_up[:, f:].contiguous()
            state[f"layers.{i}.ffn.w2"] = hf_state[pre + "down_proj"].to(torch.float32)
            used.update({fused, pre + "down_proj"})
        else:
            for lm, hf in _PROJ:
                names = [f"{pre}{e}.{hf}.weight" for e in range(n)]
                missing = [k for k in names if k not in hf_state]
                if missing:
                    raise LmforgeError(f"{source}: tensor '{missing[0]}' is missing")
                state[f"layers.{i}.ffn.{lm}"] = torch.stack(
                    [hf_state[k].to(torch.float32) for k in names]
                )
                used.update(names)
        state[f"layers.{i}.ffn.expert_bias"] = torch.zeros(n)


def hf_config(cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3-MoE ``config.json`` from the dense one ``base`` (Qwen3) written for ``cfg``."""
    check_exportable(cfg)
    mc = cfg.moe
    out = dict(base)
    out.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_experts=mc.n_experts,
        num_experts_per_tok=mc.top_k,
        moe_intermediate_size=cfg.expert_dim,
        decoder_sparse_step=mc.every,
        norm_topk_prob=mc.norm_top_k,
        mlp_only_layers=[],
        router_aux_loss_coef=mc.aux_loss_coef,
        output_router_logits=False,
    )
    return out


def moe_from_hf(hf: dict[str, Any], where: str) -> MoEConfig:
    """The :class:`MoEConfig` of a Qwen3-MoE ``config.json`` (default for other types)."""
    if hf.get("model_type") != "qwen3_moe":
        return MoEConfig()
    if hf.get("mlp_only_layers"):
        raise LmforgeError(f"{where}: mlp_only_layers is not supported (use decoder_sparse_step)")
    try:
        return MoEConfig(
            n_experts=int(hf.get("num_experts", hf.get("num_local_experts", 0))),
            top_k=int(hf["num_experts_per_tok"]),
            expert_d_ff=int(hf["moe_intermediate_size"]),
            every=int(hf.get("decoder_sparse_step", 1)),
            norm_top_k=bool(hf.get("norm_topk_prob", False)),
            aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
        )
    except KeyError as e:
        raise LmforgeError(f"{where}: missing key {e.args[0]!r}") from None
    except ValueError as e:
        raise LmforgeError(f"{where}: {e}") from None
